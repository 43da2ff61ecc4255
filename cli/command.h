// Sub-command registry of the `zinf` CLI. A command file defines
//   static const zinf::cli::Registration kReg{"bench", "io", &setup};
// where `setup` adds the command's options to the CLI11 sub-app it is given and sets its callback.
// Callbacks report failure by throwing CliError (a one-line message, exit code 1 or 2).
#pragma once

#include <CLI/CLI.hpp>
#include <cstdint>
#include <functional>
#include <stdexcept>
#include <string>
#include <vector>

namespace zinf::cli {

// A failure to report as one line "zinf: <message>" with the given exit code (never a trace).
struct CliError : std::runtime_error {
  CliError(const std::string& message, int exit_code = 1)
      : std::runtime_error(message), code(exit_code) {}
  int code;
};

// A byte size given on the command line ("4G", "128K"); a bad one is a CliError naming the flag.
uint64_t bytes_flag(const std::string& flag, const std::string& text);

// A count of elements given on the command line: an integer, or DeepSpeed's float notation
// ("5e7"); a bad one (negative, fractional, too large) is a CliError naming the flag.
uint64_t elements_flag(const std::string& flag, const std::string& text);

// The median of repeated measurements (the mean of the two middle ones for an even count).
double median(std::vector<double> values);

using SetupFn = std::function<void(CLI::App& sub)>;

struct Registration {
  // group: "" for a top-level command (`zinf train`), or a parent such as "bench".
  Registration(const char* group, const char* name, const char* description, SetupFn setup);
};

// Called by main(): builds every registered command under `app`.
void build_commands(CLI::App& app);

}  // namespace zinf::cli
