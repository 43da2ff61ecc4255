// The safetensors reader (zinf::gpt::parse_safetensors) on arbitrary bytes. Properties: it returns
// tensors or an error, never crashes, throws or reads past the input; the tensors it returns hold
// exactly their shape's element count, have distinct names, and together account for every byte
// after the header.
#include <set>
#include <span>

#include "fuzz_check.h"
#include "zinf/gpt/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  zinf::Result<std::vector<zinf::gpt::NamedTensor>> tensors =
      zinf::gpt::parse_safetensors(std::span(data, size));
  if (!tensors.is_ok()) {
    FUZZ_CHECK(!tensors.status().message().empty());
    return 0;
  }
  uint64_t header_bytes = 0;
  for (int i = 0; i < 8; ++i) header_bytes |= uint64_t{data[i]} << (8 * i);
  uint64_t data_bytes = 0;
  std::set<std::string> names;
  for (const zinf::gpt::NamedTensor& t : *tensors) {
    uint64_t numel = 1;
    for (int64_t d : t.shape) {
      FUZZ_CHECK(d >= 0);
      numel *= static_cast<uint64_t>(d);
    }
    FUZZ_CHECK(numel == t.data.size());
    FUZZ_CHECK(names.insert(t.name).second);
    FUZZ_CHECK(t.name != "__metadata__");
    data_bytes += t.data.size() * 4;
  }
  FUZZ_CHECK(8 + header_bytes + data_bytes == size);
  return 0;
}
