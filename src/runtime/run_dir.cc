#include "src/runtime/run_dir.h"

#include <algorithm>
#include <ctime>
#include <filesystem>

#include "fuyou/checkpoint.h"
#include "fuyou/error.h"
#include "fuyou/hf_checkpoint.h"
#include "fuyou/log.h"
#include "src/runtime/checkpoint_dirs.h"
#include "src/storage/dir_lock.h"

namespace fs = std::filesystem;

namespace fuyou {
namespace {

bool starts_with(const std::string& s, const char* prefix) { return s.rfind(prefix, 0) == 0; }

// What a start killed before it could clean up leaves (SIGKILL, a second stop signal): its
// lock, which DirLock takes over once its holder is gone, and its data staging directory.
bool start_debris(const std::string& n) {
  return n == kDirLockName || starts_with(n, ".data-staging-");
}

// What a run killed while writing its first checkpoint leaves in checkpoints/.
bool checkpoint_leftover(const std::string& c) {
  return starts_with(c, ".staging-") || starts_with(c, ".deleting-") ||
         c == std::string(kLatestFile) + ".tmp" || c == std::string(kBestFile) + ".tmp";
}

// The files a run writes before its first checkpoint is committed, written or half-written.
bool uncommitted_run_file(const fs::path& dir, const std::string& n) {
  if (start_debris(n) || starts_with(n, kRestartedPrefix)) return true;
  for (const RunFile& f : kRunFiles)
    if (f.before_first_checkpoint && (n == f.name || n == run_temp_file(f))) return true;
  for (const std::string& f : carried_file_names())
    if (n == f || n == f + ".tmp") return true;
  std::error_code ec;
  if (n == "data") return fs::is_directory(dir / n, ec);
  if (n != kCheckpointsDir) return false;
  // checkpoints/ of a run killed while writing its first: staging and temporary files only.
  for (const auto& e : fs::directory_iterator(dir / n, ec))
    if (!checkpoint_leftover(e.path().filename().string())) return false;
  return !ec;
}

std::string utc_stamp() {
  std::time_t now = std::time(nullptr);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y%m%dT%H%M%SZ", std::gmtime(&now));
  return buf;
}

std::string list_names(const std::vector<std::string>& names) {
  std::string out;
  const size_t shown = std::min<size_t>(names.size(), 8);
  for (size_t i = 0; i < shown; ++i) out += (i ? ", " : "") + printable(names[i], 80);
  if (names.size() > shown) out += str(" and ", names.size() - shown, " more");
  return out;
}

}  // namespace

std::vector<std::string> foreign_run_dir_entries(const std::string& dir, RunDirUse use) {
  std::vector<std::string> out;
  if (use == RunDirUse::kSameRun) return out;
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) return out;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    const std::string n = e.path().filename().string();
    const bool allowed = use == RunDirUse::kNew ? start_debris(n) : uncommitted_run_file(dir, n);
    if (allowed) continue;
    // In checkpoints/, name what a killed run would not have left there.
    if (use == RunDirUse::kRestart && n == kCheckpointsDir && e.is_directory(ec)) {
      for (const auto& c : fs::directory_iterator(e.path(), ec))
        if (!checkpoint_leftover(c.path().filename().string()))
          out.push_back(n + "/" + c.path().filename().string());
      continue;
    }
    out.push_back(n);
  }
  std::sort(out.begin(), out.end());
  return out;
}

std::string run_dir_refusal(const std::string& dir, RunDirUse use, bool resuming) {
  const std::vector<std::string> foreign = foreign_run_dir_entries(dir, use);
  if (foreign.empty()) return "";
  if (use == RunDirUse::kRestart)
    return str("run directory '", dir, "' has no complete checkpoint to resume, and holds files ",
               "that are not a killed run's own (", list_names(foreign),
               "); refusing to start over in it (move them away, or choose another --run-dir)");
  return str("run directory '", dir, "' already holds files (", list_names(foreign),
             "); refusing to overwrite them (choose another --run-dir",
             resuming ? ", or leave it out to continue in the checkpoint's run" : "", ")");
}

std::string set_aside_killed_run(const std::string& dir, const std::string& ours) {
  const fs::path root(dir);
  std::error_code ec;
  std::vector<fs::path> keep, drop;
  for (const auto& e : fs::directory_iterator(root, ec)) {
    const std::string n = e.path().filename().string();
    if (n == kDirLockName || starts_with(n, kRestartedPrefix)) continue;
    if (!ours.empty() && fs::path(ours).filename() == n) continue;
    const bool kept =
        std::any_of(std::begin(kRunFiles), std::end(kRunFiles),
                    [&](const RunFile& f) { return f.kept_on_restart && n == f.name; });
    (kept ? keep : drop).push_back(e.path());
  }
  if (ec) throw IoError(str(dir, ": cannot list the run directory: ", ec.message()));
  std::string aside;
  if (!keep.empty()) {
    aside = (root / (kRestartedPrefix + utc_stamp())).string();
    for (int i = 2; fs::exists(aside, ec); ++i)
      aside = (root / str(kRestartedPrefix, utc_stamp(), "-", i)).string();
    fs::create_directory(aside, ec);
    if (ec) throw IoError(str(aside, ": cannot create: ", ec.message()));
    for (const fs::path& p : keep) {
      fs::rename(p, fs::path(aside) / p.filename(), ec);
      if (ec) throw IoError(str(p.string(), ": cannot move it into ", aside, ": ", ec.message()));
    }
    fsync_dir(aside);
  }
  for (const fs::path& p : drop) {
    fs::remove_all(p, ec);
    if (ec) throw IoError(str(p.string(), ": cannot remove: ", ec.message()));
  }
  fsync_dir(dir);
  return aside;
}

}  // namespace fuyou
