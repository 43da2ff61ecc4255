#include "zinf/core/trace.h"

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <map>
#include <mutex>
#include <vector>

namespace zinf::trace {
namespace {

struct Event {
  int track;
  std::string name;
  int64_t ts_us;
  int64_t dur_us;
};

struct Recorder {
  std::atomic<bool> on{false};
  std::mutex mu;
  std::string path;
  Clock::time_point origin;
  std::map<std::string, int> tracks;
  std::vector<Event> events;
};

Recorder& recorder() {
  static Recorder* r = new Recorder();  // never destroyed: late threads may still record
  return *r;
}

std::string escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (c == '"' || c == '\\') out += '\\';
    if (static_cast<unsigned char>(c) < 0x20) continue;
    out += c;
  }
  return out;
}

}  // namespace

bool enabled() { return recorder().on.load(std::memory_order_relaxed); }

void start(std::string path) {
  Recorder& r = recorder();
  std::lock_guard lock(r.mu);
  r.path = std::move(path);
  r.origin = Clock::now();
  r.tracks.clear();
  r.events.clear();
  r.on = true;
}

void complete(const std::string& track, const std::string& name, Clock::time_point begin) {
  Recorder& r = recorder();
  if (!r.on.load(std::memory_order_relaxed)) return;
  auto end = Clock::now();
  std::lock_guard lock(r.mu);
  auto [it, added] = r.tracks.emplace(track, static_cast<int>(r.tracks.size()) + 1);
  (void)added;
  auto us = [&](Clock::time_point t) {
    return std::chrono::duration_cast<std::chrono::microseconds>(t - r.origin).count();
  };
  r.events.push_back({it->second, name, us(begin), std::max<int64_t>(us(end) - us(begin), 1)});
}

Status stop() {
  Recorder& r = recorder();
  std::lock_guard lock(r.mu);
  if (!r.on) return Status::ok();
  r.on = false;
  std::string tmp = r.path + ".partial";
  FILE* f = std::fopen(tmp.c_str(), "w");
  if (f == nullptr) return errno_status(errno, fmt::format("cannot write trace file {}", tmp));
  std::fprintf(f, "{\"displayTimeUnit\":\"ms\",\"traceEvents\":[\n");
  bool first = true;
  for (const auto& [name, id] : r.tracks) {
    std::fprintf(f,
                 "%s{\"ph\":\"M\",\"name\":\"thread_name\",\"pid\":1,\"tid\":%d,"
                 "\"args\":{\"name\":\"%s\"}}",
                 first ? "" : ",\n", id, escape(name).c_str());
    first = false;
  }
  for (const Event& e : r.events) {
    std::fprintf(f,
                 "%s{\"ph\":\"X\",\"pid\":1,\"tid\":%d,\"name\":\"%s\",\"ts\":%lld,\"dur\":%lld}",
                 first ? "" : ",\n", e.track, escape(e.name).c_str(),
                 static_cast<long long>(e.ts_us), static_cast<long long>(e.dur_us));
    first = false;
  }
  std::fprintf(f, "\n]}\n");
  bool ok = std::fflush(f) == 0;
  ok = std::fclose(f) == 0 && ok;
  if (!ok) return errno_status(errno, fmt::format("error writing trace file {}", tmp));
  if (std::rename(tmp.c_str(), r.path.c_str()) != 0) {
    return errno_status(errno, fmt::format("cannot move {} to {}", tmp, r.path));
  }
  r.events.clear();
  return Status::ok();
}

}  // namespace zinf::trace
