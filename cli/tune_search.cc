#include "tune_search.h"

#include <algorithm>
#include <chrono>
#include <map>

#include "command.h"
#include "zinf/core/units.h"

namespace zinf::cli {

std::string describe(const IoSetting& s) {
  return fmt::format("{} x {}, {} ring{}, {}", format_bytes(static_cast<double>(s.block_size)),
                     s.queue_depth, s.rings, s.rings == 1 ? "" : "s",
                     s.fixed_buffers ? "registered" : "unregistered");
}

double IoMeasurement::score() const {
  if (read_bytes_per_s <= 0 || write_bytes_per_s <= 0) return 0;
  return 3.0 / (2.0 / read_bytes_per_s + 1.0 / write_bytes_per_s);
}

namespace {

class Search {
 public:
  Search(const MeasureIo& measure, const IoSearchOptions& o) : measure_(measure), o_(o) {
    if (!o_.clock) {
      o_.clock = [] {
        return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch())
            .count();
      };
    }
    start_ = o_.clock();
  }

  Result<IoSearchResult> run() {
    IoSetting best;  // 1 MiB x 8, 1 ring, registered
    // The sweeps keep a quarter of the budget for the confirmation.
    sweep_deadline_ = start_ + 0.75 * o_.budget_seconds;
    ZINF_RETURN_IF_ERROR(sweep("block size", best, o_.block_sizes, &IoSetting::block_size));
    ZINF_RETURN_IF_ERROR(sweep("queue depth", best, o_.queue_depths, &IoSetting::queue_depth));
    ZINF_RETURN_IF_ERROR(refine_block_size(best));
    std::vector<uint32_t> rings;
    for (uint32_t r = 1; r <= std::max<uint32_t>(o_.max_rings, 1); ++r) rings.push_back(r);
    ZINF_RETURN_IF_ERROR(sweep("rings", best, rings, &IoSetting::rings, /*patience=*/1));
    {
      IoSetting off = best;
      off.fixed_buffers = false;
      ZINF_RETURN_IF_ERROR(try_setting("registered", off, best).status());
    }
    result_.best_tried = best;
    result_.chosen = best;
    result_.chosen_median_score = scores_[best].front();
    ZINF_RETURN_IF_ERROR(confirm());
    return std::move(result_);
  }

 private:
  enum class Tried { kMeasured, kOverInFlight, kOutOfBudget };

  // Measures `s` unless it was measured already, keeps too much in flight, or the budget has no
  // room for it; updates `best`.
  Result<Tried> try_setting(const char* phase, const IoSetting& s, IoSetting& best) {
    if (s.block_size * s.queue_depth * s.rings > o_.max_in_flight_bytes) {
      return Tried::kOverInFlight;
    }
    if (!scores_.contains(s)) {
      if (!fits(sweep_deadline_)) {
        result_.budget_ran_out = true;
        return Tried::kOutOfBudget;
      }
      ZINF_RETURN_IF_ERROR(measure(phase, s).status());
    }
    if (score(s) > score(best) || !scores_.contains(best)) best = s;
    return Tried::kMeasured;
  }

  Result<IoTrial> measure(const char* phase, const IoSetting& s) {
    const double t0 = o_.clock();
    auto m = measure_(s);
    if (!m.is_ok()) {
      return make_error(m.status().code(), "measuring {}: {}", describe(s), m.status().message());
    }
    IoTrial t{.setting = s, .measured = *m, .phase = phase, .seconds = o_.clock() - t0};
    longest_ = std::max(longest_, t.seconds);
    scores_[s].push_back(m->score());
    result_.trials.push_back(t);
    if (o_.on_trial) o_.on_trial(t);
    return t;
  }

  bool fits(double deadline) const { return o_.clock() + longest_ <= deadline; }

  double score(const IoSetting& s) const {
    auto it = scores_.find(s);
    return it == scores_.end() ? 0 : *std::max_element(it->second.begin(), it->second.end());
  }

