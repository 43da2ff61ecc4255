// IoEngine: asynchronous reads and writes of aligned buffers at file offsets, over io_uring.
//
// Contract
//  - submit() hands a request to one of the engine's rings (round robin). Each ring is served by
//    one thread that keeps up to `queue_depth` chunks in flight; a request longer than
//    `block_size` is split into chunks of at most that size.
//  - Every accepted request completes exactly once: its callback runs (or its future becomes
//    ready) after every byte was transferred or after the first error, and only once no chunk of
//    it is still in flight (so the caller may free the buffer then).
//  - A short transfer continues from where it stopped; -EAGAIN/-EINTR resubmit; any other
//    negative result becomes an error naming the operation, file, offset and length.
//  - A request that cannot be valid (misaligned buffer, offset or length for an O_DIRECT file;
//    zero length; null buffer) is refused by submit() with kInvalidArgument, and its callback is
//    never called.
//  - Callbacks run on the ring's thread: they must be short and must not block. They may call
//    submit() (that is how pipelines refill without a context switch).
//  - Buffers registered with register_buffer() are used as fixed buffers (READ_FIXED /
//    WRITE_FIXED) when a request falls inside one; files registered with register_file() are
//    used through the ring's fixed-file table. Both are optional accelerations. The table
//    updates are queued to each ring's thread (and run there at once when called on it), which
//    applies them before any request submitted after them; a registration the kernel refuses
//    (RLIMIT_MEMLOCK, ...) is logged (once per ring and kind) and that ring moves the data
//    unregistered. Neither call waits for a ring's thread, so they may be called with locks held
//    that callbacks take. A buffer or file must have no request in flight when unregistered.
//  - io_uring_enter failing (other than EINTR) is retried, every millisecond, for at most
//    `submit_retry_ms`; then the ring is broken: every request it holds that the kernel has not
//    taken fails with an error naming the ring, the errno and the request (operation, file,
//    offset, length), and so does every later request given to that ring. Requests the kernel
//    took still complete normally.
//  - Destruction waits for every accepted request to complete, for at most `drain_timeout_ms`;
//    past it, an error names how many requests are still outstanding (and the first of them) and
//    they are abandoned: their callbacks never run and the kernel may still write into their
//    buffers, so a caller whose destruction timed out must not reuse those buffers (in practice:
//    the process is going down after a device stopped answering).
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <future>
#include <memory>
#include <span>
#include <vector>

#include "zinf/core/status.h"
#include "zinf/io/fault.h"
#include "zinf/io/file.h"

namespace zinf::io {

struct IoEngineOptions {
  uint32_t queue_depth = 32;         // chunks in flight per ring
  uint64_t block_size = 1ull << 20;  // largest chunk handed to the kernel
  uint32_t rings = 1;                // rings, each with its own thread
  bool fixed_buffers = true;         // use registered buffers when a request falls in one
  bool fixed_files = true;           // use the fixed-file table for registered files
  uint32_t max_registered_buffers = 64;
  uint32_t max_registered_files = 256;
  uint32_t max_retries = 1000;  // -EAGAIN/-EINTR resubmissions of one chunk before failing
  // Submit each chunk with its own io_uring_enter instead of batching the chunks prepared
  // together (DeepSpeed's aio.single_submit; slower, kept for comparison).
  bool single_submit = false;
  // Create the rings with IORING_SETUP_SINGLE_ISSUER | IORING_SETUP_DEFER_TASKRUN where the
  // kernel has them (6.1+), as fio does: completions are posted when the ring's thread waits for
  // them instead of interrupting it. (Registrations run on the ring's thread either way.)
  bool defer_taskrun = true;
  // Bounded waits (see the contract above).
  uint32_t submit_retry_ms = 1000;    // a failing io_uring_enter, before the ring is broken
  uint32_t drain_timeout_ms = 60000;  // destruction waiting for outstanding requests
};

struct IoRequest {
  IoOp op = IoOp::kRead;
  const File* file = nullptr;
  uint64_t offset = 0;
  void* buffer = nullptr;  // for writes, read only
  uint64_t length = 0;
};

using IoCallback = std::function<void(Status)>;

struct IoStats {
  uint64_t requests_completed = 0;
  uint64_t requests_failed = 0;
  uint64_t chunks_submitted = 0;
  uint64_t short_continuations = 0;  // chunks resubmitted after a short transfer
  uint64_t retries = 0;              // -EAGAIN / -EINTR resubmissions
  uint64_t bytes_read = 0;
  uint64_t bytes_written = 0;
  uint64_t fixed_buffer_chunks = 0;  // chunks that used a registered buffer
  uint64_t fixed_file_chunks = 0;    // chunks that used a registered file
  uint32_t deferred_rings = 0;       // rings created SINGLE_ISSUER | DEFER_TASKRUN
};

class IoEngine {
 public:
  static Result<std::unique_ptr<IoEngine>> create(const IoEngineOptions& options);
  ~IoEngine();
  IoEngine(const IoEngine&) = delete;
  IoEngine& operator=(const IoEngine&) = delete;

  // Asynchronous: `done` runs once with the request's outcome (see the contract above).
  Status submit(const IoRequest& request, IoCallback done);
  // Submits several requests with one wake-up of each ring; stops at the first invalid one and
  // returns its error. The requests before it were accepted (their number is stored in
  // *accepted when given) and will call back; the refused ones never will.
  Status submit_batch(std::span<const IoRequest> requests, std::span<IoCallback> done,
                      size_t* accepted = nullptr);
  // Future flavour: an invalid request yields a ready future holding the error.
  std::future<Status> submit(const IoRequest& request);

  // Synchronous conveniences.
  Status read(const File& file, uint64_t offset, void* buffer, uint64_t length);
  Status write(const File& file, uint64_t offset, const void* buffer, uint64_t length);

  // Registers [base, base+length) as a fixed buffer on every ring. Returns a slot to pass to
  // unregister_buffer(). Fails (kUnavailable) when the table is full; requests then simply use
  // the buffer unregistered, as they do on a ring whose kernel refused it (logged once per ring).
  // The buffer must have no request in flight when unregistered.
  Result<int> register_buffer(void* base, uint64_t length);
  Status unregister_buffer(int slot);
  // Registers a file in the fixed-file table of every ring. The file must outlive its
  // registration and have no request in flight when unregistered.
  Status register_file(const File& file);
  Status unregister_file(const File& file);

  // Blocks until every request accepted so far has completed: ok; or, after `timeout`, kTimeout
  // naming how many are outstanding.
  Status drain(std::chrono::milliseconds timeout = std::chrono::milliseconds::max());

  IoStats stats() const;
  const IoEngineOptions& options() const { return options_; }

  class Ring;  // one io_uring and its thread (io_engine.cc)

 private:
  explicit IoEngine(const IoEngineOptions& options);
  Status validate(const IoRequest& r) const;
  int buffer_slot(const void* buffer, uint64_t length) const;  // -1: not registered

  IoEngineOptions options_;
  std::vector<std::unique_ptr<Ring>> rings_;
  std::atomic<uint32_t> next_ring_{0};

  friend class Ring;
  struct Registry;
  std::unique_ptr<Registry> registry_;
};

}  // namespace zinf::io
