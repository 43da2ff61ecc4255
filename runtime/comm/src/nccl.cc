#include "zinf/comm/nccl.h"

#include <cuda_runtime.h>
#include <nccl.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <mutex>
#include <thread>

#include "nccl_reduce.h"
#include "zinf/comm/detail/op_header.h"
#include "zinf/core/log.h"

namespace zinf::comm {
namespace {

using Clock = std::chrono::steady_clock;

Status cuda_status(cudaError_t err, std::string_view call) {
  if (err == cudaSuccess) return Status::ok();
  return make_error(ErrorCode::kInternal, "{} failed: {}", call, cudaGetErrorString(err));
}

// Device memory with one owner. Grows, never shrinks; contents are not kept on growth.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer() {
    if (ptr_) cudaFree(ptr_);
  }
  Result<std::byte*> reserve(size_t bytes) {
    if (bytes > bytes_) {
      if (ptr_) cudaFree(ptr_);
      ptr_ = nullptr;
      bytes_ = 0;
      ZINF_RETURN_IF_ERROR(
          cuda_status(cudaMalloc(&ptr_, std::max<size_t>(bytes, 256)), "cudaMalloc"));
      bytes_ = std::max<size_t>(bytes, 256);
    }
    return static_cast<std::byte*>(ptr_);
  }

 private:
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

class OwnedStream {
 public:
  OwnedStream() = default;
  OwnedStream(const OwnedStream&) = delete;
  OwnedStream& operator=(const OwnedStream&) = delete;
  ~OwnedStream() {
    if (stream_) cudaStreamDestroy(stream_);
  }
  Status create() {
    return cuda_status(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking),
                       "cudaStreamCreateWithFlags");
  }
  cudaStream_t get() const { return stream_; }

 private:
  cudaStream_t stream_ = nullptr;
};

// A non-blocking NCCL communicator, owned. Every call is followed by wait_ready(): NCCL may
// answer ncclInProgress and must be polled until it settles. A timeout aborts the communicator.
class OwnedNcclComm {
 public:
  OwnedNcclComm() = default;
  OwnedNcclComm(const OwnedNcclComm&) = delete;
  OwnedNcclComm& operator=(const OwnedNcclComm&) = delete;
  ~OwnedNcclComm() {
    if (comm_) ncclCommDestroy(comm_);
  }

  ncclComm_t* out() { return &comm_; }
  ncclComm_t get() const { return comm_; }

  void abort() {
    if (comm_) ncclCommAbort(comm_);
    comm_ = nullptr;
  }

  // The outcome of an NCCL call on this communicator, polling while it is in progress.
  // `aborted` (the backend's abort flag, set from any thread) ends the wait: the communicator is
  // aborted here, on the thread that uses it, since NCCL forbids concurrent calls on one.
  Status settle(ncclResult_t result, std::string_view call, Clock::time_point deadline,
                const std::atomic<bool>& aborted) {
    while (result == ncclInProgress) {
      if (aborted.load()) {
        abort();
        return make_error(ErrorCode::kCancelled, "{} abandoned: this rank aborted", call);
      }
      if (Clock::now() >= deadline) {
        abort();
        return make_error(ErrorCode::kTimeout, "{} still in progress at the deadline; aborted",
                          call);
      }
      std::this_thread::yield();
      if (ncclCommGetAsyncError(comm_, &result) != ncclSuccess) break;
    }
    if (result == ncclSuccess) return Status::ok();
    const char* last = comm_ ? ncclGetLastError(comm_) : "";
    return make_error(ErrorCode::kInternal, "{} failed: {}{}{}", call, ncclGetErrorString(result),
                      last && *last ? ": " : "", last ? last : "");
  }

 private:
  ncclComm_t comm_ = nullptr;
};

class NcclBackend final : public CommBackend {
 public:
  explicit NcclBackend(NcclOptions options) : options_(std::move(options)) {
    headers_.resize(options_.world_size);
  }

  ~NcclBackend() override {
    cudaSetDevice(options_.device);
    // ncclCommDestroy waits for the operations queued on the communicator, which a failed rank's
    // peers will never complete: abort instead.
    if (aborted_.load()) comm_.abort();
  }

