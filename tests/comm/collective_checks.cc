#include "collective_checks.h"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <thread>

#include "zinf/comm/local.h"
#include "zinf/core/dtype.h"

namespace zinf::comm::test {
namespace {

class HostMemory final : public TestMemory {
 public:
  void* alloc(size_t bytes) override { return std::malloc(std::max<size_t>(bytes, 1)); }
  void release(void* ptr) override { std::free(ptr); }
  void upload(void* dst, const void* src, size_t bytes) override {
    if (bytes) std::memcpy(dst, src, bytes);
  }
  void download(void* dst, const void* src, size_t bytes) override {
    if (bytes) std::memcpy(dst, src, bytes);
  }
};

uint64_t splitmix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

float element_to_f32(const std::vector<uint8_t>& bytes, size_t i, DType dtype) {
  if (dtype == DType::kF32) {
    float f;
    std::memcpy(&f, bytes.data() + 4 * i, 4);
    return f;
  }
  uint16_t h;
  std::memcpy(&h, bytes.data() + 2 * i, 2);
  return dtype == DType::kBF16 ? bf16_to_f32(h) : f16_to_f32(h);
}

void f32_to_element(std::vector<uint8_t>& bytes, size_t i, DType dtype, float value) {
  if (dtype == DType::kF32) {
    std::memcpy(bytes.data() + 4 * i, &value, 4);
    return;
  }
  uint16_t h = dtype == DType::kBF16 ? f32_to_bf16(value) : f32_to_f16(value);
  std::memcpy(bytes.data() + 2 * i, &h, 2);
}

// A buffer in the backend's memory, freed on scope exit.
class Buffer {
 public:
  Buffer(TestMemory& memory, size_t bytes) : memory_(memory), bytes_(bytes) {
    ptr_ = memory.alloc(bytes);
  }
  ~Buffer() { memory_.release(ptr_); }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;

  void* get() const { return ptr_; }
  std::byte* at(size_t byte_offset) const { return static_cast<std::byte*>(ptr_) + byte_offset; }
  void upload(const std::vector<uint8_t>& data, size_t byte_offset = 0) {
    memory_.upload(at(byte_offset), data.data(), data.size());
  }
  std::vector<uint8_t> download(size_t byte_offset, size_t bytes) const {
    std::vector<uint8_t> out(bytes);
    memory_.download(out.data(), at(byte_offset), bytes);
    return out;
  }

 private:
  TestMemory& memory_;
  size_t bytes_;
  void* ptr_;
};

std::vector<size_t> prefix(const std::vector<size_t>& counts) {
  std::vector<size_t> d(counts.size() + 1, 0);
  for (size_t i = 0; i < counts.size(); ++i) d[i + 1] = d[i] + counts[i];
  return d;
}

// Uneven per-rank counts around `size`: some ranks get none, none agree with the even split.
std::vector<size_t> uneven_counts(size_t size, int world) {
  std::vector<size_t> counts(world);
  for (int j = 0; j < world; ++j) counts[j] = j % 2 == 1 ? 0 : size / (j + 1) + j;
  return counts;
}

OpCounters minus(const OpCounters& a, const OpCounters& b) {
  return OpCounters{.calls = a.calls - b.calls,
                    .volume_elements = a.volume_elements - b.volume_elements,
                    .bytes_in = a.bytes_in - b.bytes_in,
                    .bytes_out = a.bytes_out - b.bytes_out,
                    .bytes_sent = a.bytes_sent - b.bytes_sent,
                    .bytes_received = a.bytes_received - b.bytes_received};
}

std::string describe(const OpCounters& c) {
  return fmt::format("calls {} volume {} in {} out {} sent {} received {}", c.calls,
                     c.volume_elements, c.bytes_in, c.bytes_out, c.bytes_sent, c.bytes_received);
}

class Sweep {
 public:
  Sweep(Communicator& comm, const SweepOptions& options)
      : comm_(comm), options_(options), mem_(*options.memory) {}

