// The Gloo backend: ranks are processes on CPUs, on one host or many, with no MPI launcher. The
// ranks meet through the TCP store (store.h) that rank 0 serves at MASTER_ADDR:MASTER_PORT, the
// way torchrun-style launches do; Gloo's TCP transport then connects every pair of ranks.
//
// Like the MPI backend, every operation first exchanges a small header with each peer (so a rank
// that does not arrive is named, and mismatched shapes are an error on every rank), then moves
// data point to point with Gloo's unbound buffers: each rank's chunk straight to the peer that
// needs it. Reductions never use Gloo's own algorithms (their order follows the algorithm): each
// rank receives its chunk of every peer's buffer and sums them in rank order with the same
// element function as the other backends, so results equal the local, MPI and NCCL backends bit
// for bit.
//
// Addresses: each rank's Gloo device listens on the local address its kernel would use to reach
// MASTER_ADDR (so on a multi-homed host the interface that faces the other hosts), or on the
// interface named by GLOO_SOCKET_IFNAME when that is set.
//
// Faults: a peer that does not arrive within the timeout is named (kTimeout) and the
// communicator is broken; abort(reason) sends the reason to every peer on a channel of its own
// (a fixed Gloo slot), and each peer's wait in flight returns at once with kUnavailable naming
// the rank and its reason. A broken communicator closes its connections, so no peer's data can
// land in a buffer after its operation failed, and peers still waiting fail promptly. A peer
// that dies: receives from it fail at once; a send to it already being written ends at the
// timeout (Gloo does not report the lost connection to it).
#pragma once

#include <chrono>
#include <memory>
#include <string>

#include "zinf/comm/communicator.h"
#include "zinf/core/status.h"

namespace zinf::comm {

inline constexpr char kGlooIfaceEnv[] = "GLOO_SOCKET_IFNAME";

struct GlooOptions {
  int rank = 0;
  int world_size = 1;
  std::string master_addr = "127.0.0.1";  // where rank 0's TCP store listens
  uint16_t master_port = 29500;
  std::string store_bind = "127.0.0.1";  // what rank 0's store binds to
  // The interface Gloo listens on (GLOO_SOCKET_IFNAME); empty: the local address that routes
  // to master_addr.
  std::string iface;
  std::chrono::milliseconds timeout = kDefaultTimeout;
};

// Connects the ranks (every rank calls it with the same master address and port) and returns
// this rank's communicator. Communicators created one after another in a job each get a store
// prefix of their own, so every rank must create them in the same order; they share rank 0's
// store while any of them lives, so keep one alive while making the next (or use another port).
Result<std::unique_ptr<Communicator>> make_gloo_communicator(GlooOptions options);

// The local address (numeric) that this host's routing would use to reach `host`:`port`.
Result<std::string> local_address_toward(const std::string& host, uint16_t port);

}  // namespace zinf::comm
