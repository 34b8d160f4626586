#include "src/runtime/checkpoint_dirs.h"

#include <fcntl.h>
#include <linux/fs.h>
#include <stdio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <vector>

#include "fuyou/checkpoint.h"
#include "fuyou/error.h"
#include "fuyou/log.h"
#include "fuyou/read_file.h"
#include "fuyou/safetensors.h"
#include "src/runtime/checkpoint_manifest.h"

namespace fs = std::filesystem;

namespace fuyou {

int64_t step_of(const std::string& name) {
  if (name.rfind("step-", 0) != 0 || name.size() == 5) return -1;
  int64_t n = 0;
  for (size_t i = 5; i < name.size(); ++i) {
    if (name[i] < '0' || name[i] > '9' || n > (INT64_MAX - 9) / 10) return -1;
    n = n * 10 + (name[i] - '0');
  }
  return n;
}

namespace {

bool is_complete(const fs::path& dir) {
  std::error_code ec;
  return fs::is_regular_file(dir / kManifestFile, ec);
}

// The name `latest` (or `best`) holds, or "" when there is none. One that is not a regular
// file (a directory, a FIFO) is refused: the engine could not replace it, and would fail at
// the first checkpoint after a resume.
std::string read_latest(const fs::path& root, const char* file = kLatestFile) {
  std::error_code ec;
  const fs::path path = root / file;
  const fs::file_status st = fs::symlink_status(path, ec);
  if (!fs::exists(st)) return "";
  if (!fs::is_regular_file(st))
    throw IoError(
        str(path.string(), " is not a regular file (",
            fs::is_directory(st) ? "a directory" : "a special file",
            "); the engine writes a one-line file there naming a checkpoint: move it away"));
  std::string s = read_file_bounded(path.string(), 4096, "checkpoint pointer");
  while (!s.empty() && (s.back() == '\n' || s.back() == ' ')) s.pop_back();
  return s;
}

}  // namespace

std::string step_dir_name(int64_t step) { return str("step-", step); }

void fsync_dir(const std::string& dir) {
  int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0)
    throw IoError(str(dir, ": cannot open the directory to fsync it: ", std::strerror(errno)));
  int r = ::fsync(fd);
  int err = errno;
  ::close(fd);
  if (r != 0) throw IoError(str(dir, ": fsync of the directory failed: ", std::strerror(err)));
}

std::string commit_staging(const std::string& root, const std::string& staging,
                           const std::string& name) {
  const fs::path target = fs::path(root) / name;
  std::error_code ec;
  if (!fs::exists(target, ec)) {
    if (::rename(staging.c_str(), target.c_str()) != 0)
      throw IoError(
          str(target.string(), ": rename from ", staging, " failed: ", std::strerror(errno)));
  } else {
    // The old step-N and the new one swap names in one step; the old one, now at the
    // staging name, is removed after (a crash before that leaves it as a leftover).
    if (::renameat2(AT_FDCWD, staging.c_str(), AT_FDCWD, target.c_str(), RENAME_EXCHANGE) != 0) {
      const fs::path aside = fs::path(root) / str(".deleting-", name, "-", ::getpid());
      if (::rename(target.c_str(), aside.c_str()) != 0 ||
          ::rename(staging.c_str(), target.c_str()) != 0)
        throw IoError(str(target.string(), ": replacing it with ", staging,
                          " failed: ", std::strerror(errno)));
      fsync_dir(root);
      fs::remove_all(aside, ec);
      return target.string();
    }
    fsync_dir(root);
    fs::remove_all(staging, ec);
    return target.string();
  }
  fsync_dir(root);
  return target.string();
}

void write_latest(const std::string& root, const std::string& name) {
  const std::string text = name + "\n";
  write_file_atomic((fs::path(root) / kLatestFile).string(), text.data(), text.size());
}

std::vector<std::string> list_checkpoints(const std::string& run_dir) {
  const fs::path root = fs::path(run_dir) / kCheckpointsDir;
  std::vector<std::pair<int64_t, std::string>> found;
  std::error_code ec;
  if (!fs::is_directory(root, ec)) return {};
  for (const auto& e : fs::directory_iterator(root, ec)) {
    const int64_t step = step_of(e.path().filename().string());
    if (step >= 0 && e.is_directory(ec) && is_complete(e.path()))
      found.push_back({step, e.path().string()});
  }
  std::sort(found.begin(), found.end());
  std::vector<std::string> out;
  for (auto& f : found) out.push_back(f.second);
  return out;
}

BestCheckpoint find_best_checkpoint(const std::string& run_dir) {
  const fs::path root = fs::path(run_dir) / kCheckpointsDir;
  BestCheckpoint b;
  b.pointer = read_latest(root, kBestFile);
  for (const std::string& dir : list_checkpoints(run_dir)) {
    const std::string path = (fs::path(dir) / kManifestFile).string();
    double loss = 0;
    try {
      loss = parse_manifest(read_file_bounded(path, 16u << 20, "checkpoint manifest"), path)
                 .manifest.progress.last_val_loss;
    } catch (const Error& e) {
      b.unreadable.push_back(dir);
      spdlog::warn("checkpoints: {} is not compared for keep_best and is not pruned: {}", dir,
                   e.what());
      continue;
    }
    // 0: no validation had run when the checkpoint was written (a loss is never 0).
    if (loss > 0 && (b.name.empty() || loss < b.loss)) {
      b.name = fs::path(dir).filename().string();
      b.loss = loss;
    }
  }
  return b;
}

