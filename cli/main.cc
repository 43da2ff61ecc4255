// zinf: the command-line front end. Sub-commands register themselves (command.h).
#include <cstdio>

#include "command.h"

int main(int argc, char** argv) {
  CLI::App app{"zinf: ZeRO stages 1-3, ZeRO-Offload and ZeRO-Infinity from C++", "zinf"};
  app.require_subcommand(1);
  app.set_version_flag("--version", "zinf 0.1.0");
  zinf::cli::build_commands(app);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  } catch (const zinf::cli::CliError& e) {
    std::fprintf(stderr, "zinf: %s\n", e.what());
    return e.code;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "zinf: %s\n", e.what());
    return 1;
  }
  return 0;
}
