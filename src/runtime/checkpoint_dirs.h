// The directory side of checkpoints: names, the atomic commit of a staging directory, the
// `latest` pointer, pruning to checkpoint.keep. Every step that must survive a power loss
// is followed by an fsync of the file or of the directory that names it.
#pragma once

#include <cstdint>
#include <string>

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
// Removes the oldest complete checkpoints beyond `keep` (never the ones `latest` and `best`
// name);
// each is renamed to a hidden name first, so a crash half-way through leaves a leftover
// the next start removes, never a step directory with files missing. Returns how many.
int prune_checkpoints(const std::string& run_dir, int keep);

}  // namespace fuyou
