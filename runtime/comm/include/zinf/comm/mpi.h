// The MPI backend (OpenMPI): ranks are processes under mpirun, on one machine or many.
//
// Every operation first exchanges a small header with each peer (point-to-point, so a rank that
// does not arrive is named, and the exchange can be cancelled after a timeout); the header
// carries the operation, dtype, counts and root, so mismatched shapes are an error on every rank.
// A barrier is that exchange alone. Data then moves with non-blocking point-to-point transfers
// (each rank's chunk straight to the peer that needs it; broadcast is MPI_Ibcast), polled against
// the timeout. Reductions never use MPI's own (order-unspecified) reduce: each rank receives its
// chunk of every peer's buffer and sums them in rank order itself, so results equal the local
// backend's bit for bit.
//
// MPI is initialised (MPI_THREAD_MULTIPLE) by the first communicator if the program has not done
// it, and then finalised at exit. Counts up to 2^31-1 elements per rank chunk and per buffer.
// After a timeout during a data phase MPI cannot cancel the collective: the user buffers stay
// owned by MPI and the process should exit.
#pragma once

#include <chrono>
#include <memory>

#include "zinf/comm/communicator.h"
#include "zinf/comm/store.h"

namespace zinf::comm {

struct MpiOptions {
  std::chrono::milliseconds timeout = kDefaultTimeout;
};

// A communicator over (a duplicate of) MPI_COMM_WORLD.
Result<std::unique_ptr<Communicator>> make_mpi_communicator(MpiOptions options = {});

// MPI_COMM_WORLD's rank and size, initialising MPI if needed.
Result<std::pair<int, int>> mpi_world_rank_size();

// ShareFromRank0 over MPI_Bcast on MPI_COMM_WORLD (collective: every rank must call it).
ShareFromRank0 mpi_share_from_rank0();

}  // namespace zinf::comm
