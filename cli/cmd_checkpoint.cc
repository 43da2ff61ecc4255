// `zinf checkpoint inspect DIR`: a checkpoint's manifest summarised, every file verified (size
// and XXH3). `zinf checkpoint export DIR --out FILE.safetensors [--dtype fp32|bf16]`: its weights
// as one safetensors file, streamed (docs/checkpoints.md).
#include <cstdio>
#include <memory>
#include <string>

#include "command.h"
#include "zinf/ckpt/directory.h"
#include "zinf/ckpt/export.h"
#include "zinf/ckpt/manifest.h"
#include "zinf/core/units.h"

namespace zinf::cli {
namespace {

// The checkpoint DIR names (a step directory, or a root holding `latest`), its manifest read.
std::pair<std::string, ckpt::Manifest> open_checkpoint(const std::string& path) {
  auto dir = ckpt::resolve_checkpoint(path);
  if (!dir.is_ok()) throw CliError(dir.status().detail(), 2);
  auto m = ckpt::read_manifest(*dir);
  if (!m.is_ok()) throw CliError(m.status().detail());
  return {*dir, std::move(*m)};
}

void inspect(const std::string& path) {
  auto [dir, m] = open_checkpoint(path);
  auto tier = [](const std::string& home) { return home == "none" ? "device" : home.c_str(); };
  uint64_t params = 0, padded = 0;
  for (const ckpt::UnitEntry& u : m.units) {
    params += u.numel;
    padded += u.numel_padded;
  }
  std::printf("checkpoint %s: step %lld (format %d)\n", dir.c_str(), static_cast<long long>(m.step),
              m.format_version);
  std::printf("  world size %d, ZeRO stage %d, %s%s; parameters on %s, optimizer on %s\n", m.world,
              m.stage, dtype_name(m.dtype).data(), m.mixed ? " with an fp32 master" : "",
              tier(m.param_home), tier(m.optimizer_home));
  std::printf("  %zu units, %llu parameters (%llu padded at world size %d)\n", m.units.size(),
              static_cast<unsigned long long>(params), static_cast<unsigned long long>(padded),
              m.world);
  std::printf("  engine: %s\n", m.engine.dump().c_str());
  std::printf("  user:   %s\n", m.user.dump().c_str());
  size_t files = 0;
  for (const ckpt::RankEntry& r : m.ranks) {
    for (const ckpt::FileDigest& f : r.files) {
      Status st = ckpt::verify_file(dir, f);
      if (!st.is_ok()) throw CliError(st.detail());
      std::printf("  %-28s %12llu bytes  xxh3 %016llx  ok\n", f.name.c_str(),
                  static_cast<unsigned long long>(f.bytes),
                  static_cast<unsigned long long>(f.xxh3));
      ++files;
    }
  }
  std::printf("%zu files, %s, checksums verified\n", files,
              format_bytes(static_cast<double>(m.total_bytes())).c_str());
}

void export_weights(const std::string& path, const std::string& out, const std::string& dtype) {
  auto dt = parse_dtype(dtype);
  if (!dt || *dt == DType::kF16) throw CliError("--dtype: fp32 or bf16, got '" + dtype + "'", 2);
  auto [dir, m] = open_checkpoint(path);
  Status st = ckpt::export_safetensors(dir, m, out, *dt);
  if (!st.is_ok()) throw CliError(st.detail());
  std::printf("exported %s (step %lld) to %s (%s)\n", dir.c_str(), static_cast<long long>(m.step),
              out.c_str(), dtype_name(*dt).data());
}

const Registration kInspect{
    "checkpoint", "inspect", "Summarise a checkpoint's manifest and verify every file's checksum",
    [](CLI::App& sub) {
      auto dir = std::make_shared<std::string>();
      sub.add_option("DIR", *dir, "A step directory, or a --save-dir root (its latest)")
          ->required();
      sub.callback([dir] { inspect(*dir); });
    }};

const Registration kExport{
    "checkpoint", "export", "Write a checkpoint's weights as one safetensors file, streamed",
    [](CLI::App& sub) {
      auto dir = std::make_shared<std::string>();
      auto out = std::make_shared<std::string>();
      auto dtype = std::make_shared<std::string>("fp32");
      sub.add_option("DIR", *dir, "A step directory, or a --save-dir root (its latest)")
          ->required();
      sub.add_option("--out", *out, "The .safetensors file to write")->required();
      sub.add_option("--dtype", *dtype, "fp32 | bf16")->capture_default_str();
      sub.callback([dir, out, dtype] { export_weights(*dir, *out, *dtype); });
    }};

}  // namespace
}  // namespace zinf::cli
