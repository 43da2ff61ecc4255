// The local backend: ranks are threads of one process sharing memory. The embedded default and
// the test vehicle of every layer above.
//
// Each collective is a rendezvous of all ranks (a generation-counted barrier under one mutex):
// every rank posts its Collective, the last to arrive checks that the shapes agree, then each
// rank computes its own part directly from its peers' buffers (its chunk of a reduction, in rank
// order; its copies of a gather) and the ranks meet again before anyone returns, so no buffer is
// released while a peer still reads it. Bit-identical from run to run.
#pragma once

#include <chrono>
#include <memory>
#include <vector>

#include "zinf/comm/communicator.h"

namespace zinf::comm {

struct LocalOptions {
  // Bound on each wait for the other ranks. A rank that does not arrive in time fails the
  // operation with kTimeout naming it, and breaks the group: every later operation on any rank
  // fails with the same error.
  std::chrono::milliseconds timeout = kDefaultTimeout;
};

// Creates one group of `world` ranks and returns its communicators, element r being rank r.
// Hand each to its own thread (a rank's operations may also be issued from one thread for all
// ranks: they are asynchronous). Destroying one communicator makes the other ranks' later
// operations fail with kUnavailable instead of waiting for it; so does Communicator::abort on one
// rank, at once, for the operations every rank has in flight (the error names the rank and why).
Result<std::vector<std::unique_ptr<Communicator>>> make_local_group(int world,
                                                                    LocalOptions options = {});

}  // namespace zinf::comm