  std::vector<std::string> run() {
    for (DType dtype : options_.dtypes) {
      for (size_t size : options_.sizes) {
        const int world = comm_.world_size();
        all_gather(dtype, std::vector<size_t>(world, size), "all_gather", false);
        all_gather(dtype, std::vector<size_t>(world, size), "all_gather in place", true);
        all_gather(dtype, even_partition(size, world), "all_gather_v even split", false);
        all_gather(dtype, uneven_counts(size, world), "all_gather_v uneven", true);
        for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg}) {
          reduce_scatter(dtype, op, std::vector<size_t>(world, size), "reduce_scatter", false);
          reduce_scatter(dtype, op, std::vector<size_t>(world, size), "reduce_scatter in place",
                         true);
          reduce_scatter(dtype, op, even_partition(size, world), "reduce_scatter_v even split",
                         false);
          reduce_scatter(dtype, op, uneven_counts(size, world), "reduce_scatter_v uneven", true);
          all_reduce(dtype, op, size, false);
          all_reduce(dtype, op, size, true);
          all_reduce_is_reduce_scatter_then_all_gather(dtype, op, size);
        }
        for (int root = 0; root < world; ++root) broadcast(dtype, size, root);
      }
    }
    for (size_t bytes : options_.sizes) {
      all_gather_bytes(bytes, false);
      all_gather_bytes(bytes, true);
      for (int root = 0; root < comm_.world_size(); ++root) broadcast_bytes(bytes, root);
    }
    barrier();
    return std::move(failures_);
  }

 private:
  void fail(std::string message) {
    if (failures_.size() < 25) {
      failures_.push_back(
          fmt::format("rank {} of {}: {}", comm_.rank(), comm_.world_size(), std::move(message)));
    }
  }

  uint64_t salt(std::string_view name, DType dtype, size_t size, int extra = 0) {
    uint64_t h = splitmix(size * 131 + static_cast<uint64_t>(dtype) * 7 + extra);
    for (char ch : name) h = splitmix(h ^ static_cast<uint8_t>(ch));
    return h;
  }

  // Waits for `work`, then checks the op's counters moved by exactly the expected amounts.
  bool finish(const Work& work, CollectiveOp op, const std::vector<size_t>& counts, int root,
              DType dtype, const OpCounters& before, const std::string& what) {
    return finish(work, op, counts, root, dtype_size(dtype), before, what);
  }
  bool finish(const Work& work, CollectiveOp op, const std::vector<size_t>& counts, int root,
              size_t element_bytes, const OpCounters& before, const std::string& what) {
    Status status = work.wait();
    if (!status.is_ok()) {
      fail(fmt::format("{}: {}", what, status.to_string()));
      return false;
    }
    OpCounters got = minus(comm_.counters()[op], before);
    OpCounters want =
        expected_counters(op, counts, root, comm_.rank(), comm_.world_size(), element_bytes);
    if (!(got == want)) {
      fail(fmt::format("{}: counters {} != expected {}", what, describe(got), describe(want)));
    }
    return true;
  }

  void compare(const std::string& what, const std::vector<uint8_t>& got,
               const std::vector<uint8_t>& want, DType dtype) {
    std::string diff = first_difference(got, want, dtype);
    if (!diff.empty()) fail(fmt::format("{}: {}", what, diff));
  }

  void all_gather(DType dtype, const std::vector<size_t>& counts, const char* name, bool in_place) {
    const int world = comm_.world_size(), me = comm_.rank();
    const size_t e = dtype_size(dtype);
    const std::vector<size_t> displs = prefix(counts);
    const size_t total = displs[world];
    const std::string what =
        fmt::format("{} {} counts[me]={} total={}", name, dtype_name(dtype), counts[me], total);
    const uint64_t s = salt(name, dtype, total);
    std::vector<uint8_t> want;
    for (int j = 0; j < world; ++j) {
      std::vector<uint8_t> in = test_input(j, counts[j], dtype, s);
      want.insert(want.end(), in.begin(), in.end());
    }
    Buffer recv(mem_, total * e);
    Buffer send(mem_, counts[me] * e);
    const void* source = send.get();
    if (in_place) {
      recv.upload(test_input(me, counts[me], dtype, s), displs[me] * e);
      source = recv.at(displs[me] * e);
    } else {
      send.upload(test_input(me, counts[me], dtype, s));
    }
    OpCounters before = comm_.counters()[CollectiveOp::kAllGather];
    bool equal =
        std::all_of(counts.begin(), counts.end(), [&](size_t n) { return n == counts[0]; });
    Work work = equal ? comm_.all_gather(source, recv.get(), counts[0], dtype)
                      : comm_.all_gather_v(source, recv.get(), counts, dtype);
    if (!finish(work, CollectiveOp::kAllGather, counts, 0, dtype, before, what)) return;
    compare(what, recv.download(0, total * e), want, dtype);
  }

