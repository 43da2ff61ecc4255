#include "store_wire.h"

#include <algorithm>

#include "zinf/comm/store.h"

namespace zinf::comm::wire {

std::optional<Request> decode_request(std::span<const uint8_t> payload) {
  Reader in(payload);
  Request r;
  r.op = static_cast<Op>(in.u8());
  switch (r.op) {
    case Op::kHello:
      r.version = in.u32();
      r.token = in.str();
      break;
    case Op::kSet:
      r.keys = {in.str()};
      r.value = in.str();
      break;
    case Op::kGet:
      r.timeout_ms = in.u32();
      r.keys = {in.str()};
      break;
    case Op::kWait: {
      r.timeout_ms = in.u32();
      const uint32_t n = in.u32();
      if (n > kMaxWaitKeys) return std::nullopt;
      // Not reserved from n: a 9-byte payload must not allocate 64 Ki strings.
      for (uint32_t i = 0; i < n && in.ok(); ++i) r.keys.push_back(in.str());
      break;
    }
    case Op::kAdd:
      r.delta = in.i64();
      r.keys = {in.str()};
      break;
    default:
      return std::nullopt;
  }
  if (!in.done()) return std::nullopt;
  return r;
}

Writer encode_request(const Request& r) {
  Writer w;
  w.u8(static_cast<uint8_t>(r.op));
  switch (r.op) {
    case Op::kHello:
      w.u32(r.version).str(r.token);
      break;
    case Op::kSet:
      w.str(r.keys.at(0)).str(r.value);
      break;
    case Op::kGet:
      w.u32(r.timeout_ms).str(r.keys.at(0));
      break;
    case Op::kWait:
      w.u32(r.timeout_ms).u32(static_cast<uint32_t>(r.keys.size()));
      for (const std::string& key : r.keys) w.str(key);
      break;
    case Op::kAdd:
      w.i64(r.delta).str(r.keys.at(0));
      break;
  }
  return w;
}

size_t frame_limit(bool authenticated, size_t max_frame_bytes) {
  return authenticated ? max_frame_bytes : std::min(kPreAuthFrameBytes, max_frame_bytes);
}

}  // namespace zinf::comm::wire
