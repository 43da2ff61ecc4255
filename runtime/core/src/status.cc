#include "zinf/core/status.h"

#include <cerrno>
#include <cstdio>
#include <cstring>

namespace zinf {

std::string_view error_code_name(ErrorCode code) {
  switch (code) {
    case ErrorCode::kOk:
      return "ok";
    case ErrorCode::kInvalidArgument:
      return "invalid argument";
    case ErrorCode::kIo:
      return "I/O error";
    case ErrorCode::kNoSpace:
      return "no space left";
    case ErrorCode::kOutOfMemory:
      return "out of memory";
    case ErrorCode::kNotFound:
      return "not found";
    case ErrorCode::kCorrupt:
      return "corrupt data";
    case ErrorCode::kNonFinite:
      return "non-finite values";
    case ErrorCode::kTimeout:
      return "timed out";
    case ErrorCode::kUnavailable:
      return "unavailable";
    case ErrorCode::kCancelled:
      return "cancelled";
    case ErrorCode::kInternal:
      return "internal error";
  }
  return "unknown";
}

Status& Status::with_context(std::string_view context) & {
  if (!is_ok()) message_ = fmt::format("{}: {}", context, message_);
  return *this;
}

Status&& Status::with_context(std::string_view context) && {
  if (!is_ok()) message_ = fmt::format("{}: {}", context, message_);
  return std::move(*this);
}

std::string Status::detail() const {
  if (errno_ != 0) return fmt::format("{}: {}", message_, std::strerror(errno_));
  return message_;
}

std::string Status::to_string() const {
  if (is_ok()) return "ok";
  if (errno_ != 0)
    return fmt::format("{}: {}: {}", error_code_name(code_), message_, std::strerror(errno_));
  return fmt::format("{}: {}", error_code_name(code_), message_);
}

Status errno_status(int err, std::string message) {
  if (err < 0) err = -err;
  ErrorCode code = ErrorCode::kIo;
  switch (err) {
    case ENOSPC:
    case EDQUOT:
      code = ErrorCode::kNoSpace;
      break;
    case ENOMEM:
      code = ErrorCode::kOutOfMemory;
      break;
    case ENOENT:
      code = ErrorCode::kNotFound;
      break;
    case EINVAL:
    case EISDIR:
    case ENOTDIR:
    case EACCES:
    case EPERM:
    case EROFS:
    case ELOOP:
    case EEXIST:
      code = ErrorCode::kInvalidArgument;
      break;
    case ETIMEDOUT:
      code = ErrorCode::kTimeout;
      break;
    case ECANCELED:
      code = ErrorCode::kCancelled;
      break;
    default:
      break;
  }
  return Status(code, std::move(message), err);
}

void check_failed(const char* file, int line, const char* expr, const std::string& msg) {
  std::fprintf(stderr, "zinf: invariant broken at %s:%d: %s%s%s\n", file, line, expr,
               msg.empty() ? "" : ": ", msg.c_str());
  std::fflush(stderr);
  std::abort();
}

}  // namespace zinf
