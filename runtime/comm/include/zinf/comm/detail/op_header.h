// Cross-rank agreement on a collective, shared by the backends. Each rank describes its call in
// a fixed-size OpHeader; every rank checks everyone's headers with the same function, so all
// ranks reach the same verdict and report the same message.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "zinf/comm/communicator.h"

namespace zinf::comm::detail {

struct OpHeader {
  uint64_t seq = 0;
  uint64_t total = 0;        // sum of counts
  uint64_t own_count = 0;    // counts[rank] for all_gather / reduce_scatter, else total
  uint64_t counts_hash = 0;  // FNV-1a over the counts vector
  int32_t root = 0;
  uint8_t op = 0;
  uint8_t dtype = 0;  // the DType, or kRawBytes for a collective of raw bytes
  uint8_t reduce = 0;
  uint8_t invalid = 0;  // this rank's arguments were rejected (Collective::invalid)
};
static_assert(sizeof(OpHeader) == 40);
inline constexpr uint8_t kRawBytes = 0xff;  // OpHeader::dtype of a Payload::kBytes collective

OpHeader make_header(const Collective& c, int rank);

// The verdict on one collective from every rank's header (headers[j] is rank j's). `reason(j)`
// gives rank j's Collective::invalid text where this rank knows it ("" otherwise).
Status check_headers(std::span<const OpHeader> headers,
                     const std::function<std::string(int rank)>& reason);

// The ranks in `ranks`, written "rank 3" or "ranks 1, 2, 5".
std::string format_ranks(std::span<const int> ranks);

// The host reduction: dst[i] = reduce of srcs(0)[i], ..., srcs(nsrc-1)[i] for i < count, with
// reduce_element's arithmetic (rank-order fp32 sum, scale, one rounding). dst may be one of the
// sources (in place). `srcs` is an array of nsrc base pointers.
void reduce_rank_order(void* dst, const void* const* srcs, int nsrc, size_t count, DType dtype,
                       float scale);

// 1.0f for kSum, 1.0f / world for kAvg.
float reduce_scale(ReduceOp op, int world);

// displs[j] = counts[0] + ... + counts[j-1], for j = 0 .. counts.size() (the last is the total).
std::vector<size_t> prefix_sums(const std::vector<size_t>& counts);

// A host buffer that grows to the largest size asked of it and is reused (the host backends'
// staging for reductions).
class ScratchBuffer {
 public:
  std::byte* get(size_t bytes) {
    if (bytes > capacity_) {
      buffer_.reset(new std::byte[bytes]);
      capacity_ = bytes;
    }
    return buffer_.get();
  }

 private:
  std::unique_ptr<std::byte[]> buffer_;
  size_t capacity_ = 0;
};

}  // namespace zinf::comm::detail
