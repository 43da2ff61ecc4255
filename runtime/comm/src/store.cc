// The TCP rendezvous store. Wire format (all integers little-endian):
//   frame    = u32 payload_length (1 ..= max_frame_bytes) | payload
//   string   = u32 length | bytes
//   requests = u8 op | fields:   HELLO u32 version, string token
//                                SET   string key, string value
//                                GET   u32 timeout_ms, string key
//                                WAIT  u32 timeout_ms, u32 n, n x string key
//                                ADD   i64 delta, string key
//   reply    = u8 status (ok, timeout, refused, error) | GET: the value; ADD: i64; else a message
// A payload must be consumed exactly; anything else is malformed and closes the connection.
#include "zinf/comm/store.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <boost/asio.hpp>
#include <cerrno>
#include <cstdlib>
#include <map>
#include <mutex>
#include <set>
#include <thread>
#include <vector>

#include "store_wire.h"
#include "zinf/core/log.h"

namespace zinf::comm {

namespace asio = boost::asio;
using tcp = asio::ip::tcp;
using Clock = std::chrono::steady_clock;

namespace {

using wire::Op;
using wire::Reader;
using wire::Reply;
using wire::Request;
using wire::Writer;

uint32_t le32(const std::array<uint8_t, 4>& b) {
  return uint32_t{b[0]} | uint32_t{b[1]} << 8 | uint32_t{b[2]} << 16 | uint32_t{b[3]} << 24;
}

Result<std::string> resolve_token(const std::optional<std::string>& token) {
  std::string out;
  if (token) {
    out = *token;
  } else {
    ZINF_ASSIGN_OR_RETURN(out, store_token_from_env());
  }
  if (out.size() > kMaxStoreTokenBytes) {
    return make_error(ErrorCode::kInvalidArgument,
                      "store: a token of {} bytes is longer than the {} allowed", out.size(),
                      kMaxStoreTokenBytes);
  }
  return out;
}

bool tokens_equal(std::string_view a, std::string_view b) {
  // Constant time in the content, so the comparison does not leak how much of a guess matched.
  size_t diff = a.size() ^ b.size();
  for (size_t i = 0; i < std::max(a.size(), b.size()); ++i) {
    uint8_t x = i < a.size() ? static_cast<uint8_t>(a[i]) : 0;
    uint8_t y = i < b.size() ? static_cast<uint8_t>(b[i]) : 0;
    diff |= x ^ y;
  }
  return diff == 0;
}

// The one owner of a descriptor: closes it on destruction.
class Fd {
 public:
  explicit Fd(int fd) : fd_(fd) {}
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  ~Fd() {
    if (fd_ >= 0) ::close(fd_);
  }
  int get() const { return fd_; }

 private:
  int fd_;
};

Result<std::string> read_token_file(const std::string& path) {
  auto fail = [&](std::string why) {
    return make_error(ErrorCode::kInvalidArgument, "{}={}: {}", kStoreTokenFileEnv, path, why);
  };
  // O_NONBLOCK: a FIFO planted under the name must not block the open.
  Fd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOCTTY | O_NONBLOCK));
  if (fd.get() < 0) return errno_status(errno, fmt::format("{}={}", kStoreTokenFileEnv, path));
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0) {
    return errno_status(errno, fmt::format("{}={}: fstat", kStoreTokenFileEnv, path));
  }
  if (!S_ISREG(st.st_mode)) return fail("not a regular file");
  if (st.st_uid != ::geteuid()) {
    return fail(fmt::format("owned by uid {}, not by this user (uid {})", st.st_uid, ::geteuid()));
  }
  if ((st.st_mode & 077) != 0) {
    return fail(fmt::format("mode {:04o} lets group or others read or write it; chmod 600 it",
                            st.st_mode & 07777));
  }
  if (st.st_size > static_cast<off_t>(kMaxStoreTokenBytes) + 1) {
    return fail(fmt::format("{} bytes; a token is at most {}", st.st_size, kMaxStoreTokenBytes));
  }
  std::string text(kMaxStoreTokenBytes + 2, '\0');
  size_t got = 0;
  for (;;) {
    ssize_t n = ::read(fd.get(), text.data() + got, text.size() - got);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return errno_status(errno, fmt::format("{}={}: read", kStoreTokenFileEnv, path));
    if (n == 0) break;
    got += static_cast<size_t>(n);
    if (got == text.size()) return fail("grew while being read");
  }
  text.resize(got);
  if (!text.empty() && text.back() == '\n') text.pop_back();
  if (!text.empty() && text.back() == '\r') text.pop_back();
  if (text.empty()) return fail("empty");
  return text;
}

