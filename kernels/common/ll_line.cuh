// The 16-byte line of the collectives' low-latency protocol (kernels/collectives.cu): 8 bytes
// of a piece with a flag beside each 4-byte half, {lo, flag_lo, hi, flag_hi}, stored and
// loaded as one vector. Plain integer arithmetic, so tests/ll_line_vectors.rs compiles this
// file as host C++ (with __device__ and __forceinline__ defined away, uint2 and make_uint2
// supplied) and checks it without a GPU.
//
// The flags name the 64-bit step together: flag_lo is its low half, flag_hi its low half
// XOR its high half (both equal the step below 2^32). A reader takes a line only when both
// equal those of its step, so
//   - a line left from any other step of the area (same parity) is refused: equal flags
//     mean equal halves, which is the same step. A line that short pieces left unwritten
//     can sit for 2^32 steps of its CTA (hours of back-to-back decode calls), and a flag of
//     the low half alone would then match it, or the zeroed region at step 2^32;
//   - a line torn between two stores of the area is refused unless the older store lay
//     2^32 or more steps back: with the first half current, the older second half's flag
//     matches only if the XOR of the two steps' high halves equals that of their low
//     halves, which is even (the steps have the same parity) and nonzero, so the high
//     halves differ above their lowest bit.
#pragma once
#include <stdint.h>

struct LlFlags {
  uint32_t lo, hi;
};

__device__ __forceinline__ LlFlags ll_flags(uint64_t step) {
  return LlFlags{(uint32_t)step, (uint32_t)step ^ (uint32_t)(step >> 32)};
}

// Whether the flags read from a line are those of `want`.
__device__ __forceinline__ bool ll_flags_match(uint32_t flag_lo, uint32_t flag_hi, LlFlags want) {
  return flag_lo == want.lo && flag_hi == want.hi;
}

// Bytes [8i, 8i + 8) of the `nb` bytes at `src` (zero past the end).
__device__ __forceinline__ uint2 ll_read(const char* src, uint64_t nb, uint64_t i) {
  const uint64_t at = i * 8;
  if (at + 8 <= nb && (reinterpret_cast<uintptr_t>(src + at) & 7) == 0) return *reinterpret_cast<const uint2*>(src + at);
  uint64_t w = 0;  // byte by byte into a register (an array would live on the stack)
#pragma unroll
  for (int k = 0; k < 8; ++k)
    if (at + k < nb) w |= (uint64_t)(uint8_t)src[at + k] << (8 * k);
  return make_uint2((uint32_t)w, (uint32_t)(w >> 32));
}

// Writes the bytes of `v` that fall inside the `nb` bytes at `dst`, at [8i, 8i + 8).
__device__ __forceinline__ void ll_write(char* dst, uint64_t nb, uint64_t i, uint2 v) {
  const uint64_t at = i * 8;
  if (at + 8 <= nb && (reinterpret_cast<uintptr_t>(dst + at) & 7) == 0) {
    *reinterpret_cast<uint2*>(dst + at) = v;
    return;
  }
  const uint64_t w = (uint64_t)v.x | (uint64_t)v.y << 32;
#pragma unroll
  for (int k = 0; k < 8; ++k)
    if (at + k < nb) dst[at + k] = (char)(w >> (8 * k));
}