  Status init() {
    const auto deadline = Clock::now() + options_.timeout;
    ZINF_RETURN_IF_ERROR(cuda_status(cudaSetDevice(options_.device), "cudaSetDevice"));
    ncclUniqueId id;
    std::memset(&id, 0, sizeof(id));
    if (options_.rank == 0) {
      ncclResult_t r = ncclGetUniqueId(&id);
      if (r != ncclSuccess) {
        return make_error(ErrorCode::kInternal, "ncclGetUniqueId failed: {}",
                          ncclGetErrorString(r));
      }
    }
    if (options_.world_size > 1) {
      if (!options_.share_unique_id) {
        return make_error(ErrorCode::kInvalidArgument,
                          "NCCL communicator of {} ranks without a way to share the unique id",
                          options_.world_size);
      }
      std::string blob(reinterpret_cast<const char*>(&id), sizeof(id));
      ZINF_ASSIGN_OR_RETURN(std::string shared, options_.share_unique_id(blob));
      if (shared.size() != sizeof(id)) {
        return make_error(ErrorCode::kCorrupt, "NCCL unique id of {} bytes (expected {})",
                          shared.size(), sizeof(id));
      }
      std::memcpy(&id, shared.data(), sizeof(id));
    }
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    ZINF_RETURN_IF_ERROR(comm_.settle(
        ncclCommInitRankConfig(comm_.out(), options_.world_size, id, options_.rank, &config),
        "ncclCommInitRankConfig", deadline, aborted_));
    ZINF_RETURN_IF_ERROR(stream_.create());
    return Status::ok();
  }

  Backend kind() const override { return Backend::kNccl; }
  int rank() const override { return options_.rank; }
  int world_size() const override { return options_.world_size; }

  Status start_on_stream() override {
    return cuda_status(cudaSetDevice(options_.device), "cudaSetDevice");
  }

  // Sets the flag that every wait on the stream thread polls; that thread aborts the NCCL
  // communicator (ncclCommAbort), or the destructor does if no operation comes. NCCL itself has
  // no way to tell the peers: theirs fail when NCCL reports the lost peer, or at their timeout.
  void abort(const Status& reason) override {
    {
      std::lock_guard lock(abort_mu_);
      own_abort_ =
          make_error(ErrorCode::kCancelled, "rank {} failed: {}; the NCCL communicator is aborted",
                     options_.rank, reason.detail());
    }
    aborted_.store(true);
  }

  Status run(const Collective& c) override {
    if (!broken_.is_ok()) return broken_;
    if (aborted_.load()) return abort_now();
    deadline_ = Clock::now() + options_.timeout;
    Status status = run_op(c);
    if (aborted_.load()) return abort_now();
    if (status.code() == ErrorCode::kTimeout) broken_ = status;
    return status;
  }

 private:
  Status run_op(const Collective& c) {
    ZINF_RETURN_IF_ERROR(exchange_headers(c));
    if (c.total() == 0) return Status::ok();  // nothing to move (and a barrier is done)
    switch (c.op) {
      case CollectiveOp::kAllGather:
        ZINF_RETURN_IF_ERROR(all_gather(c.element_size(), c.send, c.recv, c.counts));
        break;
      case CollectiveOp::kReduceScatter:
        ZINF_RETURN_IF_ERROR(reduce_scatter(c, c.send, c.recv, c.counts));
        break;
      case CollectiveOp::kAllReduce: {
        std::vector<size_t> chunks = even_partition(c.total(), options_.world_size);
        ZINF_ASSIGN_OR_RETURN(std::byte * mine,
                              chunk_.reserve(chunks[options_.rank] * c.element_size()));
        ZINF_RETURN_IF_ERROR(reduce_scatter(c, c.send, mine, chunks));
        ZINF_RETURN_IF_ERROR(all_gather(c.element_size(), mine, c.recv, chunks));
        break;
      }
      case CollectiveOp::kBroadcast: {
        void* buffer = options_.rank == c.root ? const_cast<void*>(c.send) : c.recv;
        ZINF_RETURN_IF_ERROR(settle(ncclBroadcast(buffer, buffer, c.total() * c.element_size(),
                                                  ncclUint8, c.root, comm_.get(), stream_.get()),
                                    "ncclBroadcast"));
        break;
      }
      case CollectiveOp::kBarrier:
        return Status::ok();  // the header exchange met every rank
    }
    return wait_stream(c);
  }

