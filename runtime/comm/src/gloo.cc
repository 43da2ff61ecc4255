#include "zinf/comm/gloo.h"

#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/store.h>
#include <gloo/transport/tcp/device.h>
#include <gloo/transport/unbound_buffer.h>
#include <netdb.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <charconv>
#include <condition_variable>
#include <cstring>
#include <map>
#include <mutex>
#include <thread>

#include "zinf/comm/detail/op_header.h"
#include "zinf/comm/store.h"
#include "zinf/core/log.h"

namespace zinf::comm {
namespace {

using Clock = std::chrono::steady_clock;
using gloo::transport::UnboundBuffer;

// Slots (Gloo's message tags): a stride of four per collective, of which it uses three (the
// header, and up to two data phases: an all_reduce is a reduce_scatter then an all_gather), and
// one far above them for aborts.
constexpr uint64_t kSlotsPerOp = 4;
constexpr uint64_t kAbortSlot = uint64_t{1} << 62;
constexpr size_t kAbortTextBytes = 1024;
// How long abort() waits for its messages to leave.
constexpr std::chrono::milliseconds kAbortSendWait{2000};
// After a peer's connection fails, how long to wait for its abort message, which names the
// reason, before reporting the connection error alone.
constexpr std::chrono::milliseconds kAbortReasonGrace{1000};
// The abort watcher's wait has no deadline of its own (the destructor wakes it); Gloo needs one.
constexpr std::chrono::milliseconds kWatchForever = std::chrono::hours(24 * 365);

// A peer's abort message: fixed size, because a Gloo receive names its byte count.
struct AbortMessage {
  uint32_t valid = 0;  // 1 once a message arrived in this slot
  uint32_t length = 0;
  char text[kAbortTextBytes] = {};
};

// Gloo's rendezvous store interface over zinf's TCP store client, every key under a prefix of
// this communicator's own. Gloo expects errors as exceptions.
class StoreAdapter final : public gloo::rendezvous::Store {
 public:
  StoreAdapter(TcpStoreClient& client, std::string prefix, std::chrono::milliseconds timeout)
      : client_(client), prefix_(std::move(prefix)), timeout_(timeout) {}

  void set(const std::string& key, const std::vector<char>& data) override {
    throw_if(client_.set(prefix_ + key, std::string_view(data.data(), data.size())));
  }
  std::vector<char> get(const std::string& key) override {
    Result<std::string> value = client_.get(prefix_ + key, timeout_);
    throw_if_late({key}, timeout_, value.status());
    return std::vector<char>(value->begin(), value->end());
  }
  void wait(const std::vector<std::string>& keys) override { wait(keys, timeout_); }
  void wait(const std::vector<std::string>& keys,
            const std::chrono::milliseconds& timeout) override {
    std::vector<std::string> full;
    for (const std::string& k : keys) full.push_back(prefix_ + k);
    throw_if_late(keys, timeout, client_.wait(full, timeout));
  }

