#include "zinf/comm/mpi.h"

#include <mpi.h>

#include <array>
#include <atomic>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <thread>

#include "zinf/comm/detail/op_header.h"
#include "zinf/core/log.h"

namespace zinf::comm {
namespace {

using Clock = std::chrono::steady_clock;

std::string mpi_error_string(int code) {
  char text[MPI_MAX_ERROR_STRING];
  int length = 0;
  if (MPI_Error_string(code, text, &length) != MPI_SUCCESS)
    return fmt::format("MPI error {}", code);
  return std::string(text, static_cast<size_t>(length));
}

Status mpi_status(int code, std::string_view call) {
  if (code == MPI_SUCCESS) return Status::ok();
  return make_error(ErrorCode::kInternal, "{} failed: {}", call, mpi_error_string(code));
}

// Initialises MPI once per process (MPI_THREAD_MULTIPLE: each communicator calls MPI from its own
// stream thread) unless the program did, and then finalises it at exit.
Status ensure_mpi() {
  static std::once_flag once;
  static Status status;
  std::call_once(once, [] {
    int initialized = 0;
    MPI_Initialized(&initialized);
    int provided = 0;
    if (!initialized) {
      int rc = MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided);
      if (rc != MPI_SUCCESS) {
        status =
            make_error(ErrorCode::kUnavailable, "MPI_Init_thread failed: {}", mpi_error_string(rc));
        return;
      }
      std::atexit([] {
        int finalized = 0;
        MPI_Finalized(&finalized);
        if (!finalized) MPI_Finalize();
      });
    } else {
      MPI_Query_thread(&provided);
    }
    if (provided < MPI_THREAD_MULTIPLE) {
      status =
          make_error(ErrorCode::kUnavailable,
                     "MPI provides thread level {}, but zinf's MPI communicators call MPI from "
                     "their stream threads and need MPI_THREAD_MULTIPLE ({})",
                     provided, MPI_THREAD_MULTIPLE);
    }
  });
  return status;
}

bool mpi_finalized() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  return finalized != 0;
}

// Owns one duplicate of MPI_COMM_WORLD, with errors returned instead of aborting the job.
class OwnedComm {
 public:
  OwnedComm() = default;
  OwnedComm(const OwnedComm&) = delete;
  OwnedComm& operator=(const OwnedComm&) = delete;
  ~OwnedComm() {
    if (comm_ != MPI_COMM_NULL && !leak_ && !mpi_finalized()) MPI_Comm_free(&comm_);
  }

  Status dup_world() {
    ZINF_RETURN_IF_ERROR(mpi_status(MPI_Comm_dup(MPI_COMM_WORLD, &comm_), "MPI_Comm_dup"));
    return mpi_status(MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN), "MPI_Comm_set_errhandler");
  }
  MPI_Comm get() const { return comm_; }
  // Freeing a communicator with an operation MPI still runs is not allowed: keep it.
  void leak() { leak_ = true; }

 private:
  MPI_Comm comm_ = MPI_COMM_NULL;
  bool leak_ = false;
};

// Paces a polling loop. OpenMPI progresses non-blocking collectives only inside MPI calls, so
// while data moves the loop polls without sleeping (yielding the core to oversubscribed ranks).
// Waiting for peers to arrive may take long: after a while the loop sleeps between polls, with a
// growing interval, so that a late peer does not cost a core.
class Backoff {
 public:
  explicit Backoff(bool may_sleep) : may_sleep_(may_sleep), start_(Clock::now()) {}
  void pause() {
    if (!may_sleep_ || Clock::now() - start_ < std::chrono::milliseconds(100)) {
      std::this_thread::yield();
      return;
    }
    std::this_thread::sleep_for(sleep_);
    sleep_ = std::min(sleep_ * 2, std::chrono::microseconds(1000));
  }

 private:
  const bool may_sleep_;
  const Clock::time_point start_;
  std::chrono::microseconds sleep_{20};
};