uint32_t clamp_ms(std::chrono::milliseconds timeout) {
  return static_cast<uint32_t>(std::clamp<int64_t>(timeout.count(), 0, UINT32_MAX));
}

std::optional<int64_t> parse_i64(const std::string& text) {
  if (text.empty()) return std::nullopt;
  char* end = nullptr;
  errno = 0;
  long long v = std::strtoll(text.c_str(), &end, 10);
  if (errno != 0 || end != text.c_str() + text.size()) return std::nullopt;
  return v;
}

}  // namespace

Result<std::string> store_token_from_env() {
  if (const char* token = std::getenv(kStoreTokenEnv); token && *token) return std::string(token);
  if (const char* path = std::getenv(kStoreTokenFileEnv); path && *path) {
    return read_token_file(path);
  }
  return std::string();
}

namespace {

// ---- server ------------------------------------------------------------------------------------

class Connection;

struct ServerState {
  std::string token;
  size_t max_frame_bytes = 0;
  std::chrono::milliseconds handshake_timeout{0};
  size_t max_connections = 0;
  size_t open_connections = 0;  // counted from start() to close()
  std::map<std::string, std::string, std::less<>> data;
  std::set<std::shared_ptr<Connection>> waiting;  // connections blocked in GET or WAIT

  void notify_waiters();
};

// One client connection, driven by the server's io thread only. At most one request is in flight:
// the next frame is read after the reply to the previous one is written.
class Connection : public std::enable_shared_from_this<Connection> {
 public:
  Connection(ServerState& state, tcp::socket socket)
      : state_(state),
        socket_(std::move(socket)),
        timer_(socket_.get_executor()),
        handshake_timer_(socket_.get_executor()) {}

  // Serves the connection; it counts against max_connections until it closes. A connection over
  // the limit is told so and closed.
  void start() {
    if (state_.open_connections >= state_.max_connections) {
      log::debug("store: refusing a connection: {} are open already", state_.open_connections);
      counted_ = false;
      return refuse(
          fmt::format("the store serves at most {} connections at once", state_.max_connections));
    }
    ++state_.open_connections;
    // The handshake's deadline: a client that connects and sends nothing (or drips bytes) is
    // dropped, so it cannot hold a connection slot.
    handshake_timer_.expires_after(state_.handshake_timeout);
    handshake_timer_.async_wait([self = shared_from_this()](boost::system::error_code ec) {
      if (ec || self->authenticated_ || self->closed_) return;
      log::debug("store: closing a connection that did not say HELLO within {} ms",
                 self->state_.handshake_timeout.count());
      self->close();
    });
    read_frame();
  }

  // Answers a GET or WAIT whose keys are all present now; returns whether it did.
  bool try_finish_wait() {
    for (const std::string& key : wait_keys_) {
      if (!state_.data.count(key)) return false;
    }
    std::string value = want_value_ ? state_.data.find(wait_keys_[0])->second : std::string();
    end_wait();
    reply(Reply::kOk, value);
    return true;
  }

 private:
  void read_frame() {
    auto self = shared_from_this();
    asio::async_read(socket_, asio::buffer(header_), [self](boost::system::error_code ec, size_t) {
      if (ec) return self->close();
      uint32_t length = le32(self->header_);
      // Before HELLO only a small frame: nothing large is allocated for an unknown peer.
      const size_t limit = wire::frame_limit(self->authenticated_, self->state_.max_frame_bytes);
      if (length == 0 || length > limit) {
        log::debug("store: closing a connection that announced a {}-byte frame", length);
        return self->close();
      }
      self->payload_.resize(length);
      asio::async_read(self->socket_, asio::buffer(self->payload_),
                       [self](boost::system::error_code ec2, size_t) {
                         if (ec2) return self->close();
                         self->handle();
                       });
    });
  }

