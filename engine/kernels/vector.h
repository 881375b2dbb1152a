// Vectors of fp32 lanes shared by pdserve's CPU kernels (paged_attention.cpp, small_matmul.cpp): the
// lane count and register budget of this CPU, a cache-line prefetch, unaligned loads that convert the
// pool's dtypes in registers, and a transposing horizontal sum.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

namespace pdserve {

inline float as_float(float x) { return x; }
inline float as_float(at::Half x) { return static_cast<float>(x); }
inline float as_float(at::BFloat16 x) {  // bf16 is the top half of an fp32: a shift the compiler vectorizes
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// x rounded to scalar_t and back (for bf16: round to nearest even on the bits, which the compiler vectorizes;
// x is finite here).
template <typename scalar_t>
inline float round_to(float x) { return as_float(static_cast<scalar_t>(x)); }
template <>
inline float round_to<float>(float x) { return x; }
template <>
inline float round_to<at::BFloat16>(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  bits = (bits + 0x7FFFu + ((bits >> 16) & 1u)) & 0xFFFF0000u;
  std::memcpy(&x, &bits, sizeof x);
  return x;
}

// One vector of fp32 lanes in GCC's vector extension, as wide as the CPU's registers (-march=native
// decides): 16 lanes in 32 AVX-512 registers, else 8 lanes in 16 AVX2 ones. The kernels' loops are written
// for kLanes lanes and size their register blocks from kVectorRegisters, so neither width spills.
#if defined(__AVX512F__)
constexpr int kLanes = 16;
constexpr int kVectorRegisters = 32;
#else
constexpr int kLanes = 8;
constexpr int kVectorRegisters = 16;
#endif
typedef float vf __attribute__((vector_size(kLanes * sizeof(float))));
typedef int32_t vi __attribute__((vector_size(kLanes * sizeof(int32_t))));

// Unaligned vector loads of one register each (a memcpy of several vectors may be split into narrower moves).
typedef float vf_unaligned __attribute__((vector_size(kLanes * sizeof(float)), aligned(alignof(float))));
typedef uint16_t vh_unaligned __attribute__((vector_size(kLanes * sizeof(uint16_t)), aligned(alignof(uint16_t))));

// Ask for the cache line at `address` into L2 (prefetcht1), for the kernels whose next reads the hardware
// prefetchers do not foresee in time (paged_attention.cpp: a row's next K/V rows; small_matmul.cpp: the
// next block of weight rows). Into L1 (prefetcht0) lines requested together queue behind each other for
// the core's few L1 miss buffers and stall the loads in between; into L2 they do not: on an AMD EPYC with
// AVX-512 (Zen 4), decode attention at batch 64 took 1.56x as long with prefetcht0, in fp32 and in bf16
// (bench/experiments/kernel_variants.py). GCC deletes a loop of __builtin_prefetch (or _mm_prefetch)
// calls as free of side effects, so the request is an asm statement, which it keeps.
inline void prefetch_line(const void* address) {
#if defined(__x86_64__)
  asm volatile("prefetcht1 %0" : : "m"(*static_cast<const char*>(address)));
#else
  __builtin_prefetch(address, 0, 2);
#endif
}

// `count` vectors of fp32 lanes from a row stored in scalar_t, converted in registers: going through a
// float array first would store it in pieces the vector loads cannot forward from (a stall per load).
template <int count, typename scalar_t>
inline void load_vectors(const scalar_t* src, vf* dst) {
  for (int c = 0; c < count; ++c) {
    if constexpr (std::is_same_v<scalar_t, float>) {
      dst[c] = *reinterpret_cast<const vf_unaligned*>(src + c * kLanes);
    } else if constexpr (std::is_same_v<scalar_t, at::BFloat16>) {  // bf16 is the top half of an fp32
      dst[c] = (vf)(__builtin_convertvector(*reinterpret_cast<const vh_unaligned*>(src + c * kLanes), vi) << 16);
    } else {
      for (int lane = 0; lane < kLanes; ++lane) dst[c][lane] = as_float(src[c * kLanes + lane]);
    }
  }
}

// `count` vectors of fp32 lanes stored to `dst` one register each: a memcpy from an array of vectors takes
// the array's address, and GCC then keeps the array in memory (an accumulator loaded and stored per add).
template <int count>
inline void store_vectors(const vf* src, float* dst) {
  for (int c = 0; c < count; ++c) *reinterpret_cast<vf_unaligned*>(dst + c * kLanes) = src[c];
}

// The first n lanes of x stored to dst (n <= kLanes), through a copy whose address may be taken (see store_vectors).
inline void store_lanes(vf x, float* dst, int64_t n) {
  if (n == kLanes) {
    *reinterpret_cast<vf_unaligned*>(dst) = x;
    return;
  }
  alignas(sizeof(vf)) float lanes[kLanes];
  *reinterpret_cast<vf*>(lanes) = x;
  std::memcpy(dst, lanes, n * sizeof(float));
}

// round_to on kLanes lanes at once, the same operations lane by lane.
template <typename scalar_t>
inline vf round_to(vf x) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    return x;
  } else if constexpr (std::is_same_v<scalar_t, at::BFloat16>) {
    const vi bits = (vi)x;
    return (vf)((bits + 0x7FFF + ((bits >> 16) & 1)) & (vi{} + static_cast<int32_t>(0xFFFF0000u)));
  } else {
    for (int lane = 0; lane < kLanes; ++lane) x[lane] = round_to<scalar_t>(x[lane]);
    return x;
  }
}

