#include "zinf/io/checksum.h"

#include <xxhash.h>

namespace zinf::io {
namespace detail {

bool checksum64_has_avx2() {
#if defined(ZINF_IO_X86)
  // libgcc's check includes the OS side (XGETBV): AVX state the OS does not save is "absent".
  static const bool avx2 = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") != 0;
  }();
  return avx2;
#else
  return false;
#endif
}

uint64_t checksum64_portable(const void* data, size_t bytes) { return XXH3_64bits(data, bytes); }

#if !defined(ZINF_IO_X86)
uint64_t checksum64_avx2(const void* data, size_t bytes) { return XXH3_64bits(data, bytes); }
#endif

}  // namespace detail

uint64_t checksum64(const void* data, size_t bytes) {
  static const auto fn =
      detail::checksum64_has_avx2() ? &detail::checksum64_avx2 : &detail::checksum64_portable;
  return fn(data, bytes);
}

}  // namespace zinf::io