  void handle() {
    const auto op = static_cast<Op>(Reader(payload_).u8());
    if (!authenticated_ && op != Op::kHello) return refuse("the first request must be HELLO");
    std::optional<Request> request = wire::decode_request(payload_);
    if (!request) return close();  // malformed
    if (!authenticated_) {
      if (request->version != kStoreProtocolVersion) {
        return refuse(
            fmt::format("protocol version {} is not {}", request->version, kStoreProtocolVersion));
      }
      if (!state_.token.empty() && !tokens_equal(request->token, state_.token)) {
        return refuse("wrong token");
      }
      authenticated_ = true;
      handshake_timer_.cancel();
      return reply(Reply::kOk, "");
    }
    switch (request->op) {
      case Op::kSet:
        state_.data[std::move(request->keys[0])] = std::move(request->value);
        reply(Reply::kOk, "");
        state_.notify_waiters();
        return;
      case Op::kGet:
      case Op::kWait:
        wait_keys_ = std::move(request->keys);
        want_value_ = request->op == Op::kGet;
        return begin_wait(request->timeout_ms);
      case Op::kAdd: {
        const std::string& key = request->keys[0];
        int64_t value = 0;
        if (auto it = state_.data.find(key); it != state_.data.end()) {
          auto parsed = parse_i64(it->second);
          if (!parsed) return reply(Reply::kError, fmt::format("key '{}' is not an integer", key));
          value = *parsed;
        }
        if (__builtin_add_overflow(value, request->delta, &value)) {
          return reply(Reply::kError,
                       fmt::format("adding {} to key '{}' overflows", request->delta, key));
        }
        state_.data[key] = std::to_string(value);
        Writer w;
        reply(Reply::kOk, w.i64(value).view());
        state_.notify_waiters();
        return;
      }
      case Op::kHello:
        return close();  // HELLO twice: malformed
    }
  }

  void begin_wait(uint32_t timeout_ms) {
    if (try_finish_wait()) return;
    state_.waiting.insert(shared_from_this());
    const uint64_t id = ++wait_id_;
    timer_.expires_after(std::chrono::milliseconds(timeout_ms));
    auto self = shared_from_this();
    // While it waits the client must send nothing: the socket turning readable means it hung up
    // (or broke the protocol). Either way the wait is released at once, not at its timeout.
    socket_.async_wait(tcp::socket::wait_read, [self, id](boost::system::error_code ec) {
      if (ec || id != self->wait_id_ || !self->state_.waiting.count(self)) return;
      log::debug("store: a client left while waiting; its wait is released");
      self->close();
    });
    timer_.async_wait([self](boost::system::error_code ec) {
      if (ec || !self->state_.waiting.count(self)) return;  // cancelled, or answered already
      std::string missing;
      for (const std::string& key : self->wait_keys_) {
        if (!self->state_.data.count(key)) missing += (missing.empty() ? "'" : ", '") + key + "'";
      }
      self->end_wait();
      self->reply(Reply::kTimeout, "keys not set in time: " + missing);
    });
  }

  void end_wait() {
    state_.waiting.erase(shared_from_this());
    timer_.cancel();
    // Ends the readability watch (the only operation on the socket during a wait).
    boost::system::error_code ignored;
    socket_.cancel(ignored);
  }

  void refuse(std::string message) {
    close_after_reply_ = true;
    reply(Reply::kRefused, message);
  }

  void reply(Reply status, std::string_view body) {
    Writer w;
    out_ = w.u8(static_cast<uint8_t>(status)).raw(body).frame();
    auto self = shared_from_this();
    asio::async_write(socket_, asio::buffer(out_), [self](boost::system::error_code ec, size_t) {
      if (ec || self->close_after_reply_) return self->close();
      self->read_frame();
    });
  }

