// Step agreement: a step happens on every rank or on none. Every rank goes through the same
// collectives whatever failed locally (a rank that failed sends a sentinel or a flag instead of
// its data), so no rank is left waiting in a collective the others skipped.
#pragma once

#include <vector>

#include "zinf/comm/communicator.h"
#include "zinf/core/status.h"

namespace zinf::engine_detail {

class StepAgreement {
 public:
  // `control_elements` counts the elements of these small collectives (CommReport).
  StepAgreement(comm::Communicator& comm, uint64_t& control_elements)
      : comm_(comm), control_elements_(control_elements) {}

  // Everyone's partial sum of squares in rank order (8 bytes per rank, gathered as raw bytes:
  // the communicator has no fp64). A rank that could not compute its partial passes kFailed.
  static constexpr double kFailed = -1;
  Result<std::vector<double>> exchange_partials(double partial) {
    const int world = comm_.world_size();
    std::vector<double> all(world);
    comm::Work w = comm_.all_gather_bytes(&partial, all.data(), sizeof partial);
    control_elements_ += world * sizeof partial;  // a byte collective counts bytes
    ZINF_RETURN_IF_ERROR(w.wait());
    return all;
  }

  // One small all-reduce: how many ranks failed their part of the step, and how many of them
  // fatally (`fatal`: this rank's failure leaves the run unable to go on). `local` is this
  // rank's outcome; the result fails when any rank failed (naming how many others did), and
  // *fatal_elsewhere says whether another rank's failure was fatal.
  Status agree(Status local, bool fatal = false, bool* fatal_elsewhere = nullptr) {
    if (fatal_elsewhere) *fatal_elsewhere = false;
    if (comm_.world_size() == 1) return local;
    const float mine[2] = {local.is_ok() ? 0.0f : 1.0f, fatal ? 1.0f : 0.0f};
    float total[2] = {0, 0};
    comm::Work w = comm_.all_reduce(mine, total, 2, DType::kF32, comm::ReduceOp::kSum);
    control_elements_ += 4;
    Status ws = w.wait();
    if (ws.is_ok() && fatal_elsewhere) *fatal_elsewhere = total[1] - mine[1] > 0;
    if (!local.is_ok()) return local;
    if (!ws.is_ok()) return ws;
    if (total[1] > 0) {
      return make_error(ErrorCode::kNonFinite,
                        "the optimizer step failed on {} other rank(s) with a non-finite "
                        "gradient while units were being updated during the backward pass "
                        "(overlap_optimizer); the run cannot go on",
                        static_cast<int>(total[1]));
    }
    if (total[0] > 0) {
      return make_error(ErrorCode::kUnavailable,
                        "the optimizer step failed on {} other rank(s) (their errors name the "
                        "cause); this rank's update is kept: call step() again to finish it",
                        static_cast<int>(total[0]));
    }
    return Status::ok();
  }

 private:
  comm::Communicator& comm_;
  uint64_t& control_elements_;
};

}  // namespace zinf::engine_detail
