#include "zinf/ckpt/directory.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <filesystem>

#include "zinf/ckpt/files.h"
#include "zinf/ckpt/manifest.h"

namespace zinf::ckpt {
namespace fs = std::filesystem;
namespace {

// "step-<N>" -> N; -1 for anything else.
int64_t parse_step(const std::string& name) {
  if (name.rfind("step-", 0) != 0 || name.size() == 5) return -1;
  int64_t n = 0;
  for (size_t i = 5; i < name.size(); ++i) {
    if (name[i] < '0' || name[i] > '9') return -1;
    n = n * 10 + (name[i] - '0');
  }
  return n;
}

// "tmp-<N>-<pid>" or "old-<N>-<pid>" -> pid; 0 for anything else.
pid_t parse_tmp_pid(const std::string& name) {
  if (name.rfind("tmp-", 0) != 0 && name.rfind("old-", 0) != 0) return 0;
  const size_t dash = name.rfind('-');
  if (dash <= 3) return 0;
  try {
    return static_cast<pid_t>(std::stol(name.substr(dash + 1)));
  } catch (...) {
    return 0;
  }
}

bool is_dir(const std::string& path) {
  struct stat st {};
  return ::lstat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

}  // namespace

std::string step_dir_name(int64_t step) { return fmt::format("step-{}", step); }

Status fsync_dir(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return errno_status(errno, "cannot open directory " + path);
  const int rc = ::fsync(fd);
  const int err = errno;
  (void)::close(fd);
  if (rc != 0) return errno_status(err, "fsync of directory " + path);
  return Status::ok();
}

Status remove_tree(const std::string& path) {
  std::error_code ec;
  fs::remove_all(path, ec);
  if (ec) return errno_status(ec.value(), "cannot remove " + path);
  return Status::ok();
}

Result<std::string> create_temp_dir(const std::string& root, int64_t step, uint64_t pid) {
  std::error_code ec;
  fs::create_directories(root, ec);
  if (ec) return errno_status(ec.value(), "cannot create checkpoint directory " + root);
  const std::string tmp = fmt::format("{}/tmp-{}-{}", root, step, pid);
  if (::mkdir(tmp.c_str(), 0700) != 0) return errno_status(errno, "cannot create " + tmp);
  return tmp;
}

Result<std::string> commit_dir(const std::string& root, const std::string& tmp, int64_t step) {
  ZINF_RETURN_IF_ERROR(fsync_dir(tmp));
  const std::string name = step_dir_name(step);
  const std::string final_dir = root + "/" + name;
  // A checkpoint of the same step already there: moved aside first (rename cannot replace a
  // non-empty directory), removed once the new one is in place.
  std::string aside;
  if (is_dir(final_dir)) {
    aside = fmt::format("{}/old-{}-{}", root, step, ::getpid());
    if (std::rename(final_dir.c_str(), aside.c_str()) != 0) {
      return errno_status(errno, fmt::format("cannot move {} aside to {}", final_dir, aside));
    }
  }
  if (std::rename(tmp.c_str(), final_dir.c_str()) != 0) {
    const int err = errno;
    if (!aside.empty()) (void)std::rename(aside.c_str(), final_dir.c_str());
    return errno_status(err, fmt::format("cannot rename {} to {}", tmp, final_dir));
  }
  ZINF_RETURN_IF_ERROR(fsync_dir(root));
  const std::string latest_tmp = fmt::format("latest.tmp-{}", ::getpid());
  (void)::unlink((root + "/" + latest_tmp).c_str());
  ZINF_RETURN_IF_ERROR(write_small_file(root, latest_tmp, name + "\n").status());
  if (std::rename((root + "/" + latest_tmp).c_str(), (root + "/latest").c_str()) != 0) {
    const int err = errno;
    (void)::unlink((root + "/" + latest_tmp).c_str());
    return errno_status(err, "cannot update " + root + "/latest");
  }
  ZINF_RETURN_IF_ERROR(fsync_dir(root));
  if (!aside.empty()) ZINF_RETURN_IF_ERROR(remove_tree(aside));
  return final_dir;
}

std::vector<int64_t> list_steps(const std::string& root) {
  std::vector<int64_t> steps;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(root, ec)) {
    const int64_t n = parse_step(entry.path().filename().string());
    if (n >= 0 && is_dir(entry.path().string())) steps.push_back(n);
  }
  std::sort(steps.begin(), steps.end());
  return steps;
}

Status prune(const std::string& root, int keep) {
  std::string latest;
  if (auto text = read_small_file(root + "/latest"); text.is_ok()) {
    latest = *text;
    while (!latest.empty() && (latest.back() == '\n' || latest.back() == ' ')) latest.pop_back();
  }
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(root, ec)) {
    const std::string name = entry.path().filename().string();
    const pid_t pid = parse_tmp_pid(name);
    // A save in progress elsewhere keeps its directories: only a dead process's are removed
    // (an old-<N> of a dead process only once step-<N> is complete again).
    const bool replaced = name.rfind("old-", 0) != 0 ||
                          is_dir(root + "/" + step_dir_name(std::atoll(name.c_str() + 4)) + "/");
    if (pid > 0 && pid != ::getpid() && replaced && ::kill(pid, 0) != 0 && errno == ESRCH) {
      ZINF_RETURN_IF_ERROR(remove_tree(entry.path().string()));
    }
  }
  if (keep <= 0) return Status::ok();
  const std::vector<int64_t> steps = list_steps(root);
  for (size_t i = 0; i + static_cast<size_t>(keep) < steps.size(); ++i) {
    const std::string name = step_dir_name(steps[i]);
    if (name == latest) continue;
    ZINF_RETURN_IF_ERROR(remove_tree(root + "/" + name));
  }
  return fsync_dir(root);
}

Result<std::string> resolve_checkpoint(const std::string& path) {
  struct stat st {};
  if (::stat((path + "/" + kManifestName).c_str(), &st) == 0) return path;
  auto text = read_small_file(path + "/latest");
  if (!text.is_ok()) {
    return make_error(ErrorCode::kNotFound,
                      "{} is not a checkpoint: it holds neither {} nor a `latest` pointer", path,
                      kManifestName);
  }
  std::string name = *text;
  while (!name.empty() && (name.back() == '\n' || name.back() == ' ')) name.pop_back();
  if (parse_step(name) < 0) {
    return make_error(ErrorCode::kCorrupt, "{}/latest names '{}', not a step-<N> directory", path,
                      name);
  }
  const std::string dir = path + "/" + name;
  if (::stat((dir + "/" + kManifestName).c_str(), &st) != 0) {
    // A save of the same step again that died between moving the old step-<N> aside and
    // renaming the new one into place (commit_dir): the old one, complete, is still aside.
    const std::string aside = fmt::format("old-{}-", parse_step(name));
    std::error_code ec;
    for (const auto& entry : fs::directory_iterator(path, ec)) {
      const std::string n = entry.path().filename().string();
      if (n.rfind(aside, 0) == 0 &&
          ::stat((entry.path().string() + "/" + kManifestName).c_str(), &st) == 0) {
        return entry.path().string();
      }
    }
    return errno_status(
        errno, fmt::format("{}/latest names {}, which has no {}", path, name, kManifestName));
  }
  return dir;
}

}  // namespace zinf::ckpt