  void close() {
    if (closed_) return;
    closed_ = true;
    if (counted_) --state_.open_connections;
    state_.waiting.erase(shared_from_this());
    boost::system::error_code ignored;
    timer_.cancel();
    handshake_timer_.cancel();
    socket_.shutdown(tcp::socket::shutdown_both, ignored);
    socket_.close(ignored);
  }

  ServerState& state_;
  tcp::socket socket_;
  asio::steady_timer timer_;            // a GET or WAIT's timeout
  asio::steady_timer handshake_timer_;  // HELLO's deadline
  std::array<uint8_t, 4> header_{};
  std::vector<uint8_t> payload_;
  std::vector<uint8_t> out_;
  std::vector<std::string> wait_keys_;
  bool want_value_ = false;
  bool authenticated_ = false;
  bool close_after_reply_ = false;
  bool closed_ = false;
  bool counted_ = true;   // holds one of max_connections
  uint64_t wait_id_ = 0;  // which wait a readability watch belongs to
};

void ServerState::notify_waiters() {
  // Copy first: answering a waiter removes it from the set.
  std::vector<std::shared_ptr<Connection>> snapshot(waiting.begin(), waiting.end());
  for (auto& c : snapshot) c->try_finish_wait();
}

}  // namespace

// Pauses between accepts that fail (EMFILE, ENFILE, ENOBUFS): the pending connection stays in
// the backlog and the next accept would fail at once, so retrying without a pause spins a core.
constexpr std::chrono::milliseconds kAcceptBackoffMin{10};
constexpr std::chrono::milliseconds kAcceptBackoffMax{1000};

struct TcpStoreServer::Impl {
  asio::io_context io;  // first member: destroyed last, after everything that uses it
  tcp::acceptor acceptor{io};
  asio::steady_timer accept_timer{io};
  std::chrono::milliseconds accept_backoff{0};
  uint64_t accept_failures = 0;
  ServerState state;
  uint16_t port = 0;
  std::thread thread;

  void accept() {
    acceptor.async_accept([this](boost::system::error_code ec, tcp::socket socket) {
      if (ec == asio::error::operation_aborted) return;
      if (ec) {
        // Said at the first failure and then at every power of two, not at every retry.
        ++accept_failures;
        if ((accept_failures & (accept_failures - 1)) == 0) {
          log::warn("store: accept failed ({} time(s)): {}; retrying with a pause", accept_failures,
                    ec.message());
        }
        accept_backoff = std::clamp(accept_backoff * 2, kAcceptBackoffMin, kAcceptBackoffMax);
        accept_timer.expires_after(accept_backoff);
        accept_timer.async_wait([this](boost::system::error_code timer_ec) {
          if (!timer_ec) accept();
        });
        return;
      }
      accept_backoff = std::chrono::milliseconds(0);
      std::make_shared<Connection>(state, std::move(socket))->start();
      accept();
    });
  }

  ~Impl() {
    io.stop();
    if (thread.joinable()) thread.join();
    state.waiting.clear();
  }
};

TcpStoreServer::TcpStoreServer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
TcpStoreServer::~TcpStoreServer() = default;
uint16_t TcpStoreServer::port() const { return impl_->port; }

