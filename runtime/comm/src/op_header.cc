#include "zinf/comm/detail/op_header.h"

#include <map>
#include <vector>

namespace zinf::comm::detail {

OpHeader make_header(const Collective& c, int rank) {
  uint64_t hash = 1469598103934665603ull;  // FNV-1a
  for (size_t n : c.counts) {
    for (int b = 0; b < 8; ++b) {
      hash ^= (static_cast<uint64_t>(n) >> (8 * b)) & 0xffu;
      hash *= 1099511628211ull;
    }
  }
  bool per_rank = c.op == CollectiveOp::kAllGather || c.op == CollectiveOp::kReduceScatter;
  bool has_own = per_rank && static_cast<size_t>(rank) < c.counts.size();
  return OpHeader{.seq = c.seq,
                  .total = c.total(),
                  .own_count = has_own ? c.counts[rank] : c.total(),
                  .counts_hash = hash,
                  .root = c.root,
                  .op = static_cast<uint8_t>(c.op),
                  .dtype = c.payload == Payload::kBytes ? kRawBytes : static_cast<uint8_t>(c.dtype),
                  .reduce = static_cast<uint8_t>(c.reduce),
                  .invalid = static_cast<uint8_t>(c.invalid.empty() ? 0 : 1)};
}

std::string format_ranks(std::span<const int> ranks) {
  std::string out = ranks.size() == 1 ? "rank " : "ranks ";
  for (size_t i = 0; i < ranks.size(); ++i) {
    if (i == 8 && ranks.size() > 9) {
      out += fmt::format(", ... ({} more)", ranks.size() - i);
      break;
    }
    out += fmt::format("{}{}", i ? ", " : "", ranks[i]);
  }
  return out;
}

namespace {

// "all_gather on ranks 0, 2; broadcast on rank 1": ranks grouped by what `describe` says.
template <typename Describe>
std::string group_ranks(std::span<const OpHeader> headers, Describe describe) {
  std::map<std::string, std::vector<int>> groups;
  std::vector<std::string> order;
  for (int r = 0; r < static_cast<int>(headers.size()); ++r) {
    std::string key = describe(headers[r]);
    if (!groups.count(key)) order.push_back(key);
    groups[key].push_back(r);
  }
  std::string out;
  for (const std::string& key : order) {
    out += fmt::format("{}{} on {}", out.empty() ? "" : "; ", key, format_ranks(groups[key]));
  }
  return out;
}

}  // namespace

Status check_headers(std::span<const OpHeader> headers,
                     const std::function<std::string(int rank)>& reason) {
  const OpHeader& h0 = headers[0];
  const auto op_name = [](const OpHeader& h) {
    return std::string(collective_name(static_cast<CollectiveOp>(h.op)));
  };
  std::string what = op_name(h0);
  for (int r = 0; r < static_cast<int>(headers.size()); ++r) {
    if (headers[r].invalid) {
      std::string why = reason(r);
      return make_error(ErrorCode::kInvalidArgument, "rank {} passed invalid arguments{}{}", r,
                        why.empty() ? "" : ": ", why.empty() ? " (its log says why)" : why);
    }
  }
  bool same_op = true, same_dtype = true, same_reduce = true, same_root = true, same_counts = true;
  for (const OpHeader& h : headers) {
    if (h.seq != h0.seq) {
      return make_error(ErrorCode::kInternal, "ranks are at different collectives: #{} and #{}",
                        h0.seq, h.seq);
    }
    same_op &= h.op == h0.op;
    same_dtype &= h.dtype == h0.dtype;
    same_reduce &= h.reduce == h0.reduce;
    same_root &= h.root == h0.root;
    same_counts &= h.total == h0.total && h.counts_hash == h0.counts_hash;
  }
  if (!same_op) {
    return make_error(ErrorCode::kInvalidArgument, "ranks issued different collectives: {}",
                      group_ranks(headers, op_name));
  }
  if (!same_dtype) {
    return make_error(ErrorCode::kInvalidArgument, "{}: ranks disagree on the dtype: {}", what,
                      group_ranks(headers, [](const OpHeader& h) {
                        return h.dtype == kRawBytes
                                   ? std::string("raw bytes")
                                   : std::string(dtype_name(static_cast<DType>(h.dtype)));
                      }));
  }
  auto op = static_cast<CollectiveOp>(h0.op);
  bool reduces = op == CollectiveOp::kReduceScatter || op == CollectiveOp::kAllReduce;
  if (reduces && !same_reduce) {
    return make_error(ErrorCode::kInvalidArgument, "{}: ranks disagree on the reduction: {}", what,
                      group_ranks(headers, [](const OpHeader& h) {
                        return std::string(reduce_op_name(static_cast<ReduceOp>(h.reduce)));
                      }));
  }
  if (op == CollectiveOp::kBroadcast && !same_root) {
    return make_error(
        ErrorCode::kInvalidArgument, "broadcast: ranks disagree on the root: {}",
        group_ranks(headers, [](const OpHeader& h) { return fmt::format("root {}", h.root); }));
  }
  if (!same_counts) {
    bool per_rank = op == CollectiveOp::kAllGather || op == CollectiveOp::kReduceScatter;
    return make_error(ErrorCode::kInvalidArgument, "{}: ranks disagree on the element counts: {}",
                      what, group_ranks(headers, [per_rank](const OpHeader& h) {
                        return per_rank ? fmt::format("{} of {} elements", h.own_count, h.total)
                                        : fmt::format("{} elements", h.total);
                      }));
  }
  return Status::ok();
}

std::vector<size_t> prefix_sums(const std::vector<size_t>& counts) {
  std::vector<size_t> displs(counts.size() + 1, 0);
  for (size_t i = 0; i < counts.size(); ++i) displs[i + 1] = displs[i] + counts[i];
  return displs;
}

}  // namespace zinf::comm::detail
