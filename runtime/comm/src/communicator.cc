#include "zinf/comm/communicator.h"

#include <condition_variable>
#include <deque>
#include <limits>
#include <numeric>
#include <thread>

namespace zinf::comm {

std::string_view backend_name(Backend backend) {
  switch (backend) {
    case Backend::kLocal:
      return "local";
    case Backend::kMpi:
      return "mpi";
    case Backend::kNccl:
      return "nccl";
    case Backend::kGloo:
      return "gloo";
  }
  return "unknown";
}

std::string_view reduce_op_name(ReduceOp op) { return op == ReduceOp::kSum ? "sum" : "avg"; }

std::string_view collective_name(CollectiveOp op) {
  switch (op) {
    case CollectiveOp::kAllGather:
      return "all_gather";
    case CollectiveOp::kReduceScatter:
      return "reduce_scatter";
    case CollectiveOp::kAllReduce:
      return "all_reduce";
    case CollectiveOp::kBroadcast:
      return "broadcast";
    case CollectiveOp::kBarrier:
      return "barrier";
  }
  return "unknown";
}

std::vector<size_t> even_partition(size_t total, int world) {
  ZINF_CHECK(world > 0, "world size {}", world);
  size_t n = static_cast<size_t>(world);
  std::vector<size_t> counts(n, total / n);
  for (size_t r = 0; r < total % n; ++r) ++counts[r];
  return counts;
}

size_t Collective::total() const {
  return std::accumulate(counts.begin(), counts.end(), size_t{0});
}

size_t Collective::displacement(int rank) const {
  return std::accumulate(counts.begin(), counts.begin() + rank, size_t{0});
}

size_t Collective::element_size() const {
  return payload == Payload::kBytes ? 1 : dtype_size(dtype);
}

namespace {

// Ring traffic of an all_gather / reduce_scatter over per-rank chunks.
void ring_gather(const std::vector<size_t>& c, int r, uint64_t e, uint64_t& sent, uint64_t& recvd) {
  int n = static_cast<int>(c.size());
  uint64_t total = std::accumulate(c.begin(), c.end(), uint64_t{0});
  sent += (total - c[(r + 1) % n]) * e;
  recvd += (total - c[r]) * e;
}
void ring_scatter(const std::vector<size_t>& c, int r, uint64_t e, uint64_t& sent,
                  uint64_t& recvd) {
  int n = static_cast<int>(c.size());
  uint64_t total = std::accumulate(c.begin(), c.end(), uint64_t{0});
  sent += (total - c[r]) * e;
  recvd += (total - c[(r + n - 1) % n]) * e;
}

}  // namespace

Traffic collective_traffic(const Collective& c, int rank, int world) {
  Traffic t;
  const uint64_t e = c.element_size();
  const uint64_t total = c.total();
  const bool alone = world == 1;
  switch (c.op) {
    case CollectiveOp::kAllGather:
      t.volume_elements = total;
      t.bytes_in = c.counts[rank] * e;
      t.bytes_out = total * e;
      if (!alone) ring_gather(c.counts, rank, e, t.bytes_sent, t.bytes_received);
      break;
    case CollectiveOp::kReduceScatter:
      t.volume_elements = total;
      t.bytes_in = total * e;
      t.bytes_out = c.counts[rank] * e;
      if (!alone) ring_scatter(c.counts, rank, e, t.bytes_sent, t.bytes_received);
      break;
    case CollectiveOp::kAllReduce: {
      t.volume_elements = 2 * total;
      t.bytes_in = total * e;
      t.bytes_out = total * e;
      if (!alone) {
        std::vector<size_t> chunks = even_partition(total, world);
        ring_scatter(chunks, rank, e, t.bytes_sent, t.bytes_received);
        ring_gather(chunks, rank, e, t.bytes_sent, t.bytes_received);
      }
      break;
    }
    case CollectiveOp::kBroadcast:
      t.volume_elements = total;
      t.bytes_in = rank == c.root ? total * e : 0;
      t.bytes_out = rank == c.root ? 0 : total * e;
      if (!alone) {
        t.bytes_sent = rank == (c.root + world - 1) % world ? 0 : total * e;
        t.bytes_received = rank == c.root ? 0 : total * e;
      }
      break;
    case CollectiveOp::kBarrier:
      break;
  }
  return t;
}

OpCounters& OpCounters::operator+=(const OpCounters& o) {
  calls += o.calls;
  volume_elements += o.volume_elements;
  bytes_in += o.bytes_in;
  bytes_out += o.bytes_out;
  bytes_sent += o.bytes_sent;
  bytes_received += o.bytes_received;
  return *this;
}

OpCounters CommCounters::total() const {
  OpCounters sum;
  for (const OpCounters& c : per_op) sum += c;
  return sum;
}

// ---- Work ------------------------------------------------------------------------------------

namespace detail {

struct WorkState {
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  Status status;

