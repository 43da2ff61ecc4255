// The XXH3-64 hash of swap blocks (SwapSpace's checksums), computed with the fastest build of it
// this CPU runs. Debian's libxxhash is built for the x86-64 baseline (SSE2); on a CPU with AVX2
// the same algorithm built for AVX2 hashed 1 MiB blocks 3x as fast from cache and 1.7x as fast
// from memory (docs/io.md). The value is XXH3_64bits' on every path: a checksum written by one
// path verifies on the other.
#pragma once

#include <cstddef>
#include <cstdint>

namespace zinf::io {

// XXH3_64bits(data, bytes), on the AVX2 path where the CPU and OS support AVX2.
uint64_t checksum64(const void* data, size_t bytes);

namespace detail {
bool checksum64_has_avx2();
uint64_t checksum64_portable(const void* data, size_t bytes);  // libxxhash's build
uint64_t checksum64_avx2(const void* data, size_t bytes);      // only where has_avx2()
}  // namespace detail

}  // namespace zinf::io