 private:
  static void throw_if(const Status& s) {
    if (!s.is_ok()) throw std::runtime_error(s.to_string());
  }
  // Gloo's keys are "<r>" (rank r's addresses) and "rank_<r>" (its host name): a timeout names
  // the ranks that did not publish theirs.
  static void throw_if_late(const std::vector<std::string>& keys, std::chrono::milliseconds timeout,
                            const Status& s) {
    if (s.code() == ErrorCode::kTimeout) {
      std::vector<int> ranks;
      for (const std::string& k : keys) {
        std::string_view digits(k);
        if (digits.starts_with("rank_")) digits.remove_prefix(5);
        int r = -1;
        auto [end, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), r);
        if (ec == std::errc() && end == digits.data() + digits.size()) ranks.push_back(r);
      }
      if (!ranks.empty()) {
        throw std::runtime_error(fmt::format("{} did not reach the rendezvous within {:.1f} s ({})",
                                             detail::format_ranks(ranks), timeout.count() / 1000.0,
                                             s.message()));
      }
    }
    throw_if(s);
  }
  TcpStoreClient& client_;
  const std::string prefix_;
  const std::chrono::milliseconds timeout_;
};

// Rank 0's store server and this process's client, shared by the communicators made against the
// same master address while any of them lives.
struct StoreSession {
  std::unique_ptr<TcpStoreServer> server;
  std::unique_ptr<TcpStoreClient> client;
};

Result<std::shared_ptr<StoreSession>> store_session(const GlooOptions& o) {
  static std::mutex mu;
  static std::map<std::pair<std::string, uint16_t>, std::weak_ptr<StoreSession>> sessions;
  std::lock_guard lock(mu);
  std::weak_ptr<StoreSession>& slot = sessions[{o.master_addr, o.master_port}];
  if (auto live = slot.lock()) return live;
  auto session = std::make_shared<StoreSession>();
  if (o.rank == 0) {
    ZINF_ASSIGN_OR_RETURN(
        session->server, TcpStoreServer::start({.host = o.store_bind,
                                                .port = o.master_port,
                                                .max_connections = std::max<size_t>(
                                                    1024, 2 * static_cast<size_t>(o.world_size))}));
  }
  ZINF_ASSIGN_OR_RETURN(session->client, TcpStoreClient::connect({.host = o.master_addr,
                                                                  .port = o.master_port,
                                                                  .connect_timeout = o.timeout,
                                                                  .io_timeout = o.timeout}));
  slot = session;
  return session;
}

// Communicators made in this process so far: each gets its own store prefix.
std::atomic<uint64_t> g_generation{0};

class GlooBackend final : public CommBackend {
 public:
  GlooBackend(const GlooOptions& o, std::shared_ptr<StoreSession> session,
              std::shared_ptr<gloo::rendezvous::Context> context)
      : rank_(o.rank),
        world_(o.world_size),
        timeout_(o.timeout),
        session_(std::move(session)),
        context_(std::move(context)),
        headers_(o.world_size) {}

  ~GlooBackend() override {
    {
      std::lock_guard lock(mu_);
      shutting_down_ = true;
    }
    if (abort_in_buffer_) abort_in_buffer_->abortWaitRecv();
    if (watcher_.joinable()) watcher_.join();
    // Buffers hold the transport context: it goes when the last of them does.
    context_.reset();
    abort_in_buffer_.reset();
    abort_out_buffer_.reset();
  }

  // Posts the abort channel's receives (one slot per peer, so that every peer's message can
  // land, however many abort) and starts its watcher.
  Status init() {
    if (world_ == 1) return Status::ok();
    return guarded("the abort channel", [&] {
      constexpr size_t m = sizeof(AbortMessage);
      abort_in_.resize(world_);
      abort_in_buffer_ = context_->createUnboundBuffer(abort_in_.data(), world_ * m);
      for (int j : peers()) abort_in_buffer_->recv(j, kAbortSlot, j * m, m);
      watcher_ = std::thread([this] { watch(); });
      return Status::ok();
    });
  }

  Backend kind() const override { return Backend::kGloo; }
  int rank() const override { return rank_; }
  int world_size() const override { return world_; }

  // This rank's waits fail at once; the peers get the reason on the abort slot. fail() (the
  // stream thread closing the connections) waits for the reason to leave first.
  void abort(const Status& reason) override {
    bool tell_peers = false;
    {
      std::lock_guard lock(mu_);
      if (self_aborted_) return;
      self_aborted_ = true;
      own_abort_ =
          make_error(ErrorCode::kCancelled, "rank {} failed: {}; the Gloo communicator is aborted",
                     rank_, reason.detail());
      tell_peers = !peer_aborted_ && world_ > 1;
      abort_sending_ = tell_peers;
      wake_waiters_locked();
    }
    if (!tell_peers) return;
    send_abort(reason.detail());
    std::lock_guard lock(mu_);
    abort_sending_ = false;
    abort_cv_.notify_all();
  }

