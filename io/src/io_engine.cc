#include "zinf/io/io_engine.h"

#include <liburing.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <functional>
#include <future>
#include <limits>
#include <mutex>
#include <optional>
#include <shared_mutex>
#include <thread>
#include <unordered_map>

#include "zinf/core/log.h"
#include "zinf/core/units.h"

namespace zinf::io {
namespace {

constexpr uint64_t kEventTag = ~uint64_t{0};    // user_data of the wake-up read on the eventfd
constexpr uint64_t kMaxBlockSize = 1ull << 30;  // one SQE moves at most 2^31-1 bytes
// The result a chunk completes with when its ring is broken (no errno is that negative).
constexpr int kBrokenRes = std::numeric_limits<int>::min();
// While stopping, the ring thread waits for completions in slices of this much, so that it sees
// the stop deadline go by.
constexpr auto kStopSlice = std::chrono::milliseconds(20);

const char* op_name(IoOp op) { return op == IoOp::kRead ? "read" : "write"; }

}  // namespace

struct IoEngine::Registry {
  mutable std::shared_mutex mu;
  struct Buffer {
    uintptr_t base;
    uint64_t length;
    int slot;
  };
  std::vector<Buffer> buffers;  // sorted by base
  std::vector<bool> buffer_slot_used;
  std::unordered_map<int, int> file_slot;  // fd -> slot in the fixed-file table
  std::vector<bool> file_slot_used;
  bool buffers_available = true;  // sparse buffer tables exist on every ring
  bool files_available = true;    // sparse file tables exist on every ring
  // Bumped by every register and unregister of a slot. A ring that gets to a queued registration
  // after a later change of its slot skips it: the fd or memory it names may be gone by then.
  std::unique_ptr<std::atomic<uint64_t>[]> buffer_gen, file_gen;

  // Engine-wide completion accounting for drain().
  std::mutex drain_mu;
  std::condition_variable drain_cv;
  uint64_t accepted = 0;
  uint64_t completed = 0;
};

// One io_uring, served by one thread. Requests arrive in `incoming_` (any thread); the ring
// thread alone touches the ring, the chunk pool and the active list.
class IoEngine::Ring {
 public:
  struct Pending {
    IoRequest request;
    IoCallback done;
    int file_slot;  // -1: use the fd
    int buf_index;  // -1: not a registered buffer
  };

  Ring(IoEngine& engine, uint32_t index) : engine_(engine), index_(index) {}
  ~Ring() { stop(std::chrono::steady_clock::now()); }

  // Creates the ring (not yet its thread). With options.defer_taskrun the ring is created
  // disabled with IORING_SETUP_SINGLE_ISSUER | IORING_SETUP_DEFER_TASKRUN, as fio does: only its
  // own thread then enters it, and completions run when that thread asks for them rather than as
  // task work that interrupts it. Kernels without them (before 6.1) get COOP_TASKRUN, or nothing.
  Status init() {
    const auto& o = engine_.options_;
    unsigned entries = o.queue_depth + 2;  // + the eventfd wake-up read
    const unsigned coop = IORING_SETUP_COOP_TASKRUN;
    const unsigned deferred =
        coop | IORING_SETUP_SINGLE_ISSUER | IORING_SETUP_DEFER_TASKRUN | IORING_SETUP_R_DISABLED;
    int rc = -EINVAL;
    io_uring_params params{};
    for (unsigned flags : {o.defer_taskrun ? deferred : coop, coop, 0u}) {
      params = {};
      params.flags = flags;
      rc = io_uring_queue_init_params(entries, &ring_, &params);
      if (rc != -EINVAL) break;
    }
    if (rc < 0) {
      return errno_status(rc, fmt::format("cannot create io_uring ring {} (queue depth {})", index_,
                                          o.queue_depth));
    }
    ring_ok_ = true;
    single_issuer_ = (params.flags & IORING_SETUP_SINGLE_ISSUER) != 0;
    timed_wait_ = (params.features & IORING_FEAT_EXT_ARG) != 0;
    event_fd_ = ::eventfd(0, EFD_CLOEXEC);
    if (event_fd_ < 0) return errno_status(errno, "cannot create eventfd for io_uring ring");
    chunks_.resize(o.queue_depth);
    for (uint32_t i = 0; i < o.queue_depth; ++i) free_chunks_.push_back(&chunks_[i]);
    fixed_buffer_ok_.assign(o.max_registered_buffers, false);
    fixed_file_ok_.assign(o.max_registered_files, false);
    return Status::ok();
  }

