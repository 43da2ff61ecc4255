#include "zinf/io/fault.h"

#include <cerrno>
#include <charconv>
#include <cstdlib>

#include "zinf/core/log.h"

namespace zinf::io {
namespace {

std::vector<std::string_view> split(std::string_view s, char sep) {
  std::vector<std::string_view> parts;
  size_t start = 0;
  while (true) {
    size_t pos = s.find(sep, start);
    parts.push_back(s.substr(start, pos == std::string_view::npos ? pos : pos - start));
    if (pos == std::string_view::npos) break;
    start = pos + 1;
  }
  return parts;
}

}  // namespace

FaultInjector& FaultInjector::global() {
  static FaultInjector* instance = new FaultInjector();  // never destroyed: used by late threads
  return *instance;
}

FaultInjector::FaultInjector() {
  if (const char* spec = std::getenv("ZINF_IO_FAULTS"); spec && *spec) {
    Status s = add_spec(spec);
    if (!s.is_ok()) {
      log::error("ignoring ZINF_IO_FAULTS: {}", s.message());
    } else {
      log::warn("I/O fault injection is on (ZINF_IO_FAULTS={})", spec);
    }
  }
}

void FaultInjector::add(FaultRule rule) {
  std::lock_guard lock(mu_);
  rules_.push_back({std::move(rule), 0});
  update_active();
}

Status FaultInjector::add_spec(std::string_view spec) {
  std::vector<FaultRule> parsed;
  for (std::string_view entry : split(spec, ',')) {
    if (entry.empty()) continue;
    if (entry == "direct:refuse") {
      set_refuse_direct(true);
      continue;
    }
    if (entry == "fallocate:enospc") {
      set_fallocate_enospc(true);
      continue;
    }
    auto fields = split(entry, ':');
    auto bad = [&](std::string_view why) {
      return make_error(ErrorCode::kInvalidArgument,
                        "fault rule '{}': {} (expected OP:WHICH:KIND[:PATH], e.g. write:3:eio)",
                        entry, why);
    };
    if (fields.size() < 3 || fields.size() > 4) return bad("wrong number of fields");
    FaultRule rule;
    if (fields[0] == "read")
      rule.op = IoOp::kRead;
    else if (fields[0] == "write")
      rule.op = IoOp::kWrite;
    else if (fields[0] == "submit")
      rule.target = FaultTarget::kRingSubmit;
    else if (fields[0] != "any")
      return bad("OP must be read, write, any or submit");
    std::string_view which = fields[1];
    if (which == "every") {
      rule.nth = 1;
      rule.and_after = true;
    } else {
      if (which.ends_with('+')) {
        rule.and_after = true;
        which.remove_suffix(1);
      }
      auto [p, ec] = std::from_chars(which.data(), which.data() + which.size(), rule.nth);
      if (ec != std::errc() || p != which.data() + which.size() || rule.nth == 0) {
        return bad("WHICH must be a positive number, N+ or every");
      }
    }
    if (fields[2] == "eio")
      rule.kind = FaultKind::kEio;
    else if (fields[2] == "enospc")
      rule.kind = FaultKind::kEnospc;
    else if (fields[2] == "short")
      rule.kind = FaultKind::kShort;
    else if (fields[2] == "eagain")
      rule.kind = FaultKind::kEagain;
    else if (fields[2] == "corrupt")
      rule.kind = FaultKind::kCorrupt;
    else if (fields[2] == "hang")
      rule.kind = FaultKind::kHang;
    else
      return bad("KIND must be eio, enospc, eagain, short, corrupt or hang");
    if (rule.kind == FaultKind::kCorrupt && rule.op != IoOp::kRead) {
      return bad("corrupt applies to reads only");
    }
    if (rule.target == FaultTarget::kRingSubmit &&
        (rule.kind == FaultKind::kShort || rule.kind == FaultKind::kCorrupt ||
         rule.kind == FaultKind::kHang || fields.size() == 4)) {
      return bad("a submit rule fails io_uring_enter with eio, enospc or eagain, for any file");
    }
    if (fields.size() == 4) rule.path_contains = std::string(fields[3]);
    parsed.push_back(std::move(rule));
  }
  for (auto& r : parsed) add(std::move(r));
  return Status::ok();
}

void FaultInjector::clear() {
  std::lock_guard lock(mu_);
  rules_.clear();
  refuse_direct_ = false;
  fallocate_enospc_ = false;
  fired_ = 0;
  update_active();
}

void FaultInjector::set_refuse_direct(bool on) { refuse_direct_ = on; }

void FaultInjector::set_fallocate_enospc(bool on) { fallocate_enospc_ = on; }

void FaultInjector::update_active() { active_ = !rules_.empty(); }

std::optional<FaultKind> FaultInjector::on_submit(IoOp op, const std::string& path) {
  if (!active()) return std::nullopt;
  std::lock_guard lock(mu_);
  for (auto& e : rules_) {
    if (e.rule.target != FaultTarget::kChunks) continue;
    if (e.rule.op && *e.rule.op != op) continue;
    if (!e.rule.path_contains.empty() && path.find(e.rule.path_contains) == std::string::npos) {
      continue;
    }
    ++e.seen;
    if (e.seen == e.rule.nth || (e.rule.and_after && e.seen > e.rule.nth)) {
      ++fired_;
      return e.rule.kind;
    }
  }
  return std::nullopt;
}

std::optional<int> FaultInjector::on_ring_submit() {
  if (!active()) return std::nullopt;
  std::lock_guard lock(mu_);
  for (auto& e : rules_) {
    if (e.rule.target != FaultTarget::kRingSubmit) continue;
    ++e.seen;
    if (e.seen == e.rule.nth || (e.rule.and_after && e.seen > e.rule.nth)) {
      ++fired_;
      return e.rule.kind == FaultKind::kEnospc   ? ENOSPC
             : e.rule.kind == FaultKind::kEagain ? EAGAIN
                                                 : EIO;
    }
  }
  return std::nullopt;
}

std::optional<int> FaultInjector::on_preallocate(const std::string&) {
  if (!fallocate_enospc_.load()) return std::nullopt;
  ++fired_;
  return ENOSPC;
}

}  // namespace zinf::io
