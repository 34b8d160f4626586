#include "src/runtime/checkpoint_packed.h"

#include <cstring>

#include "fuyou/error.h"
#include "src/common/xxh3.h"

namespace fuyou {
namespace {

std::string entry_name(StateKind kind, const std::string& group, int plane) {
  return str(state_kind_name(kind), ".", group, plane ? ".scale" : "");
}

StDtype value_dtype(MomentFormat f) {
  return f == MomentFormat::kBF16 ? StDtype::kBF16 : StDtype::kU8;
}

}  // namespace

std::vector<StEntry> packed_moment_entries(const ParamLayout& layout, MomentFormat f,
                                           StateKind kind) {
  std::vector<StEntry> out;
  for (const ParamGroup& g : layout.groups) {
    out.push_back({entry_name(kind, g.name, 0), value_dtype(f), {static_cast<int64_t>(g.numel)}});
    if (f == MomentFormat::kInt8)
      out.push_back({entry_name(kind, g.name, 1),
                     StDtype::kF32,
                     {static_cast<int64_t>(state_blocks(g.numel))}});
  }
  return out;
}

std::vector<std::string> write_packed_moments(TrainEngine& engine, const ParamLayout& layout,
                                              SafetensorsStreamWriter& w, StateKind kind) {
  const MomentFormat f = engine.optim_format().moments;
  std::vector<std::string> sums;
  std::unique_ptr<XXH3_state_t, decltype(&XXH3_freeState)> hash{XXH3_createState(),
                                                                &XXH3_freeState};
  for (size_t g = 0; g < layout.groups.size(); ++g) {
    XXH3_64bits_reset(hash.get());
    int open = -1;
    engine.read_packed(static_cast<int>(g), kind,
                       [&](int plane, size_t begin, const void* data, size_t n) {
                         if (plane != open) {
                           FY_CHECK(begin == 0, "packed plane ", plane, " of group ",
                                    layout.groups[g].name, " starts at ", begin);
                           w.begin_tensor(entry_name(kind, layout.groups[g].name, plane));
                           open = plane;
                         }
                         const size_t bytes = n * (plane ? 4 : moment_elem_bytes(f));
                         w.append(data, bytes);
                         xxh3_64_update(hash.get(), data, bytes);
                       });
    sums.push_back(hex64(XXH3_64bits_digest(hash.get())));
  }
  return sums;
}

std::string restore_packed_moment(TrainEngine& engine, const RangedTensorFile& f,
                                  const ParamLayout& layout, int g, StateKind kind,
                                  MomentFormat file) {
  const ParamGroup& pg = layout.groups.at(g);
  const int planes = file == MomentFormat::kInt8 ? 2 : 1;
  const StTensorInfo* info[2] = {};
  for (int p = 0; p < planes; ++p) {
    const std::string name = entry_name(kind, pg.name, p);
    if (!f.reader().has(name))
      throw IoError(str(f.path(), ": no tensor '", name, "' (the checkpoint's ",
                        moment_format_name(file), " moments do not match this model)"));
    info[p] = &f.reader().info(name);
    const uint64_t want = p ? state_blocks(pg.numel) : pg.numel;
    if (info[p]->dtype != (p ? StDtype::kF32 : value_dtype(file)) || info[p]->shape.size() != 1 ||
        static_cast<uint64_t>(info[p]->shape[0]) != want)
      throw IoError(str(f.path(), ": tensor '", name, "' is not ",
                        st_dtype_name(p ? StDtype::kF32 : value_dtype(file)), " [", want,
                        "] as the model's group ", pg.name, " needs"));
  }
  std::unique_ptr<XXH3_state_t, decltype(&XXH3_freeState)> hash{XXH3_createState(),
                                                                &XXH3_freeState};
  XXH3_64bits_reset(hash.get());
  const size_t eb = moment_elem_bytes(file);
  if (engine.optim_format().moments == file) {
    engine.write_packed(g, kind, [&](int plane, size_t begin, void* data, size_t n) {
      const size_t b = plane ? 4 : eb;
      f.read(*info[plane], b * begin, data, b * n);
      xxh3_64_update(hash.get(), data, b * n);
    });
    return hex64(XXH3_64bits_digest(hash.get()));
  }
  // Another format: the group decoded to fp32 here (one group at a time), encoded by the engine.
  std::vector<char> values(eb * pg.numel);
  std::vector<float> scales(planes == 2 ? state_blocks(pg.numel) : 0), decoded(pg.numel);
  f.read(*info[0], 0, values.data(), values.size());
  xxh3_64_update(hash.get(), values.data(), values.size());
  if (planes == 2) {
    f.read(*info[1], 0, scales.data(), 4 * scales.size());
    xxh3_64_update(hash.get(), scales.data(), 4 * scales.size());
  }
  decode_moment(file, kind == StateKind::kAdamV, values.data(), scales.data(), decoded.data(),
                pg.numel);
  engine.write_state(g, kind, [&](size_t begin, float* data, size_t n) {
    std::memcpy(data, decoded.data() + begin, 4 * n);
  });
  return hex64(XXH3_64bits_digest(hash.get()));
}

}  // namespace fuyou
