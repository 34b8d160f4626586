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

std::vector<fs::path> list_input_files(const std::vector<std::string>& inputs, size_t* skipped) {
  std::vector<fs::path> files;
  for (const auto& in : inputs) {
    fs::path p(in);
    std::error_code ec;
    if (fs::is_symlink(p, ec) && !fs::is_directory(p, ec)) {
      ++*skipped;
      continue;
    }
    if (fs::is_directory(p, ec)) {
      std::vector<fs::path> found;
      for (auto it = fs::recursive_directory_iterator(p, ec);
           !ec && it != fs::recursive_directory_iterator(); it.increment(ec)) {
        if (it->is_symlink()) {
          ++*skipped;
          continue;
        }
        if (it->is_regular_file()) found.push_back(it->path());
      }
      if (ec) throw IoError(str(in, ": cannot list directory: ", ec.message()));
      std::sort(found.begin(), found.end());
      files.insert(files.end(), found.begin(), found.end());
    } else if (fs::is_regular_file(p, ec)) {
      files.push_back(p);
    } else if (fs::exists(p, ec)) {
      // A device (/dev/zero), a FIFO or a socket: reading it may never end.
      throw IoError(str(in, ": not a regular file or a directory; text data is read from files"));
    } else {
      throw IoError(str(in, ": no such file or directory"));
    }
  }
  return files;
}

std::string read_whole_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw IoError(str(path, ": cannot open"));
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

TextShardResult build_text_shards(const std::vector<std::string>& inputs,
                                  const std::string& out_dir, double val_fraction) {
  TextShardResult r;
  std::vector<fs::path> files = list_input_files(inputs, &r.skipped);
  std::vector<int32_t> train, val;
  for (const auto& f : files) {
    std::string text = read_whole_file(f.string());
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
