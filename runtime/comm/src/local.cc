#include "zinf/comm/local.h"

#include <condition_variable>
#include <cstring>
#include <mutex>

#include "zinf/comm/detail/op_header.h"

namespace zinf::comm {
namespace {

using Clock = std::chrono::steady_clock;

// The meeting point of a group's rank threads. A generation-counted barrier: arrive() returns
// once every rank has arrived at the current generation, or fails after the timeout. When ranks
// post their Collective (the first meeting of an operation), the last to arrive checks them all
// and every rank returns that verdict. A timeout or a departed rank breaks the group for good.
class LocalGroup {
 public:
  LocalGroup(int world, std::chrono::milliseconds timeout)
      : world_(world),
        timeout_(timeout),
        arrived_(world, 0),
        reading_(world, 0),
        slots_(world, nullptr) {}

  // `c` is this rank's operation; `post` publishes it for the peers (it must stay alive until the
  // operation's last meeting). `stage` names the meeting in error messages.
  //
  // After a meeting other than the last ("end"), every rank reads its peers' buffers until its
  // next meeting. A broken group does not let a rank leave while a peer is still reading: its
  // buffers may be freed as soon as its operation completes (a failed rank's engine is
  // destroyed), so a broken arrive first waits for the peers that are mid-copy to finish.
  Status arrive(int rank, const Collective& c, bool post, std::string_view stage) {
    std::unique_lock lock(mu_);
    reading_[rank] = 0;  // this rank is done with the peers' buffers of the last phase
    cv_.notify_all();
    if (!broken_.is_ok()) return broken_after_readers(lock, rank);
    const bool reads_after = stage != "end" && c.op != CollectiveOp::kBarrier;
    if (post) slots_[rank] = &c;
    arrived_[rank] = 1;
    const uint64_t generation = generation_;
    if (++n_arrived_ == world_) {
      verdict_ = post ? check_posted() : Status::ok();
      n_arrived_ = 0;
      std::fill(arrived_.begin(), arrived_.end(), 0);
      ++generation_;
      // Every rank reads its peers' buffers from now on, the waiters included: their flags are
      // set here, not when they wake, or a peer that finds the group broken before a waiter
      // wakes would see nobody reading and leave, and the waiter would then copy from the
      // operation the peer has just destroyed.
      if (verdict_.is_ok() && reads_after) std::fill(reading_.begin(), reading_.end(), 1);
      cv_.notify_all();
      return verdict_;
    }
    const auto deadline = Clock::now() + timeout_;
    for (;;) {
      // A completed generation wins over a later failure: its verdict stays put until this rank
      // arrives at the next meeting.
      if (generation_ != generation) return verdict_;  // (reading_ set by the last to arrive)
      if (!broken_.is_ok()) return broken_after_readers(lock, rank);
      if (cv_.wait_until(lock, deadline) == std::cv_status::timeout && generation_ == generation &&
          broken_.is_ok()) {
        std::vector<int> missing;
        for (int r = 0; r < world_; ++r) {
          if (!arrived_[r]) missing.push_back(r);
        }
        broken_ = make_error(ErrorCode::kTimeout,
                             "{} did not arrive within {:.1f} s ({} of {} #{} on rank {}); the "
                             "local group is broken",
                             detail::format_ranks(missing), timeout_.count() / 1000.0, stage,
                             collective_name(c.op), c.seq, rank);
        cv_.notify_all();
        return broken_after_readers(lock, rank);
      }
    }
  }

  const Collective& slot(int rank) const { return *slots_[rank]; }

  // A rank's communicator is gone: nobody may wait for it any more.
  void leave(int rank) {
    std::lock_guard lock(mu_);
    if (broken_.is_ok()) {
      broken_ = make_error(ErrorCode::kUnavailable,
                           "rank {} left the local group (its communicator was destroyed)", rank);
    }
    cv_.notify_all();
  }

  // A rank failed: wake every waiter, on every rank, with an error naming it and its reason.
  // A group already broken keeps its first error (the cause, not its echo).
  void abort(int rank, const Status& reason) {
    std::lock_guard lock(mu_);
    if (broken_.is_ok()) {
      broken_ = make_error(ErrorCode::kUnavailable,
                           "rank {} failed: {}; the local group is aborted", rank, reason.detail());
    }
    cv_.notify_all();
  }

  int world() const { return world_; }

 private:
  // The group's error, once no other rank is reading this rank's buffers (a peer mid-copy
  // finishes its memcpy and arrives, clearing its flag); bounded by the timeout all the same.
  Status broken_after_readers(std::unique_lock<std::mutex>& lock, int rank) {
    const auto deadline = Clock::now() + timeout_;
    cv_.wait_until(lock, deadline, [&] {
      for (int r = 0; r < world_; ++r) {
        if (r != rank && reading_[r]) return false;
      }
      return true;
    });
    return broken_;
  }

  Status check_posted() const {
    std::vector<detail::OpHeader> headers(world_);
    for (int r = 0; r < world_; ++r) headers[r] = detail::make_header(*slots_[r], r);
    return detail::check_headers(headers, [this](int r) { return slots_[r]->invalid; });
  }