  // Along one axis, from the current best's value up, then down; a direction stops after
  // `patience` settings in a row that are clearly worse than the best so far.
  template <class T>
  Status sweep(const char* phase, IoSetting& best, const std::vector<T>& values,
               T IoSetting::*field, int patience = 2) {
    auto at = std::find(values.begin(), values.end(), best.*field);
    const size_t from = at == values.end() ? 0 : static_cast<size_t>(at - values.begin());
    for (int dir : {+1, -1}) {
      int worse = 0;
      for (size_t i = dir > 0 ? from : from - 1; i < values.size() && worse < patience;
           i += static_cast<size_t>(dir)) {
        IoSetting s = best;
        s.*field = values[i];
        ZINF_ASSIGN_OR_RETURN(Tried tried, try_setting(phase, s, best));
        if (tried == Tried::kOutOfBudget) return Status::ok();
        if (tried == Tried::kOverInFlight) break;  // larger only keeps more in flight
        const bool clearly_worse =
            patience == 1 ? score(s) < score(best) : score(s) < o_.prune_below * score(best);
        worse = clearly_worse ? worse + 1 : 0;
        if (dir < 0 && i == 0) break;
      }
    }
    return Status::ok();
  }

  Status refine_block_size(IoSetting& best) {
    auto at = std::find(o_.block_sizes.begin(), o_.block_sizes.end(), best.block_size);
    if (at == o_.block_sizes.end()) return Status::ok();
    const auto i = static_cast<size_t>(at - o_.block_sizes.begin());
    for (size_t j : {i + 1, i - 1}) {
      if (j >= o_.block_sizes.size()) continue;  // i - 1 wraps for i == 0
      IoSetting s = best;
      s.block_size = o_.block_sizes[j];
      ZINF_ASSIGN_OR_RETURN(Tried tried, try_setting("block size", s, best));
      if (tried == Tried::kOutOfBudget) break;
    }
    return Status::ok();
  }

  // The finalists, measured again in alternating rounds until the budget ends; the chosen one has
  // the best median over all its measurements.
  Status confirm() {
    std::vector<IoSetting> finalists;
    for (const auto& [s, v] : scores_) finalists.push_back(s);
    std::sort(finalists.begin(), finalists.end(),
              [&](const IoSetting& a, const IoSetting& b) { return score(a) > score(b); });
    finalists.resize(std::min(finalists.size(), std::max<size_t>(o_.finalists, 1)));
    if (finalists.size() < 2) return Status::ok();
    const double deadline = start_ + o_.budget_seconds;
    while (o_.clock() + longest_ * static_cast<double>(finalists.size()) <= deadline) {
      for (const IoSetting& s : finalists) ZINF_RETURN_IF_ERROR(measure("confirm", s).status());
      ++result_.confirm_rounds;
    }
    if (result_.confirm_rounds == 0) return Status::ok();
    result_.chosen_median_score = 0;
    for (const IoSetting& s : finalists) {
      const double m = median(scores_[s]);
      if (m > result_.chosen_median_score) {
        result_.chosen = s;
        result_.chosen_median_score = m;
      }
    }
    return Status::ok();
  }

  const MeasureIo& measure_;
  IoSearchOptions o_;
  double start_ = 0, sweep_deadline_ = 0, longest_ = 0;
  std::map<IoSetting, std::vector<double>> scores_;
  IoSearchResult result_;
};

}  // namespace

Result<IoSearchResult> search_io(const MeasureIo& measure, const IoSearchOptions& options) {
  if (options.block_sizes.empty() || options.queue_depths.empty()) {
    return make_error(ErrorCode::kInvalidArgument, "nothing to search: no block sizes or depths");
  }
  if (!(options.budget_seconds > 0)) {
    return make_error(ErrorCode::kInvalidArgument, "the time budget must be positive");
  }
  Search search(measure, options);
  return search.run();
}

}  // namespace zinf::cli