  // Starts the ring's thread. A single-issuer ring is enabled by that thread, which makes it the
  // ring's only submitter; from then on every io_uring_register call on it must come from there
  // too, so table updates are queued to it (update_buffer, update_file).
  Status start() {
    std::future<int> result = enabled_.get_future();
    thread_ = std::thread([this] {
      tls_ring_ = this;
      // liburing 2.3 declares io_uring_enable_rings but does not export it.
      int rc = 0;
      if (single_issuer_ && ::syscall(__NR_io_uring_register, ring_.ring_fd,
                                      IORING_REGISTER_ENABLE_RINGS, nullptr, 0) < 0) {
        rc = -errno;
      }
      if (rc < 0) {
        std::lock_guard lock(mu_);
        exited_ = true;
      }
      enabled_.set_value(rc);
      if (rc < 0) return;
      loop();
    });
    int rc = result.get();
    if (rc < 0) {
      thread_.join();
      return errno_status(rc, fmt::format("cannot enable io_uring ring {}", index_));
    }
    return Status::ok();
  }

  bool single_issuer() const { return single_issuer_; }

  // Called once per ring at engine creation, before any request.
  bool register_sparse_buffers(uint32_t n) {
    return n > 0 && io_uring_register_buffers_sparse(&ring_, n) == 0;
  }
  bool register_sparse_files(uint32_t n) {
    return n > 0 && io_uring_register_files_sparse(&ring_, n) == 0;
  }
  // Table updates, queued to the ring's thread (run at once when called there). The thread runs
  // them before it takes any request submitted after them (take_incoming), so a request never
  // names a slot its ring has not seen. Nothing here waits for the ring thread: a caller may hold
  // a lock that a completion callback takes. If the kernel refuses an update (RLIMIT_MEMLOCK,
  // ...), the ring uses plain reads and writes for that slot and warns once.
  void update_buffer(int slot, iovec iov, uint64_t gen) {
    run_on_ring([this, slot, iov, gen]() mutable {
      if (iov.iov_base != nullptr && engine_.registry_->buffer_gen[slot].load() != gen) return;
      __u64 tag = 0;
      int rc = io_uring_register_buffers_update_tag(&ring_, slot, &iov, &tag, 1);
      fixed_buffer_ok_[slot] = rc >= 0 && iov.iov_base != nullptr;
      if (rc < 0) {
        log::warn_once(fmt::format("io:fixedbuf-refused:{}", index_),
                       fmt::format("io_uring ring {} could not register a {}-byte I/O buffer: {}; "
                                   "requests in it use plain reads and writes (reported once)",
                                   index_, iov.iov_len, std::strerror(-rc)));
      }
    });
  }
  void update_file(int slot, int fd, uint64_t gen) {
    run_on_ring([this, slot, fd, gen]() mutable {
      if (fd >= 0 && engine_.registry_->file_gen[slot].load() != gen) return;
      int rc = io_uring_register_files_update(&ring_, slot, &fd, 1);
      fixed_file_ok_[slot] = rc >= 0 && fd >= 0;
      if (rc < 0) {
        log::warn_once(fmt::format("io:fixedfile-refused:{}", index_),
                       fmt::format("io_uring ring {} could not register a file: {}; requests on it "
                                   "use its descriptor (reported once)",
                                   index_, std::strerror(-rc)));
      }
    });
  }

  void enqueue(Pending&& p) {
    bool wake;
    {
      std::lock_guard lock(mu_);
      wake = incoming_.empty();
      incoming_.push_back(std::move(p));
    }
    if (wake && tls_ring_ != this) wake_up();
  }

  void enqueue_batch(std::vector<Pending>&& batch) {
    bool wake;
    {
      std::lock_guard lock(mu_);
      wake = incoming_.empty();
      for (auto& p : batch) incoming_.push_back(std::move(p));
    }
    if (wake && tls_ring_ != this) wake_up();
  }

  // Waits for the ring thread to finish what it holds, until `deadline`; past it, the chunks
  // still in flight are abandoned (logged).
  void stop(std::chrono::steady_clock::time_point deadline) {
    if (!thread_.joinable()) {
      close_resources();
      return;
    }
    {
      std::lock_guard lock(mu_);
      stopping_ = true;
      stop_deadline_ = deadline;
    }
    wake_up();
    thread_.join();
    close_resources();
  }

  void add_stats(IoStats& s) const {
    s.requests_completed += stats_.requests_completed.load();
    s.requests_failed += stats_.requests_failed.load();
    s.chunks_submitted += stats_.chunks_submitted.load();
    s.short_continuations += stats_.short_continuations.load();
    s.retries += stats_.retries.load();
    s.bytes_read += stats_.bytes_read.load();
    s.bytes_written += stats_.bytes_written.load();
    s.fixed_buffer_chunks += stats_.fixed_buffer_chunks.load();
    s.fixed_file_chunks += stats_.fixed_file_chunks.load();
    s.deferred_rings += single_issuer_ ? 1 : 0;
  }

 private:
  // A request being worked on by this ring.
  struct Op {
    Pending p;
    uint64_t carved = 0;       // bytes handed out as chunks so far
    uint32_t outstanding = 0;  // chunks in flight (or awaiting a synthetic completion)
    Status error;              // first error; once set no new chunk is carved
  };
  struct Chunk {
    Op* op = nullptr;
    uint64_t start = 0;  // byte position within the request
    uint64_t length = 0;
    uint64_t done = 0;  // bytes transferred so far (short transfers continue from here)
    uint32_t retries = 0;
    bool corrupt = false;  // fault injection: flip a byte of what this read brings in
  };