// One step of a transposing horizontal sum: lanes of `a` and `b` in chunks of `Width` are paired and
// added, so that after widths 1, 2, 4 (, 8) the sums of kLanes vectors sit in one vector, vector t in lane t.
template <int Width>
inline vf pair_sum(vf a, vf b) {
  vi first, second;
  for (int lane = 0; lane < kLanes; ++lane) {
    const int chunk = lane / (2 * Width), offset = lane % (2 * Width);
    const int source = (offset < Width ? 0 : kLanes) + chunk * 2 * Width + offset % Width;
    first[lane] = source;
    second[lane] = source + Width;
  }
  return __builtin_shuffle(a, b, first) + __builtin_shuffle(a, b, second);
}

template <int Width>
inline void pair_sums(vf* partial) {
  for (int i = 0; i < kLanes / (2 * Width); ++i) partial[i] = pair_sum<Width>(partial[2 * i], partial[2 * i + 1]);
}

// lane t of the result = the sum of the lanes of partial[t] (kLanes vectors, unused ones zero).
inline vf transpose_sum(vf* partial) {
  pair_sums<1>(partial);
  pair_sums<2>(partial);
  pair_sums<4>(partial);
  if constexpr (kLanes == 16) pair_sums<8>(partial);
  return partial[0];
}

// m[w] lane t <- m[t] lane w for kLanes vectors (a kLanes x kLanes block of floats): per stage B (1, 2, 4, 8
// apart), lanes with bit B set trade places between vectors r and r | B.
template <int B>
inline void transpose_stage(vf* m) {
  vi keep, swap;
  for (int c = 0; c < kLanes; ++c) {
    keep[c] = (c & B) ? kLanes + (c ^ B) : c;
    swap[c] = (c & B) ? kLanes + c : (c | B);
  }
  for (int r = 0; r < kLanes; ++r) {
    if (r & B) continue;
    const vf a = m[r], b = m[r | B];
    m[r] = __builtin_shuffle(a, b, keep);
    m[r | B] = __builtin_shuffle(a, b, swap);
  }
}

inline void transpose_lanes(vf* m) {
  transpose_stage<1>(m);
  transpose_stage<2>(m);
  transpose_stage<4>(m);
  if constexpr (kLanes == 16) transpose_stage<8>(m);
}

}  // namespace pdserve