  void reduce_scatter(DType dtype, ReduceOp op, const std::vector<size_t>& counts, const char* name,
                      bool in_place) {
    const int world = comm_.world_size(), me = comm_.rank();
    const size_t e = dtype_size(dtype);
    const std::vector<size_t> displs = prefix(counts);
    const size_t total = displs[world];
    const std::string what = fmt::format("{} {} {} counts[me]={} total={}", name, dtype_name(dtype),
                                         reduce_op_name(op), counts[me], total);
    const uint64_t s = salt(name, dtype, total, static_cast<int>(op));
    std::vector<std::vector<uint8_t>> inputs;
    for (int j = 0; j < world; ++j) inputs.push_back(test_input(j, total, dtype, s));
    std::vector<uint8_t> want = reference_reduce(inputs, displs[me], counts[me], dtype, op);
    Buffer send(mem_, total * e);
    Buffer recv(mem_, counts[me] * e);
    send.upload(inputs[me]);
    void* out = in_place ? send.at(displs[me] * e) : recv.get();
    OpCounters before = comm_.counters()[CollectiveOp::kReduceScatter];
    bool equal =
        std::all_of(counts.begin(), counts.end(), [&](size_t n) { return n == counts[0]; });
    Work work = equal ? comm_.reduce_scatter(send.get(), out, counts[0], dtype, op)
                      : comm_.reduce_scatter_v(send.get(), out, counts, dtype, op);
    if (!finish(work, CollectiveOp::kReduceScatter, counts, 0, dtype, before, what)) return;
    compare(
        what,
        in_place ? send.download(displs[me] * e, counts[me] * e) : recv.download(0, counts[me] * e),
        want, dtype);
  }

  void all_reduce(DType dtype, ReduceOp op, size_t size, bool in_place) {
    const int world = comm_.world_size(), me = comm_.rank();
    const size_t e = dtype_size(dtype);
    const std::string what = fmt::format("all_reduce{} {} {} count={}", in_place ? " in place" : "",
                                         dtype_name(dtype), reduce_op_name(op), size);
    const uint64_t s = salt("all_reduce", dtype, size, static_cast<int>(op));
    std::vector<std::vector<uint8_t>> inputs;
    for (int j = 0; j < world; ++j) inputs.push_back(test_input(j, size, dtype, s));
    std::vector<uint8_t> want = reference_reduce(inputs, 0, size, dtype, op);
    Buffer send(mem_, size * e);
    Buffer recv(mem_, size * e);
    send.upload(inputs[me]);
    void* out = in_place ? send.get() : recv.get();
    OpCounters before = comm_.counters()[CollectiveOp::kAllReduce];
    Work work = comm_.all_reduce(send.get(), out, size, dtype, op);
    if (!finish(work, CollectiveOp::kAllReduce, {size}, 0, dtype, before, what)) return;
    compare(what, (in_place ? send : recv).download(0, size * e), want, dtype);
  }

  // The contract, literally: all_reduce gives the bits of reduce_scatter_v over
  // even_partition followed by all_gather_v, issued back to back without waiting in between.
  void all_reduce_is_reduce_scatter_then_all_gather(DType dtype, ReduceOp op, size_t size) {
    const int world = comm_.world_size(), me = comm_.rank();
    const size_t e = dtype_size(dtype);
    const std::string what = fmt::format("all_reduce == reduce_scatter + all_gather {} {} count={}",
                                         dtype_name(dtype), reduce_op_name(op), size);
    std::vector<uint8_t> in = test_input(me, size, dtype, salt("ar=rs+ag", dtype, size));
    std::vector<size_t> chunks = even_partition(size, world);
    Buffer send(mem_, size * e), reduced(mem_, size * e), shard(mem_, chunks[me] * e),
        gathered(mem_, size * e);
    send.upload(in);
    Work a = comm_.all_reduce(send.get(), reduced.get(), size, dtype, op);
    Work b = comm_.reduce_scatter_v(send.get(), shard.get(), chunks, dtype, op);
    Work c = comm_.all_gather_v(shard.get(), gathered.get(), chunks, dtype);
    for (const Work* w : {&a, &b, &c}) {
      Status status = w->wait();
      if (!status.is_ok()) return fail(fmt::format("{}: {}", what, status.to_string()));
    }
    compare(what, gathered.download(0, size * e), reduced.download(0, size * e), dtype);
  }