  // Runs `fn` (an io_uring_register call and its bookkeeping) on the ring's thread: at once when
  // called there, else queued for it and the thread woken. Once the thread has exited (engine
  // shutdown) it is dropped: the ring is closed right after.
  void run_on_ring(std::function<void()> fn) {
    if (tls_ring_ == this) {
      fn();
      return;
    }
    {
      std::lock_guard lock(mu_);
      if (exited_) return;
      controls_.push_back(std::move(fn));
    }
    wake_up();
  }

  void wake_up() {
    uint64_t one = 1;
    // A full eventfd counter (EAGAIN) already means "wake up": nothing is lost.
    while (::write(event_fd_, &one, sizeof(one)) < 0 && errno == EINTR) {
    }
  }

  void close_resources() {
    if (ring_ok_) {
      io_uring_queue_exit(&ring_);
      ring_ok_ = false;
    }
    if (event_fd_ >= 0) {
      ::close(event_fd_);
      event_fd_ = -1;
    }
  }

  // An SQE for `chunk` (nullptr: the eventfd wake-up read). Never called on a broken ring.
  io_uring_sqe* get_sqe(Chunk* chunk) {
    io_uring_sqe* sqe = io_uring_get_sqe(&ring_);
    if (sqe == nullptr) {  // cannot happen while in-flight <= queue depth; flush to be safe
      enter(0);
      sqe = io_uring_get_sqe(&ring_);
    }
    ZINF_CHECK(sqe != nullptr, "io_uring submission queue full");
    sq_order_.push_back(chunk);
    return sqe;
  }

  // io_uring_enter: submits what is prepared and, with wait_nr 1, waits for a completion (in
  // slices of kStopSlice once stopping, where the kernel can time the wait). Tracks how long
  // submissions have been failing. Returns the call's result.
  int enter(unsigned wait_nr, bool stopping = false) {
    int rc;
    if (auto err = FaultInjector::global().on_ring_submit()) {
      rc = -*err;
    } else if (wait_nr == 0) {
      rc = io_uring_submit(&ring_);
    } else if (stopping && timed_wait_) {
      __kernel_timespec ts{.tv_sec = 0, .tv_nsec = std::chrono::nanoseconds(kStopSlice).count()};
      io_uring_cqe* cqe = nullptr;
      rc = io_uring_submit_and_wait_timeout(&ring_, &cqe, wait_nr, &ts, nullptr);
      if (rc == -ETIME) rc = 0;
    } else {
      rc = io_uring_submit_and_wait(&ring_, wait_nr);
    }
    // What the kernel took leaves the front of sq_order_ (the SQ is consumed in order).
    while (sq_order_.size() > io_uring_sq_ready(&ring_)) sq_order_.pop_front();
    if (rc >= 0 || rc == -EINTR) {
      failing_since_.reset();
    } else {
      last_submit_error_ = -rc;
      if (!failing_since_) failing_since_ = std::chrono::steady_clock::now();
    }
    return rc;
  }

  // io_uring_enter has failed for longer than submit_retry_ms: the chunks whose SQEs the kernel
  // never took fail (they stay in the SQ and the ring is never entered again), and so does every
  // chunk issued from now on.
  void break_ring() {
    auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(
                  std::chrono::steady_clock::now() - *failing_since_)
                  .count();
    broken_ = errno_status(last_submit_error_,
                           fmt::format("io_uring ring {} is broken: submitting to it failed for "
                                       "{} ms (gave up after submit_retry_ms = {})",
                                       index_, ms, engine_.options_.submit_retry_ms));
    log::error("{}", broken_.to_string());
    for (Chunk* c : sq_order_) {
      if (c != nullptr) synthetic_.push_back({c, kBrokenRes});
    }
    sq_order_.clear();
  }

  void arm_wakeup() {
    io_uring_sqe* sqe = get_sqe(nullptr);
    io_uring_prep_read(sqe, event_fd_, &event_value_, sizeof(event_value_), 0);
    io_uring_sqe_set_data64(sqe, kEventTag);
  }

  // Table updates first, then the requests: both are taken under one lock, so every update
  // queued before a request is applied before that request is issued.
  void take_incoming() {
    std::deque<std::function<void()>> controls;
    std::deque<Pending> incoming;
    {
      std::lock_guard lock(mu_);
      controls.swap(controls_);
      incoming.swap(incoming_);
    }
    for (auto& fn : controls) fn();
    for (auto& p : incoming) active_.push_back(new Op{std::move(p)});
  }

  // Hands chunks to the kernel while there is room in the queue.
  void fill() {
    const uint64_t block = engine_.options_.block_size;
    while (!active_.empty() && !free_chunks_.empty()) {
      Op* op = active_.front();
      if (!op->error.is_ok() || op->carved == op->p.request.length) {
        active_.pop_front();
        if (op->outstanding == 0) complete(op);
        continue;
      }
      Chunk* c = free_chunks_.back();
      free_chunks_.pop_back();
      uint64_t len = std::min(block, op->p.request.length - op->carved);
      *c = Chunk{.op = op, .start = op->carved, .length = len};
      op->carved += len;
      ++op->outstanding;
      issue(c);
    }
  }