std::string best_pointer_warning(const std::string& run_dir, const BestCheckpoint& b) {
  if (b.pointer_agrees()) return "";
  const fs::path file = fs::path(run_dir) / kCheckpointsDir / kBestFile;
  std::string held;
  if (b.pointer.empty()) {
    held = "is missing";
  } else {
    const int64_t step = step_of(b.pointer);
    held = str("names '", printable(b.pointer, 80), "', ",
               step < 0 ? "which is not a checkpoint name of this run (step-N)"
               : !is_complete(file.parent_path() / b.pointer)
                   ? "which is not a complete checkpoint"
                   : "which records a higher validation loss");
  }
  if (b.name.empty())
    return str(file.string(), " ", held,
               "; no complete checkpoint records a validation loss, so the next evaluated "
               "checkpoint becomes the best");
  return str(file.string(), " ", held, "; from the checkpoints' manifests the best is ", b.name,
             " (validation loss ", b.loss, "), and best is rewritten to name it");
}

void write_best(const std::string& root, const std::string& name) {
  const std::string text = name + "\n";
  write_file_atomic((fs::path(root) / kBestFile).string(), text.data(), text.size());
  fsync_dir(root);
}

int prune_checkpoints(const std::string& run_dir, int keep, bool keep_best) {
  const fs::path root = fs::path(run_dir) / kCheckpointsDir;
  const std::string latest = read_latest(root), best = read_latest(root, kBestFile);
  std::vector<std::string> all = list_checkpoints(run_dir);
  if (all.size() <= static_cast<size_t>(keep)) return 0;
  std::vector<std::string> spared;  // paths never removed here
  if (keep_best) {
    const BestCheckpoint b = find_best_checkpoint(run_dir);
    if (!b.name.empty()) spared.push_back((root / b.name).string());
    spared.insert(spared.end(), b.unreadable.begin(), b.unreadable.end());
  }
  int removed = 0;
  std::error_code ec;
  for (size_t i = 0; i + static_cast<size_t>(keep) < all.size(); ++i) {
    const fs::path p(all[i]);
    if (p.filename().string() == latest || p.filename().string() == best) continue;
    if (std::find(spared.begin(), spared.end(), p.string()) != spared.end()) continue;
    const fs::path aside = root / str(".deleting-", p.filename().string(), "-", ::getpid());
    if (::rename(p.c_str(), aside.c_str()) != 0) {
      spdlog::warn("checkpoints: could not remove {}: {}", p.string(), std::strerror(errno));
      continue;
    }
    fs::remove_all(aside, ec);
    ++removed;
  }
  if (removed) fsync_dir(root.string());
  return removed;
}

int remove_checkpoint_leftovers(const std::string& run_dir) {
  const fs::path root = fs::path(run_dir) / kCheckpointsDir;
  std::error_code ec;
  if (!fs::is_directory(root, ec)) return 0;
  std::vector<fs::path> leftovers;
  for (const auto& e : fs::directory_iterator(root, ec)) {
    const std::string n = e.path().filename().string();
    if (n.rfind(".staging-", 0) == 0 || n.rfind(".deleting-", 0) == 0 ||
        n == std::string(kLatestFile) + ".tmp")
      leftovers.push_back(e.path());
  }
  for (const auto& p : leftovers) {
    const uintmax_t n = fs::remove_all(p, ec);
    spdlog::warn(
        "checkpoints: removed {} ({} files), left half-written or half-deleted by a run that "
        "stopped then",
        p.string(), n == static_cast<uintmax_t>(-1) ? 0 : n);
  }
  return static_cast<int>(leftovers.size());
}

std::string checkpoint_run_dir(const std::string& checkpoint_dir) {
  fs::path p = fs::path(checkpoint_dir).lexically_normal();
  if (p.filename().empty()) p = p.parent_path();
  return p.parent_path().parent_path().string();
}

std::string resolve_checkpoint(const std::string& path) {
  fs::path p = fs::path(path).lexically_normal();
  if (p.filename().empty()) p = p.parent_path();
  std::error_code ec;
  if (!fs::is_directory(p, ec)) throw Error(str("--resume ", path, ": no such directory"));
  if (step_of(p.filename().string()) >= 0) {
    if (!is_complete(p))
      throw Error(str("--resume ", path, ": no ", kManifestFile,
                      " in it; it is not a complete checkpoint"));
    return p.string();
  }
  const fs::path run = p.filename() == kCheckpointsDir ? p.parent_path() : p;
  const fs::path root = run / kCheckpointsDir;
  const std::string latest = read_latest(root);
  if (!latest.empty() && step_of(latest) >= 0 && is_complete(root / latest))
    return (root / latest).string();
  std::vector<std::string> all = list_checkpoints(run.string());
  if (all.empty())
    throw Error(str("--resume ", path, ": no complete checkpoint in ", root.string(),
                    " (the run stopped before its first one; start it over in its directory with "
                    "fuyou-train --resume-or-start --run-dir ",
                    run.string(), ", which keeps its old metrics aside)"));
  spdlog::warn("checkpoints: {} {}; resuming from the newest complete checkpoint, {}",
               (root / kLatestFile).string(),
               latest.empty()
                   ? "is missing"
                   : "names '" + printable(latest, 80) + "', which is not a complete checkpoint",
               all.back());
  return all.back();
}

}  // namespace fuyou
