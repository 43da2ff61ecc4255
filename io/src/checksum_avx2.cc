// XXH3-64 built for AVX2 (this file alone is compiled with -mavx2; see CMakeLists.txt). The
// inlined header keeps every xxHash function static to this unit, so nothing built here can be
// linked into a caller that runs on a CPU without AVX2.
#define XXH_INLINE_ALL
#define XXH_VECTOR XXH_AVX2
#include <xxhash.h>

#include "zinf/io/checksum.h"

namespace zinf::io::detail {

uint64_t checksum64_avx2(const void* data, size_t bytes) { return XXH3_64bits(data, bytes); }

}  // namespace zinf::io::detail