  Status run(const Collective& c) override {
    if (!broken_.is_ok()) return broken_;
    Status s = guarded(collective_name(c.op), [&] { return run_unguarded(c); });
    // A failed header check leaves every rank in step; anything else breaks the communicator.
    if (!s.is_ok() && s.code() != ErrorCode::kInvalidArgument) return fail(s);
    return s;
  }

 private:
  Status run_unguarded(const Collective& c) {
    ZINF_RETURN_IF_ERROR(abort_status());
    ZINF_RETURN_IF_ERROR(exchange_headers(c));
    switch (c.op) {
      case CollectiveOp::kAllGather:
        return all_gather(c, c.send, c.recv, c.counts, 1);
      case CollectiveOp::kReduceScatter:
        return reduce_scatter(c, c.send, c.recv, c.counts, 1);
      case CollectiveOp::kAllReduce: {
        const size_t e = c.element_size();
        std::vector<size_t> chunks = even_partition(c.total(), world_);
        std::byte* mine = chunk_.get(chunks[rank_] * e);
        ZINF_RETURN_IF_ERROR(reduce_scatter(c, c.send, mine, chunks, 1));
        return all_gather(c, mine, c.recv, chunks, 2);
      }
      case CollectiveOp::kBroadcast:
        return broadcast(c);
      case CollectiveOp::kBarrier:
        return Status::ok();  // the header exchange met every rank
    }
    return Status::ok();
  }

  // Runs `body`, turning Gloo's exceptions into a status.
  template <typename Body>
  Status guarded(std::string_view what, Body&& body) {
    try {
      return body();
    } catch (const std::exception& e) {
      return make_error(ErrorCode::kUnavailable, "Gloo {} failed on rank {}: {}", what, rank_,
                        e.what());
    }
  }

  // The communicator is broken from now on: its connections are closed, so no peer's data can
  // land in a buffer whose operation failed, and peers still waiting on this rank fail promptly.
  Status fail(Status error) {
    broken_ = std::move(error);
    {
      // An abort of this rank's own may still be telling the peers: closing now would cut it.
      std::unique_lock lock(mu_);
      abort_cv_.wait_for(lock, kAbortSendWait + std::chrono::seconds(1),
                         [&] { return !abort_sending_; });
    }
    try {
      if (context_) context_->closeConnections();
    } catch (const std::exception& e) {
      log::debug("comm: closing Gloo connections after a failure: {}", e.what());
    }
    return broken_;
  }

  // An abort (this rank's or a peer's) as the error every operation now fails with.
  Status abort_status() {
    std::lock_guard lock(mu_);
    return abort_status_locked();
  }
  Status abort_status_locked() const {
    if (self_aborted_) return own_abort_;
    if (peer_aborted_) return peer_abort_;
    return Status::ok();
  }

  void wake_waiters_locked() {
    for (UnboundBuffer* b : waiting_) {
      b->abortWaitRecv();
      b->abortWaitSend();
    }
    abort_cv_.notify_all();
  }

  // Sends `text` to every peer on the abort slot and waits (boundedly) for it to leave.
  void send_abort(const std::string& text) {
    abort_out_.valid = 1;
    abort_out_.length = static_cast<uint32_t>(std::min(text.size(), kAbortTextBytes));
    std::memcpy(abort_out_.text, text.data(), abort_out_.length);
    try {
      abort_out_buffer_ = context_->createUnboundBuffer(&abort_out_, sizeof(abort_out_));
      for (int j = 0; j < world_; ++j) {
        if (j != rank_) abort_out_buffer_->send(j, kAbortSlot, 0, sizeof(abort_out_));
      }
      // One deadline for all of them (each waitSend takes what is left of it).
      const auto deadline = Clock::now() + std::min(timeout_, kAbortSendWait);
      for (int j = 1; j < world_; ++j) {
        abort_out_buffer_->waitSend(
            nullptr,
            std::max(std::chrono::milliseconds(1),
                     std::chrono::ceil<std::chrono::milliseconds>(deadline - Clock::now())));
      }
    } catch (const std::exception& e) {
      // A peer that is gone, or one that does not take the message in time: the others still
      // learn of the abort when this rank's connections close.
      log::debug("comm: Gloo abort message not delivered everywhere: {}", e.what());
    }
  }