  void broadcast(DType dtype, size_t size, int root) {
    const int me = comm_.rank();
    const size_t e = dtype_size(dtype);
    const std::string what =
        fmt::format("broadcast {} count={} root={}", dtype_name(dtype), size, root);
    const uint64_t s = salt("broadcast", dtype, size, root);
    std::vector<uint8_t> want = test_input(root, size, dtype, s);
    Buffer buffer(mem_, size * e);
    buffer.upload(me == root ? want : test_input(me, size, dtype, s + 1));
    OpCounters before = comm_.counters()[CollectiveOp::kBroadcast];
    Work work = comm_.broadcast(buffer.get(), size, dtype, root);
    if (!finish(work, CollectiveOp::kBroadcast, {size}, root, dtype, before, what)) return;
    compare(what, buffer.download(0, size * e), want, dtype);
  }

  // Raw bytes: every byte of every rank's contribution lands where the contract puts it, and the
  // counters count one element per byte.
  void all_gather_bytes(size_t bytes, bool in_place) {
    const int world = comm_.world_size(), me = comm_.rank();
    const std::string what =
        fmt::format("all_gather_bytes{} bytes={}", in_place ? " in place" : "", bytes);
    const uint64_t s = salt("all_gather_bytes", DType::kF32, bytes, in_place);
    std::vector<uint8_t> want;
    for (int j = 0; j < world; ++j) {
      std::vector<uint8_t> in = test_bytes(j, bytes, s);
      want.insert(want.end(), in.begin(), in.end());
    }
    Buffer recv(mem_, world * bytes);
    Buffer send(mem_, bytes);
    const void* source = send.get();
    if (in_place) {
      recv.upload(test_bytes(me, bytes, s), me * bytes);
      source = recv.at(me * bytes);
    } else {
      send.upload(test_bytes(me, bytes, s));
    }
    OpCounters before = comm_.counters()[CollectiveOp::kAllGather];
    Work work = comm_.all_gather_bytes(source, recv.get(), bytes);
    const std::vector<size_t> counts(world, bytes);
    if (!finish(work, CollectiveOp::kAllGather, counts, 0, 1, before, what)) return;
    compare_bytes(what, recv.download(0, world * bytes), want);
  }

  void broadcast_bytes(size_t bytes, int root) {
    const int me = comm_.rank();
    const std::string what = fmt::format("broadcast_bytes bytes={} root={}", bytes, root);
    const uint64_t s = salt("broadcast_bytes", DType::kF32, bytes, root);
    std::vector<uint8_t> want = test_bytes(root, bytes, s);
    Buffer buffer(mem_, bytes);
    buffer.upload(me == root ? want : test_bytes(me, bytes, s + 1));
    OpCounters before = comm_.counters()[CollectiveOp::kBroadcast];
    Work work = comm_.broadcast_bytes(buffer.get(), bytes, root);
    if (!finish(work, CollectiveOp::kBroadcast, {bytes}, root, 1, before, what)) return;
    compare_bytes(what, buffer.download(0, bytes), want);
  }

  void compare_bytes(const std::string& what, const std::vector<uint8_t>& got,
                     const std::vector<uint8_t>& want) {
    std::string diff = first_byte_difference(got, want);
    if (!diff.empty()) fail(fmt::format("{}: {}", what, diff));
  }

  void barrier() {
    OpCounters before = comm_.counters()[CollectiveOp::kBarrier];
    finish(comm_.barrier(), CollectiveOp::kBarrier, {}, 0, DType::kF32, before, "barrier");
  }

  Communicator& comm_;
  const SweepOptions& options_;
  TestMemory& mem_;
  std::vector<std::string> failures_;
};

}  // namespace

TestMemory& host_memory() {
  static HostMemory memory;
  return memory;
}

