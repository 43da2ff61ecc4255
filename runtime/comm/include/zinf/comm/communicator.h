// The Communicator contract: the collectives ZeRO is made of, one API over three backends
// (local threads, MPI processes, NCCL on GPUs, Gloo processes without MPI). docs/communicators.md
// has the long form.
//
// Issue order and asynchrony
//   Every operation is enqueued on the communicator's stream (one worker thread per
//   communicator) and returns a Work at once. Operations run in issue order, one at a time. All
//   ranks must issue the same sequence of collectives with matching shapes; a rank that issues a
//   different operation, dtype, root or count is named in an error that every rank receives.
//   Buffers belong to the operation from the call until its Work completes: do not read, write or
//   free them before. Dropping a Work cancels nothing; only its own wait() reports its error. A
//   communicator may be called from several threads; the issue order is then the order in which the
//   calls take its lock, so callers that care issue from one thread.
//
// Shapes (elements, not bytes)
//   all_gather(_v):     each rank contributes counts[rank] elements; recv holds sum(counts)
//                       elements, rank j's contribution at displacement(j) = counts[0..j).
//   reduce_scatter(_v): send holds sum(counts) elements on every rank; rank r receives the
//                       reduction of elements [displacement(r), displacement(r) + counts[r]).
//   all_reduce:         send and recv hold count elements. It is, element for element, a
//                       reduce_scatter over even_partition(count, world) followed by an
//                       all_gather, so all_reduce == reduce_scatter + all_gather bit for bit.
//   broadcast:          buffer holds count elements; after the op every rank has root's.
//   all_gather_bytes, broadcast_bytes: all_gather and broadcast of raw bytes (integers, flags,
//                       trivially copyable structs): counts are bytes, any count (not only
//                       multiples of an element size), any alignment. No backend reads them as
//                       numbers or converts them: every byte arrives as sent. Bytes are never
//                       reduced. Traffic counts one element per byte, so the byte counters
//                       (bytes_in ... bytes_received) are those of the same bytes sent as
//                       elements of a dtype; volume_elements counts bytes.
//   In place: all_gather with send == recv + displacement(rank), reduce_scatter with
//   recv == send + displacement(rank), all_reduce with send == recv. Otherwise send and recv must
//   not overlap.
//
// Determinism
//   Reductions convert every contribution to fp32, add them in rank order 0, 1, ..., world-1,
//   multiply by the fp32 value 1.0f / world for kAvg, and convert back once (round to nearest
//   even). The local, MPI and NCCL backends all do this, so a result does not depend on the
//   backend, the run, or how a buffer is split into collectives.
//
// Faults
//   No operation waits forever: each backend has a timeout (LocalOptions, MpiOptions,
//   NcclOptions; ZINF_COMM_TIMEOUT through from_env). A peer that does not arrive in time fails
//   the operation with kTimeout naming the missing ranks; after a timeout the communicator is
//   broken and every later operation fails with the same error. Mismatched shapes across ranks
//   fail with kInvalidArgument on every rank and leave the communicator usable.
//   A rank that fails for a reason of its own (an I/O error, a refused allocation) calls
//   abort(reason): its queued and later operations fail with kCancelled, and every peer's
//   operation in flight or to come fails with kUnavailable naming the rank and its reason,
//   promptly rather than at the timeout (local: the group wakes its waiters; MPI: a message on a
//   channel of its own that every wait polls; NCCL: ncclCommAbort on this rank, and the peers
//   return when NCCL reports the lost peer or at their timeout). docs/communicators.md, "Faults".
#pragma once

#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "zinf/core/dtype.h"
#include "zinf/core/status.h"