// Raw bytes as MPI_BYTE; 16-bit floats as MPI_UINT16_T (the backend reduces them itself).
MPI_Datatype mpi_type(const Collective& c) {
  if (c.payload == Payload::kBytes) return MPI_BYTE;
  return c.dtype == DType::kF32 ? MPI_FLOAT : MPI_UINT16_T;
}

// Counts and displacements as MPI's ints, or an error when a buffer is too large for them.
Result<std::vector<int>> to_ints(const std::vector<size_t>& values, std::string_view what) {
  std::vector<int> out(values.size());
  for (size_t i = 0; i < values.size(); ++i) {
    if (values[i] > static_cast<size_t>(INT_MAX)) {
      return make_error(ErrorCode::kInvalidArgument,
                        "{} of {} elements exceeds MPI's int counts (2^31-1): split the buffer",
                        what, values[i]);
    }
    out[i] = static_cast<int>(values[i]);
  }
  return out;
}

// The abort channel: a rank that fails sends its reason (at most this many bytes) to every peer
// on a communicator of its own; every rank keeps one receive from any source posted there, and
// every wait of a collective tests it. An error broadcast rather than MPI_Abort: the peers return
// an error naming the failed rank, clean up (swap files) and exit on their own, instead of being
// killed by the launcher mid-write.
constexpr int kAbortTag = 1;
constexpr int kAbortMessageBytes = 1024;
// How long abort() waits for its messages to leave before handing them to MPI to finish.
constexpr std::chrono::milliseconds kAbortSendWait{2000};

class MpiBackend final : public CommBackend {
 public:
  MpiBackend(int rank, int world, std::chrono::milliseconds timeout)
      : rank_(rank), world_(world), timeout_(timeout), headers_(world) {}

  ~MpiBackend() override {
    if (abort_recv_ != MPI_REQUEST_NULL && !mpi_finalized()) {
      MPI_Cancel(&abort_recv_);
      MPI_Wait(&abort_recv_, MPI_STATUS_IGNORE);
    }
    // A broken communicator (timeout, abort) may still have messages of its last operation on
    // the way. Freeing it would let MPI hand its context to the next communicator, where they
    // would match that one's operations: keep it (one context per failure).
    if (!broken_.is_ok() || self_aborted_.load() || peer_aborted_.load()) {
      header_comm_.leak();
      data_comm_.leak();
      abort_comm_.leak();
    }
    if (!abandoned_.empty()) {
      header_comm_.leak();
      data_comm_.leak();
      log::error(
          "comm: an MPI communicator is destroyed with {} operation(s) MPI never completed; "
          "their buffers still belong to MPI",
          abandoned_.size());
    }
  }

  Status init() {
    ZINF_RETURN_IF_ERROR(header_comm_.dup_world());
    ZINF_RETURN_IF_ERROR(data_comm_.dup_world());
    ZINF_RETURN_IF_ERROR(abort_comm_.dup_world());
    return mpi_status(MPI_Irecv(abort_in_.data(), kAbortMessageBytes, MPI_BYTE, MPI_ANY_SOURCE,
                                kAbortTag, abort_comm_.get(), &abort_recv_),
                      "MPI_Irecv (abort channel)");
  }

  Backend kind() const override { return Backend::kMpi; }
  int rank() const override { return rank_; }
  int world_size() const override { return world_; }

