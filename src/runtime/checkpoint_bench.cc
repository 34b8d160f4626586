#include "fuyou/checkpoint_bench.h"

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <vector>

#include "fuyou/backend_select.h"
#include "fuyou/checkpoint.h"
#include "fuyou/engine.h"
#include "fuyou/error.h"
#include "fuyou/rng.h"
#include "fuyou/sizes.h"
#include "fuyou/timing.h"

namespace fs = std::filesystem;

namespace fuyou {
namespace {

// Drops a directory's files from the page cache (they are fsynced, so their pages are
// clean), so that the restore reads the disk as a restart would.
void drop_cache(const fs::path& dir) {
  for (const auto& e : fs::recursive_directory_iterator(dir)) {
    if (!e.is_regular_file()) continue;
    int fd = ::open(e.path().c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) continue;
    ::fdatasync(fd);
    ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
    ::close(fd);
  }
}

// `cmd` through sh, its output. The child starts with no signal blocked: the tools block the
// stop signals in every thread of their own (include/fuyou/stop.h), and a child that inherited
// that mask would not stop on Ctrl-C.
std::string run_command(const std::string& cmd) {
  int fds[2];
  if (::pipe2(fds, O_CLOEXEC) != 0)
    throw Error(str("cannot run: ", cmd, ": pipe: ", std::strerror(errno)));
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, fds[1], STDOUT_FILENO);
  posix_spawnattr_t attr;
  posix_spawnattr_init(&attr);
  sigset_t none;
  sigemptyset(&none);
  posix_spawnattr_setsigmask(&attr, &none);
  posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETSIGMASK);
  const char* argv[] = {"sh", "-c", cmd.c_str(), nullptr};
  pid_t pid = 0;
  const int err =
      ::posix_spawn(&pid, "/bin/sh", &actions, &attr, const_cast<char* const*>(argv), environ);
  posix_spawn_file_actions_destroy(&actions);
  posix_spawnattr_destroy(&attr);
  ::close(fds[1]);
  if (err != 0) {
    ::close(fds[0]);
    throw Error(str("cannot run: ", cmd, ": ", std::strerror(err)));
  }
  std::string out;
  char buf[4096];
  for (ssize_t n; (n = ::read(fds[0], buf, sizeof buf)) != 0;) {
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) break;
    out.append(buf, static_cast<size_t>(n));
  }
  ::close(fds[0]);
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) throw Error(str("failed: ", cmd, "\n", out));
  return out;
}

bool fio_installed() {
  try {
    run_command("command -v fio > /dev/null 2>&1");
    return true;
  } catch (const Error&) {
    return false;
  }
}

// The fio jobs the checkpoint is measured against, over the same bytes in the same directory:
// the disk's sequential write bandwidth (direct 1 MiB writes, 16 in flight, an fsync at the
// end: the checkpoint files are written with O_DIRECT), and buffered 1 MiB reads after fio
// drops the file from the page cache (invalidate), as the files are read on restore.
const char* const kFioWrite =
    "--rw=write --bs=1M --direct=1 --ioengine=libaio --iodepth=16 --end_fsync=1";
const char* const kFioRead = "--rw=read --bs=1M --ioengine=psync --invalidate=1";

// fio's bandwidth (bytes/s) of `rw` (write or read) over `bytes` in `dir`.
double fio_bandwidth(const fs::path& dir, const std::string& rw, uint64_t bytes) {
  const std::string cmd =
      str("fio --name=fuyou-ckpt --directory=", dir.string(), " --filename=fio.dat ",
          rw == "write" ? kFioWrite : kFioRead, " --size=", bytes, " --output-format=json 2>&1");
  nlohmann::json j = nlohmann::json::parse(run_command(cmd));
  return j.at("jobs").at(0).at(rw).at("bw_bytes").get<double>();
}

}  // namespace

