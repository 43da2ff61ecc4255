#include "shutdown.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>

namespace zinf::cli {

int remove_own_swap_directories(const std::vector<std::string>& paths) {
  const std::string prefix = "zinf-" + std::to_string(::getpid()) + "-";
  int removed = 0;
  for (const std::string& dir : paths) {
    std::error_code ec;
    for (const auto& entry : std::filesystem::directory_iterator(dir, ec)) {
      if (entry.path().filename().string().rfind(prefix, 0) != 0) continue;
      std::error_code rm;
      std::filesystem::remove_all(entry.path(), rm);
      if (rm) {
        std::fprintf(stderr, "zinf: cannot remove %s: %s\n", entry.path().c_str(),
                     rm.message().c_str());
      } else {
        ++removed;
      }
    }
  }
  return removed;
}

namespace {
int g_pipe_write = -1;  // the watcher's pipe, for the handler

void on_signal(int sig) {
  const int saved = errno;
  const unsigned char byte = static_cast<unsigned char>(sig);
  if (g_pipe_write >= 0) (void)!::write(g_pipe_write, &byte, 1);
  errno = saved;
}
}  // namespace

SignalWatcher::SignalWatcher(std::vector<std::string> nvme_paths)
    : nvme_paths_(std::move(nvme_paths)) {
  if (::pipe2(pipe_, O_CLOEXEC | O_NONBLOCK) != 0) {
    std::fprintf(stderr,
                 "zinf: warning: no pipe for the signal watcher (%s): SIGINT and SIGTERM "
                 "stop at once\n",
                 std::strerror(errno));
    return;
  }
  g_pipe_write = pipe_[1];
  struct sigaction sa {};
  sa.sa_handler = on_signal;
  sa.sa_flags = SA_RESTART;
  sigemptyset(&sa.sa_mask);
  ::sigaction(SIGINT, &sa, &old_int_);
  ::sigaction(SIGTERM, &sa, &old_term_);
  thread_ = std::thread([this] { watch(); });
}

SignalWatcher::~SignalWatcher() {
  if (pipe_[0] < 0) return;
  ::sigaction(SIGINT, &old_int_, nullptr);
  ::sigaction(SIGTERM, &old_term_, nullptr);
  done_ = true;
  thread_.join();
  g_pipe_write = -1;
  ::close(pipe_[0]);
  ::close(pipe_[1]);
}

void SignalWatcher::watch() {
  // Polled with a timeout so that the destructor's `done_` is seen within 100 ms.
  while (!done_) {
    pollfd p{.fd = pipe_[0], .events = POLLIN, .revents = 0};
    if (::poll(&p, 1, 100) <= 0) continue;
    unsigned char byte = 0;
    if (::read(pipe_[0], &byte, 1) != 1) continue;
    const int sig = byte;
    int none = 0;
    if (received_.compare_exchange_strong(none, sig)) {
      std::fprintf(stderr,
                   "\nzinf: %s received: finishing the current step and saving when --save-dir "
                   "is given (a second signal stops at once)\n",
                   sig == SIGINT ? "SIGINT" : "SIGTERM");
      continue;
    }
    const int removed = remove_own_swap_directories(nvme_paths_);
    std::fprintf(stderr, "zinf: second signal: stopping now (%d swap director%s removed)\n",
                 removed, removed == 1 ? "y" : "ies");
    std::_Exit(128 + received_.load());
  }
}

}  // namespace zinf::cli