  // Sends the reason to every peer (unless a peer's abort came first: the job knows already),
  // then makes this rank's own wait in flight, if any, return.
  void abort(const Status& reason) override {
    if (mpi_finalized()) return;
    if (!peer_aborted_.load()) {
      const std::string text = reason.detail();
      const size_t n = std::min<size_t>(text.size(), kAbortMessageBytes);
      std::memcpy(abort_out_.data(), text.data(), n);
      std::vector<MPI_Request> sends;
      for (int j = 0; j < world_; ++j) {
        if (j == rank_) continue;
        MPI_Request r;
        if (MPI_Isend(abort_out_.data(), static_cast<int>(n), MPI_BYTE, j, kAbortTag,
                      abort_comm_.get(), &r) == MPI_SUCCESS) {
          sends.push_back(r);
        }
      }
      // Small messages leave at once; a peer that does not take them in time gets them when MPI
      // gets to it (a freed send request still completes).
      const auto deadline = Clock::now() + std::min(timeout_, kAbortSendWait);
      int done = 0;
      while (!sends.empty() &&
             MPI_Testall(static_cast<int>(sends.size()), sends.data(), &done,
                         MPI_STATUSES_IGNORE) == MPI_SUCCESS &&
             !done && Clock::now() < deadline) {
        std::this_thread::sleep_for(std::chrono::microseconds(100));
      }
      if (!done) {
        for (MPI_Request& r : sends) {
          if (r != MPI_REQUEST_NULL) MPI_Request_free(&r);
        }
      }
    }
    {
      std::lock_guard lock(abort_mu_);
      own_abort_ =
          make_error(ErrorCode::kCancelled, "rank {} failed: {}; the MPI communicator is aborted",
                     rank_, reason.detail());
    }
    self_aborted_.store(true);
  }

  Status run(const Collective& c) override {
    if (!broken_.is_ok()) return broken_;
    ZINF_RETURN_IF_ERROR(check_abort());
    ZINF_RETURN_IF_ERROR(exchange_headers(c));
    switch (c.op) {
      case CollectiveOp::kAllGather:
        return all_gather(c, c.send, c.recv, c.counts);
      case CollectiveOp::kReduceScatter:
        return reduce_scatter(c, c.send, c.recv, c.counts);
      case CollectiveOp::kAllReduce:
        return all_reduce(c);
      case CollectiveOp::kBroadcast:
        return broadcast(c);
      case CollectiveOp::kBarrier:
        return Status::ok();  // the header exchange met every rank
    }
    return Status::ok();
  }

 private:
  // Every rank sends its header to every peer and receives theirs (point to point: a peer that
  // never arrives is named, and its pending receive can be cancelled). Then all check them alike.
  Status exchange_headers(const Collective& c) {
    headers_[rank_] = detail::make_header(c, rank_);
    const int tag = static_cast<int>(c.seq % 32768);
    std::vector<MPI_Request> recvs, sends;
    std::vector<int> recv_rank;
    for (int j = 0; j < world_; ++j) {
      if (j == rank_) continue;
      MPI_Request r;
      ZINF_RETURN_IF_ERROR(mpi_status(MPI_Irecv(&headers_[j], sizeof(detail::OpHeader), MPI_BYTE, j,
                                                tag, header_comm_.get(), &r),
                                      "MPI_Irecv"));
      recvs.push_back(r);
      recv_rank.push_back(j);
    }
    for (int j = 0; j < world_; ++j) {
      if (j == rank_) continue;
      MPI_Request r;
      ZINF_RETURN_IF_ERROR(mpi_status(MPI_Isend(&headers_[rank_], sizeof(detail::OpHeader),
                                                MPI_BYTE, j, tag, header_comm_.get(), &r),
                                      "MPI_Isend"));
      sends.push_back(r);
    }
    const auto deadline = Clock::now() + timeout_;
    Result<bool> recvs_polled = poll(recvs, deadline, /*may_sleep=*/true);
    if (!recvs_polled.is_ok()) {
      // Aborted (by this rank or a peer) or MPI failed: take back the receives still pending.
      for (MPI_Request& r : recvs) {
        if (r == MPI_REQUEST_NULL) continue;
        MPI_Cancel(&r);
        MPI_Wait(&r, MPI_STATUS_IGNORE);
      }
      for (MPI_Request& r : sends) {
        if (r != MPI_REQUEST_NULL) MPI_Request_free(&r);
      }
      return recvs_polled.status();
    }
    const bool recvs_done = *recvs_polled;
    if (!recvs_done) {
      std::vector<int> missing;
      for (size_t i = 0; i < recvs.size(); ++i) {
        int flag = 0;
        MPI_Test(&recvs[i], &flag, MPI_STATUS_IGNORE);
        if (flag) continue;
        missing.push_back(recv_rank[i]);
        MPI_Cancel(&recvs[i]);
        MPI_Wait(&recvs[i], MPI_STATUS_IGNORE);
      }
      for (MPI_Request& r : sends) MPI_Request_free(&r);
      broken_ = make_error(ErrorCode::kTimeout,
                           "{} did not arrive within {:.1f} s ({} #{} on rank {}); the MPI "
                           "communicator is broken",
                           detail::format_ranks(missing), timeout_.count() / 1000.0,
                           collective_name(c.op), c.seq, rank_);
      return broken_;
    }
    Result<bool> sends_polled = poll(sends, deadline, /*may_sleep=*/true);
    if (!sends_polled.is_ok() || !*sends_polled) {
      for (MPI_Request& r : sends) {
        if (r != MPI_REQUEST_NULL) MPI_Request_free(&r);
      }
      if (!sends_polled.is_ok()) return sends_polled.status();
      broken_ = make_error(ErrorCode::kTimeout, "header sends did not complete within {:.1f} s",
                           timeout_.count() / 1000.0);
      return broken_;
    }
    return detail::check_headers(headers_,
                                 [&](int j) { return j == rank_ ? c.invalid : std::string(); });
  }

