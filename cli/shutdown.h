// Clean shutdown of `zinf train` (docs/checkpoints.md). SIGINT and SIGTERM are caught by a
// handler (SA_RESTART) that only writes the signal's number into a pipe; the watcher's thread
// reads it and does the rest outside signal context. (Blocking the signals instead does not
// work: threads started before, such as oneTBB's workers, would still take them.) The first asks
// the run to stop after the current step (TrainOptions::stop: the ranks agree on the step, a
// checkpoint is saved when --save-dir is given, the engines remove their swap files as they go); a
// second stops the process at once, after removing this process's swap run directories
// (zinf-<pid>-*) under the NVMe paths. Either way the exit code is 128 + the signal (130 for
// SIGINT, 143 for SIGTERM).
//
// One watcher per process at a time; the destructor restores the previous handlers.
#pragma once

#include <signal.h>

#include <atomic>
#include <string>
#include <thread>
#include <vector>

namespace zinf::cli {

class SignalWatcher {
 public:
  explicit SignalWatcher(std::vector<std::string> nvme_paths);
  ~SignalWatcher();
  SignalWatcher(const SignalWatcher&) = delete;
  SignalWatcher& operator=(const SignalWatcher&) = delete;

  // The first signal received (0: none yet).
  const std::atomic<int>& received() const { return received_; }

 private:
  void watch();
  std::vector<std::string> nvme_paths_;
  std::atomic<int> received_{0};
  std::atomic<bool> done_{false};
  int pipe_[2] = {-1, -1};
  struct sigaction old_int_ {
  }, old_term_{};
  std::thread thread_;
};

// Removes this process's swap run directories (zinf-<pid>-*) under `paths`; returns how many.
int remove_own_swap_directories(const std::vector<std::string>& paths);

// Removes the swap run directories (zinf-<pid>-*) under `paths` that processes which no longer
// exist left behind (a SIGKILL, a crash, a power loss), logging one line per directory with its
// size to stderr; returns how many. `zinf train` calls it at start, before its space check.
//
// A directory is removed only when all hold: it was made under this machine boot and this pid
// namespace (its name is zinf-<pid>-<io::swap_host_tag()>-*: a directory of a run on another node
// sharing the file system, or in another container, is never taken for dead, and neither is one
// whose name says nothing of where it was made); no process has its pid (kill(pid, 0) fails with
// ESRCH: EPERM means another user's process has it); it is a real directory (lstat: a symlink of
// that name is left alone, never followed), owned by this user; and the directory opened
// (O_NOFOLLOW) is the one checked (same device and inode). Its contents are removed through
// directory descriptors (openat / unlinkat), never following a symlink inside: a symlink is
// unlinked, its target untouched. A live process's directory, another zinf's included, is never
// touched; so is this process's own.
// Errors are reported as warnings and the directory is skipped (one removed meanwhile by another
// zinf starting at the same time is not an error).
int remove_stale_swap_directories(const std::vector<std::string>& paths);

}  // namespace zinf::cli
