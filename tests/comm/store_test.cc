// The TCP store, on 127.0.0.1 only: set/get/wait/add, concurrent clients, timeouts, malformed and
// oversized frames (the connection closes, the server serves on), tokens, an unreachable store;
// and the defences against a hostile peer: the pre-authentication frame limit, no
// listening beyond loopback without a token, token files, the handshake timeout, the connection
// limit, a waiting client that hangs up, and accept failures (EMFILE) that must not spin.
#include "zinf/comm/store.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <thread>

namespace zinf::comm {
namespace {

using namespace std::chrono_literals;
using ::testing::HasSubstr;

std::unique_ptr<TcpStoreServer> serve(StoreServerOptions options = {}) {
  if (!options.token) options.token = "";
  auto server = TcpStoreServer::start(options);
  ZINF_CHECK(server.is_ok(), "{}", server.status().to_string());
  return std::move(server).value();
}

Result<std::unique_ptr<TcpStoreClient>> connect_to(const TcpStoreServer& server,
                                                   std::string token = "") {
  return TcpStoreClient::connect({.host = "127.0.0.1",
                                  .port = server.port(),
                                  .token = std::move(token),
                                  .connect_timeout = 5s,
                                  .io_timeout = 5s});
}

std::unique_ptr<TcpStoreClient> client_of(const TcpStoreServer& server) {
  auto client = connect_to(server);
  ZINF_CHECK(client.is_ok(), "{}", client.status().to_string());
  return std::move(client).value();
}

// A raw TCP connection to the server, to send what a well-behaved client never would.
class RawConnection {
 public:
  explicit RawConnection(uint16_t port) {
    fd_ = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(port);
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    ZINF_CHECK(::connect(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0);
    timeval tv{.tv_sec = 5, .tv_usec = 0};
    ::setsockopt(fd_, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  }
  ~RawConnection() { ::close(fd_); }
  int fd() const { return fd_; }
  // One reply frame's status byte, or -1 when the connection ended first.
  int read_reply_status() {
    uint8_t buf[5];
    size_t got = 0;
    while (got < sizeof(buf)) {
      ssize_t n = ::recv(fd_, buf + got, sizeof(buf) - got, 0);
      if (n <= 0) return -1;
      got += static_cast<size_t>(n);
    }
    return buf[4];
  }

  void send(const std::vector<uint8_t>& bytes) {
    ZINF_CHECK(::send(fd_, bytes.data(), bytes.size(), MSG_NOSIGNAL) ==
               static_cast<ssize_t>(bytes.size()));
  }
  // A frame: little-endian length, then the payload.
  void send_frame(const std::vector<uint8_t>& payload) {
    std::vector<uint8_t> frame = le32(static_cast<uint32_t>(payload.size()));
    frame.insert(frame.end(), payload.begin(), payload.end());
    send(frame);
  }
  // True when the server closed the connection (EOF) before sending anything more than a reply.
  bool closed_by_server() {
    uint8_t buf[256];
    for (;;) {
      ssize_t n = ::recv(fd_, buf, sizeof(buf), 0);
      if (n == 0) return true;
      if (n < 0) return errno == ECONNRESET;  // a timeout (EAGAIN) means still open
    }
  }

  static std::vector<uint8_t> le32(uint32_t v) {
    return {uint8_t(v), uint8_t(v >> 8), uint8_t(v >> 16), uint8_t(v >> 24)};
  }
  static std::vector<uint8_t> hello(std::string_view token = "") {
    std::vector<uint8_t> p{1};
    for (uint8_t b : le32(kStoreProtocolVersion)) p.push_back(b);
    for (uint8_t b : le32(static_cast<uint32_t>(token.size()))) p.push_back(b);
    p.insert(p.end(), token.begin(), token.end());
    return p;
  }

 private:
  int fd_ = -1;
};

TEST(Store, SetGetOverwriteAndBinaryValues) {
  auto server = serve();
  auto client = client_of(*server);
  ASSERT_TRUE(client->set("a", "1").is_ok());
  EXPECT_EQ(client->get("a", 1s).value(), "1");
  ASSERT_TRUE(client->set("a", "two").is_ok());
  EXPECT_EQ(client->get("a", 1s).value(), "two");
  std::string binary("\0\x01\xff zero", 8);
  ASSERT_TRUE(client->set("bin", binary).is_ok());
  EXPECT_EQ(client->get("bin", 1s).value(), binary);
  ASSERT_TRUE(client->set("empty", "").is_ok());
  EXPECT_EQ(client->get("empty", 1s).value(), "");
  EXPECT_NE(server->port(), 0);
}

TEST(Store, GetBlocksUntilAnotherClientSets) {
  auto server = serve();
  auto waiter = client_of(*server);
  auto setter = client_of(*server);
  std::thread later([&] {
    std::this_thread::sleep_for(50ms);
    EXPECT_TRUE(setter->set("ready", "yes").is_ok());
  });
  auto value = waiter->get("ready", 10s);
  later.join();
  ASSERT_TRUE(value.is_ok()) << value.status().to_string();
  EXPECT_EQ(value.value(), "yes");
}

TEST(Store, GetAndWaitTimeOutNamingTheMissingKeys) {
  auto server = serve();
  auto client = client_of(*server);
  auto start = std::chrono::steady_clock::now();
  auto missing = client->get("never", 100ms);
  EXPECT_EQ(missing.status().code(), ErrorCode::kTimeout);
  EXPECT_THAT(missing.status().message(), HasSubstr("'never'"));
  ASSERT_TRUE(client->set("here", "1").is_ok());
  std::vector<std::string> keys{"here", "gone", "lost"};
  Status s = client->wait(keys, 100ms);
  EXPECT_EQ(s.code(), ErrorCode::kTimeout);
  EXPECT_THAT(s.message(), HasSubstr("'gone', 'lost'"));
  EXPECT_THAT(s.message(), ::testing::Not(HasSubstr("'here'")));
  EXPECT_LT(std::chrono::steady_clock::now() - start, 3s);
  // The connection is still good after a timeout reply.
  EXPECT_TRUE(client->wait(std::vector<std::string>{"here"}, 100ms).is_ok());
}

TEST(Store, WaitReturnsWhenTheLastKeyArrives) {
  auto server = serve();
  auto waiter = client_of(*server);
  std::vector<std::thread> setters;
  for (int i = 0; i < 4; ++i) {
    setters.emplace_back([&, i] {
      auto c = client_of(*server);
      EXPECT_TRUE(c->set(fmt::format("rank/{}", i), "up").is_ok());
    });
  }
  std::vector<std::string> keys{"rank/0", "rank/1", "rank/2", "rank/3"};
  EXPECT_TRUE(waiter->wait(keys, 10s).is_ok());
  for (auto& t : setters) t.join();
}

TEST(Store, ConcurrentAddsAreAtomic) {
  auto server = serve();
  constexpr int kClients = 8, kAdds = 50;
  std::vector<std::thread> threads;
  for (int i = 0; i < kClients; ++i) {
    threads.emplace_back([&] {
      auto c = client_of(*server);
      for (int k = 0; k < kAdds; ++k) EXPECT_TRUE(c->add("counter", 1).is_ok());
    });
  }
  for (auto& t : threads) t.join();
  auto client = client_of(*server);
  EXPECT_EQ(client->add("counter", 0).value(), kClients * kAdds);
  EXPECT_EQ(client->get("counter", 1s).value(), std::to_string(kClients * kAdds));
  EXPECT_EQ(client->add("counter", -400).value(), 0);
  EXPECT_EQ(client->add("fresh", -5).value(), -5);
  ASSERT_TRUE(client->set("text", "abc").is_ok());
  auto bad = client->add("text", 1);
  EXPECT_EQ(bad.status().code(), ErrorCode::kInvalidArgument);
  EXPECT_THAT(bad.status().message(), HasSubstr("not an integer"));
  EXPECT_EQ(client->add("counter", 1).value(), 1);  // still usable after an error reply
}

TEST(Store, OneClientSharedByThreads) {
  auto server = serve();
  auto client = client_of(*server);
  std::vector<std::thread> threads;
  for (int i = 0; i < 4; ++i) {
    threads.emplace_back([&] {
      for (int k = 0; k < 25; ++k) EXPECT_TRUE(client->add("n", 1).is_ok());
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(client->get("n", 1s).value(), "100");
}

TEST(Store, MalformedFramesCloseOnlyThatConnection) {
  auto server = serve();
  auto good = client_of(*server);
  ASSERT_TRUE(good->set("k", "v").is_ok());
  {
    RawConnection raw(server->port());  // a request before HELLO is refused, then closed
    raw.send_frame({2, 1, 0, 0, 0, 'k', 1, 0, 0, 0, 'v'});
    EXPECT_TRUE(raw.closed_by_server());
  }
  {
    RawConnection raw(server->port());  // a zero-length frame
    raw.send(RawConnection::le32(0));
    EXPECT_TRUE(raw.closed_by_server());
  }
  {
    RawConnection raw(server->port());  // a string length running past the frame's end
    raw.send_frame(RawConnection::hello());
    raw.send_frame({2, 0xff, 0xff, 0, 0, 'k'});
    EXPECT_TRUE(raw.closed_by_server());
  }
  {
    RawConnection raw(server->port());  // trailing bytes after a well-formed request
    raw.send_frame(RawConnection::hello());
    raw.send_frame({3, 0, 0, 0, 0, 1, 0, 0, 0, 'k', 'x'});
    EXPECT_TRUE(raw.closed_by_server());
  }
  {
    RawConnection raw(server->port());  // an unknown operation
    raw.send_frame(RawConnection::hello());
    raw.send_frame({99});
    EXPECT_TRUE(raw.closed_by_server());
  }
  {
    RawConnection raw(server->port());  // a WAIT announcing more keys than allowed
    raw.send_frame(RawConnection::hello());
    raw.send_frame({4, 0, 0, 0, 0, 0xff, 0xff, 0xff, 0xff});
    EXPECT_TRUE(raw.closed_by_server());
  }
  // The server and its other connections are unharmed.
  EXPECT_EQ(good->get("k", 1s).value(), "v");
  EXPECT_EQ(client_of(*server)->get("k", 1s).value(), "v");
}

TEST(Store, OversizedFramesAreRefusedOnBothSides) {
  auto server = serve({.max_frame_bytes = 1024});
  {
    RawConnection raw(server->port());  // announces 1 GiB: closed before anything is allocated
    raw.send(RawConnection::le32(1u << 30));
    EXPECT_TRUE(raw.closed_by_server());
  }
  auto client = client_of(*server);
  // The server's limit: a 2 KiB value makes a frame over 1 KiB; the server drops the connection.
  Status big = client->set("big", std::string(2048, 'x'));
  EXPECT_FALSE(big.is_ok());
  EXPECT_EQ(big.code(), ErrorCode::kUnavailable);
  // The client's own limit is checked before sending and leaves the connection open.
  auto limited = TcpStoreClient::connect(
      {.host = "127.0.0.1", .port = server->port(), .token = "", .max_frame_bytes = 512});
  ASSERT_TRUE(limited.is_ok());
  Status local = limited.value()->set("big", std::string(600, 'x'));
  EXPECT_EQ(local.code(), ErrorCode::kInvalidArgument);
  EXPECT_THAT(local.message(), HasSubstr("frame limit"));
  EXPECT_TRUE(limited.value()->set("small", "ok").is_ok());
  EXPECT_EQ(client_of(*server)->get("small", 1s).value(), "ok");
}

TEST(Store, WrongOrMissingTokenIsRefusedBeforeAnyRequest) {
  auto server = serve({.token = "s3cret"});
  auto wrong = connect_to(*server, "guess");
  ASSERT_FALSE(wrong.is_ok());
  EXPECT_EQ(wrong.status().code(), ErrorCode::kInvalidArgument);
  EXPECT_THAT(wrong.status().message(), HasSubstr("wrong token"));
  EXPECT_THAT(wrong.status().message(), HasSubstr("ZINF_STORE_TOKEN"));
  EXPECT_FALSE(connect_to(*server, "").is_ok());
  EXPECT_FALSE(connect_to(*server, "s3cret-and-more").is_ok());
  {
    RawConnection raw(server->port());  // a wrong HELLO, then a SET anyway: never served
    raw.send_frame(RawConnection::hello("nope"));
    raw.send_frame({2, 1, 0, 0, 0, 'k', 1, 0, 0, 0, 'v'});
    EXPECT_TRUE(raw.closed_by_server());
  }
  auto right = connect_to(*server, "s3cret");
  ASSERT_TRUE(right.is_ok()) << right.status().to_string();
  EXPECT_EQ(right.value()->get("k", 50ms).status().code(), ErrorCode::kTimeout);
}

TEST(Store, TokenFromTheEnvironment) {
  // Options without a token read ZINF_STORE_TOKEN, on the server and on the client.
  ::setenv(kStoreTokenEnv, "from-env", 1);
  auto server = TcpStoreServer::start({});
  ASSERT_TRUE(server.is_ok());
  auto client = TcpStoreClient::connect({.host = "127.0.0.1", .port = server.value()->port()});
  ::unsetenv(kStoreTokenEnv);
  ASSERT_TRUE(client.is_ok()) << client.status().to_string();
  EXPECT_FALSE(connect_to(*server.value(), "").is_ok());
  EXPECT_TRUE(connect_to(*server.value(), "from-env").is_ok());
}

TEST(Store, BeforeHelloOnlyASmallFrameIsAccepted) {
  auto server = serve();  // max_frame_bytes: the 64 MiB default
  {
    // 2 KiB announced before HELLO: closed at once. Had the server taken the length, it would be
    // waiting for the payload and the connection would still be open at the 5 s receive timeout.
    RawConnection raw(server->port());
    raw.send(RawConnection::le32(static_cast<uint32_t>(kPreAuthFrameBytes) + 1));
    auto start = std::chrono::steady_clock::now();
    EXPECT_TRUE(raw.closed_by_server());
    EXPECT_LT(std::chrono::steady_clock::now() - start, 2s);
  }
  {
    RawConnection raw(server->port());  // the largest length the 64 MiB limit allows
    raw.send(RawConnection::le32(64u << 20));
    EXPECT_TRUE(raw.closed_by_server());
  }
  // After HELLO the full limit applies: a 4 KiB value goes through.
  auto client = client_of(*server);
  ASSERT_TRUE(client->set("k", std::string(4096, 'v')).is_ok());
  EXPECT_EQ(client->get("k", 1s).value().size(), 4096u);
}

TEST(Store, ListeningBeyondLoopbackNeedsAToken) {
  ::unsetenv(kStoreTokenEnv);
  ::unsetenv(kStoreTokenFileEnv);
  auto open = TcpStoreServer::start({.host = "0.0.0.0"});
  ASSERT_FALSE(open.is_ok());
  EXPECT_EQ(open.status().code(), ErrorCode::kInvalidArgument);
  EXPECT_THAT(open.status().message(), HasSubstr("refusing to listen on 0.0.0.0"));
  EXPECT_THAT(open.status().message(), HasSubstr("Set ZINF_STORE_TOKEN"));
  EXPECT_THAT(open.status().message(), HasSubstr("ZINF_STORE_TOKEN_FILE"));
  EXPECT_FALSE(TcpStoreServer::start({.host = "0.0.0.0", .token = ""}).is_ok());
  // With a token it listens; loopback needs none (an IPv4 or IPv6 loopback, or a name for one).
  auto guarded = TcpStoreServer::start({.host = "0.0.0.0", .token = "s3cret"});
  ASSERT_TRUE(guarded.is_ok()) << guarded.status().to_string();
  EXPECT_TRUE(connect_to(*guarded.value(), "s3cret").is_ok());
  EXPECT_FALSE(connect_to(*guarded.value(), "").is_ok());
  EXPECT_TRUE(TcpStoreServer::start({.host = "localhost", .token = ""}).is_ok());
  EXPECT_TRUE(TcpStoreServer::start({.host = "127.0.0.1"}).is_ok());
  // A token longer than a pre-authentication frame can carry is refused up front.
  auto huge = TcpStoreServer::start({.token = std::string(kMaxStoreTokenBytes + 1, 't')});
  EXPECT_THAT(huge.status().message(), HasSubstr("longer than the 512 allowed"));
}

class TokenFile : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::filesystem::temp_directory_path() /
           fmt::format("zinf-store-token-{}-{}", ::getpid(),
                       ::testing::UnitTest::GetInstance()->current_test_info()->name());
    std::filesystem::remove_all(dir_);
    std::filesystem::create_directories(dir_);
    ::unsetenv(kStoreTokenEnv);
  }
  void TearDown() override {
    ::unsetenv(kStoreTokenEnv);
    ::unsetenv(kStoreTokenFileEnv);
    std::filesystem::remove_all(dir_);
  }
  std::string write(const std::string& name, const std::string& text, mode_t mode) {
    std::string path = (dir_ / name).string();
    std::ofstream(path) << text;
    ::chmod(path.c_str(), mode);
    return path;
  }
  std::filesystem::path dir_;
};

TEST_F(TokenFile, A0600FileGivesTheTokenToServerAndClient) {
  ::setenv(kStoreTokenFileEnv, write("token", "from-a-file\n", 0600).c_str(), 1);
  EXPECT_EQ(store_token_from_env().value(), "from-a-file");  // the trailing newline dropped
  auto server = TcpStoreServer::start({.host = "0.0.0.0"});  // beyond loopback: needs it
  ASSERT_TRUE(server.is_ok()) << server.status().to_string();
  auto client = TcpStoreClient::connect({.host = "127.0.0.1", .port = server.value()->port()});
  ASSERT_TRUE(client.is_ok()) << client.status().to_string();
  EXPECT_FALSE(connect_to(*server.value(), "").is_ok());
  // ZINF_STORE_TOKEN, when set, comes first.
  ::setenv(kStoreTokenEnv, "from-env", 1);
  EXPECT_EQ(store_token_from_env().value(), "from-env");
}

TEST_F(TokenFile, UnsafeOrUnusableFilesAreClearErrors) {
  struct Case {
    std::string path;
    std::string expect;
  };
  std::string fifo = (dir_ / "fifo").string();
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  const std::vector<Case> cases = {
      {write("readable", "t", 0644), "mode 0644 lets group or others read or write it; chmod 600"},
      {write("group", "t", 0660), "mode 0660"},
      {write("empty", "", 0600), "empty"},
      {write("long", std::string(kMaxStoreTokenBytes + 10, 't'), 0600), "a token is at most 512"},
      {fifo, "not a regular file"},  // and the open does not block on it
      {(dir_ / "missing").string(), "No such file"},
  };
  for (const Case& c : cases) {
    ::setenv(kStoreTokenFileEnv, c.path.c_str(), 1);
    auto token = store_token_from_env();
    ASSERT_FALSE(token.is_ok()) << c.path;
    EXPECT_THAT(token.status().detail(), HasSubstr("ZINF_STORE_TOKEN_FILE=" + c.path));
    EXPECT_THAT(token.status().detail(), HasSubstr(c.expect));
    // The server and the client refuse to start on it rather than run without a token.
    EXPECT_FALSE(TcpStoreServer::start({}).is_ok()) << c.path;
  }
}

TEST(Store, AClientThatSaysNothingIsDroppedAfterTheHandshakeTimeout) {
  auto server = serve({.handshake_timeout = 200ms});
  auto start = std::chrono::steady_clock::now();
  {
    RawConnection silent(server->port());
    EXPECT_TRUE(silent.closed_by_server());
  }
  {
    RawConnection dripping(server->port());  // half a header, then nothing
    dripping.send({4, 0});
    EXPECT_TRUE(dripping.closed_by_server());
  }
  auto elapsed = std::chrono::steady_clock::now() - start;
  EXPECT_GE(elapsed, 350ms);
  EXPECT_LT(elapsed, 4s);  // not the 5 s receive timeout of the raw connection
  // A client that did say HELLO may stay idle for longer.
  auto client = client_of(*server);
  std::this_thread::sleep_for(400ms);
  EXPECT_TRUE(client->set("still", "here").is_ok());
}

// Connects a client, retrying a refusal for up to 3 s (the server notices a closed connection
// asynchronously).
Result<std::unique_ptr<TcpStoreClient>> connect_eventually(const TcpStoreServer& server) {
  auto deadline = std::chrono::steady_clock::now() + 3s;
  for (;;) {
    auto client = connect_to(server);
    if (client.is_ok() || std::chrono::steady_clock::now() > deadline) return client;
    std::this_thread::sleep_for(20ms);
  }
}

TEST(Store, ConnectionsBeyondTheLimitAreRefused) {
  auto server = serve({.max_connections = 2});
  auto a = client_of(*server);
  auto b = client_of(*server);
  auto third = connect_to(*server);
  ASSERT_FALSE(third.is_ok());
  EXPECT_THAT(third.status().message(), HasSubstr("at most 2 connections"));
  {
    RawConnection raw(server->port());  // unauthenticated connections count too
    EXPECT_TRUE(raw.closed_by_server());
  }
  // A closed connection frees its slot.
  b.reset();
  auto again = connect_eventually(*server);
  ASSERT_TRUE(again.is_ok()) << again.status().to_string();
  EXPECT_TRUE(a->set("k", "v").is_ok());
}

TEST(Store, AClientThatHangsUpWhileWaitingReleasesItsWait) {
  // One connection allowed: a client parked in a 60 s GET holds it until it hangs up.
  auto server = serve({.max_connections = 1});
  {
    RawConnection raw(server->port());
    raw.send_frame(RawConnection::hello());
    ASSERT_EQ(raw.read_reply_status(), 0);
    raw.send_frame({3, 0x60, 0xea, 0, 0, 1, 0, 0, 0, 'k'});  // GET 'k', 60 000 ms
    std::this_thread::sleep_for(100ms);
    EXPECT_FALSE(connect_to(*server).is_ok());  // the slot is taken
  }                                             // hangs up mid-wait
  auto start = std::chrono::steady_clock::now();
  auto next = connect_eventually(*server);
  ASSERT_TRUE(next.is_ok()) << next.status().to_string();
  EXPECT_LT(std::chrono::steady_clock::now() - start, 3s);
  // The server goes on serving waits: set from this client, answered at once.
  EXPECT_TRUE(next.value()->set("k", "v").is_ok());
  EXPECT_EQ(next.value()->get("k", 1s).value(), "v");
}

// The CPU time this process has used, user and system.
double cpu_seconds() {
  rusage ru{};
  ::getrusage(RUSAGE_SELF, &ru);
  return static_cast<double>(ru.ru_utime.tv_sec + ru.ru_stime.tv_sec) +
         static_cast<double>(ru.ru_utime.tv_usec + ru.ru_stime.tv_usec) / 1e6;
}

// In a child process: descriptors exhausted, so accept fails with EMFILE while a connection waits
// in the backlog. The server must pause between attempts (little CPU for a second) and serve the
// connection once descriptors are free again. Exit codes name what failed.
int accept_emfile_child() {
  auto server = TcpStoreServer::start({.token = ""});
  if (!server.is_ok()) return 10;
  rlimit limit{};
  if (::getrlimit(RLIMIT_NOFILE, &limit) != 0) return 11;
  limit.rlim_cur = 256;
  if (::setrlimit(RLIMIT_NOFILE, &limit) != 0) return 12;
  std::vector<int> fillers;
  for (;;) {
    int fd = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
    if (fd < 0) break;
    fillers.push_back(fd);
  }
  if (errno != EMFILE || fillers.empty()) return 13;
  ::close(fillers.back());  // one descriptor for the client's socket, none for the server
  fillers.pop_back();
  int client = ::socket(AF_INET, SOCK_STREAM, 0);
  if (client < 0) return 14;
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(server.value()->port());
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::connect(client, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) return 15;
  const double cpu0 = cpu_seconds();
  std::this_thread::sleep_for(1s);
  const double spent = cpu_seconds() - cpu0;
  std::fprintf(stderr, "CPU while accept fails with EMFILE: %.3f s in 1 s\n", spent);
  if (spent > 0.25) return 16;  // a spinning accept loop burns most of a core
  for (int fd : fillers) ::close(fd);
  // Served once descriptors are back (within the longest pause).
  timeval tv{.tv_sec = 5, .tv_usec = 0};
  ::setsockopt(client, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  std::vector<uint8_t> hello = RawConnection::hello();
  std::vector<uint8_t> frame = RawConnection::le32(static_cast<uint32_t>(hello.size()));
  frame.insert(frame.end(), hello.begin(), hello.end());
  if (::send(client, frame.data(), frame.size(), MSG_NOSIGNAL) !=
      static_cast<ssize_t>(frame.size())) {
    return 17;
  }
  uint8_t reply[5];
  size_t got = 0;
  while (got < sizeof(reply)) {
    ssize_t n = ::recv(client, reply + got, sizeof(reply) - got, 0);
    if (n <= 0) return 18;
    got += static_cast<size_t>(n);
  }
  return reply[4] == 0 ? 0 : 19;
}

TEST(Store, FailingAcceptsPauseInsteadOfSpinning) {
  pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) ::_exit(accept_emfile_child());
  int status = 0;
  auto deadline = std::chrono::steady_clock::now() + 30s;
  pid_t done = 0;
  while ((done = ::waitpid(pid, &status, WNOHANG)) == 0 &&
         std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(20ms);
  }
  if (done == 0) {
    ::kill(pid, SIGKILL);
    ::waitpid(pid, &status, 0);
    FAIL() << "the child did not finish within 30 s";
  }
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0) << "exit code names the failed step in accept_emfile_child "
                                       "(16: the accept loop spun)";
}

TEST(Store, AnUnreachableStoreFailsWithinTheConnectTimeout) {
  uint16_t port;
  {
    auto server = serve();
    port = server->port();
  }  // closed: nothing listens there now
  auto start = std::chrono::steady_clock::now();
  auto client = TcpStoreClient::connect(
      {.host = "127.0.0.1", .port = port, .token = "", .connect_timeout = 300ms});
  auto elapsed = std::chrono::steady_clock::now() - start;
  ASSERT_FALSE(client.is_ok());
  EXPECT_EQ(client.status().code(), ErrorCode::kUnavailable);
  EXPECT_THAT(client.status().message(), HasSubstr(fmt::format("127.0.0.1:{}", port)));
  EXPECT_LT(elapsed, 3s);
}

TEST(Store, ClientRetriesUntilTheServerComesUp) {
  // Reserve a port, free it, then start the server there a little after the client tries.
  uint16_t port;
  {
    auto probe = serve();
    port = probe->port();
  }
  std::unique_ptr<TcpStoreServer> server;
  std::thread starter([&] {
    std::this_thread::sleep_for(150ms);
    server = serve({.port = port});
  });
  auto client = TcpStoreClient::connect(
      {.host = "127.0.0.1", .port = port, .token = "", .connect_timeout = 10s});
  starter.join();
  ASSERT_TRUE(client.is_ok()) << client.status().to_string();
  EXPECT_TRUE(client.value()->set("up", "1").is_ok());
}

TEST(Store, ServerBindErrorsAreReported) {
  auto first = serve();
  auto clash = TcpStoreServer::start({.port = first->port(), .token = ""});
  EXPECT_EQ(clash.status().code(), ErrorCode::kUnavailable);
  auto empty = TcpStoreServer::start({.host = "", .token = ""});
  EXPECT_EQ(empty.status().code(), ErrorCode::kInvalidArgument);
}

TEST(Store, ShareFromRank0AcrossThreads) {
  // Three "ranks" as threads: rank 0 serves and publishes, the others fetch.
  auto probe = serve();
  uint16_t port = probe->port();
  probe.reset();
  std::vector<std::string> got(3);
  std::vector<ShareFromRank0> shares;
  for (int r = 0; r < 3; ++r) {
    shares.push_back(store_share_from_rank0(
        {.rank = r, .world_size = 3, .master_port = port, .key = "id", .timeout = 10s}));
  }
  std::vector<std::thread> threads;
  for (int r = 0; r < 3; ++r) {
    threads.emplace_back([&, r] {
      auto blob = shares[r](r == 0 ? "the-unique-id" : "");
      ASSERT_TRUE(blob.is_ok()) << blob.status().to_string();
      got[r] = blob.value();
    });
  }
  for (auto& t : threads) t.join();
  for (const std::string& g : got) EXPECT_EQ(g, "the-unique-id");
}

}  // namespace
}  // namespace zinf::comm