  Status settle(ncclResult_t result, std::string_view call) {
    return comm_.settle(result, call, deadline_, aborted_);
  }

  // Stream thread: aborts the NCCL communicator after abort() and breaks this backend for good.
  Status abort_now() {
    comm_.abort();
    std::lock_guard lock(abort_mu_);
    broken_ = own_abort_;
    return broken_;
  }

  // Point-to-point calls between ncclGroupStart and ncclGroupEnd: the group is always closed,
  // and the first failure inside it is reported after.
  class GroupCalls {
   public:
    void start() { first_ = ncclGroupStart(); }
    void note(ncclResult_t r) {
      if (first_ == ncclSuccess && r != ncclSuccess && r != ncclInProgress) first_ = r;
    }
    Status end(NcclBackend& backend, std::string_view what) {
      ncclResult_t end = ncclGroupEnd();
      if (first_ != ncclSuccess) {
        return backend.settle(first_, fmt::format("NCCL send/recv in {}", what));
      }
      return backend.settle(end, fmt::format("ncclGroupEnd ({})", what));
    }

   private:
    ncclResult_t first_ = ncclSuccess;
  };

  // Polls the stream until the work queued on it is done; aborts NCCL at the deadline.
  Status wait_stream(const Collective& c) {
    for (;;) {
      cudaError_t err = cudaStreamQuery(stream_.get());
      if (err == cudaSuccess) return Status::ok();
      if (err != cudaErrorNotReady) return cuda_status(err, "cudaStreamQuery");
      ncclResult_t async = ncclSuccess;
      ncclCommGetAsyncError(comm_.get(), &async);
      if (async != ncclSuccess && async != ncclInProgress) return settle(async, "NCCL");
      if (aborted_.load()) return abort_now();
      if (Clock::now() >= deadline_) {
        comm_.abort();
        return make_error(ErrorCode::kTimeout,
                          "{} #{} did not complete within {:.1f} s; the NCCL communicator is "
                          "aborted",
                          collective_name(c.op), c.seq, options_.timeout.count() / 1000.0);
      }
      std::this_thread::yield();
    }
  }

  // Every rank's header, all-gathered through NCCL, then checked alike on every rank.
  Status exchange_headers(const Collective& c) {
    const int world = options_.world_size;
    const size_t h = sizeof(detail::OpHeader);
    headers_[options_.rank] = detail::make_header(c, options_.rank);
    ZINF_ASSIGN_OR_RETURN(std::byte * dev, header_dev_.reserve(world * h));
    ZINF_RETURN_IF_ERROR(
        cuda_status(cudaMemcpyAsync(dev + options_.rank * h, &headers_[options_.rank], h,
                                    cudaMemcpyHostToDevice, stream_.get()),
                    "cudaMemcpyAsync"));
    ZINF_RETURN_IF_ERROR(settle(
        ncclAllGather(dev + options_.rank * h, dev, h, ncclUint8, comm_.get(), stream_.get()),
        "ncclAllGather (headers)"));
    ZINF_RETURN_IF_ERROR(cuda_status(
        cudaMemcpyAsync(headers_.data(), dev, world * h, cudaMemcpyDeviceToHost, stream_.get()),
        "cudaMemcpyAsync"));
    ZINF_RETURN_IF_ERROR(wait_stream(c));
    return detail::check_headers(
        headers_, [&](int j) { return j == options_.rank ? c.invalid : std::string(); });
  }