  // Prepares the SQE for what remains of chunk c (or a synthetic completion for a fault).
  void issue(Chunk* c) {
    Op* op = c->op;
    const IoRequest& r = op->p.request;
    uint64_t pos = c->start + c->done;
    uint64_t len = c->length - c->done;
    auto* buf = static_cast<char*>(r.buffer) + pos;
    uint64_t offset = r.offset + pos;
    ++stats_.chunks_submitted;

    if (!broken_.is_ok()) {
      synthetic_.push_back({c, kBrokenRes});
      return;
    }
    FaultInjector& faults = FaultInjector::global();
    if (faults.active()) {
      if (auto fault = faults.on_submit(r.op, r.file->path())) {
        if (*fault == FaultKind::kShort) {
          uint64_t align = std::max<uint64_t>(r.file->offset_alignment(), 1);
          uint64_t shorter = align_down(len / 2, align);
          if (shorter > 0 && shorter < len) len = shorter;
        } else if (*fault == FaultKind::kCorrupt) {
          c->corrupt = true;
        } else if (*fault == FaultKind::kHang) {
          parked_.push_back(c);  // in flight for ever
          return;
        } else {
          int res = *fault == FaultKind::kEio      ? -EIO
                    : *fault == FaultKind::kEnospc ? -ENOSPC
                                                   : -EAGAIN;
          synthetic_.push_back({c, res});
          return;
        }
      }
    }

    io_uring_sqe* sqe = get_sqe(c);
    const bool fixed_file = op->p.file_slot >= 0 && fixed_file_ok_[op->p.file_slot];
    if (fixed_file) ++stats_.fixed_file_chunks;
    int fd = fixed_file ? op->p.file_slot : r.file->fd();
    auto n = static_cast<unsigned>(len);
    if (op->p.buf_index >= 0 && fixed_buffer_ok_[op->p.buf_index]) {
      ++stats_.fixed_buffer_chunks;
      if (r.op == IoOp::kRead) {
        io_uring_prep_read_fixed(sqe, fd, buf, n, offset, op->p.buf_index);
      } else {
        io_uring_prep_write_fixed(sqe, fd, buf, n, offset, op->p.buf_index);
      }
    } else if (r.op == IoOp::kRead) {
      io_uring_prep_read(sqe, fd, buf, n, offset);
    } else {
      io_uring_prep_write(sqe, fd, buf, n, offset);
    }
    if (fixed_file) sqe->flags |= IOSQE_FIXED_FILE;
    io_uring_sqe_set_data(sqe, c);
    // aio.single_submit: every chunk goes to the kernel on its own (one system call each).
    if (engine_.options_.single_submit) enter(0);
  }

  void on_chunk_result(Chunk* c, int res) {
    Op* op = c->op;
    const IoRequest& r = op->p.request;
    uint64_t pos = c->start + c->done;
    uint64_t remaining = c->length - c->done;
    auto describe = [&] {
      return fmt::format("{} of {} bytes at offset {} of {}", op_name(r.op), remaining,
                         r.offset + pos, r.file->path());
    };
    if (res == kBrokenRes) {
      set_error(op, Status(broken_).with_context(describe()));
    } else if (res == -EAGAIN || res == -EINTR) {
      if (++c->retries <= engine_.options_.max_retries) {
        ++stats_.retries;
        issue(c);
        return;
      }
      set_error(op, errno_status(res, describe() + fmt::format(" (gave up after {} retries)",
                                                               c->retries - 1)));
    } else if (res < 0) {
      set_error(op, errno_status(res, describe()));
    } else if (res == 0) {
      set_error(op, r.op == IoOp::kRead
                        ? Status(ErrorCode::kIo, "unexpected end of file: " + describe())
                        : Status(ErrorCode::kIo, describe() + " wrote nothing"));
    } else {
      auto moved = static_cast<uint64_t>(res);
      ZINF_CHECK(moved <= remaining, "kernel reported {} bytes for a {}-byte chunk", moved,
                 remaining);
      if (c->corrupt && r.op == IoOp::kRead) {  // fault injection: the disk returned bad data
        static_cast<char*>(r.buffer)[pos] ^= 0x5a;
        c->corrupt = false;
      }
      c->done += moved;
      (r.op == IoOp::kRead ? stats_.bytes_read : stats_.bytes_written) += moved;
      if (c->done < c->length) {
        ++stats_.short_continuations;
        issue(c);
        return;
      }
    }
    // The chunk is finished (transferred or failed).
    free_chunks_.push_back(c);
    --op->outstanding;
    // An op with chunks in flight is either at the front of active_ (still being carved, or
    // failed and not yet popped: fill() completes it) or already popped (complete it here).
    bool at_front = !active_.empty() && active_.front() == op;
    if (op->outstanding == 0 && !at_front) complete(op);
  }