  // A peer's abort message, or this rank's own abort(): the error every operation now fails with.
  // Stream thread only (it alone touches abort_recv_).
  Status check_abort() {
    if (self_aborted_.load()) {
      std::lock_guard lock(abort_mu_);
      broken_ = own_abort_;
      return broken_;
    }
    if (abort_recv_ == MPI_REQUEST_NULL) return Status::ok();
    int flag = 0;
    MPI_Status st;
    if (MPI_Test(&abort_recv_, &flag, &st) != MPI_SUCCESS || !flag) return Status::ok();
    int bytes = 0;
    MPI_Get_count(&st, MPI_BYTE, &bytes);
    peer_aborted_.store(true);
    broken_ = make_error(ErrorCode::kUnavailable,
                         "rank {} failed: {}; the MPI communicator is aborted", st.MPI_SOURCE,
                         std::string(abort_in_.data(), static_cast<size_t>(std::max(bytes, 0))));
    return broken_;
  }

  // Polls until every request completed (true) or the deadline passed (false, requests kept).
  // An abort (a peer's or this rank's) is an error, with the requests left as they are.
  // `may_sleep`: the wait is for peers to arrive, not for data to move (see Backoff).
  Result<bool> poll(std::vector<MPI_Request>& requests, Clock::time_point deadline,
                    bool may_sleep) {
    Backoff backoff(may_sleep);
    for (;;) {
      ZINF_RETURN_IF_ERROR(check_abort());
      int flag = 0;
      int rc = MPI_Testall(static_cast<int>(requests.size()), requests.data(), &flag,
                           MPI_STATUSES_IGNORE);
      if (rc != MPI_SUCCESS) {
        broken_ = mpi_status(rc, "MPI_Testall");
        return broken_;
      }
      if (flag) return true;
      if (Clock::now() >= deadline) return false;
      backoff.pause();
    }
  }

  // Waits for the data-phase requests. MPI cannot take back a transfer a peer may be matching:
  // after a timeout the requests are abandoned with their buffers, and the communicator is broken.
  Status finish(std::vector<MPI_Request>& requests, const Collective& c, std::string_view what) {
    Result<bool> polled = poll(requests, Clock::now() + timeout_, /*may_sleep=*/false);
    if (!polled.is_ok()) {
      // MPI cannot take back a transfer in flight: its buffers stay with MPI.
      for (MPI_Request r : requests) {
        if (r != MPI_REQUEST_NULL) abandoned_.push_back(r);
      }
      return polled.status();
    }
    if (!*polled) {
      abandoned_.insert(abandoned_.end(), requests.begin(), requests.end());
      broken_ =
          make_error(ErrorCode::kTimeout,
                     "{} of {} #{} did not complete within {:.1f} s after every rank arrived; "
                     "MPI still owns its buffers: the process should exit",
                     what, collective_name(c.op), c.seq, timeout_.count() / 1000.0);
      return broken_;
    }
    return Status::ok();
  }