namespace zinf::comm {

enum class Backend : uint8_t { kLocal, kMpi, kNccl, kGloo };
std::string_view backend_name(Backend backend);

enum class ReduceOp : uint8_t {
  kSum,
  kAvg,  // the rank-order fp32 sum multiplied by 1.0f / world
};
std::string_view reduce_op_name(ReduceOp op);

enum class CollectiveOp : uint8_t { kAllGather, kReduceScatter, kAllReduce, kBroadcast, kBarrier };
inline constexpr size_t kNumCollectiveOps = 5;
std::string_view collective_name(CollectiveOp op);

// Default bound on every wait inside a collective (a peer that never arrives).
inline constexpr std::chrono::milliseconds kDefaultTimeout{300'000};

// Splits `total` elements into `world` chunks: the first total % world ranks get one element
// more. all_reduce uses this split (it only affects the byte counters, never the values).
std::vector<size_t> even_partition(size_t total, int world);

// What a collective's elements are. kTyped: values of its `dtype`. kBytes: raw bytes, which no
// backend reads as numbers (all_gather and broadcast only; counts are bytes, `dtype` is unused).
enum class Payload : uint8_t { kTyped, kBytes };

// One collective as a backend sees it.
struct Collective {
  CollectiveOp op = CollectiveOp::kBarrier;
  DType dtype = DType::kF32;
  Payload payload = Payload::kTyped;
  ReduceOp reduce = ReduceOp::kSum;
  const void* send = nullptr;  // broadcast: the buffer (read on the root)
  void* recv = nullptr;        // broadcast: the buffer (written on the other ranks)
  // all_gather / reduce_scatter: one count per rank. all_reduce / broadcast: one entry, the
  // whole buffer. barrier: empty.
  std::vector<size_t> counts;
  int root = 0;      // broadcast only
  uint64_t seq = 0;  // position in this communicator's issue order, from 0
  // Non-empty when this rank's arguments were rejected at issue (null buffer, overlap, ...). The
  // backend still meets the other ranks and fails the operation on all of them with this reason,
  // so no rank is left waiting.
  std::string invalid;

  size_t total() const;                 // sum of counts
  size_t displacement(int rank) const;  // sum of counts[0..rank)
  size_t element_size() const;          // bytes per element: 1 for kBytes, else dtype_size(dtype)
};

// What one rank's part in one collective amounts to. Counted from the operation's shape, not
// measured on a wire, so every backend reports the same numbers for the same program.
struct Traffic {
  // The ZeRO paper's communication volume, in elements of the full (unsharded) buffer: P for an
  // all_gather or reduce_scatter of a P-element buffer, 2P for an all_reduce of P elements (a
  // reduce-scatter plus an all-gather), P for a broadcast, 0 for a barrier. Counted whatever the
  // world size, so ZeRO stages 0-2 add up to 2P per step and stage 3 to 3P.
  uint64_t volume_elements = 0;
  // Bytes the rank hands to the operation (its input) and gets back from it (its output):
  // all_gather: counts[r] in, total out; reduce_scatter: total in, counts[r] out; all_reduce:
  // count in and out; broadcast: count in on the root, count out on the others.
  uint64_t bytes_in = 0;
  uint64_t bytes_out = 0;
  // Bytes the rank sends to and receives from its peers in the bandwidth-optimal ring algorithm
  // (what NCCL's ring moves; the nccl-tests "bus" volume). With n ranks, T = total elements,
  // c = counts, e = element size, neighbours r-1 and r+1 modulo n:
  //   all_gather:     sent (T - c[r+1]) e, received (T - c[r]) e
  //   reduce_scatter: sent (T - c[r]) e,   received (T - c[r-1]) e
  //   all_reduce:     the two above over even_partition(count, n), added
  //   broadcast:      a chain root, root+1, ...: sent count*e unless r is the last link
  //                   (root-1), received count*e unless r is the root
  //   barrier:        0
  // All zero when world == 1. With equal counts both are (n-1)/n of the buffer per reduce_scatter
  // or all_gather, twice that per all_reduce.
  uint64_t bytes_sent = 0;
  uint64_t bytes_received = 0;
};
Traffic collective_traffic(const Collective& c, int rank, int world);

struct OpCounters {
  uint64_t calls = 0;  // completed successfully
  uint64_t volume_elements = 0;
  uint64_t bytes_in = 0;
  uint64_t bytes_out = 0;
  uint64_t bytes_sent = 0;
  uint64_t bytes_received = 0;

  OpCounters& operator+=(const OpCounters& other);
  bool operator==(const OpCounters&) const = default;
};

// Per-rank counters, per operation; only successful operations count.
struct CommCounters {
  std::array<OpCounters, kNumCollectiveOps> per_op{};

  const OpCounters& operator[](CollectiveOp op) const { return per_op[static_cast<size_t>(op)]; }
  OpCounters& operator[](CollectiveOp op) { return per_op[static_cast<size_t>(op)]; }
  OpCounters total() const;
};

namespace detail {
struct WorkState;
}

// The handle of one issued operation (an event on the communicator's stream). Cheap to copy.
class Work {
 public:
  Work() = default;  // an empty Work is complete and ok
  explicit Work(std::shared_ptr<detail::WorkState> state) : state_(std::move(state)) {}

  bool ready() const;
  // Blocks until the operation completes and returns its status. Never forever: the operation
  // itself is bounded by the communicator's timeout.
  Status wait() const;
  // As wait(), but gives up after `timeout` with kTimeout; the operation then keeps running and
  // still owns its buffers.
  Status wait_for(std::chrono::milliseconds timeout) const;

 private:
  std::shared_ptr<detail::WorkState> state_;
};

// What a backend implements. The Communicator calls it from its stream thread only: run() in
// issue order, never two at once, always with a Collective whose shape passed local checks
// (or carries `invalid`). run() must return within the backend's timeout, must not throw, and
// after a timeout must fail every later call with that error.
class CommBackend {
 public:
  virtual ~CommBackend() = default;
  virtual Backend kind() const = 0;
  virtual int rank() const = 0;
  virtual int world_size() const = 0;
  // Called once on the stream thread before the first run() (e.g. to select the CUDA device).
  virtual Status start_on_stream() { return Status::ok(); }
  // Runs `c` to completion.
  virtual Status run(const Collective& c) = 0;
  // This rank failed with `reason`: make run() on this rank and on every peer fail from now on,
  // waking the waits in flight (peers' errors name this rank and the reason). Called from any
  // thread, possibly while run() is in flight on the stream thread, at most once; returns within
  // a short bounded time and never throws.
  virtual void abort(const Status& reason) = 0;
};

class Communicator {
 public:
  // Takes the backend and starts the stream thread.
  explicit Communicator(std::unique_ptr<CommBackend> backend);
  // Drains the stream (every issued operation completes or fails within the timeout), then stops
  // it and destroys the backend.
  ~Communicator();
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  int rank() const { return rank_; }
  int world_size() const { return world_; }
  Backend backend() const { return kind_; }

  Work all_gather(const void* send, void* recv, size_t count, DType dtype);
  Work all_gather_v(const void* send, void* recv, std::span<const size_t> counts, DType dtype);
  Work reduce_scatter(const void* send, void* recv, size_t count, DType dtype, ReduceOp op);
  Work reduce_scatter_v(const void* send, void* recv, std::span<const size_t> counts, DType dtype,
                        ReduceOp op);
  Work all_reduce(const void* send, void* recv, size_t count, DType dtype, ReduceOp op);
  Work broadcast(void* buffer, size_t count, DType dtype, int root);
  // Raw bytes (see "Shapes"): each rank contributes `bytes` bytes; recv holds world * bytes,
  // rank j's at offset j * bytes.
  Work all_gather_bytes(const void* send, void* recv, size_t bytes);
  Work broadcast_bytes(void* buffer, size_t bytes, int root);
  Work barrier();

  CommCounters counters() const;
  void reset_counters();

  // This rank failed with `reason` and will issue no more operations that its peers could match:
  // every operation not yet complete on this rank fails with kCancelled, and every peer's fails
  // with kUnavailable naming this rank and the reason, promptly (see "Faults" above). Safe from
  // any thread, at any time; only the first call acts. The communicator stays broken.
  void abort(const Status& reason);
  // Whether abort() was called on this rank.
  bool aborted() const;

 private:
  struct Stream;
  Work submit(Collective c);

  std::unique_ptr<CommBackend> backend_;
  int rank_;
  int world_;
  Backend kind_;
  mutable std::mutex counters_mu_;
  CommCounters counters_;
  std::unique_ptr<Stream> stream_;  // declared last: stopped first
};

}  // namespace zinf::comm
