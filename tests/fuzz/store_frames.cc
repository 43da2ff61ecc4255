// The rendezvous store's request decoder on an arbitrary byte stream, read as the server reads a
// connection (store.cc): u32 length-prefixed frames, at most kPreAuthFrameBytes until a HELLO is
// decoded, then at most max_frame_bytes; a frame out of bounds or a malformed payload ends the
// stream. Properties: decoding never crashes, reads past the payload or allocates more than the
// payload justifies; a decoded request re-encodes (as the client encodes it) to the payload byte
// for byte, and decodes back to itself.
#include <span>

#include "fuzz_check.h"
#include "store_wire.h"
#include "zinf/comm/store.h"

namespace wire = zinf::comm::wire;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  // A small post-HELLO limit so that the fuzzer reaches it; the server's smallest is 64.
  constexpr size_t kMaxFrameBytes = 4096;
  std::span<const uint8_t> stream(data, size);
  bool authenticated = false;
  while (stream.size() >= 4) {
    const uint32_t length = uint32_t{stream[0]} | uint32_t{stream[1]} << 8 |
                            uint32_t{stream[2]} << 16 | uint32_t{stream[3]} << 24;
    if (length == 0 || length > wire::frame_limit(authenticated, kMaxFrameBytes)) return 0;
    if (stream.size() - 4 < length) return 0;  // the peer hung up mid-frame
    std::span<const uint8_t> payload = stream.subspan(4, length);
    stream = stream.subspan(4 + length);
    FUZZ_CHECK(wire::frame_limit(authenticated, kMaxFrameBytes) <=
               (authenticated ? kMaxFrameBytes : zinf::comm::kPreAuthFrameBytes));

    std::optional<wire::Request> request = wire::decode_request(payload);
    if (!request) return 0;  // malformed: the server closes the connection
    // Every string is in the payload: nothing decoded outgrows what was sent.
    size_t string_bytes = request->token.size() + request->value.size();
    for (const std::string& key : request->keys) string_bytes += key.size() + 4;
    FUZZ_CHECK(string_bytes <= payload.size());
    if (request->op == wire::Op::kWait) FUZZ_CHECK(request->keys.size() <= wire::kMaxWaitKeys);
    if (request->op == wire::Op::kSet || request->op == wire::Op::kGet ||
        request->op == wire::Op::kAdd) {
      FUZZ_CHECK(request->keys.size() == 1);
    }

    wire::Writer encoded = wire::encode_request(*request);
    std::string_view bytes = encoded.view();
    FUZZ_CHECK(bytes.size() == payload.size());
    FUZZ_CHECK(std::equal(bytes.begin(), bytes.end(), payload.begin(),
                          [](char a, uint8_t b) { return static_cast<uint8_t>(a) == b; }));
    std::optional<wire::Request> again = wire::decode_request(
        std::span(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size()));
    FUZZ_CHECK(again && *again == *request);

    if (!authenticated) {
      if (request->op != wire::Op::kHello) return 0;  // refused: the first request must be HELLO
      authenticated = true;                           // (version and token aside)
    } else if (request->op == wire::Op::kHello) {
      return 0;  // HELLO twice is malformed
    }
  }
  return 0;
}