Result<std::unique_ptr<TcpStoreServer>> TcpStoreServer::start(StoreServerOptions options) {
  if (options.host.empty()) {
    return make_error(ErrorCode::kInvalidArgument,
                      "store: empty bind address (say 0.0.0.0 to listen on every interface)");
  }
  if (options.max_frame_bytes < 64) {
    return make_error(ErrorCode::kInvalidArgument, "store: max_frame_bytes {} is too small",
                      options.max_frame_bytes);
  }
  if (options.max_connections < 1 || options.handshake_timeout.count() <= 0) {
    return make_error(ErrorCode::kInvalidArgument,
                      "store: max_connections and handshake_timeout must be positive");
  }
  auto impl = std::make_unique<Impl>();
  ZINF_ASSIGN_OR_RETURN(impl->state.token, resolve_token(options.token));
  impl->state.max_frame_bytes = options.max_frame_bytes;
  impl->state.handshake_timeout = options.handshake_timeout;
  impl->state.max_connections = options.max_connections;
  boost::system::error_code ec;
  tcp::resolver resolver(impl->io);
  auto endpoints = resolver.resolve(options.host, std::to_string(options.port),
                                    tcp::resolver::passive | tcp::resolver::numeric_service, ec);
  if (ec || endpoints.empty()) {
    return make_error(ErrorCode::kInvalidArgument, "store: cannot resolve bind address '{}': {}",
                      options.host, ec.message());
  }
  tcp::endpoint endpoint = *endpoints.begin();
  if (!endpoint.address().is_loopback() && impl->state.token.empty()) {
    return make_error(ErrorCode::kInvalidArgument,
                      "store: refusing to listen on {} ({}) without a token: beyond loopback any "
                      "host could steer the rendezvous. Set {} to the same secret on every rank, "
                      "or {} to a file of mode 0600 holding it; or bind to 127.0.0.1 "
                      "(ZINF_STORE_BIND) when every rank runs on this machine",
                      options.host, endpoint.address().to_string(), kStoreTokenEnv,
                      kStoreTokenFileEnv);
  }
  impl->acceptor.open(endpoint.protocol(), ec);
  if (!ec) impl->acceptor.set_option(tcp::acceptor::reuse_address(true), ec);
  if (!ec) impl->acceptor.bind(endpoint, ec);
  if (!ec) impl->acceptor.listen(asio::socket_base::max_listen_connections, ec);
  if (ec) {
    return make_error(ErrorCode::kUnavailable, "store: cannot listen on {}:{}: {}", options.host,
                      options.port, ec.message());
  }
  impl->port = impl->acceptor.local_endpoint().port();
  impl->accept();
  Impl* raw = impl.get();
  impl->thread = std::thread([raw] { raw->io.run(); });
  log::debug("store: serving on {}:{}{}", options.host, impl->port,
             impl->state.token.empty() ? "" : " (token required)");
  return std::unique_ptr<TcpStoreServer>(new TcpStoreServer(std::move(impl)));
}

// ---- client ------------------------------------------------------------------------------------

struct TcpStoreClient::Impl {
  asio::io_context io;
  tcp::socket socket{io};
  StoreClientOptions options;
  std::string where;  // "host:port" for messages
  std::mutex mu;
  Status broken;

  // Runs the io_context until `done` or the deadline; on the deadline closes the socket (which
  // completes the pending handlers) and returns false.
  bool run_until(const bool& done, Clock::time_point deadline) {
    io.restart();
    while (!done && !io.stopped()) {
      auto now = Clock::now();
      if (now >= deadline) break;
      io.run_one_for(deadline - now);
    }
    if (done) return true;
    boost::system::error_code ignored;
    socket.close(ignored);
    io.restart();
    io.run();
    return false;
  }

  Status connect_once(Clock::time_point deadline) {
    boost::system::error_code ec;
    tcp::resolver resolver(io);
    auto endpoints = resolver.resolve(options.host, std::to_string(options.port),
                                      tcp::resolver::numeric_service, ec);
    if (ec)
      return make_error(ErrorCode::kUnavailable, "cannot resolve '{}': {}", options.host,
                        ec.message());
    bool done = false;
    asio::async_connect(socket, endpoints, [&](boost::system::error_code e, const tcp::endpoint&) {
      ec = e;
      done = true;
    });
    if (!run_until(done, deadline)) return make_error(ErrorCode::kTimeout, "connect timed out");
    if (ec) {
      socket.close(ec);
      return make_error(ErrorCode::kUnavailable, "{}", ec.message());
    }
    socket.set_option(tcp::no_delay(true), ec);
    return Status::ok();
  }

  struct Answer {
    Reply status;
    std::vector<uint8_t> body;
  };