std::vector<uint8_t> test_input(int rank, size_t count, DType dtype, uint64_t salt) {
  std::vector<uint8_t> out(count * dtype_size(dtype));
  for (size_t i = 0; i < count; ++i) {
    uint64_t h = splitmix(salt ^ splitmix(static_cast<uint64_t>(rank) << 40 ^ i));
    uint32_t mantissa = static_cast<uint32_t>(h) & 0x7fffffu;
    // Wide enough that fp32 sums of a few elements round (an exact sum hides the order): fp32
    // spans 2^-6 .. 2^6 with 24-bit mantissas; bf16 (8 bits) 2^-16 .. 2^16; fp16 (11 bits)
    // 2^-14 .. 2^10, clear of its subnormals and of overflow when 4 ranks add up.
    const int low = dtype == DType::kF32 ? -6 : dtype == DType::kBF16 ? -16 : -14;
    const int high = dtype == DType::kF32 ? 6 : dtype == DType::kBF16 ? 16 : 10;
    uint32_t exponent =
        static_cast<uint32_t>(127 + low + static_cast<int>((h >> 32) % (high - low + 1)));
    uint32_t sign = static_cast<uint32_t>(h >> 63) << 31;
    f32_to_element(out, i, dtype, bits_f32(sign | exponent << 23 | mantissa));
  }
  return out;
}

std::vector<uint8_t> reference_reduce(const std::vector<std::vector<uint8_t>>& inputs,
                                      size_t offset, size_t count, DType dtype, ReduceOp op) {
  const int world = static_cast<int>(inputs.size());
  std::vector<uint8_t> out(count * dtype_size(dtype));
  for (size_t i = 0; i < count; ++i) {
    float acc = element_to_f32(inputs[0], offset + i, dtype);
    for (int j = 1; j < world; ++j) acc += element_to_f32(inputs[j], offset + i, dtype);
    if (op == ReduceOp::kAvg) acc *= 1.0f / static_cast<float>(world);
    f32_to_element(out, i, dtype, acc);
  }
  return out;
}

std::vector<uint8_t> test_bytes(int rank, size_t bytes, uint64_t salt) {
  std::vector<uint8_t> out(bytes);
  for (size_t i = 0; i < bytes; ++i) {
    out[i] = static_cast<uint8_t>(splitmix(salt ^ splitmix(static_cast<uint64_t>(rank) << 40 ^ i)));
  }
  return out;
}

OpCounters expected_counters(CollectiveOp op, const std::vector<size_t>& counts, int root, int rank,
                             int world, DType dtype) {
  return expected_counters(op, counts, root, rank, world, dtype_size(dtype));
}

OpCounters expected_counters(CollectiveOp op, const std::vector<size_t>& counts, int root, int rank,
                             int world, size_t element_bytes) {
  const uint64_t e = element_bytes;
  const uint64_t total = std::accumulate(counts.begin(), counts.end(), uint64_t{0});
  const int next = (rank + 1) % world, prev = (rank + world - 1) % world;
  OpCounters c{.calls = 1};
  switch (op) {
    case CollectiveOp::kAllGather:
      c.volume_elements = total;
      c.bytes_in = counts[rank] * e;
      c.bytes_out = total * e;
      if (world > 1) {
        c.bytes_sent = (total - counts[next]) * e;
        c.bytes_received = (total - counts[rank]) * e;
      }
      break;
    case CollectiveOp::kReduceScatter:
      c.volume_elements = total;
      c.bytes_in = total * e;
      c.bytes_out = counts[rank] * e;
      if (world > 1) {
        c.bytes_sent = (total - counts[rank]) * e;
        c.bytes_received = (total - counts[prev]) * e;
      }
      break;
    case CollectiveOp::kAllReduce: {
      c.volume_elements = 2 * total;
      c.bytes_in = c.bytes_out = total * e;
      if (world > 1) {
        std::vector<size_t> p(world, total / world);
        for (uint64_t j = 0; j < total % world; ++j) ++p[j];
        c.bytes_sent = (total - p[rank]) * e + (total - p[next]) * e;
        c.bytes_received = (total - p[prev]) * e + (total - p[rank]) * e;
      }
      break;
    }
    case CollectiveOp::kBroadcast:
      c.volume_elements = total;
      c.bytes_in = rank == root ? total * e : 0;
      c.bytes_out = rank == root ? 0 : total * e;
      if (world > 1) {
        c.bytes_sent = rank == (root + world - 1) % world ? 0 : total * e;
        c.bytes_received = rank == root ? 0 : total * e;
      }
      break;
    case CollectiveOp::kBarrier:
      break;
  }
  return c;
}

