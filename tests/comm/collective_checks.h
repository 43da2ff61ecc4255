// The collective suite shared by every backend's tests (local threads, mpirun, Gloo, NCCL): every
// operation x dtype x reduce op x size (sizes not divisible by the world included) x layout, each
// result compared bit for bit with a reference computed here (rank-order fp32 sums); the byte
// collectives at every size (byte counts that are not multiples of 4 included), compared byte by
// byte; and each operation's byte counters compared exactly with the documented formulas.
#pragma once

#include <cstdint>
#include <ostream>
#include <string>
#include <vector>

#include "zinf/comm/communicator.h"

namespace zinf {
// gtest prints these by name.
inline void PrintTo(DType dtype, std::ostream* os) { *os << dtype_name(dtype); }
namespace comm {
inline void PrintTo(Backend backend, std::ostream* os) { *os << backend_name(backend); }
}  // namespace comm
}  // namespace zinf

namespace zinf::comm::test {

// Where a backend's buffers live: host memory, or device memory for NCCL.
class TestMemory {
 public:
  virtual ~TestMemory() = default;
  virtual void* alloc(size_t bytes) = 0;
  virtual void release(void* ptr) = 0;
  virtual void upload(void* dst, const void* src, size_t bytes) = 0;
  virtual void download(void* dst, const void* src, size_t bytes) = 0;
};
TestMemory& host_memory();

struct SweepOptions {
  std::vector<DType> dtypes = {DType::kF32, DType::kBF16, DType::kF16};
  std::vector<size_t> sizes = {0, 1, 7, 1001, 4099, 70001};  // elements; bytes for the byte ops
  TestMemory* memory = &host_memory();
};

// Runs the whole suite on this rank. Every rank of the communicator calls it with the same
// options (the ranks' calls pair up in order). Returns the failures, each naming its case; an
// empty vector is a pass.
std::vector<std::string> run_sweep(Communicator& comm, const SweepOptions& options = {});

// Rank `rank`'s input for one case: mixed signs and magnitudes with full mantissas, spread so that
// a different summation order gives different bits in every dtype. Stored in `dtype`.
std::vector<uint8_t> test_input(int rank, size_t count, DType dtype, uint64_t salt);

// The reduction of elements [offset, offset + count) of every rank's input, written straight
// from the contract: fp32 sum in rank order, times 1.0f / world for kAvg, one rounding.
std::vector<uint8_t> reference_reduce(const std::vector<std::vector<uint8_t>>& inputs,
                                      size_t offset, size_t count, DType dtype, ReduceOp op);

// Rank `rank`'s input for one byte collective: `bytes` pseudo-random bytes.
std::vector<uint8_t> test_bytes(int rank, size_t bytes, uint64_t salt);

// The documented counters of one operation on `rank` (communicator.h, Traffic), computed here
// independently of the library, for elements of `dtype` or of `element_bytes` bytes (1: raw
// bytes).
OpCounters expected_counters(CollectiveOp op, const std::vector<size_t>& counts, int root, int rank,
                             int world, DType dtype);
OpCounters expected_counters(CollectiveOp op, const std::vector<size_t>& counts, int root, int rank,
                             int world, size_t element_bytes);

// The same inputs all-reduced (kAvg) through `comm` and through a local group of its world size in
// this process, in every dtype: the differences on this rank (empty: equal bit for bit). Every
// rank of `comm` calls it.
std::vector<std::string> compare_with_local_group(Communicator& comm);

// For suites whose ranks are processes: rank 0 keeps gtest's report, the others print only their
// failures, marked with the rank. Call after InitGoogleTest.
void print_only_failures_unless_rank0(int rank);

// First differing element of two byte buffers of `dtype` elements, or "" when equal.
std::string first_difference(const std::vector<uint8_t>& got, const std::vector<uint8_t>& want,
                             DType dtype);

// First differing byte of two byte buffers, or "" when equal.
std::string first_byte_difference(const std::vector<uint8_t>& got,
                                  const std::vector<uint8_t>& want);

}  // namespace zinf::comm::test