  // One request and its reply within `timeout`. Transport failures break the client.
  Result<Answer> transact(const Writer& request, std::chrono::milliseconds timeout) {
    if (!broken.is_ok()) return broken;
    if (request.size() > options.max_frame_bytes) {
      return make_error(ErrorCode::kInvalidArgument,
                        "store request of {} bytes exceeds the {}-byte frame limit", request.size(),
                        options.max_frame_bytes);
    }
    std::vector<uint8_t> frame = request.frame();
    std::array<uint8_t, 4> header{};
    std::vector<uint8_t> payload;
    boost::system::error_code ec;
    bool oversized = false;
    bool done = false;
    asio::async_write(socket, asio::buffer(frame), [&](boost::system::error_code e, size_t) {
      if (e) {
        ec = e;
        done = true;
        return;
      }
      asio::async_read(socket, asio::buffer(header), [&](boost::system::error_code e2, size_t) {
        uint32_t length = le32(header);
        if (e2 || length == 0 || length > options.max_frame_bytes) {
          ec = e2;
          oversized = !e2;
          done = true;
          return;
        }
        payload.resize(length);
        asio::async_read(socket, asio::buffer(payload), [&](boost::system::error_code e3, size_t) {
          ec = e3;
          done = true;
        });
      });
    });
    if (!run_until(done, Clock::now() + timeout)) {
      broken = make_error(ErrorCode::kUnavailable,
                          "store at {}: no reply within {:.1f} s; the connection is closed", where,
                          timeout.count() / 1000.0);
      return make_error(ErrorCode::kTimeout, "store at {}: no reply within {:.1f} s", where,
                        timeout.count() / 1000.0);
    }
    if (ec || oversized) {
      boost::system::error_code ignored;
      socket.close(ignored);
      broken = make_error(ErrorCode::kUnavailable, "store at {}: {}", where,
                          oversized                ? "reply frame out of bounds"
                          : ec == asio::error::eof ? "the server closed the connection"
                                                   : ec.message());
      return broken;
    }
    Reader in(payload);
    auto status = static_cast<Reply>(in.u8());
    return Answer{status, std::vector<uint8_t>(payload.begin() + 1, payload.end())};
  }

  // The Status an answer other than kOk stands for.
  Status answer_error(const Answer& a, std::string_view what) {
    std::string text(a.body.begin(), a.body.end());
    switch (a.status) {
      case Reply::kOk:
        return Status::ok();
      case Reply::kTimeout:
        return make_error(ErrorCode::kTimeout, "store at {}: {}: {}", where, what, text);
      case Reply::kRefused:
        return make_error(ErrorCode::kInvalidArgument, "store at {} refused {}: {}", where, what,
                          text);
      case Reply::kError:
        return make_error(ErrorCode::kInvalidArgument, "store at {}: {}: {}", where, what, text);
    }
    return make_error(ErrorCode::kInternal, "store at {}: unknown reply status", where);
  }
};