std::string first_difference(const std::vector<uint8_t>& got, const std::vector<uint8_t>& want,
                             DType dtype) {
  if (got.size() != want.size()) {
    return fmt::format("size {} bytes, expected {}", got.size(), want.size());
  }
  const size_t e = dtype_size(dtype);
  for (size_t i = 0; i < got.size() / e; ++i) {
    if (std::memcmp(got.data() + i * e, want.data() + i * e, e) != 0) {
      size_t mismatches = 0;
      for (size_t k = i; k < got.size() / e; ++k) {
        mismatches += std::memcmp(got.data() + k * e, want.data() + k * e, e) != 0;
      }
      return fmt::format("element {} is {:.9g}, expected {:.9g} ({} elements differ)", i,
                         element_to_f32(got, i, dtype), element_to_f32(want, i, dtype), mismatches);
    }
  }
  return "";
}

std::string first_byte_difference(const std::vector<uint8_t>& got,
                                  const std::vector<uint8_t>& want) {
  if (got.size() != want.size()) {
    return fmt::format("size {} bytes, expected {}", got.size(), want.size());
  }
  for (size_t i = 0; i < got.size(); ++i) {
    if (got[i] != want[i]) {
      size_t mismatches = 0;
      for (size_t k = i; k < got.size(); ++k) mismatches += got[k] != want[k];
      return fmt::format("byte {} is {:#04x}, expected {:#04x} ({} bytes differ)", i, got[i],
                         want[i], mismatches);
    }
  }
  return "";
}

std::vector<std::string> run_sweep(Communicator& comm, const SweepOptions& options) {
  return Sweep(comm, options).run();
}

std::vector<std::string> compare_with_local_group(Communicator& comm) {
  const int world = comm.world_size(), me = comm.rank();
  constexpr size_t kCount = 10007;
  std::vector<std::string> failures;
  auto local = make_local_group(world).value();
  for (DType dtype : {DType::kF32, DType::kBF16, DType::kF16}) {
    std::vector<std::vector<uint8_t>> inputs;
    for (int j = 0; j < world; ++j) inputs.push_back(test_input(j, kCount, dtype, 7));
    std::vector<std::vector<uint8_t>> local_out(world, std::vector<uint8_t>(inputs[0].size()));
    std::vector<Status> local_status(world);
    std::vector<std::thread> threads;
    for (int j = 0; j < world; ++j) {
      threads.emplace_back([&, j] {
        local_status[j] =
            local[j]
                ->all_reduce(inputs[j].data(), local_out[j].data(), kCount, dtype, ReduceOp::kAvg)
                .wait();
      });
    }
    for (auto& t : threads) t.join();
    for (const Status& s : local_status) {
      if (!s.is_ok()) failures.push_back("local group: " + s.to_string());
    }
    std::vector<uint8_t> out(inputs[me].size());
    Status s = comm.all_reduce(inputs[me].data(), out.data(), kCount, dtype, ReduceOp::kAvg).wait();
    if (!s.is_ok()) {
      failures.push_back(s.to_string());
    } else if (std::string d = first_difference(out, local_out[me], dtype); !d.empty()) {
      failures.push_back(fmt::format("{}: {}", dtype_name(dtype), d));
    }
  }
  return failures;
}

namespace {
class RankFailurePrinter : public ::testing::EmptyTestEventListener {
 public:
  explicit RankFailurePrinter(int rank) : rank_(rank) {}
  void OnTestPartResult(const ::testing::TestPartResult& result) override {
    if (result.failed()) {
      std::fprintf(stderr, "[rank %d] %s:%d: %s\n", rank_, result.file_name(), result.line_number(),
                   result.summary());
    }
  }

 private:
  int rank_;
};
}  // namespace

void print_only_failures_unless_rank0(int rank) {
  if (rank == 0) return;
  auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
  delete listeners.Release(listeners.default_result_printer());
  listeners.Append(new RankFailurePrinter(rank));
}

}  // namespace zinf::comm::test