nlohmann::json run_checkpoint_bench(const Config& cfg, const CheckpointBenchOptions& o) {
  const fs::path dir = o.dir.empty()
                           ? fs::current_path() / str("fuyou-bench-checkpoint-", ::getpid())
                           : fs::path(o.dir);
  fs::create_directories(dir);
  const fs::path run = dir / "run";
  std::string why;
  auto backend = make_backend(cfg, &why);
  auto engine = make_train_engine(cfg, *backend);
  engine->init_params();
  // One step on random tokens, so the moments hold values rather than zeros.
  const int B = cfg.schedule.micro_batch, T = cfg.model.seq_len;
  std::vector<std::vector<int32_t>> mbs(cfg.schedule.grad_accum,
                                        std::vector<int32_t>(static_cast<size_t>(B) * (T + 1)));
  Rng rng(cfg.runtime.seed);
  std::vector<const int32_t*> ptrs;
  for (auto& mb : mbs) {
    for (auto& t : mb) t = static_cast<int32_t>(rng.below(cfg.model.vocab_size));
    ptrs.push_back(mb.data());
  }
  engine->step(0, ptrs);
  // The offloaded step returns while its last updates still run beside where the next step
  // would start; a checkpoint waits for them (counters() drains). That wait is the step's work,
  // so it is left out of save_s.
  engine->counters();
  TrainProgress p;
  p.step = 1;
  SavedCheckpoint saved = save_checkpoint(run.string(), cfg, *engine, p, {});
  drop_cache(run);
  auto t0 = std::chrono::steady_clock::now();
  CheckpointManifest m = read_checkpoint_manifest(saved.dir);
  restore_checkpoint(saved.dir, m, cfg.model, *engine);
  const double restore_s = seconds_since(t0);
  nlohmann::json r{{"engine", engine->offloaded() ? "offloaded" : "in-memory"},
                   {"dir", dir.string()},
                   {"bytes", saved.bytes},
                   {"save_s", saved.seconds},
                   {"restore_s", restore_s},
                   {"save_MBps", saved.bytes / saved.seconds / 1e6},
                   {"restore_MBps", saved.bytes / restore_s / 1e6}};
  fs::remove_all(run);
  r["fio"] = nullptr;
  if (o.fio && fio_installed()) {
    const double w = fio_bandwidth(dir, "write", saved.bytes),
                 rd = fio_bandwidth(dir, "read", saved.bytes);
    fs::remove(dir / "fio.dat");
    r["fio"] =
        str("write: fio ", kFioWrite, "; read: fio ", kFioRead, " (same directory, same bytes)");
    r["fio_write_MBps"] = w / 1e6;
    r["fio_read_MBps"] = rd / 1e6;
    r["save_fraction_of_fio"] = r["save_MBps"].get<double>() / (w / 1e6);
    r["restore_fraction_of_fio"] = r["restore_MBps"].get<double>() / (rd / 1e6);
  } else if (o.fio) {
    r["fio_missing"] = "fio is not installed (apt-get install fio)";
  }
  if (o.dir.empty()) fs::remove_all(dir);
  return r;
}

void print_checkpoint_bench(const nlohmann::json& r) {
  std::printf("checkpoint (%s engine) of %s in %s\n", r["engine"].get<std::string>().c_str(),
              format_size(r["bytes"].get<uint64_t>()).c_str(), r["dir"].get<std::string>().c_str());
  std::printf("  save    %.3f s  %8.1f MB/s", r["save_s"].get<double>(),
              r["save_MBps"].get<double>());
  if (r.contains("fio_write_MBps"))
    std::printf("   fio write %8.1f MB/s  (%.0f%%)", r["fio_write_MBps"].get<double>(),
                100 * r["save_fraction_of_fio"].get<double>());
  std::printf("\n  restore %.3f s  %8.1f MB/s", r["restore_s"].get<double>(),
              r["restore_MBps"].get<double>());
  if (r.contains("fio_read_MBps"))
    std::printf("   fio read  %8.1f MB/s  (%.0f%%)", r["fio_read_MBps"].get<double>(),
                100 * r["restore_fraction_of_fio"].get<double>());
  std::printf("\n");
  if (r.contains("fio_missing")) std::printf("  %s\n", r["fio_missing"].get<std::string>().c_str());
}

}  // namespace fuyou