  // The watcher: waits for the first peer's abort message, then fails this rank's waits. It stops
  // when the destructor wakes it, or when a connection fails (a peer that ended its run, or one
  // that died: the waits in flight on that peer see the failure themselves). A peer that aborts
  // sends its message and then closes its connections; Gloo reports the closed connection in
  // preference to a receive completed before it, so the slots are read after a failure too.
  void watch() {
    try {
      abort_in_buffer_->waitRecv(nullptr, kWatchForever);
    } catch (const std::exception&) {
      // A connection failed; a message that arrived before it is in its slot.
    }
    std::lock_guard lock(mu_);
    // Waits for a peer's reason need not sit out their grace once the watcher is done.
    watcher_done_ = true;
    abort_cv_.notify_all();
    if (shutting_down_) return;
    // Gloo names only the latest sender of a buffer: the message itself says whose it is.
    for (int j : peers()) {
      const AbortMessage& m = abort_in_[j];
      if (m.valid != 1) continue;
      const size_t n = std::min<size_t>(m.length, kAbortTextBytes);
      peer_aborted_ = true;
      peer_abort_ = make_error(ErrorCode::kUnavailable,
                               "rank {} failed: {}; the Gloo communicator is aborted", j,
                               std::string(m.text, n));
      wake_waiters_locked();
      return;
    }
  }

  // Registers the buffers whose waits an abort must interrupt, for the registration's lifetime.
  class Waiting {
   public:
    Waiting(GlooBackend& b, std::vector<UnboundBuffer*> buffers)
        : b_(b), buffers_(std::move(buffers)) {
      std::lock_guard lock(b_.mu_);
      b_.waiting_.insert(b_.waiting_.end(), buffers_.begin(), buffers_.end());
    }
    ~Waiting() {
      std::lock_guard lock(b_.mu_);
      for (UnboundBuffer* buffer : buffers_) std::erase(b_.waiting_, buffer);
    }

   private:
    GlooBackend& b_;
    std::vector<UnboundBuffer*> buffers_;
  };

  // One receive posted from one peer. A buffer per peer: Gloo reports only the source of a
  // buffer's latest completion, and the ranks that did not arrive must be named.
  struct Incoming {
    int peer;
    std::unique_ptr<UnboundBuffer> buffer;
  };

  // Posts a receive of `bytes` at `base` from `peer` on slot `s`.
  Incoming receive(int peer, void* base, size_t bytes, uint64_t s) {
    Incoming in{peer, context_->createUnboundBuffer(base, bytes)};
    in.buffer->recv(peer, s, 0, bytes);
    return in;
  }

