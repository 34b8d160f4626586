// What a run directory holds, read before a run changes it: whether a new run may start in
// it, and, for --resume-or-start, whether it is a run killed before its first checkpoint
// (nothing committed, only that run's own files), which is started over in place with its
// metrics kept aside. The run (train_run.cc) and --dry-run (dry_run.cc) ask the same
// questions here, so that both give the same verdict in the same words.
#pragma once

#include <string>
#include <vector>

namespace fuyou {

// How a run means to use its directory.
enum class RunDirUse {
  kNew,      // a new run: the directory must be new or empty (a killed start's lock aside)
  kRestart,  // --resume-or-start without a checkpoint: a killed run's own files may be there
  kSameRun,  // a resume continuing in its checkpoint's run: anything of that run may be there
};

// The entries of `dir` (names, sorted) that the use does not allow; empty when it may start.
std::vector<std::string> foreign_run_dir_entries(const std::string& dir, RunDirUse use);

// The refusal of a directory holding files the use does not allow ("" when none): the same
// sentence for the run and for --dry-run, naming the files. `resuming`: the run resumes a
// checkpoint into a new directory (the advice then offers the checkpoint's own run).
std::string run_dir_refusal(const std::string& dir, RunDirUse use, bool resuming);

// --resume-or-start in a directory of a run killed before its first checkpoint (only its own
// files, foreign_run_dir_entries(kRestart) empty): moves metrics.jsonl, samples.jsonl and
// config.yaml into DIR/restarted-<UTC date-time>/ and removes the rest of that run's files
// (its tokenized data, staging, checkpoint leftovers, carried model files) but the lock.
// `ours` (a path in `dir`, or "") is this process's and stays. Returns the directory the old
// files went to ("" when there was nothing to keep).
std::string set_aside_killed_run(const std::string& dir, const std::string& ours);

// A file a run writes at the top of its directory. Each is written through NAME.tmp
// (write_file_atomic, SafetensorsStreamWriter), so a process killed while writing one leaves
// NAME.tmp behind, which the next start in the directory removes.
struct RunFile {
  const char* name;
  bool before_first_checkpoint;  // written from the start: a run killed before its first
                                 // checkpoint may have left it (foreign_run_dir_entries)
  bool kept_on_restart;          // set aside, not removed, when such a run is started over
};

// The run's own files: the one list that the run's start (removing NAME.tmp), its stop
// cleanup, --resume-or-start and --dry-run (foreign_run_dir_entries) read.
inline constexpr RunFile kRunFiles[] = {
    {"config.yaml", true, true},         {"metrics.jsonl", true, true},
    {"samples.jsonl", true, true},       {"curves.svg", true, false},
    {"model.safetensors", false, false}, {"summary.json", false, false},
};

// NAME.tmp, the temporary file a run writes NAME through.
inline std::string run_temp_file(const RunFile& f) { return std::string(f.name) + ".tmp"; }

// The prefix of the directories set_aside_killed_run keeps old metrics in.
inline constexpr const char* kRestartedPrefix = "restarted-";

}  // namespace fuyou
