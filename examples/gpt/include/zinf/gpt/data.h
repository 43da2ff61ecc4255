// Training text for the GPT example: bytes are tokens (vocabulary 256).
//
// The default corpus is the English fortune cookies of Debian's `fortunes` package: every file in
// /usr/share/games/fortunes/ whose name has no extension (the .dat indexes and .u8 copies are
// skipped, as are subdirectories such as off/), in name order, with the "%" lines that separate
// fortunes turned into empty lines.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <utility>

#include "zinf/core/status.h"

namespace zinf::gpt {

inline constexpr std::string_view kFortunesDir = "/usr/share/games/fortunes";

class TextDataset {
 public:
  // The whole file as bytes. kNotFound for a missing file, kInvalidArgument for an empty one.
  static Result<TextDataset> from_file(const std::string& path);
  // The fortunes corpus in `dir` (see above). kNotFound when there is no such directory or no
  // fortune file in it.
  static Result<TextDataset> from_fortunes(std::string_view dir = kFortunesDir);
  // `path`, or the fortunes corpus when `path` is empty.
  static Result<TextDataset> load(std::string_view path);
  // In-memory text; kInvalidArgument when empty. `source` names it in messages.
  static Result<TextDataset> from_text(std::string text, std::string source);

  int64_t size() const { return static_cast<int64_t>(text_.size()); }
  std::string_view text() const { return text_; }
  const std::string& source() const { return source_; }

  // kInvalidArgument unless the text holds at least one window of seq + 1 bytes (inputs and
  // their next-byte targets); the message gives both sizes.
  Status check_window(int seq) const;

  // B windows of T+1 consecutive bytes: tokens [B,T] and targets [B,T] (the next byte of each).
  // Window starts are a pure function of (seed, step, rank, b): every rank of a data-parallel job
  // draws its own windows, and a rerun draws the same ones.
  Status sample_batch(uint64_t seed, uint64_t step, int rank, int batch, int seq, int32_t* tokens,
                      int32_t* targets) const;

  // (train, validation): the last `validation_fraction` of the text is held out.
  Result<std::pair<TextDataset, TextDataset>> split(double validation_fraction) const;

 private:
  TextDataset(std::string text, std::string source)
      : text_(std::move(text)), source_(std::move(source)) {}

  std::string text_;
  std::string source_;
};

}  // namespace zinf::gpt