  void set_error(Op* op, Status s) {
    if (op->error.is_ok()) op->error = std::move(s);
  }

  void complete(Op* op) {
    Status s = std::move(op->error);
    IoCallback done = std::move(op->p.done);
    delete op;
    (s.is_ok() ? stats_.requests_completed : stats_.requests_failed)++;
    if (done) {
      try {
        done(std::move(s));
      } catch (const std::exception& e) {
        log::error("an I/O completion callback threw: {}", e.what());
      }
    }
    auto& reg = *engine_.registry_;
    std::lock_guard lock(reg.drain_mu);
    if (++reg.completed == reg.accepted) reg.drain_cv.notify_all();
  }

  bool idle() const { return active_.empty() && in_flight() == 0 && synthetic_.empty(); }
  uint32_t in_flight() const { return static_cast<uint32_t>(chunks_.size() - free_chunks_.size()); }

  void loop() {
    arm_wakeup();
    while (true) {
      take_incoming();
      fill();
      // Fault-injected and broken-ring completions are handled here, without the kernel.
      while (!synthetic_.empty()) {
        auto pending = std::move(synthetic_);
        synthetic_.clear();
        for (auto [c, res] : pending) on_chunk_result(c, res);
        take_incoming();
        fill();
      }
      bool stopping;
      {
        std::lock_guard lock(mu_);
        stopping = stopping_;
        if (idle() && stopping_ && incoming_.empty() && controls_.empty()) {
          exited_ = true;
          break;
        }
        if (stopping_ && std::chrono::steady_clock::now() >= stop_deadline_) {
          abandon();
          exited_ = true;
          break;
        }
        // A callback run by fill() may have enqueued to this ring without a wake-up (it is this
        // thread): never block with requests waiting in incoming_.
        if (!incoming_.empty()) {
          if (broken_.is_ok()) enter(0);
          continue;
        }
        if (!controls_.empty()) continue;
      }
      if (!broken_.is_ok()) {
        wait_broken();
        continue;
      }
      int rc = enter(1, stopping);
      if (rc < 0 && rc != -EINTR) {
        if (std::chrono::steady_clock::now() - *failing_since_ >=
            std::chrono::milliseconds(engine_.options_.submit_retry_ms)) {
          break_ring();
          continue;
        }
        log::warn_once(fmt::format("io:submit:{}", index_),
                       fmt::format("io_uring_enter on ring {} failed: {}; retrying for up to {} "
                                   "ms (reported once)",
                                   index_, std::strerror(-rc), engine_.options_.submit_retry_ms));
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
      bool rearm = reap();
      if (rearm) arm_wakeup();
    }
    // Table updates queued before exited_ was set (none can be after); requests still queued
    // are dropped with the ring, as before a shutdown deadline.
    std::deque<std::function<void()>> controls;
    {
      std::lock_guard lock(mu_);
      controls.swap(controls_);
    }
    for (auto& fn : controls) fn();
    tls_ring_ = nullptr;
  }

  // Handles the completions in the CQ; whether the eventfd read completed (to re-arm it).
  bool reap() {
    bool rearm = false;
    io_uring_cqe* cqe;
    unsigned head, seen = 0;
    // Collect first: handlers may prepare new SQEs, which is fine, but keep the CQ walk simple.
    reaped_.clear();
    io_uring_for_each_cqe(&ring_, head, cqe) {
      ++seen;
      if (cqe->user_data == kEventTag) {
        rearm = true;
      } else {
        reaped_.push_back({static_cast<Chunk*>(io_uring_cqe_get_data(cqe)), cqe->res});
      }
    }
    io_uring_cq_advance(&ring_, seen);
    for (auto [c, res] : reaped_) on_chunk_result(c, res);
    return rearm;
  }

  // A broken ring is never entered again: new work is noticed on the eventfd (or by the next
  // slice), and completions of what the kernel took are read from the CQ without a system call.
  void wait_broken() {
    pollfd pfd{.fd = event_fd_, .events = POLLIN, .revents = 0};
    if (::poll(&pfd, 1, static_cast<int>(kStopSlice.count())) > 0) {
      uint64_t value;
      (void)!::read(event_fd_, &value, sizeof(value));
    }
    // A DEFER_TASKRUN ring posts completions only when its thread asks for them.
    if (single_issuer_) (void)io_uring_get_events(&ring_);
    (void)reap();
  }

  // The stop deadline passed with chunks in flight: they are left to the kernel (or, injected
  // hangs, to nobody); their requests never complete.
  void abandon() {
    const uint32_t n = in_flight();
    std::vector<Op*> ops;  // each once: their callbacks never run
    for (Chunk& c : chunks_) {
      if (c.op != nullptr &&
          std::find(free_chunks_.begin(), free_chunks_.end(), &c) == free_chunks_.end() &&
          std::find(ops.begin(), ops.end(), c.op) == ops.end()) {
        ops.push_back(c.op);
      }
    }
    for (Op* op : active_) {
      if (std::find(ops.begin(), ops.end(), op) == ops.end()) ops.push_back(op);
    }
    std::string first = "?";
    if (!ops.empty()) {
      const IoRequest& r = ops.front()->p.request;
      first = fmt::format("{} of {} bytes at offset {} of {}", op_name(r.op), r.length, r.offset,
                          r.file->path());
    }
    log::error(
        "io_uring ring {}: {} chunk(s) of {} request(s) still in flight at shutdown after the "
        "drain deadline (drain_timeout_ms = {}), abandoned; the first: {}",
        index_, n, ops.size(), engine_.options_.drain_timeout_ms, first);
    // Nothing reads the CQ after this, so nothing reaches these again.
    for (Op* op : ops) delete op;
    active_.clear();
    free_chunks_.clear();
    for (Chunk& c : chunks_) free_chunks_.push_back(&c);
    parked_.clear();
  }

  IoEngine& engine_;
  uint32_t index_;
  io_uring ring_{};
  bool ring_ok_ = false;
  bool single_issuer_ = false;  // SINGLE_ISSUER | DEFER_TASKRUN: only the ring thread enters it
  bool timed_wait_ = false;  // IORING_FEAT_EXT_ARG: io_uring_submit_and_wait_timeout needs no SQE
  int event_fd_ = -1;
  uint64_t event_value_ = 0;
  std::promise<int> enabled_;  // start(): the thread's io_uring_enable_rings result
  std::thread thread_;

  std::mutex mu_;
  std::deque<Pending> incoming_;                         // guarded by mu_
  std::deque<std::function<void()>> controls_;           // guarded by mu_: table updates
  bool stopping_ = false;                                // guarded by mu_
  bool exited_ = false;                                  // guarded by mu_: loop() returned
  std::chrono::steady_clock::time_point stop_deadline_;  // guarded by mu_

  // Owned by the ring thread.
  std::deque<Op*> active_;  // requests not yet fully carved into chunks
  std::vector<Chunk> chunks_;
  std::vector<Chunk*> free_chunks_;
  std::vector<bool> fixed_buffer_ok_;  // per buffer slot: registered on this ring
  std::vector<bool> fixed_file_ok_;    // per file slot: registered on this ring
  std::vector<std::pair<Chunk*, int>> synthetic_;
  std::vector<std::pair<Chunk*, int>> reaped_;
  std::deque<Chunk*> sq_order_;  // the chunk of each SQE the kernel has not taken yet, in order
  std::vector<Chunk*> parked_;   // fault injection: chunks that never complete
  Status broken_;                // set once: submissions failed for longer than submit_retry_ms
  std::optional<std::chrono::steady_clock::time_point> failing_since_;
  int last_submit_error_ = 0;

  struct AtomicStats {
    std::atomic<uint64_t> requests_completed{0}, requests_failed{0}, chunks_submitted{0},
        short_continuations{0}, retries{0}, bytes_read{0}, bytes_written{0}, fixed_buffer_chunks{0},
        fixed_file_chunks{0};
  } stats_;

  static thread_local Ring* tls_ring_;
};

thread_local IoEngine::Ring* IoEngine::Ring::tls_ring_ = nullptr;

IoEngine::IoEngine(const IoEngineOptions& options)
    : options_(options), registry_(std::make_unique<Registry>()) {}

IoEngine::~IoEngine() {
  Status drained = drain(std::chrono::milliseconds(options_.drain_timeout_ms));
  if (!drained.is_ok()) log::error("{}", drained.to_string());
  // After a timed-out drain the rings do not wait again.
  const auto deadline = drained.is_ok() ? std::chrono::steady_clock::now() +
                                              std::chrono::milliseconds(options_.drain_timeout_ms)
                                        : std::chrono::steady_clock::now();
  for (auto& r : rings_) r->stop(deadline);
}

Result<std::unique_ptr<IoEngine>> IoEngine::create(const IoEngineOptions& options) {
  if (options.queue_depth == 0 || options.queue_depth > 4096) {
    return make_error(ErrorCode::kInvalidArgument, "queue depth must be 1..4096, got {}",
                      options.queue_depth);
  }
  if (options.block_size == 0 || options.block_size > kMaxBlockSize) {
    return make_error(ErrorCode::kInvalidArgument, "block size must be 1 byte..1 GiB, got {}",
                      options.block_size);
  }
  if (options.rings == 0 || options.rings > 64) {
    return make_error(ErrorCode::kInvalidArgument, "rings must be 1..64, got {}", options.rings);
  }
  std::unique_ptr<IoEngine> engine(new IoEngine(options));
  auto& reg = *engine->registry_;
  for (uint32_t i = 0; i < options.rings; ++i) {
    auto ring = std::make_unique<Ring>(*engine, i);
    // Sparse tables are created before the ring thread runs (a single-issuer ring is still
    // disabled, so this thread may register on it).
    Status s = ring->init();
    if (!s.is_ok()) return s;
    if (options.fixed_buffers && reg.buffers_available) {
      reg.buffers_available = ring->register_sparse_buffers(options.max_registered_buffers);
    }
    if (options.fixed_files && reg.files_available) {
      reg.files_available = ring->register_sparse_files(options.max_registered_files);
    }
    s = ring->start();
    if (!s.is_ok()) return s;
    engine->rings_.push_back(std::move(ring));
  }
  reg.buffers_available = reg.buffers_available && options.fixed_buffers;
  reg.files_available = reg.files_available && options.fixed_files;
  reg.buffer_slot_used.assign(options.max_registered_buffers, false);
  reg.file_slot_used.assign(options.max_registered_files, false);
  reg.buffer_gen = std::make_unique<std::atomic<uint64_t>[]>(options.max_registered_buffers);
  reg.file_gen = std::make_unique<std::atomic<uint64_t>[]>(options.max_registered_files);
  if (options.fixed_buffers && !reg.buffers_available) {
    log::warn_once("io:fixedbuf", "io_uring registered buffers unavailable: using plain reads");
  }
  return engine;
}

Status IoEngine::validate(const IoRequest& r) const {
  if (r.file == nullptr || !r.file->is_open()) {
    return make_error(ErrorCode::kInvalidArgument, "{} request without an open file",
                      op_name(r.op));
  }
  if (r.buffer == nullptr || r.length == 0) {
    return make_error(ErrorCode::kInvalidArgument, "{} of {} bytes at offset {} of {}: {}",
                      op_name(r.op), r.length, r.offset, r.file->path(),
                      r.buffer == nullptr ? "null buffer" : "zero length");
  }
  const uint64_t mem_align = r.file->mem_alignment();
  const uint64_t off_align = r.file->offset_alignment();
  auto addr = reinterpret_cast<uintptr_t>(r.buffer);
  if (addr % mem_align != 0 || r.offset % off_align != 0 || r.length % off_align != 0) {
    return make_error(ErrorCode::kInvalidArgument,
                      "{} of {} bytes at offset {} of {} (buffer {:#x}) is misaligned: direct I/O "
                      "on this file needs buffers aligned to {} bytes and offsets and lengths "
                      "that are multiples of {}",
                      op_name(r.op), r.length, r.offset, r.file->path(), addr, mem_align,
                      off_align);
  }
  return Status::ok();
}

int IoEngine::buffer_slot(const void* buffer, uint64_t length) const {
  if (!registry_->buffers_available) return -1;
  auto addr = reinterpret_cast<uintptr_t>(buffer);
  std::shared_lock lock(registry_->mu);
  const auto& bufs = registry_->buffers;
  auto it = std::upper_bound(bufs.begin(), bufs.end(), addr,
                             [](uintptr_t a, const Registry::Buffer& b) { return a < b.base; });
  if (it == bufs.begin()) return -1;
  --it;
  if (addr + length <= it->base + it->length) return it->slot;
  return -1;
}

Status IoEngine::submit(const IoRequest& request, IoCallback done) {
  IoCallback cb[1] = {std::move(done)};
  return submit_batch(std::span<const IoRequest>(&request, 1), cb);
}

Status IoEngine::submit_batch(std::span<const IoRequest> requests, std::span<IoCallback> done,
                              size_t* accepted_out) {
  ZINF_CHECK(requests.size() == done.size(), "{} requests but {} callbacks", requests.size(),
             done.size());
  // Group per ring so that each ring is woken once.
  std::vector<std::vector<Ring::Pending>> per_ring(rings_.size());
  Status status;
  size_t accepted = 0;
  for (size_t i = 0; i < requests.size(); ++i) {
    const IoRequest& r = requests[i];
    status = validate(r);
    if (!status.is_ok()) break;
    int file_slot = -1;
    if (registry_->files_available) {
      std::shared_lock lock(registry_->mu);
      auto it = registry_->file_slot.find(r.file->fd());
      if (it != registry_->file_slot.end()) file_slot = it->second;
    }
    uint32_t ring = next_ring_.fetch_add(1, std::memory_order_relaxed) % rings_.size();
    per_ring[ring].push_back(Ring::Pending{.request = r,
                                           .done = std::move(done[i]),
                                           .file_slot = file_slot,
                                           .buf_index = buffer_slot(r.buffer, r.length)});
    ++accepted;
  }
  if (accepted_out) *accepted_out = accepted;
  if (accepted > 0) {
    {
      std::lock_guard lock(registry_->drain_mu);
      registry_->accepted += accepted;
    }
    for (size_t i = 0; i < rings_.size(); ++i) {
      if (!per_ring[i].empty()) rings_[i]->enqueue_batch(std::move(per_ring[i]));
    }
  }
  return status;
}

std::future<Status> IoEngine::submit(const IoRequest& request) {
  auto promise = std::make_shared<std::promise<Status>>();
  std::future<Status> future = promise->get_future();
  Status s = submit(request, [promise](Status st) { promise->set_value(std::move(st)); });
  if (!s.is_ok()) promise->set_value(std::move(s));
  return future;
}

Status IoEngine::read(const File& file, uint64_t offset, void* buffer, uint64_t length) {
  return submit(IoRequest{.op = IoOp::kRead,
                          .file = &file,
                          .offset = offset,
                          .buffer = buffer,
                          .length = length})
      .get();
}

Status IoEngine::write(const File& file, uint64_t offset, const void* buffer, uint64_t length) {
  return submit(IoRequest{.op = IoOp::kWrite,
                          .file = &file,
                          .offset = offset,
                          .buffer = const_cast<void*>(buffer),
                          .length = length})
      .get();
}

Result<int> IoEngine::register_buffer(void* base, uint64_t length) {
  auto& reg = *registry_;
  if (!reg.buffers_available) {
    return make_error(ErrorCode::kUnavailable, "registered buffers are not available");
  }
  if (base == nullptr || length == 0 || length > kMaxBlockSize) {
    return make_error(ErrorCode::kInvalidArgument,
                      "cannot register a buffer of {} bytes (1 byte..1 GiB)", length);
  }
  std::unique_lock lock(reg.mu);
  auto free_slot = std::find(reg.buffer_slot_used.begin(), reg.buffer_slot_used.end(), false);
  if (free_slot == reg.buffer_slot_used.end()) {
    return make_error(ErrorCode::kUnavailable, "all {} registered-buffer slots are in use",
                      reg.buffer_slot_used.size());
  }
  int slot = static_cast<int>(free_slot - reg.buffer_slot_used.begin());
  iovec iov{base, length};
  const uint64_t gen = ++reg.buffer_gen[slot];
  for (auto& ring : rings_) ring->update_buffer(slot, iov, gen);
  reg.buffer_slot_used[slot] = true;
  auto addr = reinterpret_cast<uintptr_t>(base);
  auto pos = std::lower_bound(reg.buffers.begin(), reg.buffers.end(), addr,
                              [](const Registry::Buffer& b, uintptr_t a) { return b.base < a; });
  reg.buffers.insert(pos, Registry::Buffer{addr, length, slot});
  return slot;
}

Status IoEngine::unregister_buffer(int slot) {
  auto& reg = *registry_;
  std::unique_lock lock(reg.mu);
  if (slot < 0 || static_cast<size_t>(slot) >= reg.buffer_slot_used.size() ||
      !reg.buffer_slot_used[slot]) {
    return make_error(ErrorCode::kInvalidArgument, "buffer slot {} is not registered", slot);
  }
  const uint64_t gen = ++reg.buffer_gen[slot];
  for (auto& ring : rings_) ring->update_buffer(slot, iovec{nullptr, 0}, gen);
  reg.buffer_slot_used[slot] = false;
  std::erase_if(reg.buffers, [slot](const Registry::Buffer& b) { return b.slot == slot; });
  return Status::ok();
}

Status IoEngine::register_file(const File& file) {
  auto& reg = *registry_;
  if (!reg.files_available) return Status::ok();  // plain fds work just as correctly
  std::unique_lock lock(reg.mu);
  if (reg.file_slot.count(file.fd())) return Status::ok();
  auto free_slot = std::find(reg.file_slot_used.begin(), reg.file_slot_used.end(), false);
  if (free_slot == reg.file_slot_used.end()) return Status::ok();  // table full: use the fd
  int slot = static_cast<int>(free_slot - reg.file_slot_used.begin());
  const uint64_t gen = ++reg.file_gen[slot];
  for (auto& ring : rings_) ring->update_file(slot, file.fd(), gen);
  reg.file_slot_used[slot] = true;
  reg.file_slot[file.fd()] = slot;
  return Status::ok();
}

Status IoEngine::unregister_file(const File& file) {
  auto& reg = *registry_;
  std::unique_lock lock(reg.mu);
  auto it = reg.file_slot.find(file.fd());
  if (it == reg.file_slot.end()) return Status::ok();
  const uint64_t gen = ++reg.file_gen[it->second];
  for (auto& ring : rings_) ring->update_file(it->second, -1, gen);
  reg.file_slot_used[it->second] = false;
  reg.file_slot.erase(it);
  return Status::ok();
}

Status IoEngine::drain(std::chrono::milliseconds timeout) {
  auto& reg = *registry_;
  std::unique_lock lock(reg.drain_mu);
  auto done = [&] { return reg.completed == reg.accepted; };
  if (timeout == std::chrono::milliseconds::max()) {
    reg.drain_cv.wait(lock, done);
  } else if (!reg.drain_cv.wait_for(lock, timeout, done)) {
    return make_error(ErrorCode::kTimeout,
                      "{} I/O request(s) still outstanding after waiting {} ms for them",
                      reg.accepted - reg.completed, timeout.count());
  }
  return Status::ok();
}

IoStats IoEngine::stats() const {
  IoStats s;
  for (auto& r : rings_) r->add_stats(s);
  return s;
}

}  // namespace zinf::io