  // Waits until every receive in `in` and `sends` sends of `out` complete, by `deadline`.
  // An abort returns its error at once; a lost peer is kUnavailable (with the peer's abort reason
  // when one arrives); the deadline is kTimeout naming the ranks whose part did not arrive.
  // `arrival`: the wait is for peers to reach the collective (the header exchange).
  Status wait_all(std::vector<Incoming>& in, UnboundBuffer* out, int sends,
                  Clock::time_point deadline, const Collective& c, bool arrival) {
    std::vector<UnboundBuffer*> buffers;
    for (Incoming& i : in) buffers.push_back(i.buffer.get());
    if (out != nullptr) buffers.push_back(out);
    Waiting waiting(*this, buffers);
    ZINF_RETURN_IF_ERROR(abort_status());
    auto remaining = [&] {
      return std::max(std::chrono::milliseconds(1),
                      std::chrono::ceil<std::chrono::milliseconds>(deadline - Clock::now()));
    };
    size_t done = 0;
    try {
      for (; done < in.size(); ++done) {
        if (!in[done].buffer->waitRecv(nullptr, remaining())) return abort_status();
      }
      for (int i = 0; i < sends; ++i) {
        if (!out->waitSend(nullptr, remaining())) return abort_status();
      }
    } catch (const std::exception& e) {
      // Gloo's own timeout (the wait was given what was left until the deadline), or a failure.
      if (Clock::now() >= deadline ||
          std::string_view(e.what()).find("Timed out waiting") != std::string_view::npos) {
        // The receives that did complete still count theirs; the rest failed with the timeout.
        std::vector<int> late;
        for (size_t k = done; k < in.size(); ++k) {
          try {
            if (in[k].buffer->waitRecv(nullptr, std::chrono::milliseconds(1))) continue;
          } catch (const std::exception&) {
          }
          late.push_back(in[k].peer);
        }
        if (arrival) {
          return make_error(ErrorCode::kTimeout,
                            "{} did not arrive within {:.1f} s ({} #{} on rank {}); the Gloo "
                            "communicator is broken",
                            detail::format_ranks(late), timeout_.count() / 1000.0,
                            collective_name(c.op), c.seq, rank_);
        }
        return make_error(ErrorCode::kTimeout,
                          "{} #{} did not complete within {:.1f} s after every rank arrived{}; "
                          "the Gloo communicator is broken",
                          collective_name(c.op), c.seq, timeout_.count() / 1000.0,
                          late.empty() ? std::string(" (sends pending)")
                                       : " (no data from " + detail::format_ranks(late) + ")");
      }
      // A peer's connection failed. If the peer aborted, its message came first on the same
      // connection: give the watcher a moment to report it.
      std::unique_lock lock(mu_);
      abort_cv_.wait_for(lock, kAbortReasonGrace,
                         [&] { return peer_aborted_ || self_aborted_ || watcher_done_; });
      if (Status s = abort_status_locked(); !s.is_ok()) return s;
      return make_error(ErrorCode::kUnavailable,
                        "{} #{} failed on rank {}: {}; the Gloo communicator is broken",
                        collective_name(c.op), c.seq, rank_, e.what());
    }
    return Status::ok();
  }

  static uint64_t slot(const Collective& c, uint64_t phase) { return c.seq * kSlotsPerOp + phase; }

  std::vector<int> peers() const {
    std::vector<int> out;
    for (int j = 0; j < world_; ++j) {
      if (j != rank_) out.push_back(j);
    }
    return out;
  }

  // Every rank sends its header to every peer and receives theirs, then all check them alike.
  Status exchange_headers(const Collective& c) {
    headers_[rank_] = detail::make_header(c, rank_);
    if (world_ > 1) {
      constexpr size_t h = sizeof(detail::OpHeader);
      const uint64_t s = slot(c, 0);
      std::vector<Incoming> in;
      for (int j : peers()) in.push_back(receive(j, &headers_[j], h, s));
      auto own = context_->createUnboundBuffer(&headers_[rank_], h);
      for (int j : peers()) own->send(j, s, 0, h);
      ZINF_RETURN_IF_ERROR(wait_all(in, own.get(), world_ - 1, Clock::now() + timeout_, c,
                                    /*arrival=*/true));
    }
    return detail::check_headers(headers_,
                                 [&](int j) { return j == rank_ ? c.invalid : std::string(); });
  }

  // Each rank sends its chunk to every peer and receives theirs in place in `recv`.
  Status all_gather(const Collective& c, const void* send, void* recv,
                    const std::vector<size_t>& counts, uint64_t phase) {
    const size_t e = c.element_size();
    const std::vector<size_t> displs = detail::prefix_sums(counts);
    auto* out = static_cast<std::byte*>(recv);
    if (counts[rank_] > 0 && send != out + displs[rank_] * e) {
      std::memcpy(out + displs[rank_] * e, send, counts[rank_] * e);
    }
    const uint64_t s = slot(c, phase);
    std::vector<Incoming> in;
    for (int j : peers()) {
      if (counts[j] > 0) in.push_back(receive(j, out + displs[j] * e, counts[j] * e, s));
    }
    std::unique_ptr<UnboundBuffer> own;
    int sends = 0;
    if (counts[rank_] > 0 && world_ > 1) {
      own = context_->createUnboundBuffer(const_cast<void*>(send), counts[rank_] * e);
      for (int j : peers()) own->send(j, s, 0, counts[rank_] * e);
      sends = world_ - 1;
    }
    return wait_all(in, own.get(), sends, Clock::now() + timeout_, c, false);
  }

