// Two tiers of errors:
//  - Recoverable failures (I/O, allocation, bad input, a lost peer) travel up as a Status or a
//    Result<T>; every level may add context ("tensor blocks.3.params", "file /nvme/swap-0.bin").
//  - Broken invariants abort through ZINF_CHECK with file:line and the expression. A system call
//    is never checked with assert or ZINF_CHECK: its failure is a Status.
#pragma once

#include <fmt/format.h>

#include <cstdlib>
#include <string>
#include <string_view>
#include <utility>
#include <variant>

namespace zinf {

enum class ErrorCode {
  kOk = 0,
  kInvalidArgument,  // bad input from the user or the caller (sizes, alignment, config)
  kIo,               // an I/O request failed (EIO, unexpected EOF, ...)
  kNoSpace,          // ENOSPC: the file system is full
  kOutOfMemory,      // a tier's byte budget or an allocator refused
  kNotFound,         // a path, key or tensor that does not exist
  kCorrupt,          // a checksum or format check failed
  kNonFinite,        // values that must be finite are not (a diverged training step)
  kTimeout,          // a bounded wait ran out
  kUnavailable,      // a peer, store or device could not be reached
  kCancelled,        // the operation was abandoned (engine shut down)
  kInternal,         // an unexpected failure of a dependency
};

std::string_view error_code_name(ErrorCode code);

class [[nodiscard]] Status {
 public:
  Status() = default;
  Status(ErrorCode code, std::string message, int sys_errno = 0)
      : code_(code), errno_(sys_errno), message_(std::move(message)) {}

  static Status ok() { return {}; }

  bool is_ok() const { return code_ == ErrorCode::kOk; }
  explicit operator bool() const { return is_ok(); }
  ErrorCode code() const { return code_; }
  int sys_errno() const { return errno_; }
  const std::string& message() const { return message_; }

  // Prefixes context: "while flushing tensor x: <previous message>".
  Status& with_context(std::string_view context) &;
  Status&& with_context(std::string_view context) &&;

  // "<message>[: <strerror>]": what a user reads in a one-line error.
  std::string detail() const;
  // "<code name>: <message>[: <strerror>]": for logs.
  std::string to_string() const;

 private:
  ErrorCode code_ = ErrorCode::kOk;
  int errno_ = 0;
  std::string message_;
};

// Builds a Status from a negative or positive errno value, mapping ENOSPC/ENOMEM/ENOENT/...
Status errno_status(int err, std::string message);

template <typename... Args>
Status make_error(ErrorCode code, fmt::format_string<Args...> f, Args&&... args) {
  return Status(code, fmt::format(f, std::forward<Args>(args)...));
}

template <typename T>
class [[nodiscard]] Result {
 public:
  Result(T value) : v_(std::move(value)) {}          // NOLINT: implicit on purpose
  Result(Status status) : v_(std::move(status)) {    // NOLINT
    if (std::get<Status>(v_).is_ok()) std::abort();  // an ok Status carries no value
  }

  bool is_ok() const { return v_.index() == 0; }
  explicit operator bool() const { return is_ok(); }

  const Status& status() const {
    static const Status kOk;
    return is_ok() ? kOk : std::get<Status>(v_);
  }
  Status take_status() && { return is_ok() ? Status() : std::move(std::get<Status>(v_)); }

  T& value() & { return std::get<T>(v_); }
  const T& value() const& { return std::get<T>(v_); }
  T&& value() && { return std::get<T>(std::move(v_)); }
  T* operator->() { return &std::get<T>(v_); }
  const T* operator->() const { return &std::get<T>(v_); }
  T& operator*() & { return value(); }
  const T& operator*() const& { return value(); }
  T&& operator*() && { return std::move(*this).value(); }

 private:
  std::variant<T, Status> v_;
};

[[noreturn]] void check_failed(const char* file, int line, const char* expr,
                               const std::string& msg);

}  // namespace zinf

// Broken invariants: abort with file:line and the expression. Never for system calls.
#define ZINF_CHECK(cond, ...)                                                         \
  do {                                                                                \
    if (!(cond)) [[unlikely]]                                                         \
      ::zinf::check_failed(__FILE__, __LINE__, #cond, ::fmt::format("" __VA_ARGS__)); \
  } while (0)

#define ZINF_CONCAT_INNER(a, b) a##b
#define ZINF_CONCAT(a, b) ZINF_CONCAT_INNER(a, b)

#define ZINF_RETURN_IF_ERROR(expr)                  \
  do {                                              \
    ::zinf::Status zinf_status_ = (expr);           \
    if (!zinf_status_.is_ok()) return zinf_status_; \
  } while (0)

#define ZINF_ASSIGN_OR_RETURN_IMPL(tmp, lhs, expr)       \
  auto tmp = (expr);                                     \
  if (!tmp.is_ok()) return std::move(tmp).take_status(); \
  lhs = std::move(tmp).value()

#define ZINF_ASSIGN_OR_RETURN(lhs, expr) \
  ZINF_ASSIGN_OR_RETURN_IMPL(ZINF_CONCAT(zinf_result_, __LINE__), lhs, expr)
