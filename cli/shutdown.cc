#include "shutdown.h"

#include <dirent.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <charconv>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <string>
#include <string_view>

#include "zinf/core/status.h"
#include "zinf/core/units.h"
#include "zinf/io/file.h"
#include "zinf/io/swap_space.h"

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

// The pid a run directory's name carries ("zinf-<pid>-<anything>"), or 0 when it is not one.
pid_t run_directory_pid(std::string_view name) {
  constexpr std::string_view kPrefix = "zinf-";
  if (name.substr(0, kPrefix.size()) != kPrefix) return 0;
  name.remove_prefix(kPrefix.size());
  const size_t dash = name.find('-');
  if (dash == std::string_view::npos || dash == 0) return 0;
  pid_t pid = 0;
  const auto [end, ec] = std::from_chars(name.data(), name.data() + dash, pid);
  if (ec != std::errc() || end != name.data() + dash || pid <= 0) return 0;
  return pid;
}

// The names in a directory (but . and ..), read through a descriptor of its own so that `dir`'s
// is left as it is.
Result<std::vector<std::string>> entry_names(const io::DirHandle& dir) {
  const int fd = ::openat(dir.fd(), ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return errno_status(errno, fmt::format("cannot read directory {}", dir.path()));
  std::unique_ptr<DIR, int (*)(DIR*)> d(::fdopendir(fd), &::closedir);
  if (!d) {
    const int err = errno;
    ::close(fd);
    return errno_status(err, fmt::format("cannot read directory {}", dir.path()));
  }
  std::vector<std::string> names;
  errno = 0;
  while (const dirent* e = ::readdir(d.get())) {
    const std::string_view name = e->d_name;
    if (name != "." && name != "..") names.emplace_back(name);
  }
  if (errno != 0) return errno_status(errno, fmt::format("cannot read directory {}", dir.path()));
  return names;
}

// Removes what `dir` holds, never following a symlink (sub-directories are opened O_NOFOLLOW
// relative to their parent; symlinks are unlinked), adding the bytes of the regular files to
// `bytes`. `depth` bounds the recursion (a run directory is flat).
Status remove_contents(const io::DirHandle& dir, uint64_t& bytes, int depth) {
  if (depth > 16) {
    return make_error(ErrorCode::kInvalidArgument, "{}: directories nested too deep", dir.path());
  }
  ZINF_ASSIGN_OR_RETURN(std::vector<std::string> names, entry_names(dir));
  for (const std::string& name : names) {
    struct stat st {};
    if (::fstatat(dir.fd(), name.c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0) {
      if (errno == ENOENT) continue;
      return errno_status(errno, fmt::format("cannot stat {}/{}", dir.path(), name));
    }
    int flags = 0;
    if (S_ISDIR(st.st_mode)) {
      ZINF_ASSIGN_OR_RETURN(io::DirHandle sub, io::DirHandle::open_at(dir, name));
      ZINF_RETURN_IF_ERROR(remove_contents(sub, bytes, depth + 1));
      flags = AT_REMOVEDIR;
    } else if (S_ISREG(st.st_mode)) {
      bytes += static_cast<uint64_t>(st.st_size);
    }
    if (::unlinkat(dir.fd(), name.c_str(), flags) != 0 && errno != ENOENT) {
      return errno_status(errno, fmt::format("cannot remove {}/{}", dir.path(), name));
    }
  }
  return Status::ok();
}

// Removes the run directory `name` under `root` if it is stale (see the header); returns whether
// it did.
bool remove_if_stale(const io::DirHandle& root, const std::string& name) {
  const pid_t pid = run_directory_pid(name);
  if (pid == 0 || pid == ::getpid()) return false;
  // Only a directory made under this machine boot and pid namespace (`zinf-<pid>-<host>-...`):
  // elsewhere (another node on a shared file system, a container) its pid means nothing here.
  const std::string host = io::swap_host_tag();
  const std::string mine = fmt::format("zinf-{}-{}-", pid, host);
  if (host.empty() || name.size() <= mine.size() || name.compare(0, mine.size(), mine) != 0) {
    return false;
  }
  if (::kill(pid, 0) == 0 || errno != ESRCH) return false;  // it lives (EPERM: another user's)
  struct stat st {};
  if (::fstatat(root.fd(), name.c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0) return false;
  if (!S_ISDIR(st.st_mode) || st.st_uid != ::geteuid()) return false;
  const std::string path = root.path() + "/" + name;
  auto warn = [&](const Status& s) {
    if (s.sys_errno() == ENOENT) return false;  // removed meanwhile by another zinf
    std::fprintf(stderr, "zinf: warning: cannot remove the stale swap directory %s: %s\n",
                 path.c_str(), s.detail().c_str());
    return false;
  };
  uint64_t bytes = 0;
  {
    auto run = io::DirHandle::open_at(root, name);  // O_NOFOLLOW: a symlink put there since fails
    if (!run.is_ok()) return warn(run.status());
    struct stat opened {};
    if (::fstat(run->fd(), &opened) != 0) return warn(errno_status(errno, "fstat"));
    if (opened.st_dev != st.st_dev || opened.st_ino != st.st_ino) return false;  // replaced
    if (Status s = remove_contents(*run, bytes, 0); !s.is_ok()) return warn(s);
  }
  if (::unlinkat(root.fd(), name.c_str(), AT_REMOVEDIR) != 0) {
    return warn(errno_status(errno, "unlinkat"));
  }
  std::fprintf(
      stderr, "zinf: removed the swap directory %s of process %d, which no longer exists (%s)\n",
      path.c_str(), static_cast<int>(pid), format_bytes(static_cast<double>(bytes)).c_str());
  return true;
}

}  // namespace

int remove_stale_swap_directories(const std::vector<std::string>& paths) {
  int removed = 0;
  for (const std::string& dir : paths) {
    auto root = io::DirHandle::open(dir);
    if (!root.is_ok()) continue;  // a path that is not there is zinf train's to report
    auto names = entry_names(*root);
    if (!names.is_ok()) continue;
    for (const std::string& name : *names) removed += remove_if_stale(*root, name) ? 1 : 0;
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
