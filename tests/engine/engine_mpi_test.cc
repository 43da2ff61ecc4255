// Under `mpirun -np 2`: the engine on the MPI backend gives the same parameters, bit for bit, as
// the local backend at world size 2 (run by rank 0 in threads of its own process).
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <iterator>

#include "mlp.h"
#include "zinf/comm/mpi.h"

using namespace zinf;

namespace {

Result<std::vector<std::vector<float>>> train_mpi(const EngineSettings& s, comm::Communicator& c,
                                                  int steps, int micro) {
  testing::MlpShape shape;
  ZINF_ASSIGN_OR_RETURN(auto engine,
                        Engine::create(s, c, testing::mlp_units(shape), testing::mlp_init));
  const int gas = s.gradient_accumulation_steps, r = c.rank();
  for (int step = 0; step < steps; ++step) {
    for (int m = 0; m < gas; ++m) {
      std::vector<uint64_t> samples;
      for (int i = 0; i < micro; ++i)
        samples.push_back((static_cast<uint64_t>(r) * gas + m) * micro + i);
      ZINF_ASSIGN_OR_RETURN(float loss, testing::mlp_micro_step(*engine, shape, samples));
      (void)loss;
    }
    ZINF_RETURN_IF_ERROR(engine->step());
  }
  std::vector<std::vector<float>> params;
  for (size_t u = 0; u < engine->unit_count(); ++u) {
    ZINF_ASSIGN_OR_RETURN(auto p, engine->full_parameters(u));
    params.push_back(std::move(p));
  }
  return params;
}

}  // namespace

int main() {
  auto comm = comm::make_mpi_communicator();
  if (!comm.is_ok()) {
    std::fprintf(stderr, "%s\n", comm.status().to_string().c_str());
    return 1;
  }
  int rank = (*comm)->rank(), world = (*comm)->world_size();
  int failures = 0;
  // Stage 3 runs twice: with clipping (the scheduler gathers ahead and keeps units), and without
  // clipping and with the optimizer overlapped with the backward pass (variant 4).
  const int variants[] = {0, 2, 3, 4};
  for (int variant : variants) {
    const int stage = std::min(variant, 3);
    EngineSettings s;
    s.stage = stage;
    s.adam.lr = 0.01f;
    s.gradient_clipping = variant == 4 ? 0.0f : 0.5f;
    s.overlap_optimizer = variant == 4;
    s.gradient_accumulation_steps = 2;
    auto mpi = train_mpi(s, **comm, 3, 2);
    if (!mpi.is_ok()) {
      std::fprintf(stderr, "rank %d stage %d: %s\n", rank, stage, mpi.status().to_string().c_str());
      return 1;
    }
    if (rank == 0) {
      testing::RunResult local = testing::train_local(s, world, 3, 2);
      if (!local.status.is_ok()) {
        std::fprintf(stderr, "local run: %s\n", local.status.to_string().c_str());
        return 1;
      }
      bool same = local.params.size() == mpi->size();
      for (size_t u = 0; same && u < mpi->size(); ++u) {
        same = (*mpi)[u].size() == local.params[u].size() &&
               std::memcmp((*mpi)[u].data(), local.params[u].data(), (*mpi)[u].size() * 4) == 0;
      }
      std::printf("stage %d%s: MPI and local parameters %s\n", stage,
                  s.overlap_optimizer ? " (overlapped optimizer)" : "",
                  same ? "are bit-identical" : "DIFFER");
      failures += !same;
    }
  }
  // Every rank exits with rank 0's verdict (4 bytes copied as one fp32 element).
  if (Status s = (*comm)->broadcast(&failures, 1, DType::kF32, 0).wait(); !s.is_ok()) return 1;
  if (rank == 0) {
    std::printf("%d passed, %d failed\n", static_cast<int>(std::size(variants)) - failures,
                failures);
  }
  return failures == 0 ? 0 : 1;
}
