// The TCP store, on 127.0.0.1 only: set/get/wait/add, concurrent clients, timeouts, malformed and
// oversized frames (the connection closes, the server serves on), tokens, an unreachable store.
#include "zinf/comm/store.h"

#include <arpa/inet.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

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