  // One message of `count` elements to or from `peer` on the data communicator.
  struct Transfer {
    const void* ptr;
    size_t count;
    int peer;
  };

  // Posts every receive, then every send (tagged with the collective's number), and waits.
  // Point to point rather than MPI's collectives: the same bytes, and on shared memory with
  // OpenMPI 4.1 faster than MPI_Iallgatherv (measured, docs/communicators.md).
  Status exchange(const Collective& c, const std::vector<Transfer>& recvs,
                  const std::vector<Transfer>& sends, std::string_view what) {
    const int tag = static_cast<int>(c.seq % 32768);
    const MPI_Datatype type = mpi_type(c);
    std::vector<MPI_Request> requests;
    requests.reserve(recvs.size() + sends.size());
    // Counts agree on every rank (the headers said so): a chunk too large for MPI's int counts
    // fails on every rank, before anything is posted.
    for (const auto* list : {&recvs, &sends}) {
      for (const Transfer& t : *list) {
        if (t.count > static_cast<size_t>(INT_MAX)) {
          return make_error(ErrorCode::kInvalidArgument,
                            "{}: a chunk of {} elements exceeds MPI's int counts (2^31-1): split "
                            "the buffer",
                            what, t.count);
        }
      }
    }
    auto post = [&](const Transfer& t, bool receive) -> Status {
      MPI_Request r;
      int rc = receive ? MPI_Irecv(const_cast<void*>(t.ptr), static_cast<int>(t.count), type,
                                   t.peer, tag, data_comm_.get(), &r)
                       : MPI_Isend(t.ptr, static_cast<int>(t.count), type, t.peer, tag,
                                   data_comm_.get(), &r);
      ZINF_RETURN_IF_ERROR(mpi_status(rc, receive ? "MPI_Irecv" : "MPI_Isend"));
      requests.push_back(r);
      return Status::ok();
    };
    for (const Transfer& t : recvs) ZINF_RETURN_IF_ERROR(post(t, true));
    for (const Transfer& t : sends) ZINF_RETURN_IF_ERROR(post(t, false));
    return finish(requests, c, what);
  }

  // Each rank sends its chunk to every peer and receives theirs in place in `recv`.
  Status all_gather(const Collective& c, const void* send, void* recv,
                    const std::vector<size_t>& counts) {
    const size_t e = c.element_size();
    const std::vector<size_t> displs = detail::prefix_sums(counts);
    auto* out = static_cast<std::byte*>(recv);
    std::vector<Transfer> recvs, sends;
    for (int j = 0; j < world_; ++j) {
      if (j == rank_) continue;
      if (counts[j] > 0) recvs.push_back({out + displs[j] * e, counts[j], j});
      if (counts[rank_] > 0) sends.push_back({send, counts[rank_], j});
    }
    if (counts[rank_] > 0 && send != out + displs[rank_] * e) {
      std::memcpy(out + displs[rank_] * e, send, counts[rank_] * e);
    }
    return exchange(c, recvs, sends, "all_gather");
  }

  // Chunk `rank` of every peer's `send` arrives in staging, then the chunks (this rank's own
  // straight from `send`) are summed in rank order into `recv`.
  Status reduce_scatter(const Collective& c, const void* send, void* recv,
                        const std::vector<size_t>& counts) {
    const size_t e = c.element_size();
    const size_t mine = counts[rank_];
    const std::vector<size_t> displs = detail::prefix_sums(counts);
    const auto* in = static_cast<const std::byte*>(send);
    std::byte* staging = staging_.get(world_ * mine * e);
    std::vector<Transfer> recvs, sends;
    std::vector<const void*> srcs(world_);
    for (int j = 0; j < world_; ++j) {
      srcs[j] = j == rank_ ? in + displs[rank_] * e : staging + j * mine * e;
      if (j == rank_) continue;
      if (mine > 0) recvs.push_back({staging + j * mine * e, mine, j});
      if (counts[j] > 0) sends.push_back({in + displs[j] * e, counts[j], j});
    }
    ZINF_RETURN_IF_ERROR(exchange(c, recvs, sends, "reduce_scatter"));
    detail::reduce_rank_order(recv, srcs.data(), world_, mine, c.dtype,
                              detail::reduce_scale(c.reduce, world_));
    return Status::ok();
  }

