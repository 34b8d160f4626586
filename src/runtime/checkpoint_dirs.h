// The directory side of checkpoints: names, the atomic commit of a staging directory, the
// `latest` pointer, pruning to checkpoint.keep. Every step that must survive a power loss
// is followed by an fsync of the file or of the directory that names it.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace fuyou {

std::string step_dir_name(int64_t step);   // "step-N"
int64_t step_of(const std::string& name);  // "step-N" -> N; -1 for any other name
// fsync of a directory (after a rename or a new entry in it); IoError naming it.
void fsync_dir(const std::string& dir);
// Renames the complete, fsynced staging directory to root/name and fsyncs root. A step
// directory already there (a run that resumed from an older checkpoint reaches its step
// again) is exchanged atomically and then removed. Returns the new path.
std::string commit_staging(const std::string& root, const std::string& staging,
                           const std::string& name);
// Points root/latest at `name` (write latest.tmp, fsync, rename, fsync root).
void write_latest(const std::string& root, const std::string& name);
// checkpoint.keep_best: the complete checkpoint whose manifest records the lowest validation
// loss (last_val_loss; the oldest of equals), derived from the manifests whatever the `best`
// file says, since a pointer alone can be missing, damaged or point outside the run.
struct BestCheckpoint {
  std::string name;     // "step-N"; empty when no complete checkpoint records a validation loss
  double loss = 0;      // its recorded validation loss
  std::string pointer;  // what checkpoints/best holds, trimmed ("" when there is none)
  // Complete checkpoints whose manifest could not be read: not compared, and never pruned.
  std::vector<std::string> unreadable;
  bool pointer_agrees() const { return pointer == name; }
};
// IoError when `best` exists but is not a regular file (a directory: nothing could replace it).
BestCheckpoint find_best_checkpoint(const std::string& run_dir);
// The warning a run logs when the `best` file disagrees with find_best_checkpoint ("" when
// it agrees): what the file holds and what the manifests say instead.
std::string best_pointer_warning(const std::string& run_dir, const BestCheckpoint& b);
// Points root/best at `name` (as write_latest).
void write_best(const std::string& root, const std::string& name);
// Removes the oldest complete checkpoints beyond `keep`, never the ones `latest` and `best`
// name and, with keep_best, never the one of lowest recorded validation loss nor one whose
// manifest cannot be read (find_best_checkpoint). Each is renamed to a hidden name first, so
// a crash half-way through leaves a leftover the next start removes, never a step directory
// with files missing. Returns how many.
int prune_checkpoints(const std::string& run_dir, int keep, bool keep_best = false);

}  // namespace fuyou
