// Self-checking rows for the tests and the benchmark, host and device alike: a row's values are
// derived from its id, and its last value is a checksum of the others and of the id. A torn
// row (some values old, some new) or a row read before its data landed (zeros) fails the check.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define TIERCACHE_HD __host__ __device__
#else
#define TIERCACHE_HD
#endif

namespace tiercache {
namespace check {

TIERCACHE_HD inline std::uint64_t mix(std::uint64_t x) {  // splitmix64's finalizer
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ULL;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebULL;
  x ^= x >> 31;
  return x;
}

TIERCACHE_HD inline std::uint32_t float_bits(float v) {
#if defined(__CUDA_ARCH__)
  return static_cast<std::uint32_t>(__float_as_uint(v));
#else
  std::uint32_t bits;
  std::memcpy(&bits, &v, sizeof(bits));
  return bits;
#endif
}

// An odd integer below 2^24, so exactly representable as a float and never 0.
TIERCACHE_HD inline float checksum(const float* values, std::uint32_t n, std::uint64_t id) {
  std::uint64_t h = mix(id ^ 0x9e3779b97f4a7c15ULL);
  for (std::uint32_t j = 0; j < n; ++j) h = mix(h ^ float_bits(values[j]));
  return static_cast<float>((h >> 40) | 1u);
}

// Value j (< width - 1) of the row with this id: a multiple of 1/64 in [-512, 512).
TIERCACHE_HD inline float value(std::uint64_t id, std::uint32_t j) {
  std::uint64_t h = mix(id * 0x100000001b3ULL + j);
  return static_cast<float>(static_cast<std::int64_t>(h >> 48) - 32768) / 64.0f;
}

TIERCACHE_HD inline void fill_row(float* row, std::uint32_t width, std::uint64_t id) {
  for (std::uint32_t j = 0; j + 1 < width; ++j) row[j] = value(id, j);
  row[width - 1] = checksum(row, width - 1, id);
}

TIERCACHE_HD inline bool row_ok(const float* row, std::uint32_t width, std::uint64_t id) {
  return float_bits(row[width - 1]) == float_bits(checksum(row, width - 1, id));
}

}  // namespace check
}  // namespace tiercache