  // recv gets chunk j of counts (elements of `e` bytes) from rank j's `send`. NCCL's all_gather
  // when the chunks are equal, else grouped point-to-point transfers.
  Status all_gather(size_t e, const void* send, void* recv, const std::vector<size_t>& counts) {
    const int me = options_.rank;
    bool equal =
        std::all_of(counts.begin(), counts.end(), [&](size_t n) { return n == counts[0]; });
    if (equal) {
      return settle(ncclAllGather(send, recv, counts[0] * e, ncclUint8, comm_.get(), stream_.get()),
                    "ncclAllGather");
    }
    auto* out = static_cast<std::byte*>(recv);
    size_t my_offset = 0;
    for (int j = 0; j < me; ++j) my_offset += counts[j];
    if (counts[me] > 0 && send != out + my_offset * e) {
      ZINF_RETURN_IF_ERROR(cuda_status(cudaMemcpyAsync(out + my_offset * e, send, counts[me] * e,
                                                       cudaMemcpyDeviceToDevice, stream_.get()),
                                       "cudaMemcpyAsync"));
    }
    GroupCalls group;
    group.start();
    size_t offset = 0;
    for (int j = 0; j < options_.world_size; ++j) {
      if (j != me && counts[me] > 0) {
        group.note(ncclSend(send, counts[me] * e, ncclUint8, j, comm_.get(), stream_.get()));
      }
      if (j != me && counts[j] > 0) {
        group.note(
            ncclRecv(out + offset * e, counts[j] * e, ncclUint8, j, comm_.get(), stream_.get()));
      }
      offset += counts[j];
    }
    return group.end(*this, "all_gather_v");
  }

  // Chunk `me` of every rank's `send` lands in staging in rank order (grouped send/receive),
  // then the kernel sums it in rank order into recv.
  Status reduce_scatter(const Collective& c, const void* send, void* recv,
                        const std::vector<size_t>& counts) {
    const size_t e = c.element_size();
    const int me = options_.rank;
    const size_t mine = counts[me];
    ZINF_ASSIGN_OR_RETURN(std::byte * staging, staging_.reserve(options_.world_size * mine * e));
    GroupCalls group;
    group.start();
    size_t offset = 0;
    for (int j = 0; j < options_.world_size; ++j) {
      if (counts[j] > 0) {
        group.note(ncclSend(static_cast<const std::byte*>(send) + offset * e, counts[j] * e,
                            ncclUint8, j, comm_.get(), stream_.get()));
      }
      if (mine > 0) {
        group.note(
            ncclRecv(staging + j * mine * e, mine * e, ncclUint8, j, comm_.get(), stream_.get()));
      }
      offset += counts[j];
    }
    ZINF_RETURN_IF_ERROR(group.end(*this, "reduce_scatter"));
    return cuda_status(nccl_detail::launch_rank_order_reduce(
                           recv, staging, mine * e, mine, options_.world_size, c.dtype,
                           detail::reduce_scale(c.reduce, options_.world_size), stream_.get()),
                       "rank-order reduce kernel");
  }

  NcclOptions options_;  // keeps share_unique_id (and a store server on rank 0) alive
  OwnedNcclComm comm_;
  OwnedStream stream_;
  DeviceBuffer header_dev_;
  DeviceBuffer staging_;
  DeviceBuffer chunk_;
  std::vector<detail::OpHeader> headers_;
  Clock::time_point deadline_;
  Status broken_;
  std::mutex abort_mu_;
  Status own_abort_;                  // under abort_mu_
  std::atomic<bool> aborted_{false};  // abort() was called (from any thread)
};

}  // namespace

int cuda_device_count() {
  // Without a GPU cudaGetDeviceCount fails and may leave the count unset: start from 0.
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return count;
}

Result<std::unique_ptr<Communicator>> make_nccl_communicator(NcclOptions options) {
  if (options.world_size < 1 || options.rank < 0 || options.rank >= options.world_size) {
    return make_error(ErrorCode::kInvalidArgument, "NCCL communicator: rank {} of a world of {}",
                      options.rank, options.world_size);
  }
  if (options.timeout.count() <= 0) {
    return make_error(ErrorCode::kInvalidArgument,
                      "NCCL communicator: the timeout must be positive");
  }
  int devices = cuda_device_count();
  if (devices == 0) return make_error(ErrorCode::kUnavailable, "NCCL: no CUDA device");
  if (options.device < 0 || options.device >= devices) {
    return make_error(ErrorCode::kInvalidArgument, "NCCL: device {} of {} CUDA devices",
                      options.device, devices);
  }
  auto backend = std::make_unique<NcclBackend>(std::move(options));
  ZINF_RETURN_IF_ERROR(backend->init());
  return std::make_unique<Communicator>(std::move(backend));
}

}  // namespace zinf::comm