  std::mutex mu_;
  std::condition_variable cv_;
  const int world_;
  const std::chrono::milliseconds timeout_;
  uint64_t generation_ = 0;
  int n_arrived_ = 0;
  std::vector<uint8_t> arrived_;
  std::vector<uint8_t> reading_;  // past a meeting, reading the peers' buffers
  std::vector<const Collective*> slots_;
  Status verdict_;
  Status broken_;
};

class LocalBackend final : public CommBackend {
 public:
  LocalBackend(std::shared_ptr<LocalGroup> group, int rank)
      : group_(std::move(group)), rank_(rank) {}
  ~LocalBackend() override { group_->leave(rank_); }

  Backend kind() const override { return Backend::kLocal; }
  int rank() const override { return rank_; }
  int world_size() const override { return group_->world(); }

  void abort(const Status& reason) override { group_->abort(rank_, reason); }

  Status run(const Collective& c) override {
    ZINF_RETURN_IF_ERROR(group_->arrive(rank_, c, /*post=*/true, "start"));
    switch (c.op) {
      case CollectiveOp::kAllGather:
        all_gather(c);
        break;
      case CollectiveOp::kReduceScatter:
        reduce_scatter(c);
        break;
      case CollectiveOp::kAllReduce:
        // Reduce this rank's chunk in place of the result, meet, then gather the others' chunks.
        reduce_chunks(c, even_partition(c.total(), group_->world()));
        ZINF_RETURN_IF_ERROR(group_->arrive(rank_, c, false, "middle"));
        gather_chunks(c, even_partition(c.total(), group_->world()), /*from_recv=*/true);
        break;
      case CollectiveOp::kBroadcast:
        if (rank_ != c.root) {
          std::memcpy(c.recv, group_->slot(c.root).send, c.total() * c.element_size());
        }
        break;
      case CollectiveOp::kBarrier:
        return Status::ok();
    }
    // Nobody leaves while a peer may still read its buffers.
    return group_->arrive(rank_, c, false, "end");
  }

 private:
  // recv[chunk j] <- rank j's chunk, for every j (from its send buffer, or for all_reduce from
  // its recv buffer, where it reduced its chunk). Skips the copy of a chunk already in place.
  void gather_chunks(const Collective& c, const std::vector<size_t>& chunks, bool from_recv) {
    const size_t e = c.element_size();
    auto* out = static_cast<std::byte*>(c.recv);
    size_t offset = 0;
    for (int j = 0; j < group_->world(); ++j) {
      const Collective& peer = group_->slot(j);
      const std::byte* src = from_recv ? static_cast<const std::byte*>(peer.recv) + offset * e
                                       : static_cast<const std::byte*>(peer.send);
      if (chunks[j] > 0 && src != out + offset * e)
        std::memcpy(out + offset * e, src, chunks[j] * e);
      offset += chunks[j];
    }
  }

  void all_gather(const Collective& c) { gather_chunks(c, c.counts, /*from_recv=*/false); }

  // Writes the rank-order reduction of this rank's chunk of every peer's send buffer to `dst`.
  void reduce_chunk_into(const Collective& c, size_t offset, size_t count, void* dst) {
    const size_t e = c.element_size();
    srcs_.resize(group_->world());
    for (int j = 0; j < group_->world(); ++j) {
      srcs_[j] = static_cast<const std::byte*>(group_->slot(j).send) + offset * e;
    }
    detail::reduce_rank_order(dst, srcs_.data(), group_->world(), count, c.dtype,
                              detail::reduce_scale(c.reduce, group_->world()));
  }

  void reduce_scatter(const Collective& c) {
    reduce_chunk_into(c, c.displacement(rank_), c.counts[rank_], c.recv);
  }

  void reduce_chunks(const Collective& c, const std::vector<size_t>& chunks) {
    size_t offset = 0;
    for (int j = 0; j < rank_; ++j) offset += chunks[j];
    reduce_chunk_into(c, offset, chunks[rank_],
                      static_cast<std::byte*>(c.recv) + offset * c.element_size());
  }

  std::shared_ptr<LocalGroup> group_;
  const int rank_;
  std::vector<const void*> srcs_;
};

}  // namespace

Result<std::vector<std::unique_ptr<Communicator>>> make_local_group(int world,
                                                                    LocalOptions options) {
  if (world < 1) {
    return make_error(ErrorCode::kInvalidArgument,
                      "local group: the world size must be at least 1, got {}", world);
  }
  if (options.timeout.count() <= 0) {
    return make_error(ErrorCode::kInvalidArgument, "local group: the timeout must be positive");
  }
  auto group = std::make_shared<LocalGroup>(world, options.timeout);
  std::vector<std::unique_ptr<Communicator>> comms;
  comms.reserve(world);
  for (int r = 0; r < world; ++r) {
    comms.push_back(std::make_unique<Communicator>(std::make_unique<LocalBackend>(group, r)));
  }
  return comms;
}

}  // namespace zinf::comm
