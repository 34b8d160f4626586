// Config loading: the embedded default and every shipped config parse; bad input is
// refused with a message naming the key and what is allowed.
#include <catch2/catch.hpp>
#include <filesystem>

#include "fuyou/config.h"
#include "fuyou/error.h"
#include "fuyou/sizes.h"
#include "test_support.h"

using namespace fuyou;
using Catch::Matchers::Contains;

TEST_CASE("the embedded default and every config in configs/ parse", "[config]") {
  Config d = parse_config(default_config_text(), "<default>");
  CHECK(d.model.n_layer == 6);
  CHECK(d.model.d_ff == 1536);
  int n = 0;
  for (auto& e : std::filesystem::directory_iterator(test::source_path("configs")))
    if (e.path().extension() == ".yaml") {
      INFO(e.path());
      CHECK_NOTHROW(load_config_file(e.path().string()));
      ++n;
    }
  CHECK(n >= 2);
}

TEST_CASE("config errors name the key and the allowed values", "[config]") {
  CHECK_THROWS_WITH(parse_config("model: {n_layers: 4}", "x.yaml"),
                    Contains("unknown key 'model.n_layers'") && Contains("n_layer"));
  CHECK_THROWS_WITH(parse_config("modle: {}", "x.yaml"), Contains("unknown section 'modle'"));
  CHECK_THROWS_WITH(parse_config("model: {n_layer: four}", "x.yaml"),
                    Contains("model.n_layer") && Contains("expected an integer"));
  CHECK_THROWS_WITH(parse_config("model: {d_model: 100, n_head: 3}", "x.yaml"),
                    Contains("model.d_model") && Contains("multiple of model.n_head"));
  CHECK_THROWS_WITH(parse_config("runtime: {backend: tpu}", "x.yaml"),
                    Contains("runtime.backend") && Contains("cpu, cuda, auto, cpu-streams, emulated"));
  CHECK_THROWS_WITH(parse_config("offload: {activations: sometimes}", "x.yaml"),
                    Contains("offload.activations") && Contains("auto, keep, swap, recompute"));
  CHECK_THROWS_WITH(parse_config("offload: {host_memory: 8 parsecs}", "x.yaml"),
                    Contains("offload.host_memory") && Contains("unknown unit"));
  CHECK_THROWS_WITH(parse_config("model: {n_layer: 4}\noffload: {deferred_updates: 4}", "x.yaml"),
                    Contains("offload.deferred_updates") && Contains("[0, model.n_layer - 1 = 3]"));
  CHECK_THROWS_WITH(parse_config("offload: {deferred_updates: some}", "x.yaml"),
                    Contains("offload.deferred_updates") && Contains("neither auto nor a layer count"));
  CHECK(parse_config("model: {n_layer: 4}\noffload: {deferred_updates: 2}", "x.yaml").offload.deferred_updates == 2);
  CHECK(parse_config("", "x.yaml").offload.deferred_updates == -1);
  CHECK_THROWS_WITH(parse_config("optimizer: {lr: -1}", "x.yaml"), Contains("optimizer.lr"));
  CHECK_THROWS_WITH(parse_config("model: [1, 2]", "x.yaml"), Contains("section 'model' must be a mapping"));
  CHECK_THROWS_WITH(parse_config("model: {n_layer: 4", "x.yaml"), Contains("x.yaml: line"));
  CHECK_THROWS_WITH(load_config_file("/nonexistent/c.yaml"), Contains("/nonexistent/c.yaml"));
}

TEST_CASE("config overrides from --set apply before validation", "[config]") {
  Config c = parse_config("model: {n_layer: 2}", "x", {"model.n_layer=5", "offload.host_memory=2GiB",
                                                       "data.text=[a, b]"});
  CHECK(c.model.n_layer == 5);
  CHECK(c.offload.host_memory == (2ull << 30));
  CHECK(c.data.text == std::vector<std::string>{"a", "b"});
  CHECK_THROWS_WITH(parse_config("", "x", {"model.n_layer"}), Contains("section.key=value"));
  CHECK_THROWS_WITH(parse_config("", "x", {"modell.n_layer=3"}), Contains("unknown section 'modell'"));
  CHECK_THROWS_WITH(parse_config("", "x", {"model.depth=3"}), Contains("unknown key 'model.depth'"));
}

TEST_CASE("config round-trips through YAML", "[config]") {
  Config a = parse_config(default_config_text(), "<default>");
  Config b = parse_config(config_to_yaml(a), "<roundtrip>");
  CHECK(config_to_yaml(a) == config_to_yaml(b));
}

TEST_CASE("sizes parse in binary and decimal units", "[config]") {
  CHECK(parse_size("4096", "k") == 4096);
  CHECK(parse_size("512MiB", "k") == 512ull << 20);
  CHECK(parse_size("1.5GiB", "k") == 3ull << 29);
  CHECK(parse_size("2GB", "k") == 2000000000ull);
  CHECK_THROWS_AS(parse_size("lots", "k"), ConfigError);
  CHECK_THROWS_AS(parse_size("-1GiB", "k"), ConfigError);
  CHECK(format_size(3ull << 29) == "1.50 GiB");
}
