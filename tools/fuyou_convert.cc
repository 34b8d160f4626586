// fuyou-convert: moves data into the engine's formats. `text` tokenizes plain-text files
// into token shards (byte-level); Hugging Face checkpoints come with the conversion work.
#include <CLI/CLI.hpp>

#include "fuyou/data.h"
#include "fuyou/error.h"
#include "fuyou/log.h"

int main(int argc, char** argv) {
  CLI::App app{"fuyou-convert: build token shards (and, later, convert checkpoints)"};
  app.require_subcommand(1);
  auto* text = app.add_subcommand("text", "Tokenize plain-text files or directories into token shards");
  std::vector<std::string> inputs;
  std::string out_dir;
  double val_fraction = 0.05;
  text->add_option("inputs", inputs, "Text files or directories")->required();
  text->add_option("--out", out_dir, "Output directory (train.tok, val.tok)")->required();
  text->add_option("--val-fraction", val_fraction, "Share of each file held out for validation")
      ->check(CLI::Range(0.0, 0.99));
  CLI11_PARSE(app, argc, argv);
  fuyou::init_logging(false);
  try {
    auto r = fuyou::build_text_shards(inputs, out_dir, val_fraction);
    spdlog::info("{} files ({} skipped): {} train tokens -> {}, {} validation tokens -> {}", r.files,
                 r.skipped, r.train_tokens, r.train_path, r.val_tokens, r.val_path);
  } catch (const fuyou::Error& e) {
    spdlog::error("{}", e.what());
    return 1;
  }
  return 0;
}
