// The local backend: the full collective suite at world sizes 1-4, exact counters, and every
// fault (mismatched shapes, a rank that never arrives, a rank that leaves) ending in a clear
// error on every rank within the timeout.
#include "zinf/comm/local.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <thread>

#include "collective_checks.h"

namespace zinf::comm {
namespace {

using namespace std::chrono_literals;
using ::testing::HasSubstr;

std::vector<std::unique_ptr<Communicator>> group(int world,
                                                 std::chrono::milliseconds timeout = 20s) {
  auto comms = make_local_group(world, {.timeout = timeout});
  ZINF_CHECK(comms.is_ok(), "{}", comms.status().to_string());
  return std::move(comms).value();
}

// Runs fn(rank) on one thread per rank and returns what each returned.
template <typename Fn>
auto on_every_rank(int world, Fn fn) {
  using R = decltype(fn(0));
  std::vector<R> results(world);
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) threads.emplace_back([&, r] { results[r] = fn(r); });
  for (auto& t : threads) t.join();
  return results;
}

class LocalSweep : public ::testing::TestWithParam<std::tuple<int, DType>> {};

TEST_P(LocalSweep, EveryOperationMatchesTheRankOrderReferenceBitForBit) {
  auto [world, dtype] = GetParam();
  auto comms = group(world);
  test::SweepOptions options;
  options.dtypes = {dtype};
  auto failures = on_every_rank(world, [&](int r) { return test::run_sweep(*comms[r], options); });
  for (int r = 0; r < world; ++r) {
    EXPECT_TRUE(failures[r].empty()) << ::testing::PrintToString(failures[r]);
  }
}

INSTANTIATE_TEST_SUITE_P(WorldsAndDtypes, LocalSweep,
                         ::testing::Combine(::testing::Values(1, 2, 3, 4),
                                            ::testing::Values(DType::kF32, DType::kBF16,
                                                              DType::kF16)),
                         [](const auto& info) {
                           return fmt::format("world{}_{}", std::get<0>(info.param),
                                              dtype_name(std::get<1>(info.param)));
                         });

TEST(LocalReference, InputsMakeTheSummationOrderVisible) {
  // If the suite's inputs could not tell one summation order from another, "bit-identical to
  // the rank-order reference" would prove nothing.
  for (DType dtype : {DType::kF32, DType::kBF16, DType::kF16}) {
    std::vector<std::vector<uint8_t>> inputs;
    // (The final rounding to fp16 hides most fp32 differences: it takes many elements.)
    for (int r = 0; r < 4; ++r) inputs.push_back(test::test_input(r, 70001, dtype, 42));
    std::vector<std::vector<uint8_t>> reversed(inputs.rbegin(), inputs.rend());
    auto forward = test::reference_reduce(inputs, 0, 70001, dtype, ReduceOp::kSum);
    auto backward = test::reference_reduce(reversed, 0, 70001, dtype, ReduceOp::kSum);
    EXPECT_NE(test::first_difference(forward, backward, dtype), "") << dtype_name(dtype);
  }
}

TEST(LocalCounters, HandCountedExamples) {
  // 4 ranks, fp32, 10 elements per rank: a 40-element full buffer.
  auto comms = group(4);
  std::vector<std::vector<float>> send(4, std::vector<float>(40, 1.0f)),
      recv(4, std::vector<float>(40));
  on_every_rank(4, [&](int r) {
    Communicator& c = *comms[r];
    EXPECT_TRUE(c.all_gather(send[r].data(), recv[r].data(), 10, DType::kF32).wait().is_ok());
    EXPECT_TRUE(c.reduce_scatter(send[r].data(), recv[r].data(), 10, DType::kF32, ReduceOp::kSum)
                    .wait()
                    .is_ok());
    EXPECT_TRUE(c.all_reduce(send[r].data(), recv[r].data(), 40, DType::kF32, ReduceOp::kAvg)
                    .wait()
                    .is_ok());
    EXPECT_TRUE(c.broadcast(recv[r].data(), 40, DType::kF32, 2).wait().is_ok());
    EXPECT_TRUE(c.barrier().wait().is_ok());
    return 0;
  });
  for (int r = 0; r < 4; ++r) {
    CommCounters c = comms[r]->counters();
    // all_gather: full buffer 40 elements; hands in 10 x 4 B, gets 160 B; a ring moves 3 of 4
    // chunks in and out: 120 B each way.
    EXPECT_EQ(c[CollectiveOp::kAllGather], (OpCounters{.calls = 1,
                                                       .volume_elements = 40,
                                                       .bytes_in = 40,
                                                       .bytes_out = 160,
                                                       .bytes_sent = 120,
                                                       .bytes_received = 120}));
    EXPECT_EQ(c[CollectiveOp::kReduceScatter], (OpCounters{.calls = 1,
                                                           .volume_elements = 40,
                                                           .bytes_in = 160,
                                                           .bytes_out = 40,
                                                           .bytes_sent = 120,
                                                           .bytes_received = 120}));
    // all_reduce of 40 elements: volume 2P = 80; twice the ring traffic.
    EXPECT_EQ(c[CollectiveOp::kAllReduce], (OpCounters{.calls = 1,
                                                       .volume_elements = 80,
                                                       .bytes_in = 160,
                                                       .bytes_out = 160,
                                                       .bytes_sent = 240,
                                                       .bytes_received = 240}));
    // broadcast from rank 2 along the chain 2 -> 3 -> 0 -> 1: rank 1 sends nothing, rank 2
    // receives nothing.
    EXPECT_EQ(c[CollectiveOp::kBroadcast], (OpCounters{.calls = 1,
                                                       .volume_elements = 40,
                                                       .bytes_in = r == 2 ? 160u : 0u,
                                                       .bytes_out = r == 2 ? 0u : 160u,
                                                       .bytes_sent = r == 1 ? 0u : 160u,
                                                       .bytes_received = r == 2 ? 0u : 160u}));
    EXPECT_EQ(c[CollectiveOp::kBarrier], (OpCounters{.calls = 1}));
    EXPECT_EQ(c.total().volume_elements, 40u + 40u + 80u + 40u);
    comms[r]->reset_counters();
    EXPECT_EQ(comms[r]->counters().total(), OpCounters{});
  }
}

TEST(LocalCounters, ZeroStageVolumesPerStep) {
  // The engine's check: a step of stages 0-2 moves 2P per rank (reduce-scatter + all-gather, or
  // one all-reduce), stage 3 moves 3P (two all-gathers and a reduce-scatter). P = 1003 elements,
  // padded by the caller to 1004 so every rank's shard is whole.
  constexpr size_t kP = 1004;
  auto comms = group(4);
  on_every_rank(4, [&](int r) {
    Communicator& c = *comms[r];
    std::vector<uint16_t> full(kP), grads(kP), shard(kP / 4);
    EXPECT_TRUE(
        c.all_reduce(grads.data(), grads.data(), kP, DType::kBF16, ReduceOp::kAvg).wait().is_ok());
    EXPECT_EQ(c.counters().total().volume_elements, 2 * kP);
    c.reset_counters();
    c.reduce_scatter(grads.data(), shard.data(), kP / 4, DType::kBF16, ReduceOp::kAvg);
    EXPECT_TRUE(c.all_gather(shard.data(), full.data(), kP / 4, DType::kBF16).wait().is_ok());
    EXPECT_EQ(c.counters().total().volume_elements, 2 * kP);
    c.reset_counters();
    c.all_gather(shard.data(), full.data(), kP / 4, DType::kBF16);
    c.all_gather(shard.data(), full.data(), kP / 4, DType::kBF16);
    EXPECT_TRUE(c.reduce_scatter(grads.data(), shard.data(), kP / 4, DType::kBF16, ReduceOp::kAvg)
                    .wait()
                    .is_ok());
    EXPECT_EQ(c.counters().total().volume_elements, 3 * kP);
    return 0;
  });
}

TEST(LocalCounters, TrafficFormulaMatchesTheTestsIndependentCopy) {
  for (int world = 1; world <= 5; ++world) {
    for (int rank = 0; rank < world; ++rank) {
      for (std::vector<size_t> counts : {std::vector<size_t>(world, 7), even_partition(23, world),
                                         std::vector<size_t>(world, 0)}) {
        counts[rank] += rank;  // uneven
        for (CollectiveOp op : {CollectiveOp::kAllGather, CollectiveOp::kReduceScatter}) {
          Collective c{.op = op, .dtype = DType::kBF16, .counts = counts};
          Traffic t = collective_traffic(c, rank, world);
          OpCounters want = test::expected_counters(op, counts, 0, rank, world, DType::kBF16);
          EXPECT_EQ((OpCounters{.calls = 1,
                                .volume_elements = t.volume_elements,
                                .bytes_in = t.bytes_in,
                                .bytes_out = t.bytes_out,
                                .bytes_sent = t.bytes_sent,
                                .bytes_received = t.bytes_received}),
                    want);
        }
      }
    }
  }
}

TEST(LocalFaults, WorldSizeZeroIsRefused) {
  auto comms = make_local_group(0);
  ASSERT_FALSE(comms.is_ok());
  EXPECT_EQ(comms.status().code(), ErrorCode::kInvalidArgument);
  EXPECT_THAT(comms.status().message(), HasSubstr("at least 1"));
}

TEST(LocalFaults, MismatchedCountsFailOnEveryRankAndTheGroupGoesOn) {
  auto comms = group(3);
  auto statuses = on_every_rank(3, [&](int r) {
    std::vector<float> send(12), recv(48);
    size_t count = r == 1 ? 12 : 10;
    return comms[r]->all_gather(send.data(), recv.data(), count, DType::kF32).wait();
  });
  for (const Status& s : statuses) {
    EXPECT_EQ(s.code(), ErrorCode::kInvalidArgument) << s.to_string();
    EXPECT_THAT(s.message(), HasSubstr("ranks disagree on the element counts"));
    EXPECT_THAT(s.message(), HasSubstr("10 of 30 elements on ranks 0, 2"));
    EXPECT_THAT(s.message(), HasSubstr("12 of 36 elements on rank 1"));
  }
  // Every rank got the verdict at the same meeting: the group is still in step.
  auto after = on_every_rank(3, [&](int r) { return comms[r]->barrier().wait(); });
  for (const Status& s : after) EXPECT_TRUE(s.is_ok()) << s.to_string();
  EXPECT_EQ(comms[0]->counters()[CollectiveOp::kAllGather].calls, 0u);
}

TEST(LocalFaults, MismatchedOperationsDtypesRootsAndReductions) {
  auto comms = group(2);
  std::vector<std::vector<float>> buf(2, std::vector<float>(8));
  auto ops = on_every_rank(2, [&](int r) {
    return r == 0 ? comms[r]->barrier().wait()
                  : comms[r]->broadcast(buf[r].data(), 8, DType::kF32, 0).wait();
  });
  EXPECT_THAT(ops[1].message(), HasSubstr("barrier on rank 0; broadcast on rank 1"));
  auto dtypes = on_every_rank(2, [&](int r) {
    return comms[r]->broadcast(buf[r].data(), 4, r ? DType::kBF16 : DType::kF32, 0).wait();
  });
  EXPECT_THAT(dtypes[0].message(), HasSubstr("ranks disagree on the dtype"));
  // Raw bytes are an element type of their own: the same 16 bytes as 4 fp32 elements disagree.
  auto bytes = on_every_rank(2, [&](int r) {
    return r ? comms[r]->broadcast_bytes(buf[r].data(), 16, 0).wait()
             : comms[r]->broadcast(buf[r].data(), 4, DType::kF32, 0).wait();
  });
  for (const Status& s : bytes) {
    EXPECT_THAT(s.message(), HasSubstr("fp32 on rank 0; raw bytes on rank 1")) << s.to_string();
  }
  auto roots = on_every_rank(
      2, [&](int r) { return comms[r]->broadcast(buf[r].data(), 4, DType::kF32, r).wait(); });
  EXPECT_THAT(roots[0].message(), HasSubstr("root 0 on rank 0; root 1 on rank 1"));
  auto reductions = on_every_rank(2, [&](int r) {
    return comms[r]
        ->all_reduce(buf[r].data(), buf[r].data(), 8, DType::kF32,
                     r ? ReduceOp::kAvg : ReduceOp::kSum)
        .wait();
  });
  EXPECT_THAT(reductions[1].message(), HasSubstr("sum on rank 0; avg on rank 1"));
}

TEST(LocalFaults, InvalidArgumentsOnOneRankFailEveryRank) {
  auto comms = group(3);
  auto statuses = on_every_rank(3, [&](int r) {
    std::vector<float> send(4), recv(12);
    return comms[r]->all_gather(r == 2 ? nullptr : send.data(), recv.data(), 4, DType::kF32).wait();
  });
  for (const Status& s : statuses) {
    EXPECT_EQ(s.code(), ErrorCode::kInvalidArgument);
    EXPECT_THAT(s.message(), HasSubstr("rank 2 passed invalid arguments: send buffer is null"));
  }
  auto wrong_counts = on_every_rank(3, [&](int r) {
    std::vector<size_t> counts(r == 0 ? 2 : 3, 1);
    std::vector<float> send(1), recv(3);
    return comms[r]->all_gather_v(send.data(), recv.data(), counts, DType::kF32).wait();
  });
  EXPECT_THAT(wrong_counts[1].message(), HasSubstr("counts has 2 entries for a world of 3"));
  // Overlap that is not the in-place layout.
  auto overlap = on_every_rank(3, [&](int r) {
    std::vector<float> buf(12);
    return comms[r]->all_gather(buf.data() + 1, buf.data(), 4, DType::kF32).wait();
  });
  EXPECT_THAT(overlap[0].message(), HasSubstr("overlap"));
}

TEST(LocalFaults, ARankThatNeverArrivesIsNamedWithinTheTimeout) {
  auto comms = group(3, 300ms);
  auto start = std::chrono::steady_clock::now();
  // Ranks 0 and 1 meet at a barrier; rank 2 never comes.
  auto statuses = on_every_rank(2, [&](int r) { return comms[r]->barrier().wait(); });
  auto elapsed = std::chrono::steady_clock::now() - start;
  EXPECT_LT(elapsed, 5s);
  for (const Status& s : statuses) {
    EXPECT_EQ(s.code(), ErrorCode::kTimeout) << s.to_string();
    EXPECT_THAT(s.message(), HasSubstr("rank 2 did not arrive within 0.3 s"));
  }
  // The group is broken for good: the latecomer fails at once with the same error.
  Status late = comms[2]->barrier().wait();
  EXPECT_EQ(late.code(), ErrorCode::kTimeout);
  EXPECT_THAT(late.message(), HasSubstr("rank 2 did not arrive"));
}

TEST(LocalFaults, ADestroyedRankFailsItsPeersInsteadOfHangingThem) {
  auto comms = group(2, 60s);
  Work waiting = comms[0]->barrier();
  comms[1].reset();
  Status s = waiting.wait();
  EXPECT_EQ(s.code(), ErrorCode::kUnavailable);
  EXPECT_THAT(s.message(), HasSubstr("rank 1 left the local group"));
}

TEST(LocalFaults, AnAbortedRankWakesItsPeersCollectiveAtOnceNamingItAndItsReason) {
  // A 60 s timeout: without the abort the peers would wait for all of it.
  auto comms = group(3, 60s);
  std::vector<float> send(8, 1.0f), recv0(8), recv2(8);
  Work w0 = comms[0]->all_reduce(send.data(), recv0.data(), 8, DType::kF32, ReduceOp::kSum);
  Work w2 = comms[2]->all_reduce(send.data(), recv2.data(), 8, DType::kF32, ReduceOp::kSum);
  std::this_thread::sleep_for(50ms);  // both are waiting for rank 1 now
  EXPECT_FALSE(w0.ready());
  auto start = std::chrono::steady_clock::now();
  comms[1]->abort(make_error(ErrorCode::kIo, "write of 4096 bytes at offset 0 of swap-0.bin"));
  for (const Work* w : {&w0, &w2}) {
    Status s = w->wait();
    EXPECT_EQ(s.code(), ErrorCode::kUnavailable) << s.to_string();
    EXPECT_THAT(s.message(), HasSubstr("rank 1 failed: write of 4096 bytes at offset 0 of "
                                       "swap-0.bin; the local group is aborted"));
  }
  EXPECT_LT(std::chrono::steady_clock::now() - start, 2s);
  // The aborted rank's own operations fail without waiting; so do the peers' later ones.
  Status own = comms[1]->barrier().wait();
  EXPECT_EQ(own.code(), ErrorCode::kCancelled) << own.to_string();
  EXPECT_THAT(own.message(), HasSubstr("rank 1 aborted its local communicator: write of 4096"));
  EXPECT_TRUE(comms[1]->aborted());
  EXPECT_FALSE(comms[0]->aborted());
  Status later = comms[2]->barrier().wait();
  EXPECT_EQ(later.code(), ErrorCode::kUnavailable);
  EXPECT_THAT(later.message(), HasSubstr("rank 1 failed"));
}

TEST(LocalFaults, AnAbortWakesTheAbortingRanksOwnOperationInFlight) {
  auto comms = group(3, 60s);
  Work mine = comms[1]->barrier();  // waits for ranks 0 and 2, which never come
  std::this_thread::sleep_for(20ms);
  auto start = std::chrono::steady_clock::now();
  comms[1]->abort(make_error(ErrorCode::kOutOfMemory, "refused"));
  Status s = mine.wait();
  EXPECT_LT(std::chrono::steady_clock::now() - start, 2s);
  EXPECT_FALSE(s.is_ok());
  EXPECT_THAT(s.message(), HasSubstr("rank 1 failed: refused"));
  // A second abort, by a peer that reacts to the first, keeps the cause for the others.
  comms[0]->abort(make_error(ErrorCode::kUnavailable, "an echo"));
  Status peer = comms[2]->barrier().wait();
  EXPECT_THAT(peer.message(), HasSubstr("rank 1 failed: refused"));
}

TEST(LocalWork, WaitForGivesUpWithoutCancelling) {
  auto comms = group(2, 5s);
  Work work = comms[0]->barrier();
  EXPECT_FALSE(work.ready());
  EXPECT_EQ(work.wait_for(20ms).code(), ErrorCode::kTimeout);
  EXPECT_TRUE(comms[1]->barrier().wait().is_ok());
  EXPECT_TRUE(work.wait().is_ok());
  EXPECT_TRUE(work.ready());
  EXPECT_TRUE(Work().wait().is_ok());
}

TEST(LocalWork, OperationsRunInIssueOrder) {
  // Each rank issues a chain of in-place sums without waiting: 1+2+3 = 6, then 18, 54, ... Any
  // reordering or overlap on a stream would change the result.
  auto comms = group(3);
  auto finals = on_every_rank(3, [&](int r) {
    float value = static_cast<float>(r + 1);
    std::vector<Work> works;
    for (int i = 0; i < 10; ++i) {
      works.push_back(comms[r]->all_reduce(&value, &value, 1, DType::kF32, ReduceOp::kSum));
    }
    for (auto& w : works) EXPECT_TRUE(w.wait().is_ok());
    return value;
  });
  for (float v : finals) EXPECT_EQ(v, 6.0f * 19683.0f);  // 6 * 3^9
}

}  // namespace
}  // namespace zinf::comm
