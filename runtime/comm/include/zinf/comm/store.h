// A TCP key-value store for rendezvous (the role of torch's c10d TCPStore): rank 0 runs the
// server, every rank connects a client, and small values (an NCCL unique id, a port, a counter)
// are published and awaited by key. Boost.Asio; the server runs its io_context on one thread.
//
// Protocol (docs/communicators.md has the table): every message is a frame, a 4-byte
// little-endian payload length followed by the payload. A connection must first send HELLO with
// the protocol version and the token; until then nothing else is served, frames are limited to
// kPreAuthFrameBytes, and the whole handshake to handshake_timeout. After it, frames are limited to
// max_frame_bytes. A frame the server cannot parse, or an oversized length, closes that
// connection only (before anything is allocated for it).
//
// Security (docs/security.md): the server binds to 127.0.0.1 unless told otherwise, and refuses
// to listen on any other address without a token (the option, ZINF_STORE_TOKEN, or the file named
// by ZINF_STORE_TOKEN_FILE, mode 0600). A client with a different token is refused before any
// request is served; tokens are compared in constant time. At most max_connections connections
// are open at once (more are refused); a failing accept (EMFILE) is retried with a growing
// pause, never in a spin; a client that disconnects while waiting releases its wait at once.
// The token is a shared secret against cross-talk and other users; the channel is not encrypted.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>

#include "zinf/core/status.h"

namespace zinf::comm {

inline constexpr uint32_t kStoreProtocolVersion = 1;
inline constexpr size_t kDefaultMaxFrameBytes = size_t{64} << 20;
// Before HELLO is accepted a frame may be no longer than this (HELLO is 9 bytes and the token).
inline constexpr size_t kPreAuthFrameBytes = 1024;
inline constexpr size_t kMaxStoreTokenBytes = 512;
inline constexpr char kStoreTokenEnv[] = "ZINF_STORE_TOKEN";
inline constexpr char kStoreTokenFileEnv[] = "ZINF_STORE_TOKEN_FILE";

// The token from the environment: ZINF_STORE_TOKEN when set, else the contents of the file named
// by ZINF_STORE_TOKEN_FILE (a regular file owned by this user that neither group nor others may
// read or write, e.g. mode 0600; one trailing newline is dropped), else "" (no token). Errors name
// the variable or the file and what is wrong with it.
Result<std::string> store_token_from_env();

struct StoreServerOptions {
  std::string host = "127.0.0.1";  // address to bind (a numeric address or a resolvable name)
  uint16_t port = 0;               // 0: an ephemeral port, see TcpStoreServer::port()
  // The shared token; nullopt reads store_token_from_env(). Empty (no token) is refused unless
  // `host` is a loopback address.
  std::optional<std::string> token;
  size_t max_frame_bytes = kDefaultMaxFrameBytes;  // after HELLO
  // A connection that has not completed HELLO within this time is closed.
  std::chrono::milliseconds handshake_timeout{10'000};
  // Connections open at once, authenticated or not; one more is refused and closed.
  size_t max_connections = 1024;
};

class TcpStoreServer {
 public:
  // Binds, listens and starts serving on a thread of its own.
  static Result<std::unique_ptr<TcpStoreServer>> start(StoreServerOptions options = {});
  // Stops serving: open connections are closed and pending waits are dropped.
  ~TcpStoreServer();
  TcpStoreServer(const TcpStoreServer&) = delete;
  TcpStoreServer& operator=(const TcpStoreServer&) = delete;

  uint16_t port() const;  // the bound port

  struct Impl;

 private:
  explicit TcpStoreServer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

struct StoreClientOptions {
  std::string host = "127.0.0.1";
  uint16_t port = 0;
  std::optional<std::string> token;  // nullopt reads store_token_from_env()
  // How long connect() keeps retrying a server that is not up yet (refused, unreachable).
  std::chrono::milliseconds connect_timeout{30'000};
  // Bound on each request's round trip beyond its own wait (set, add; get/wait add their timeout).
  std::chrono::milliseconds io_timeout{30'000};
  size_t max_frame_bytes = kDefaultMaxFrameBytes;
};

// One connection to a store. Requests are synchronous and serialised (the client is safe to share
// between threads, one request at a time). After a transport error or a timed-out round trip the
// client is closed and every later request fails with kUnavailable.
class TcpStoreClient {
 public:
  // Connects (retrying until connect_timeout) and says HELLO. kUnavailable when the server
  // cannot be reached in time, kInvalidArgument when it refuses the token.
  static Result<std::unique_ptr<TcpStoreClient>> connect(StoreClientOptions options);
  ~TcpStoreClient();
  TcpStoreClient(const TcpStoreClient&) = delete;
  TcpStoreClient& operator=(const TcpStoreClient&) = delete;

  Status set(std::string_view key, std::string_view value);
  // The key's value; waits up to `timeout` for it to be set (kTimeout otherwise).
  Result<std::string> get(std::string_view key, std::chrono::milliseconds timeout);
  // Waits until every key is set; kTimeout naming the missing keys otherwise.
  Status wait(std::span<const std::string> keys, std::chrono::milliseconds timeout);
  // Adds `delta` to the integer stored at key (a missing key counts as 0) and returns the new
  // value. The value is stored as decimal text, so get() returns e.g. "3". kInvalidArgument if
  // the key holds something else.
  Result<int64_t> add(std::string_view key, int64_t delta);

  struct Impl;

 private:
  explicit TcpStoreClient(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// Shares a small blob from rank 0 with every rank (an NCCL unique id). Rank 0 passes its blob
// and gets it back; the other ranks pass anything and receive rank 0's.
using ShareFromRank0 = std::function<Result<std::string>(std::string_view blob)>;

struct StoreRendezvous {
  int rank = 0;
  int world_size = 1;
  std::string master_addr = "127.0.0.1";  // where rank 0's server listens
  uint16_t master_port = 29500;
  std::string bind_host = "127.0.0.1";  // what rank 0's server binds to
  std::string key = "zinf/unique_id";   // distinct per communicator created in one job
  std::chrono::milliseconds timeout = std::chrono::milliseconds{300'000};
};

// ShareFromRank0 over a TCP store: on rank 0 it starts a server on bind_host:master_port; every
// rank connects to master_addr:master_port; rank 0 sets `key`, the others get it (waiting up to
// the timeout). The server lives as long as the returned function (and its copies), so keep the
// function alive until every rank has its blob (the NCCL backend keeps it for its lifetime).
ShareFromRank0 store_share_from_rank0(StoreRendezvous rendezvous);

}  // namespace zinf::comm