  // Chunk `rank` of every peer's `send` arrives in staging, then the chunks (this rank's own
  // straight from `send`) are summed in rank order into `recv`.
  Status reduce_scatter(const Collective& c, const void* send, void* recv,
                        const std::vector<size_t>& counts, uint64_t phase) {
    const size_t e = c.element_size();
    const size_t mine = counts[rank_];
    const std::vector<size_t> displs = detail::prefix_sums(counts);
    const auto* in = static_cast<const std::byte*>(send);
    std::byte* staging = staging_.get(world_ * mine * e);
    std::vector<const void*> srcs(world_);
    for (int j = 0; j < world_; ++j) {
      srcs[j] = j == rank_ ? in + displs[rank_] * e : staging + j * mine * e;
    }
    const uint64_t s = slot(c, phase);
    std::vector<Incoming> stage;
    if (mine > 0) {
      for (int j : peers()) stage.push_back(receive(j, staging + j * mine * e, mine * e, s));
    }
    std::unique_ptr<UnboundBuffer> out;
    int sends = 0;
    if (displs[world_] - mine > 0) {
      out = context_->createUnboundBuffer(const_cast<std::byte*>(in), displs[world_] * e);
      for (int j : peers()) {
        if (counts[j] == 0) continue;
        out->send(j, s, displs[j] * e, counts[j] * e);
        ++sends;
      }
    }
    ZINF_RETURN_IF_ERROR(wait_all(stage, out.get(), sends, Clock::now() + timeout_, c, false));
    detail::reduce_rank_order(recv, srcs.data(), world_, mine, c.dtype,
                              detail::reduce_scale(c.reduce, world_));
    return Status::ok();
  }

  // The root sends the whole buffer to every peer.
  Status broadcast(const Collective& c) {
    const size_t bytes = c.counts[0] * c.element_size();
    if (bytes == 0 || world_ == 1) return Status::ok();
    const uint64_t s = slot(c, 1);
    const auto deadline = Clock::now() + timeout_;
    std::vector<Incoming> in;
    if (rank_ == c.root) {
      auto buffer = context_->createUnboundBuffer(const_cast<void*>(c.send), bytes);
      for (int j : peers()) buffer->send(j, s, 0, bytes);
      return wait_all(in, buffer.get(), world_ - 1, deadline, c, false);
    }
    in.push_back(receive(c.root, c.recv, bytes, s));
    return wait_all(in, nullptr, 0, deadline, c, false);
  }

  const int rank_;
  const int world_;
  const std::chrono::milliseconds timeout_;
  std::shared_ptr<StoreSession> session_;  // rank 0's server lives while its communicators do
  std::shared_ptr<gloo::rendezvous::Context> context_;
  std::vector<detail::OpHeader> headers_;
  detail::ScratchBuffer staging_;  // reduce_scatter: world chunks of this rank's share
  detail::ScratchBuffer chunk_;    // all_reduce: this rank's reduced chunk
  Status broken_;                  // stream thread only

  // The abort channel.
  std::vector<AbortMessage> abort_in_;  // rank j's message in slot j
  AbortMessage abort_out_;
  std::unique_ptr<UnboundBuffer> abort_in_buffer_;
  std::unique_ptr<UnboundBuffer> abort_out_buffer_;
  std::thread watcher_;
  std::mutex mu_;  // guards what follows
  std::condition_variable abort_cv_;
  std::vector<UnboundBuffer*> waiting_;  // buffers the stream thread is waiting on
  bool self_aborted_ = false;
  bool abort_sending_ = false;  // abort() is still handing the reason to the peers
  bool peer_aborted_ = false;
  bool shutting_down_ = false;
  bool watcher_done_ = false;  // the abort watcher returned (under mu_)
  Status own_abort_;
  Status peer_abort_;
};

}  // namespace