TcpStoreClient::TcpStoreClient(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
TcpStoreClient::~TcpStoreClient() = default;

Result<std::unique_ptr<TcpStoreClient>> TcpStoreClient::connect(StoreClientOptions options) {
  auto impl = std::make_unique<Impl>();
  impl->where = fmt::format("{}:{}", options.host, options.port);
  impl->options = options;
  const auto deadline = Clock::now() + options.connect_timeout;
  auto backoff = std::chrono::milliseconds(20);
  Status last;
  for (;;) {
    last = impl->connect_once(deadline);
    if (last.is_ok()) break;
    auto left = deadline - Clock::now();
    if (left <= Clock::duration::zero()) {
      return make_error(ErrorCode::kUnavailable, "cannot reach the store at {} within {:.1f} s: {}",
                        impl->where, options.connect_timeout.count() / 1000.0, last.message());
    }
    std::this_thread::sleep_for(std::min<Clock::duration>(backoff, left));
    backoff = std::min(backoff * 2, std::chrono::milliseconds(500));
  }
  ZINF_ASSIGN_OR_RETURN(std::string token, resolve_token(options.token));
  Writer hello = wire::encode_request(
      {.op = Op::kHello, .version = kStoreProtocolVersion, .token = std::move(token)});
  ZINF_ASSIGN_OR_RETURN(auto answer, impl->transact(hello, options.io_timeout));
  if (answer.status != Reply::kOk) {
    Status refused = impl->answer_error(answer, "this client");
    if (std::string(answer.body.begin(), answer.body.end()) == "wrong token") {
      refused.with_context(
          fmt::format("the token differs from the server's (set {} alike on "
                      "every rank)",
                      kStoreTokenEnv));
    }
    return refused;
  }
  return std::unique_ptr<TcpStoreClient>(new TcpStoreClient(std::move(impl)));
}

Status TcpStoreClient::set(std::string_view key, std::string_view value) {
  std::lock_guard lock(impl_->mu);
  Writer w = wire::encode_request(
      {.op = Op::kSet, .keys = {std::string(key)}, .value = std::string(value)});
  ZINF_ASSIGN_OR_RETURN(auto answer, impl_->transact(w, impl_->options.io_timeout));
  return impl_->answer_error(answer, fmt::format("set '{}'", key));
}

Result<std::string> TcpStoreClient::get(std::string_view key, std::chrono::milliseconds timeout) {
  std::lock_guard lock(impl_->mu);
  Writer w = wire::encode_request(
      {.op = Op::kGet, .timeout_ms = clamp_ms(timeout), .keys = {std::string(key)}});
  ZINF_ASSIGN_OR_RETURN(auto answer, impl_->transact(w, timeout + impl_->options.io_timeout));
  ZINF_RETURN_IF_ERROR(impl_->answer_error(answer, fmt::format("get '{}'", key)));
  return std::string(answer.body.begin(), answer.body.end());
}

Status TcpStoreClient::wait(std::span<const std::string> keys, std::chrono::milliseconds timeout) {
  std::lock_guard lock(impl_->mu);
  if (keys.size() > wire::kMaxWaitKeys) {
    return make_error(ErrorCode::kInvalidArgument, "store: wait on {} keys (at most {})",
                      keys.size(), wire::kMaxWaitKeys);
  }
  Writer w = wire::encode_request({.op = Op::kWait,
                                   .timeout_ms = clamp_ms(timeout),
                                   .keys = std::vector<std::string>(keys.begin(), keys.end())});
  ZINF_ASSIGN_OR_RETURN(auto answer, impl_->transact(w, timeout + impl_->options.io_timeout));
  return impl_->answer_error(answer, "wait");
}

Result<int64_t> TcpStoreClient::add(std::string_view key, int64_t delta) {
  std::lock_guard lock(impl_->mu);
  Writer w = wire::encode_request({.op = Op::kAdd, .delta = delta, .keys = {std::string(key)}});
  ZINF_ASSIGN_OR_RETURN(auto answer, impl_->transact(w, impl_->options.io_timeout));
  ZINF_RETURN_IF_ERROR(impl_->answer_error(answer, fmt::format("add to '{}'", key)));
  if (answer.body.size() != 8) {
    return make_error(ErrorCode::kCorrupt, "store at {}: malformed reply to add", impl_->where);
  }
  Reader in(answer.body);
  return in.i64();
}

// ---- rendezvous through the store
// ----------------------------------------------------------------

ShareFromRank0 store_share_from_rank0(StoreRendezvous rv) {
  // The server (rank 0) and the client outlive the call: they belong to the function object.
  struct State {
    StoreRendezvous rv;
    std::unique_ptr<TcpStoreServer> server;
    std::unique_ptr<TcpStoreClient> client;
  };
  auto state = std::make_shared<State>();
  state->rv = std::move(rv);
  return [state](std::string_view blob) -> Result<std::string> {
    const StoreRendezvous& rv = state->rv;
    if (rv.rank == 0 && !state->server) {
      // Every rank holds one connection; the rest is room for retries and strays.
      ZINF_ASSIGN_OR_RETURN(
          state->server,
          TcpStoreServer::start(
              {.host = rv.bind_host,
               .port = rv.master_port,
               .max_connections = std::max<size_t>(1024, 2 * static_cast<size_t>(rv.world_size))}));
    }
    if (!state->client) {
      ZINF_ASSIGN_OR_RETURN(
          state->client,
          TcpStoreClient::connect(
              {.host = rv.master_addr, .port = rv.master_port, .connect_timeout = rv.timeout}));
    }
    if (rv.rank == 0) {
      ZINF_RETURN_IF_ERROR(state->client->set(rv.key, blob));
      return std::string(blob);
    }
    return state->client->get(rv.key, rv.timeout);
  };
}

}  // namespace zinf::comm
