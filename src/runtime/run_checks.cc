#include "src/runtime/run_checks.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <fstream>

#include "fuyou/checkpoint.h"
#include "fuyou/data.h"
#include "fuyou/error.h"
#include "fuyou/hf_checkpoint.h"
#include "fuyou/optim.h"
#include "fuyou/sizes.h"
#include "fuyou/tokenizer.h"
#include "src/runtime/checkpoint_dirs.h"
#include "src/runtime/run_dir.h"

namespace fs = std::filesystem;

namespace fuyou {

fs::path existing_ancestor(const fs::path& path) {
  fs::path p = fs::absolute(path);
  std::error_code ec;
  while (!fs::exists(p, ec) && p != p.root_path()) p = p.parent_path();
  return p;
}

namespace {

// Creates and removes a file in `dir` (with O_DIRECT when asked); the errno of the failure,
// or 0. A filesystem without direct I/O creates the file before it refuses O_DIRECT (EINVAL),
// so a failed open removes the file too, unless it was there before (EEXIST, someone else's).
int probe_file(const fs::path& dir, bool direct) {
  const fs::path probe = dir / str(".fuyou-probe-", ::getpid());
  const int fd =
      ::open(probe.c_str(), O_CREAT | O_EXCL | O_RDWR | O_CLOEXEC | (direct ? O_DIRECT : 0), 0600);
  if (fd < 0) {
    const int err = errno;
    if (err != EEXIST) ::unlink(probe.c_str());
    return err;
  }
  ::close(fd);
  ::unlink(probe.c_str());
  return 0;
}

// The run directory exists as a writable directory, or can be created.
void check_run_dir_writable(const std::string& run_dir) {
  std::error_code ec;
  const fs::path dir(run_dir);
  if (fs::exists(dir, ec) && !fs::is_directory(dir, ec))
    throw IoError(str("run directory '", run_dir, "' exists and is not a directory"));
  const fs::path base = existing_ancestor(dir);
  if (!fs::is_directory(base, ec))
    throw IoError(str("run directory '", run_dir, "': cannot create it: ", base.string(),
                      " is not a directory"));
  if (base == fs::absolute(dir)) {
    if (const int err = probe_file(base, false))
      throw IoError(str("run directory '", run_dir, "' is not writable: ", std::strerror(err)));
    return;
  }
  const fs::path probe = base / str(".fuyou-probe-", ::getpid());
  if (::mkdir(probe.c_str(), 0700) != 0)
    throw IoError(str("run directory '", run_dir, "': cannot create it in ", base.string(), ": ",
                      std::strerror(errno)));
  ::rmdir(probe.c_str());
}

// offload.ssd_paths: each an existing directory of its own (not the run directory, not given
// twice) where a file can be created with O_DIRECT, as the SSD store opens its files.
void check_ssd_paths(const Config& cfg, const std::string& run_dir) {
  std::error_code ec;
  std::vector<fs::path> seen;
  const auto& paths = cfg.offload.ssd_paths;
  for (size_t i = 0; i < paths.size(); ++i) {
    if (fs::weakly_canonical(paths[i], ec) == fs::weakly_canonical(run_dir, ec))
      throw ConfigError(
          str("offload.ssd_paths[", i, "] is ", paths[i],
              ", the run directory: the SSD store needs a directory of its own (one per SSD)"));
    if (!fs::is_directory(paths[i], ec))
      throw IoError(str("offload.ssd_paths[", i, "]: SSD store: '", paths[i],
                        "' is not a directory", ec ? ": " + ec.message() : "",
                        " (create it, or correct the path)"));
    const fs::path canon = fs::canonical(paths[i], ec);
    if (std::find(seen.begin(), seen.end(), canon) != seen.end())
      throw ConfigError(str("offload.ssd_paths[", i, "]: SSD store: directory '", paths[i],
                            "' is given twice (", canon.string(),
                            "); two stripes would share one file"));
    seen.push_back(canon);
    if (const int err = probe_file(paths[i], true))
      throw IoError(str("offload.ssd_paths[", i, "]: SSD store: cannot create a file in ", paths[i],
                        err == EINVAL ? " with O_DIRECT: " : ": ", std::strerror(err),
                        err == EINVAL ? "; the filesystem does not support direct I/O (ramfs "
                                        "does not, nor tmpfs before Linux 6.6): give a directory "
                                        "on a disk's filesystem"
                                      : ""));
  }
}

// A file the run reads (or a directory of text files) can be opened for reading.
void check_readable(const std::string& key, const std::string& path, bool dir_ok) {
  std::error_code ec;
  const fs::file_status st = fs::status(path, ec);
  if (!fs::exists(st))
    throw IoError(str(key, ": ", path, ": no such file", dir_ok ? " or directory" : ""));
  if (fs::is_directory(st) && !dir_ok)
    throw IoError(str(key, ": ", path, " is a directory; expected a file"));
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw IoError(str(key, ": ", path, ": cannot read it: ", std::strerror(errno)));
  ::close(fd);
}

void check_inputs(const Config& cfg) {
  const DataConfig& d = cfg.data;
  for (size_t i = 0; i < d.train_shards.size(); ++i)
    check_readable(str("data.train_shards[", i, "]"), d.train_shards[i], false);
  for (size_t i = 0; i < d.val_shards.size(); ++i)
    check_readable(str("data.val_shards[", i, "]"), d.val_shards[i], false);
  if (d.train_shards.empty())
    for (size_t i = 0; i < d.text.size(); ++i)
      check_readable(str("data.text[", i, "]"), d.text[i], true);
  if (!cfg.model.checkpoint.empty()) check_readable("model.checkpoint", cfg.model.checkpoint, true);
}

// Token shards the run reads (data.train_shards and data.val_shards without data.text): the
// run's tokenizer parses and each shard's header vocabulary is its, as load_shards checks them.
// Only the 32-byte header is read; a shard whose header does not parse is read whole, so that
// the error is the run's.
void check_shard_headers(const Config& cfg, const TrainOptions& opts, const std::string& run_dir,
                         bool same_run) {
  const DataConfig& d = cfg.data;
  if (!d.text.empty() || d.train_shards.empty()) return;
  const std::string tok = run_tokenizer_path(cfg, opts, run_dir, same_run);
  const uint32_t tok_vocab = tok.empty() ? 0 : Tokenizer::from_file(tok).vocab_size();
  for (const auto* list : {&d.train_shards, &d.val_shards})
    for (const std::string& p : *list)
      check_shard_vocab(p, read_token_shard_header(p).vocab_size, cfg.model.vocab_size, tok,
                        tok_vocab);
}

uint64_t free_bytes_at(const std::string& dir) {
  const fs::path p = existing_ancestor(dir);
  struct statvfs sv {};
  if (::statvfs(p.c_str(), &sv) != 0)
    throw IoError(str(p.string(), ": statvfs: ", std::strerror(errno)));
  return static_cast<uint64_t>(sv.f_bavail) * sv.f_frsize;
}

}  // namespace

std::string carry_source(const Config& cfg, const TrainOptions& opts, bool same_run) {
  if (!opts.resume.empty()) return same_run ? "" : carried_files_dir(opts.resume);
  if (cfg.model.checkpoint.empty()) return "";
  std::error_code ec;
  const fs::path base(cfg.model.checkpoint);
  return carried_files_dir((fs::is_directory(base, ec) ? base : base.parent_path()).string());
}

std::string run_tokenizer_path(const Config& cfg, const TrainOptions& opts,
                               const std::string& run_dir, bool same_run) {
  std::error_code ec;
  fs::path where = run_dir;
  // A new run has not carried the base model's files yet.
  const std::string carry = carry_source(cfg, opts, same_run);
  if (!fs::exists(where / "tokenizer.json", ec) && !carry.empty()) where = carry;
  if (where.empty() || !fs::is_regular_file(where / "tokenizer.json", ec)) return "";
  return (where / "tokenizer.json").string();
}

void check_shard_vocab(const std::string& p, uint32_t shard_vocab, int model_vocab,
                       const std::string& tokenizer, uint32_t tokenizer_vocab) {
  if (shard_vocab > static_cast<uint32_t>(model_vocab))
    throw ConfigError(
        str(p, ": shard vocab size ", shard_vocab, " exceeds model.vocab_size ", model_vocab));
  if (shard_vocab != (tokenizer.empty() ? static_cast<uint32_t>(model_vocab) : tokenizer_vocab))
    throw ConfigError(
        str(p, ": the shard was tokenized with a vocabulary of ", shard_vocab, " tokens, but ",
            tokenizer.empty() ? str("the model has ", model_vocab, " (model.vocab_size)")
                              : str("the model's tokenizer ", tokenizer, " has ", tokenizer_vocab),
            ": tokenize the data with the model's tokenizer (fuyou-convert tokenize --tokenizer ",
            tokenizer.empty() ? std::string("TOKENIZER.json") : tokenizer, ")"));
}

bool checkpoints_on(const CheckpointConfig& c) { return c.every_steps > 0 || c.every_minutes > 0; }

std::string resolved_run_dir(const TrainOptions& opts) {
  if (!opts.run_dir.empty()) return opts.run_dir;
  if (!opts.resume.empty()) return checkpoint_run_dir(opts.resume);
  std::time_t now = std::time(nullptr);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y%m%d-%H%M%S", std::localtime(&now));
  return (fs::path("runs") / buf).string();
}

void check_run_dir_space(const Config& cfg, const std::string& run_dir) {
  const uint64_t ckpt = checkpoint_bytes(cfg);
  const uint64_t weights = weights_file_bytes(cfg);
  const int keep =
      checkpoints_on(cfg.checkpoint) ? cfg.checkpoint.keep + (cfg.checkpoint.keep_best ? 1 : 0) : 1;
  const int existing = std::min<int>(keep, static_cast<int>(list_checkpoints(run_dir).size()));
  const uint64_t need = weights + static_cast<uint64_t>(keep + 1 - existing) * ckpt;
  const uint64_t have = free_bytes_at(run_dir);
  if (need > have)
    throw IoError(str("run directory ", run_dir, ": needs ", need, " bytes (", format_size(need),
                      ": final weights ", format_size(weights), " + ", keep + 1 - existing,
                      " checkpoint(s) of ", format_size(ckpt), " with checkpoint.keep ", keep,
                      ") but its filesystem has ", have, " free (", format_size(have),
                      "); free space, lower checkpoint.keep or choose another --run-dir"));
}

void check_before_run(const Config& cfg, const TrainOptions& opts, const std::string& run_dir) {
  std::error_code ec;
  const bool same_run =
      !opts.resume.empty() && fs::equivalent(checkpoint_run_dir(opts.resume), run_dir, ec);
  const RunDirUse use = same_run              ? RunDirUse::kSameRun
                        : opts.restart_killed ? RunDirUse::kRestart
                                              : RunDirUse::kNew;
  check_run_dir_writable(run_dir);
  if (const std::string r = run_dir_refusal(run_dir, use, !opts.resume.empty()); !r.empty())
    throw Error(r);
  check_ssd_paths(cfg, run_dir);
  check_inputs(cfg);
  check_shard_headers(cfg, opts, run_dir, same_run);
  if (cfg.checkpoint.keep_best && same_run) find_best_checkpoint(run_dir);
  check_run_dir_space(cfg, run_dir);
}

}  // namespace fuyou