  Status all_reduce(const Collective& c) {
    const size_t e = c.element_size();
    std::vector<size_t> chunks = even_partition(c.total(), world_);
    std::byte* mine = chunk_.get(chunks[rank_] * e);
    ZINF_RETURN_IF_ERROR(reduce_scatter(c, c.send, mine, chunks));
    return all_gather(c, mine, c.recv, chunks);
  }

  Status broadcast(const Collective& c) {
    ZINF_ASSIGN_OR_RETURN(auto count, to_ints(c.counts, "a broadcast buffer"));
    void* buffer = rank_ == c.root ? const_cast<void*>(c.send) : c.recv;
    std::vector<MPI_Request> request(1);
    ZINF_RETURN_IF_ERROR(mpi_status(
        MPI_Ibcast(buffer, count[0], mpi_type(c), c.root, data_comm_.get(), request.data()),
        "MPI_Ibcast"));
    return finish(request, c, "MPI_Ibcast");
  }

  const int rank_;
  const int world_;
  const std::chrono::milliseconds timeout_;
  OwnedComm header_comm_;  // headers only, so their tags never meet data traffic
  OwnedComm data_comm_;
  OwnedComm abort_comm_;  // the abort channel (kAbortTag), see abort()
  MPI_Request abort_recv_ = MPI_REQUEST_NULL;
  std::array<char, kAbortMessageBytes> abort_in_{};
  std::array<char, kAbortMessageBytes> abort_out_{};  // alive for as long as MPI may send it
  std::mutex abort_mu_;
  Status own_abort_;                       // under abort_mu_
  std::atomic<bool> self_aborted_{false};  // abort() was called on this rank
  std::atomic<bool> peer_aborted_{false};  // a peer's abort message arrived
  std::vector<detail::OpHeader> headers_;
  detail::ScratchBuffer staging_;  // reduce_scatter: world chunks of this rank's share
  detail::ScratchBuffer chunk_;    // all_reduce: this rank's reduced chunk
  std::vector<MPI_Request> abandoned_;
  Status broken_;
};

}  // namespace

Result<std::pair<int, int>> mpi_world_rank_size() {
  ZINF_RETURN_IF_ERROR(ensure_mpi());
  int rank = 0, size = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  return std::pair{rank, size};
}

Result<std::unique_ptr<Communicator>> make_mpi_communicator(MpiOptions options) {
  if (options.timeout.count() <= 0) {
    return make_error(ErrorCode::kInvalidArgument,
                      "MPI communicator: the timeout must be positive");
  }
  ZINF_ASSIGN_OR_RETURN(auto rank_size, mpi_world_rank_size());
  auto backend = std::make_unique<MpiBackend>(rank_size.first, rank_size.second, options.timeout);
  ZINF_RETURN_IF_ERROR(backend->init());
  return std::make_unique<Communicator>(std::move(backend));
}

ShareFromRank0 mpi_share_from_rank0() {
  return [](std::string_view blob) -> Result<std::string> {
    ZINF_ASSIGN_OR_RETURN(auto rank_size, mpi_world_rank_size());
    uint64_t size = rank_size.first == 0 ? blob.size() : 0;
    ZINF_RETURN_IF_ERROR(
        mpi_status(MPI_Bcast(&size, 1, MPI_UINT64_T, 0, MPI_COMM_WORLD), "MPI_Bcast"));
    if (size > (1u << 20)) {
      return make_error(ErrorCode::kInvalidArgument, "MPI share: a {}-byte blob is too large",
                        size);
    }
    std::string out = rank_size.first == 0 ? std::string(blob) : std::string(size, '\0');
    ZINF_RETURN_IF_ERROR(mpi_status(
        MPI_Bcast(out.data(), static_cast<int>(size), MPI_BYTE, 0, MPI_COMM_WORLD), "MPI_Bcast"));
    return out;
  };
}

}  // namespace zinf::comm
