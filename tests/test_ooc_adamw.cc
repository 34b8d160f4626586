// The out-of-core optimizer: state streamed through the SSD store gives bit-identical
// results to state in host memory, across chunk boundaries, tensor boundaries, placements
// and gradient / weight types; updates overlap and complete in order.
#include <unistd.h>

#include <catch2/catch.hpp>
#include <cstring>
#include <filesystem>

#include "fuyou/ooc_adamw.h"
#include "fuyou/rng.h"
#include "kernels/common/element_math.h"
#include "test_support.h"

namespace fs = std::filesystem;
using namespace fuyou;

namespace {

std::string store_dir(const std::string& tag) { return test::fresh_test_dir("ooc-" + tag); }

std::vector<OptimGroup> make_groups() {
  // Odd sizes: chunk tails, tensors straddling chunk boundaries, decay and no-decay tensors.
  std::vector<OptimGroup> gs;
  size_t sizes[] = {5000, 3 * 1024, 7777, 1};
  for (int g = 0; g < 4; ++g) {
    OptimGroup grp;
    grp.name = "group." + std::to_string(g);
    grp.numel = sizes[g];
    size_t half = sizes[g] / 2;
    grp.tensors.push_back({0, half, true});
    grp.tensors.push_back({half, sizes[g] - half, false});
    gs.push_back(grp);
  }
  return gs;
}

struct Result {
  std::vector<std::vector<float>> master;
  std::vector<std::vector<uint16_t>> lowp;
};

Result run(std::vector<Tier> tiers, SsdStore* store, ElemType grad_type) {
  auto groups = make_groups();
  OocAdamWOptions opts;
  opts.chunk_elems = 1024;
  OocAdamW opt(groups, tiers, store, opts);
  Result r;
  r.lowp.resize(groups.size());
  for (size_t g = 0; g < groups.size(); ++g) {
    Rng rng(100 + g);
    std::vector<float> init(groups[g].numel);
    for (auto& x : init) x = 0.02f * rng.normal();
    opt.init_group(static_cast<int>(g), init.data());
    r.lowp[g].resize(groups[g].numel);
  }
  std::vector<std::vector<float>> g32(groups.size());
  std::vector<std::vector<uint16_t>> g16(groups.size());
  for (int t = 1; t <= 4; ++t) {
    std::vector<OocAdamW::Handle> handles;
    // Submitted in backward order, all at once: the worker overlaps with this thread.
    for (int g = static_cast<int>(groups.size()) - 1; g >= 0; --g) {
      Rng rng(1000 * t + g);
      g32[g].resize(groups[g].numel);
      g16[g].resize(groups[g].numel);
      for (size_t i = 0; i < g32[g].size(); ++i) {
        g32[g][i] = rng.normal() * 1e-2f;
        g16[g][i] = math::float_to_bf16(g32[g][i]);
      }
      OocAdamW::Update u;
      u.group = g;
      u.grad =
          grad_type == ElemType::kF32 ? static_cast<const void*>(g32[g].data()) : g16[g].data();
      u.grad_type = grad_type;
      u.lowp = r.lowp[g].data();
      u.lowp_type = ElemType::kBF16;
      u.lr = 1e-3f * t;
      u.t = t;
      u.grad_scale = 0.5f;
      handles.push_back(opt.submit(u));
    }
    for (size_t i = 0; i + 1 < handles.size(); ++i) {
      opt.wait(handles[i + 1]);
      CHECK(opt.done(handles[i]));  // in order: a later update done means earlier ones are
    }
  }
  opt.wait_all();
  for (size_t g = 0; g < groups.size(); ++g) {
    std::vector<float> m(groups[g].numel);
    opt.read_master(static_cast<int>(g), m.data());
    r.master.push_back(m);
  }
  if (store) {
    CHECK(opt.ssd_bytes_read() > 0);
    CHECK(opt.ssd_bytes_written() > 0);
  }
  return r;
}

}  // namespace

TEST_CASE("out-of-core AdamW is bit-identical to in-memory AdamW", "[optim][storage]") {
  for (ElemType gt : {ElemType::kF32, ElemType::kBF16}) {
    INFO("gradient type " << elem_type_name(gt));
    std::vector<Tier> host(4, Tier::kHost);
    Result ref = run(host, nullptr, gt);

    StoreConfig sc;
    sc.dirs = {store_dir("a"), store_dir("b")};
    sc.stripe_unit = 64 * 1024;
    auto store = SsdStore::open(sc);
    Result ssd = run(std::vector<Tier>(4, Tier::kSsd), store.get(), gt);

    auto store2 = SsdStore::open({{store_dir("c")}});
    Result mixed = run(place_optimizer_state(make_groups(), 12 * 6000, true), store2.get(), gt);

    for (size_t g = 0; g < ref.master.size(); ++g) {
      INFO("group " << g);
      size_t n = ref.master[g].size();
      CHECK(std::memcmp(ssd.master[g].data(), ref.master[g].data(), 4 * n) == 0);
      CHECK(std::memcmp(ssd.lowp[g].data(), ref.lowp[g].data(), 2 * n) == 0);
      CHECK(std::memcmp(mixed.master[g].data(), ref.master[g].data(), 4 * n) == 0);
      CHECK(std::memcmp(mixed.lowp[g].data(), ref.lowp[g].data(), 2 * n) == 0);
    }
  }
}

TEST_CASE("optimizer placement follows the host budget", "[optim]") {
  auto groups = make_groups();  // 5000, 3072, 7777, 1 parameters
  auto tiers = place_optimizer_state(groups, 12 * 8100, true);
  CHECK(tiers == std::vector<Tier>{Tier::kHost, Tier::kHost, Tier::kSsd, Tier::kHost});
  CHECK_THROWS_WITH(place_optimizer_state(groups, 1000, false),
                    Catch::Matchers::Contains("offload.ssd_paths") &&
                        Catch::Matchers::Contains("12 bytes per parameter"));
}
