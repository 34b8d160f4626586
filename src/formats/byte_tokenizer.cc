#include <algorithm>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "fuyou/data.h"
#include "fuyou/error.h"

namespace fs = std::filesystem;

namespace fuyou {

std::vector<int32_t> byte_encode(const std::string& text) {
  std::vector<int32_t> out(text.size());
  for (size_t i = 0; i < text.size(); ++i) out[i] = static_cast<unsigned char>(text[i]);
  return out;
}

std::string byte_decode(const std::vector<int32_t>& tokens) {
  std::string out;
  out.reserve(tokens.size());
  for (int32_t t : tokens) out += static_cast<char>(t & 0xff);
  return out;
}

TextShardResult build_text_shards(const std::vector<std::string>& inputs,
                                  const std::string& out_dir, double val_fraction) {
  TextShardResult r;
  std::vector<fs::path> files;
  for (const auto& in : inputs) {
    fs::path p(in);
    std::error_code ec;
    if (fs::is_symlink(p, ec) && !fs::is_directory(p, ec)) {
      ++r.skipped;
      continue;
    }
    if (fs::is_directory(p, ec)) {
      std::vector<fs::path> found;
      for (auto it = fs::recursive_directory_iterator(p, ec); !ec && it != fs::recursive_directory_iterator(); it.increment(ec)) {
        if (it->is_symlink()) {
          ++r.skipped;
          continue;
        }
        if (it->is_regular_file()) found.push_back(it->path());
      }
      if (ec) throw IoError(str(in, ": cannot list directory: ", ec.message()));
      std::sort(found.begin(), found.end());
      files.insert(files.end(), found.begin(), found.end());
    } else if (fs::is_regular_file(p, ec)) {
      files.push_back(p);
    } else {
      throw IoError(str(in, ": no such file or directory (data.text)"));
    }
  }
  std::vector<int32_t> train, val;
  for (const auto& f : files) {
    std::ifstream in(f, std::ios::binary);
    if (!in) throw IoError(str(f.string(), ": cannot open"));
    std::stringstream ss;
    ss << in.rdbuf();
    std::string text = ss.str();
    if (text.empty() || text.find('\0') != std::string::npos) {
      ++r.skipped;
      continue;
    }
    ++r.files;
    size_t n_val = static_cast<size_t>(static_cast<double>(text.size()) * val_fraction);
    size_t cut = text.size() - n_val;
    auto toks = byte_encode(text);
    train.insert(train.end(), toks.begin(), toks.begin() + cut);
    val.insert(val.end(), toks.begin() + cut, toks.end());
  }
  if (r.files == 0) throw IoError("data.text: no text files found in the given paths");
  fs::create_directories(out_dir);
  r.train_path = (fs::path(out_dir) / "train.tok").string();
  r.val_path = (fs::path(out_dir) / "val.tok").string();
  write_token_shard(r.train_path, train, kByteVocab);
  write_token_shard(r.val_path, val, kByteVocab);
  r.train_tokens = train.size();
  r.val_tokens = val.size();
  return r;
}

}  // namespace fuyou
