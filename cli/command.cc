#include "command.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <string>
#include <vector>

#include "zinf/core/units.h"

namespace zinf::cli {
namespace {

struct Entry {
  std::string group, name, description;
  SetupFn setup;
};

std::vector<Entry>& registry() {
  static std::vector<Entry> entries;
  return entries;
}

}  // namespace

Registration::Registration(const char* group, const char* name, const char* description,
                           SetupFn setup) {
  registry().push_back({group, name, description, std::move(setup)});
}

uint64_t bytes_flag(const std::string& flag, const std::string& text) {
  auto r = parse_bytes(text);
  if (!r.is_ok()) throw CliError(flag + ": " + r.status().message(), 2);
  return *r;
}

uint64_t elements_flag(const std::string& flag, const std::string& text) {
  size_t used = 0;
  double v = 0;
  try {
    v = std::stod(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used == 0 || used != text.size() || !(v >= 0) || v > 1e18 || v != std::floor(v)) {
    throw CliError(flag +
                       ": expected a non-negative whole number of elements (e.g. 50000000 or "
                       "5e7), got '" +
                       text + "'",
                   2);
  }
  return static_cast<uint64_t>(v);
}

double median(std::vector<double> values) {
  if (values.empty()) return 0;
  std::sort(values.begin(), values.end());
  const size_t h = values.size() / 2;
  return values.size() % 2 ? values[h] : 0.5 * (values[h - 1] + values[h]);
}

void build_commands(CLI::App& app) {
  static const std::map<std::string, std::string> kGroupHelp = {
      {"bench",
       "Measure a component against its yardstick (io vs fio, store vs io, adam vs memory "
       "bandwidth, comm as nccl-tests)"},
      {"checkpoint", "Inspect or export a checkpoint of zinf train --save-dir"},
  };
  std::map<std::string, CLI::App*> groups;
  for (auto& e : registry()) {
    CLI::App* parent = &app;
    if (!e.group.empty()) {
      auto it = groups.find(e.group);
      if (it == groups.end()) {
        auto help = kGroupHelp.count(e.group) ? kGroupHelp.at(e.group) : e.group;
        CLI::App* g = app.add_subcommand(e.group, help);
        g->require_subcommand(1);
        it = groups.emplace(e.group, g).first;
      }
      parent = it->second;
    }
    CLI::App* sub = parent->add_subcommand(e.name, e.description);
    e.setup(*sub);
  }
}

}  // namespace zinf::cli
