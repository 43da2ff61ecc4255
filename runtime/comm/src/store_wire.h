// The TCP rendezvous store's wire format (store.cc has the grammar): the byte codecs both ends
// use, and the one function that turns a request payload into a Request. Internal to zinf_comm_core
// (and tests/fuzz, which feeds decode_request arbitrary bytes).
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace zinf::comm::wire {

enum class Op : uint8_t { kHello = 1, kSet = 2, kGet = 3, kWait = 4, kAdd = 5 };
enum class Reply : uint8_t { kOk = 0, kTimeout = 1, kRefused = 2, kError = 3 };

inline constexpr size_t kMaxWaitKeys = 1 << 16;

class Writer {
 public:
  Writer& u8(uint8_t v) {
    bytes_.push_back(v);
    return *this;
  }
  Writer& u32(uint32_t v) {
    for (int i = 0; i < 4; ++i) bytes_.push_back(static_cast<uint8_t>(v >> (8 * i)));
    return *this;
  }
  Writer& i64(int64_t v) {
    auto u = static_cast<uint64_t>(v);
    for (int i = 0; i < 8; ++i) bytes_.push_back(static_cast<uint8_t>(u >> (8 * i)));
    return *this;
  }
  Writer& raw(std::string_view s) {
    bytes_.insert(bytes_.end(), s.begin(), s.end());
    return *this;
  }
  Writer& str(std::string_view s) { return u32(static_cast<uint32_t>(s.size())).raw(s); }
  // The payload behind its length prefix.
  std::vector<uint8_t> frame() const {
    std::vector<uint8_t> out;
    out.reserve(bytes_.size() + 4);
    for (int i = 0; i < 4; ++i) out.push_back(static_cast<uint8_t>(bytes_.size() >> (8 * i)));
    out.insert(out.end(), bytes_.begin(), bytes_.end());
    return out;
  }
  size_t size() const { return bytes_.size(); }
  std::string_view view() const {
    return {reinterpret_cast<const char*>(bytes_.data()), bytes_.size()};
  }

 private:
  std::vector<uint8_t> bytes_;
};

// Reads fields off a payload; any read past the end sets !ok() and yields zeros.
class Reader {
 public:
  explicit Reader(std::span<const uint8_t> bytes) : bytes_(bytes) {}
  bool ok() const { return ok_; }
  bool done() const { return ok_ && pos_ == bytes_.size(); }
  uint8_t u8() { return static_cast<uint8_t>(fixed(1)); }
  uint32_t u32() { return static_cast<uint32_t>(fixed(4)); }
  int64_t i64() { return static_cast<int64_t>(fixed(8)); }
  std::string str() { return raw(u32()); }
  std::string rest() { return raw(bytes_.size() - pos_); }

 private:
  uint64_t fixed(int n) {
    if (!ok_ || bytes_.size() - pos_ < static_cast<size_t>(n)) {
      ok_ = false;
      return 0;
    }
    uint64_t v = 0;
    for (int i = 0; i < n; ++i) v |= uint64_t{bytes_[pos_ + i]} << (8 * i);
    pos_ += n;
    return v;
  }
  std::string raw(size_t n) {
    if (!ok_ || bytes_.size() - pos_ < n) {
      ok_ = false;
      return {};
    }
    std::string s(reinterpret_cast<const char*>(bytes_.data() + pos_), n);
    pos_ += n;
    return s;
  }

  std::span<const uint8_t> bytes_;
  size_t pos_ = 0;
  bool ok_ = true;
};

// One request. Fields an op does not carry stay empty: HELLO (version, token), SET (keys[0],
// value), GET (timeout_ms, keys[0]), WAIT (timeout_ms, keys), ADD (delta, keys[0]).
struct Request {
  Op op = Op::kHello;
  uint32_t version = 0;
  std::string token;
  uint32_t timeout_ms = 0;
  int64_t delta = 0;
  std::vector<std::string> keys;
  std::string value;

  bool operator==(const Request&) const = default;
};

// The request a payload holds, or nullopt when it is malformed: an unknown op, a field cut short,
// bytes left over, or a WAIT on more than kMaxWaitKeys keys. Every well-formed payload is
// encode_request(*decode_request(p)) byte for byte.
std::optional<Request> decode_request(std::span<const uint8_t> payload);
// The payload the client sends for `request`.
Writer encode_request(const Request& request);

// The largest payload the server reads in one frame: kPreAuthFrameBytes (capped by
// max_frame_bytes) before HELLO succeeds, max_frame_bytes after. A length of 0 or above this
// closes the connection.
size_t frame_limit(bool authenticated, size_t max_frame_bytes);

}  // namespace zinf::comm::wire