  void complete(Status s) {
    {
      std::lock_guard lock(mu);
      status = std::move(s);
      done = true;
    }
    cv.notify_all();
  }
};

}  // namespace detail

bool Work::ready() const {
  if (!state_) return true;
  std::lock_guard lock(state_->mu);
  return state_->done;
}

Status Work::wait() const {
  if (!state_) return Status::ok();
  std::unique_lock lock(state_->mu);
  state_->cv.wait(lock, [&] { return state_->done; });
  return state_->status;
}

Status Work::wait_for(std::chrono::milliseconds timeout) const {
  if (!state_) return Status::ok();
  std::unique_lock lock(state_->mu);
  if (!state_->cv.wait_for(lock, timeout, [&] { return state_->done; })) {
    return make_error(ErrorCode::kTimeout, "collective not complete after {} ms", timeout.count());
  }
  return state_->status;
}

// ---- the stream: one worker thread running the backend in issue order -------------------------

struct Communicator::Stream {
  struct Item {
    Collective c;
    std::shared_ptr<detail::WorkState> work;
  };

  std::mutex mu;
  std::condition_variable cv;
  std::deque<Item> queue;
  bool stopping = false;
  Status aborted;  // set by abort(): what every operation not yet run completes with
  uint64_t next_seq = 0;
  std::thread thread;
};

Communicator::Communicator(std::unique_ptr<CommBackend> backend)
    : backend_(std::move(backend)),
      rank_(backend_->rank()),
      world_(backend_->world_size()),
      kind_(backend_->kind()),
      stream_(std::make_unique<Stream>()) {
  stream_->thread = std::thread([this] {
    Status started = backend_->start_on_stream();
    Stream& s = *stream_;
    for (;;) {
      Stream::Item item;
      Status aborted;
      {
        std::unique_lock lock(s.mu);
        s.cv.wait(lock, [&] { return s.stopping || !s.queue.empty(); });
        if (s.queue.empty()) return;  // stopping, and drained
        item = std::move(s.queue.front());
        s.queue.pop_front();
        aborted = s.aborted;
      }
      Status status = !aborted.is_ok()  ? aborted
                      : started.is_ok() ? backend_->run(item.c)
                                        : started;
      if (status.is_ok()) {
        Traffic t = collective_traffic(item.c, rank_, world_);
        std::lock_guard lock(counters_mu_);
        OpCounters& oc = counters_[item.c.op];
        oc += OpCounters{.calls = 1,
                         .volume_elements = t.volume_elements,
                         .bytes_in = t.bytes_in,
                         .bytes_out = t.bytes_out,
                         .bytes_sent = t.bytes_sent,
                         .bytes_received = t.bytes_received};
      } else {
        status.with_context(fmt::format("{} #{} on rank {} of {} ({})", collective_name(item.c.op),
                                        item.c.seq, rank_, world_, backend_name(kind_)));
      }
      item.work->complete(std::move(status));
    }
  });
}

Communicator::~Communicator() {
  {
    std::lock_guard lock(stream_->mu);
    stream_->stopping = true;
  }
  stream_->cv.notify_all();
  stream_->thread.join();
}

void Communicator::abort(const Status& reason) {
  {
    std::lock_guard lock(stream_->mu);
    if (!stream_->aborted.is_ok()) return;
    stream_->aborted = make_error(ErrorCode::kCancelled, "rank {} aborted its {} communicator: {}",
                                  rank_, backend_name(kind_), reason.detail());
  }
  backend_->abort(reason);
}

bool Communicator::aborted() const {
  std::lock_guard lock(stream_->mu);
  return !stream_->aborted.is_ok();
}

CommCounters Communicator::counters() const {
  std::lock_guard lock(counters_mu_);
  return counters_;
}

void Communicator::reset_counters() {
  std::lock_guard lock(counters_mu_);
  counters_ = CommCounters{};
}

namespace {

bool overlaps(const void* a, size_t a_bytes, const void* b, size_t b_bytes) {
  auto pa = reinterpret_cast<uintptr_t>(a);
  auto pb = reinterpret_cast<uintptr_t>(b);
  return a_bytes > 0 && b_bytes > 0 && pa < pb + b_bytes && pb < pa + a_bytes;
}

// Checks one rank's arguments; returns why they are unusable, or "".
std::string check_arguments(const Collective& c, int rank, int world) {
  const size_t e = c.element_size();
  switch (c.op) {
    case CollectiveOp::kAllGather:
    case CollectiveOp::kReduceScatter:
      if (c.counts.size() != static_cast<size_t>(world)) {
        return fmt::format("{} counts has {} entries for a world of {}", collective_name(c.op),
                           c.counts.size(), world);
      }
      break;
    case CollectiveOp::kAllReduce:
    case CollectiveOp::kBroadcast:
      if (c.op == CollectiveOp::kBroadcast && (c.root < 0 || c.root >= world)) {
        return fmt::format("broadcast root {} is not a rank of a world of {}", c.root, world);
      }
      break;
    case CollectiveOp::kBarrier:
      return "";
  }
  // Sizes in bytes must fit size_t with room to add displacements.
  size_t total = 0;
  for (size_t n : c.counts) {
    if (n > std::numeric_limits<size_t>::max() / 8 - total) return "element count overflows";
    total += n;
  }
  if (c.op == CollectiveOp::kBroadcast) {
    if (total > 0 && c.send == nullptr) return "broadcast buffer is null";
    return "";
  }
  const size_t own = c.op == CollectiveOp::kAllGather || c.op == CollectiveOp::kReduceScatter
                         ? c.counts[rank]
                         : total;
  const size_t send_elems = c.op == CollectiveOp::kAllGather ? own : total;
  const size_t recv_elems = c.op == CollectiveOp::kReduceScatter ? own : total;
  if (send_elems > 0 && c.send == nullptr) return "send buffer is null";
  if (recv_elems > 0 && c.recv == nullptr) return "recv buffer is null";
  const auto* send = static_cast<const std::byte*>(c.send);
  const auto* recv = static_cast<const std::byte*>(c.recv);
  const size_t disp = c.op == CollectiveOp::kAllReduce ? 0 : c.displacement(rank) * e;
  bool in_place = false;
  switch (c.op) {
    case CollectiveOp::kAllGather:
      in_place = send == recv + disp;
      break;
    case CollectiveOp::kReduceScatter:
      in_place = recv == send + disp;
      break;
    default:
      in_place = send == recv;
      break;
  }
  if (!in_place && overlaps(send, send_elems * e, recv, recv_elems * e)) {
    return "send and recv overlap without being the in-place layout";
  }
  return "";
}

}  // namespace

Work Communicator::submit(Collective c) {
  c.invalid = check_arguments(c, rank_, world_);
  auto state = std::make_shared<detail::WorkState>();
  {
    std::lock_guard lock(stream_->mu);
    c.seq = stream_->next_seq++;
    stream_->queue.push_back({std::move(c), state});
  }
  stream_->cv.notify_one();
  return Work(std::move(state));
}

Work Communicator::all_gather(const void* send, void* recv, size_t count, DType dtype) {
  return submit({.op = CollectiveOp::kAllGather,
                 .dtype = dtype,
                 .send = send,
                 .recv = recv,
                 .counts = std::vector<size_t>(static_cast<size_t>(world_), count)});
}

Work Communicator::all_gather_v(const void* send, void* recv, std::span<const size_t> counts,
                                DType dtype) {
  return submit({.op = CollectiveOp::kAllGather,
                 .dtype = dtype,
                 .send = send,
                 .recv = recv,
                 .counts = {counts.begin(), counts.end()}});
}

Work Communicator::reduce_scatter(const void* send, void* recv, size_t count, DType dtype,
                                  ReduceOp op) {
  return submit({.op = CollectiveOp::kReduceScatter,
                 .dtype = dtype,
                 .reduce = op,
                 .send = send,
                 .recv = recv,
                 .counts = std::vector<size_t>(static_cast<size_t>(world_), count)});
}

Work Communicator::reduce_scatter_v(const void* send, void* recv, std::span<const size_t> counts,
                                    DType dtype, ReduceOp op) {
  return submit({.op = CollectiveOp::kReduceScatter,
                 .dtype = dtype,
                 .reduce = op,
                 .send = send,
                 .recv = recv,
                 .counts = {counts.begin(), counts.end()}});
}

Work Communicator::all_reduce(const void* send, void* recv, size_t count, DType dtype,
                              ReduceOp op) {
  return submit({.op = CollectiveOp::kAllReduce,
                 .dtype = dtype,
                 .reduce = op,
                 .send = send,
                 .recv = recv,
                 .counts = {count}});
}

Work Communicator::broadcast(void* buffer, size_t count, DType dtype, int root) {
  return submit({.op = CollectiveOp::kBroadcast,
                 .dtype = dtype,
                 .send = buffer,
                 .recv = buffer,
                 .counts = {count},
                 .root = root});
}

Work Communicator::all_gather_bytes(const void* send, void* recv, size_t bytes) {
  return submit({.op = CollectiveOp::kAllGather,
                 .payload = Payload::kBytes,
                 .send = send,
                 .recv = recv,
                 .counts = std::vector<size_t>(static_cast<size_t>(world_), bytes)});
}

Work Communicator::broadcast_bytes(void* buffer, size_t bytes, int root) {
  return submit({.op = CollectiveOp::kBroadcast,
                 .payload = Payload::kBytes,
                 .send = buffer,
                 .recv = buffer,
                 .counts = {bytes},
                 .root = root});
}

Work Communicator::barrier() { return submit({.op = CollectiveOp::kBarrier}); }

}  // namespace zinf::comm
