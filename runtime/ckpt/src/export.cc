#include "zinf/ckpt/export.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <map>
#include <vector>

#include "zinf/kernels/cpu_adam.h"

namespace zinf::ckpt {
namespace {

constexpr uint64_t kChunkElements = 1ull << 20;  // 4 MiB of fp32 per read

// Reads fp32 elements of a unit's kind from whichever rank's segment holds them.
class Elements {
 public:
  Elements(const std::string& dir, const Manifest& m) : dir_(dir), m_(m) {}

  Status read(uint32_t unit, const char* kind, uint64_t begin, uint64_t end, float* out) {
    for (uint64_t x = begin; x < end;) {
      const SegmentEntry* seg = nullptr;
      const RankEntry* owner = nullptr;
      for (const RankEntry& r : m_.ranks) {
        for (const SegmentEntry& s : r.segments) {
          if (s.unit == unit && s.kind == kind && s.flat_begin <= x && x < s.flat_end) {
            seg = &s;
            owner = &r;
            break;
          }
        }
        if (seg) break;
      }
      if (seg == nullptr || seg->dtype != DType::kF32) {
        return make_error(ErrorCode::kCorrupt, "checkpoint {} lacks fp32 {} element {} of unit {}",
                          dir_, kind, x, m_.units[unit].name);
      }
      ShardReader* reader = nullptr;
      if (auto it = readers_.find(seg->file); it != readers_.end()) {
        reader = &it->second;
      } else {
        for (const FileDigest& f : owner->files) {
          if (f.name != seg->file) continue;
          ZINF_ASSIGN_OR_RETURN(ShardReader r, ShardReader::open(dir_, f));
          reader = &readers_.emplace(f.name, std::move(r)).first->second;
        }
      }
      const uint64_t n = std::min(seg->flat_end, end) - x;
      ZINF_RETURN_IF_ERROR(
          reader->read_at(seg->offset + (x - seg->flat_begin) * 4, out + (x - begin), n * 4));
      x += n;
    }
    return Status::ok();
  }

 private:
  std::string dir_;
  const Manifest& m_;
  std::map<std::string, ShardReader> readers_;
};

}  // namespace

Status export_safetensors(const std::string& dir, const Manifest& m, const std::string& out,
                          DType dtype) {
  if (dtype == DType::kF16) {
    return make_error(ErrorCode::kInvalidArgument, "export: fp32 or bf16, not fp16");
  }
  ZINF_RETURN_IF_ERROR(verify_all(dir, m));
  const uint64_t esize = dtype_size(dtype);
  nlohmann::json header = nlohmann::json::object();
  uint64_t offset = 0;
  for (const UnitEntry& u : m.units) {
    for (const ParamEntry& p : u.params) {
      const uint64_t bytes = p.numel * esize;
      header[u.name + "." + p.name] = {{"dtype", dtype == DType::kF32 ? "F32" : "BF16"},
                                       {"shape", p.shape},
                                       {"data_offsets", {offset, offset + bytes}}};
      offset += bytes;
    }
  }
  header["__metadata__"] = {{"format", "pt"}, {"producer", "zinf"}};
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');  // keep the data 8-byte aligned

  const std::string tmp = out + ".partial";
  struct stat st {};
  if (::lstat(tmp.c_str(), &st) == 0 && !S_ISDIR(st.st_mode)) (void)::unlink(tmp.c_str());
  const size_t slash = tmp.rfind('/');
  const std::string out_dir = slash == std::string::npos ? "." : tmp.substr(0, slash);
  const std::string tmp_name = slash == std::string::npos ? tmp : tmp.substr(slash + 1);
  Status st_all;
  {
    ZINF_ASSIGN_OR_RETURN(ShardWriter w, ShardWriter::create(out_dir, tmp_name));
    const uint64_t n = text.size();
    st_all = w.write(&n, 8);
    if (st_all.is_ok()) st_all = w.write(text.data(), text.size());
    Elements elements(dir, m);
    std::vector<float> buffer;
    std::vector<uint16_t> converted;
    const char* kind = m.mixed ? kMaster : kParams;
    for (uint32_t u = 0; u < m.units.size() && st_all.is_ok(); ++u) {
      for (const ParamEntry& p : m.units[u].params) {
        for (uint64_t x = 0; x < p.numel && st_all.is_ok(); x += kChunkElements) {
          const uint64_t k = std::min(kChunkElements, p.numel - x);
          buffer.resize(k);
          st_all = elements.read(u, kind, p.offset + x, p.offset + x + k, buffer.data());
          if (!st_all.is_ok()) break;
          if (dtype == DType::kF32) {
            st_all = w.write(buffer.data(), k * 4);
          } else {
            converted.resize(k);
            kernels::cast(buffer.data(), DType::kF32, converted.data(), dtype, k, 1);
            st_all = w.write(converted.data(), k * 2);
          }
        }
        if (!st_all.is_ok()) break;
      }
    }
    if (st_all.is_ok()) st_all = w.finish().status();
  }
  if (!st_all.is_ok()) {
    (void)::unlink(tmp.c_str());
    return std::move(st_all).with_context("exporting " + dir + " to " + out);
  }
  if (std::rename(tmp.c_str(), out.c_str()) != 0) {
    const int err = errno;
    (void)::unlink(tmp.c_str());
    return errno_status(err, fmt::format("cannot move {} to {}", tmp, out));
  }
  return Status::ok();
}

}  // namespace zinf::ckpt