Result<std::string> local_address_toward(const std::string& host, uint16_t port) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_DGRAM;
  hints.ai_flags = AI_NUMERICSERV;
  addrinfo* found = nullptr;
  const std::string service = std::to_string(port);
  if (int rc = getaddrinfo(host.c_str(), service.c_str(), &hints, &found); rc != 0) {
    return make_error(ErrorCode::kInvalidArgument, "cannot resolve MASTER_ADDR '{}': {}", host,
                      gai_strerror(rc));
  }
  std::unique_ptr<addrinfo, decltype(&freeaddrinfo)> list(found, freeaddrinfo);
  std::string last_error = "no address";
  for (addrinfo* a = found; a != nullptr; a = a->ai_next) {
    int fd = socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) {
      last_error = std::strerror(errno);
      continue;
    }
    // A datagram socket's connect() sends nothing: it only picks the route and source address.
    sockaddr_storage local{};
    socklen_t length = sizeof(local);
    bool ok = connect(fd, a->ai_addr, a->ai_addrlen) == 0 &&
              getsockname(fd, reinterpret_cast<sockaddr*>(&local), &length) == 0;
    if (!ok) last_error = std::strerror(errno);
    close(fd);
    if (!ok) continue;
    char text[NI_MAXHOST];
    if (getnameinfo(reinterpret_cast<sockaddr*>(&local), length, text, sizeof(text), nullptr, 0,
                    NI_NUMERICHOST) == 0) {
      return std::string(text);
    }
  }
  return make_error(ErrorCode::kUnavailable, "no local address routes to MASTER_ADDR '{}': {}",
                    host, last_error);
}

Result<std::unique_ptr<Communicator>> make_gloo_communicator(GlooOptions o) {
  if (o.world_size < 1 || o.rank < 0 || o.rank >= o.world_size) {
    return make_error(ErrorCode::kInvalidArgument, "Gloo communicator: rank {} of {} is invalid",
                      o.rank, o.world_size);
  }
  if (o.timeout.count() <= 0) {
    return make_error(ErrorCode::kInvalidArgument,
                      "Gloo communicator: the timeout must be positive");
  }
  const uint64_t generation = g_generation.fetch_add(1);
  std::shared_ptr<StoreSession> session;
  std::shared_ptr<gloo::rendezvous::Context> context;
  if (o.world_size > 1) {
    ZINF_ASSIGN_OR_RETURN(session, store_session(o));
    gloo::transport::tcp::attr attr;
    if (!o.iface.empty()) {
      attr.iface = o.iface;
    } else {
      ZINF_ASSIGN_OR_RETURN(attr.hostname, local_address_toward(o.master_addr, o.master_port));
    }
    try {
      auto device = gloo::transport::tcp::CreateDevice(attr);
      context = std::make_shared<gloo::rendezvous::Context>(o.rank, o.world_size);
      context->setTimeout(o.timeout);
      StoreAdapter store(*session->client, fmt::format("zinf/gloo/{}/", generation), o.timeout);
      context->connectFullMesh(store, device);
    } catch (const std::exception& e) {
      return make_error(ErrorCode::kUnavailable,
                        "Gloo: rank {} of {} could not connect to its peers (store at {}:{}, "
                        "listening on {}): {}",
                        o.rank, o.world_size, o.master_addr, o.master_port,
                        o.iface.empty() ? attr.hostname : "interface " + o.iface, e.what());
    }
  }
  auto backend = std::make_unique<GlooBackend>(o, std::move(session), std::move(context));
  ZINF_RETURN_IF_ERROR(backend->init());
  return std::make_unique<Communicator>(std::move(backend));
}

}  // namespace zinf::comm
