// Decode attention that reads K and V where they live in the paged pool (CPU, fp32 and bf16).
//
// One task per row. A row is one request: its block table, its context length, and its queries, the
// last `n` positions of that context (n = 1 for a decode; 1 + k for a request verifying k proposed
// tokens, whose query i sees the context up to its own position: causal inside the row). K pass: the
// row's blocks in table order (each block one contiguous run of bytes, prefetched one block ahead),
// 16 keys at a time: their rows of a KV head are converted to fp32 once and dotted with the G = H / Hkv
// query heads of every query that share it. Each query head's scores (a few KB) are softmaxed in fp32
// over its own keys; the keys past a query's position get weight 0. V pass: per KV head, up to four
// (query, head) pairs accumulate in registers while that head's V rows stream by. No workspace, no
// padding: a row reads exactly `context_lens[row]` keys, and a query gives bit for bit what a one-query
// row of its own length gives. The row's token offsets into the pool are computed once (no division per
// key and head). A bf16 pool on a CPU with AVX512-BF16 (head sizes that are multiples of 32) skips the
// fp32 conversions: both passes use the bf16 dot-product instruction on the rows as stored (products exact
// in fp32, sums in fp32; in the V pass two keys' rows interleaved dim by dim).
// Shapes: q [T, H, D]; key/value [blocks, block_size, Hkv, D] (head_dim contiguous); block_table [B, W]
// int32 or int64; context_lens [B] (same dtype); query_starts [B + 1] (same dtype, optional: row b's
// queries are q[query_starts[b] : query_starts[b + 1]]; without it T = B, one query per row); returns
// [T, H, D] in q's dtype.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <optional>
#include <cstring>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

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

template <int D, typename scalar_t>
inline void load_row(const scalar_t* src, float* dst) {
#pragma omp simd
  for (int i = 0; i < D; ++i) dst[i] = as_float(src[i]);
}

// exp(x) for x <= 0 (scores minus their max) in a form the compiler vectorizes: 2^(x log2 e) split into
// an integer power (built in the exponent bits) and a degree-6 polynomial on [-0.5, 0.5]; relative error
// ~2e-7, the same order as expf's rounding.
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.f);
  const float t = x * 1.4426950408889634f;
  const float n = std::nearbyint(t);
  const float f = t - n;
  float p = 1.5403530393381606e-4f;
  p = p * f + 1.3333558146428443e-3f;
  p = p * f + 9.6181291076284772e-3f;
  p = p * f + 5.5504108664821580e-2f;
  p = p * f + 2.4022650695910071e-1f;
  p = p * f + 6.9314718055994531e-1f;
  p = p * f + 1.0f;
  int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

// 16 fp32 lanes in GCC's vector extension: AVX-512 registers where the CPU has them, pairs of AVX2 ones
// elsewhere (-march=native picks).
typedef float v16 __attribute__((vector_size(64)));
typedef int32_t lanes16 __attribute__((vector_size(64)));
constexpr int kLanes = 16;

// One step of a transposing horizontal sum: lanes of `a` and `b` in chunks of `Width` are paired and
// added, so that after widths 1, 2, 4, 8 the sums of 16 vectors sit in one vector, vector t in lane t.
template <int Width>
inline v16 pair_sum(v16 a, v16 b) {
  lanes16 first, second;
  for (int lane = 0; lane < kLanes; ++lane) {
    const int chunk = lane / (2 * Width), offset = lane % (2 * Width);
    const int source = (offset < Width ? 0 : kLanes) + chunk * 2 * Width + offset % Width;
    first[lane] = source;
    second[lane] = source + Width;
  }
  return __builtin_shuffle(a, b, first) + __builtin_shuffle(a, b, second);
}

// lane t of the result = the sum of the lanes of partial[t] (16 vectors, unused ones zero).
inline v16 transpose_sum(v16* partial) {
  for (int i = 0; i < 8; ++i) partial[i] = pair_sum<1>(partial[2 * i], partial[2 * i + 1]);
  for (int i = 0; i < 4; ++i) partial[i] = pair_sum<2>(partial[2 * i], partial[2 * i + 1]);
  for (int i = 0; i < 2; ++i) partial[i] = pair_sum<4>(partial[2 * i], partial[2 * i + 1]);
  return pair_sum<8>(partial[0], partial[1]);
}

// Head sizes the kernel is compiled for (multiples of 16 lanes); `supported_head_dims()` lists them.
#define PDSERVE_HEAD_DIMS(X) X(16) X(32) X(48) X(64) X(80) X(96) X(128) X(256)

struct Geometry {
  int64_t heads, kv_heads, dim, block_size, table_width;
  int64_t q_row, q_head, k_block, k_token, k_head, o_row, o_head;
};

struct Scratch {  // one per thread, reused across its rows
  std::vector<float> floats;
  std::vector<int64_t> offsets;
};

// offsets[pos] = where key/value row `pos` of the row's context starts in the pool (K and V share strides):
// computed once per row, so the K and V passes over every KV head index the pool with no division.
template <typename index_t>
inline void token_offsets(const index_t* table, int64_t length, const Geometry& g, int64_t* offsets) {
  for (int64_t first = 0, block = 0; first < length; first += g.block_size, ++block) {
    const int64_t base = static_cast<int64_t>(table[block]) * g.k_block;
    const int64_t n = std::min<int64_t>(g.block_size, length - first);
    for (int64_t t = 0; t < n; ++t) offsets[first + t] = base + t * g.k_token;
  }
}

// Ask for block `table[index]` (all its tokens and heads: one contiguous run of bytes) before it is needed:
// a row's blocks are scattered over the pool, which the hardware prefetchers cannot guess.
template <typename scalar_t, typename index_t>
inline void prefetch_block(const scalar_t* pool, const index_t* table, int64_t index, int64_t num_blocks,
                           const Geometry& g) {
  if (index >= num_blocks) return;
  const char* start = reinterpret_cast<const char*>(pool + static_cast<int64_t>(table[index]) * g.k_block);
  const int64_t bytes = g.block_size * g.k_token * static_cast<int64_t>(sizeof(scalar_t));
  for (int64_t offset = 0; offset < bytes; offset += 64) __builtin_prefetch(start + offset);
}

template <typename scalar_t, typename index_t>
inline const scalar_t* token_row(const scalar_t* pool, const index_t* table, int64_t pos, const Geometry& g) {
  return pool + static_cast<int64_t>(table[pos / g.block_size]) * g.k_block + (pos % g.block_size) * g.k_token;
}

// Keys query `query` of a row with `queries` queries and `length` keys may see: its own position and before.
inline int64_t visible_keys(int64_t length, int64_t queries, int64_t query) { return length - queries + 1 + query; }

// The (query, head) pairs that share KV head `kvh`, numbered 0 .. queries * G - 1 query by query: pair j's
// row in the [queries * H, ...] buffers.
inline int64_t pair_head(int64_t j, int64_t kvh, const Geometry& g) {
  const int64_t group = g.heads / g.kv_heads;
  return j / group * g.heads + kvh * group + j % group;
}

// scores[(i * H + h) * length + t] = q_{i,h} . K_t for every (scaled) query head h of every query i and
// every key t of the row, 16 keys at a time: the 16 keys' rows of a KV head are converted once, then
// kScoreHeads query heads at a time (their queries held in registers) take one vertical multiply-add per
// 16 dims and key, and one transposing sum per 16 keys.
template <int D>
constexpr int kScoreHeads = std::max(1, std::min(4, 16 / (D / kLanes)));

template <int D, typename scalar_t, typename index_t>
void score_keys(const float* qf, int64_t queries, const scalar_t* key, const index_t* table, const int64_t* offsets,
                int64_t length, const Geometry& g, float* scores) {
  constexpr int chunks = D / kLanes, block = kScoreHeads<D>;
  const int64_t pairs = queries * (g.heads / g.kv_heads), num_blocks = (length + g.block_size - 1) / g.block_size;
  alignas(64) float tile[kLanes][D];
  v16 partial[block][kLanes];
  for (int64_t first = 0; first < length; first += kLanes) {
    const int64_t n = std::min<int64_t>(kLanes, length - first);
    for (int64_t t = 0; t < n; ++t)
      if ((first + t) % g.block_size == 0) prefetch_block(key, table, (first + t) / g.block_size + 1, num_blocks, g);
    for (int64_t kvh = 0; kvh < g.kv_heads; ++kvh) {
      for (int64_t t = 0; t < kLanes; ++t) {
        if (t < n) {
          load_row<D>(key + offsets[first + t] + kvh * g.k_head, tile[t]);
        } else {
          std::memset(tile[t], 0, sizeof tile[t]);
        }
      }
      for (int64_t p0 = 0; p0 < pairs; p0 += block) {
        const int64_t count = std::min<int64_t>(block, pairs - p0);
        int64_t heads[block];
        v16 qr[block][chunks];
        for (int j = 0; j < block; ++j) {  // a short last block repeats its first pair (computed, not stored)
          heads[j] = pair_head(p0 + (j < count ? j : 0), kvh, g);
          std::memcpy(qr[j], qf + heads[j] * D, sizeof qr[j]);
        }
        for (int64_t t = 0; t < kLanes; ++t) {
          v16 k[chunks];
          std::memcpy(k, tile[t], sizeof k);
          for (int j = 0; j < block; ++j) {
            v16 sum = {};
            for (int c = 0; c < chunks; ++c) sum += qr[j][c] * k[c];
            partial[j][t] = sum;
          }
        }
        for (int64_t j = 0; j < count; ++j) {
          alignas(64) float out[kLanes];
          const v16 total = transpose_sum(partial[j]);
          std::memcpy(out, &total, sizeof out);
          std::memcpy(scores + heads[j] * length + first, out, n * sizeof(float));
        }
      }
    }
  }
}

// The largest of s[0 .. n), 16 lanes at a time (a scalar max is one dependent instruction per score).
inline float max_of(const float* s, int64_t n) {
  v16 lanes;
  for (int l = 0; l < kLanes; ++l) lanes[l] = -std::numeric_limits<float>::infinity();
  int64_t t = 0;
  for (; t + kLanes <= n; t += kLanes) {
    v16 x;
    std::memcpy(&x, s + t, sizeof x);
    lanes = x > lanes ? x : lanes;
  }
  float top = -std::numeric_limits<float>::infinity();
  for (int l = 0; l < kLanes; ++l) top = std::max(top, lanes[l]);
  for (; t < n; ++t) top = std::max(top, s[t]);
  return top;
}

// In place: each query head's scores over the keys it sees become exp(score - max), rounded to the pool's
// dtype as torch's CPU flash attention rounds them before its P @ V product (so a bf16 pool gives what
// transformers' bf16 SDPA gives), and the keys it does not see weigh 0; inverse_sums[i * H + h] = 1 / the
// sum of the unrounded values, applied to the output.
template <typename scalar_t>
inline void softmax_rows(float* scores, int64_t queries, int64_t heads, int64_t length, float* inverse_sums) {
  for (int64_t i = 0; i < queries; ++i) {
    const int64_t visible = visible_keys(length, queries, i);
    for (int64_t h = i * heads; h < (i + 1) * heads; ++h) {
      float* s = scores + h * length;
      const float top = max_of(s, visible);
      float sum = 0.f;
#pragma omp simd reduction(+ : sum)
      for (int64_t t = 0; t < visible; ++t) {
        const float e = exp_nonpositive(s[t] - top);
        sum += e;
        s[t] = round_to<scalar_t>(e);
      }
      std::fill(s + visible, s + length, 0.f);
      inverse_sums[h] = 1.f / sum;
    }
  }
}

// acc[i * H + h] = sum_t weights[(i * H + h) * length + t] * V_t. Per KV head, up to kValueHeads of the
// (query, head) pairs that share it accumulate in registers while the row's V rows of that head stream by
// (the row's blocks stay in L2 between the passes), as far as the last of those queries sees.
template <int D>
constexpr int kValueHeads = std::max(1, std::min(8, 24 / (D / kLanes)));

template <int D, typename scalar_t>
void weigh_values(const float* weights, int64_t queries, const scalar_t* value, const int64_t* offsets, int64_t length,
                  const Geometry& g, float* acc) {
  constexpr int chunks = D / kLanes, block = kValueHeads<D>;
  const int64_t group = g.heads / g.kv_heads, pairs = queries * group;
  alignas(64) float row[D];
  for (int64_t kvh = 0; kvh < g.kv_heads; ++kvh) {
    for (int64_t first = 0; first < pairs; first += block) {
      const int64_t count = std::min<int64_t>(block, pairs - first);
      int64_t heads[block];
      for (int64_t j = 0; j < count; ++j) heads[j] = pair_head(first + j, kvh, g);
      const int64_t visible = visible_keys(length, queries, (first + count - 1) / group);
      v16 sums[block][chunks] = {};
      for (int64_t pos = 0; pos < visible; ++pos) {
        load_row<D>(value + offsets[pos] + kvh * g.k_head, row);
        v16 v[chunks];
        std::memcpy(v, row, sizeof row);
        for (int j = 0; j < block; ++j) {
          if (j >= count) break;
          const float p = weights[heads[j] * length + pos];
          for (int c = 0; c < chunks; ++c) sums[j][c] += p * v[c];
        }
      }
      for (int64_t j = 0; j < count; ++j) std::memcpy(acc + heads[j] * D, sums[j], sizeof sums[j]);
    }
  }
}

#if defined(__AVX512BF16__)
constexpr bool kBf16Dot = true;

// score_keys for a bf16 pool on a CPU with AVX512-BF16: the queries stay in bf16 and each K row is used as
// stored, two dims per lane with the bf16 dot-product instruction (products exact in fp32, sums in fp32);
// the scale is applied to the fp32 scores.
template <int D, typename index_t>
void score_keys_bf16(const at::BFloat16* q, int64_t first_query, int64_t queries, float scale, const at::BFloat16* key,
                     const index_t* table, const int64_t* offsets, int64_t length, const Geometry& g, float* scores) {
  constexpr int pairs = D / (2 * kLanes);  // 512-bit registers of 32 bf16 per row
  const int64_t group = g.heads / g.kv_heads, num_blocks = (length + g.block_size - 1) / g.block_size;
  std::vector<__m512bh> qb(queries * g.heads * pairs);
  for (int64_t i = 0; i < queries; ++i)
    for (int64_t h = 0; h < g.heads; ++h)
      for (int c = 0; c < pairs; ++c)
        qb[(i * g.heads + h) * pairs + c] =
            (__m512bh)_mm512_loadu_si512(q + (first_query + i) * g.q_row + h * g.q_head + c * 2 * kLanes);
  for (int64_t first = 0; first < length; first += kLanes) {
    const int64_t n = std::min<int64_t>(kLanes, length - first);
    for (int64_t t = 0; t < n; ++t)
      if ((first + t) % g.block_size == 0) prefetch_block(key, table, (first + t) / g.block_size + 1, num_blocks, g);
    for (int64_t kvh = 0; kvh < g.kv_heads; ++kvh) {
      __m512bh k[kLanes][pairs];
      for (int64_t t = 0; t < kLanes; ++t)
        for (int c = 0; c < pairs; ++c)
          k[t][c] = t < n ? (__m512bh)_mm512_loadu_si512(key + offsets[first + t] + kvh * g.k_head + c * 2 * kLanes)
                          : (__m512bh)_mm512_setzero_si512();
      for (int64_t j = 0; j < queries * group; ++j) {
        const int64_t head = pair_head(j, kvh, g);
        v16 partial[kLanes];
        for (int64_t t = 0; t < kLanes; ++t) {
          __m512 sum = _mm512_setzero_ps();
          for (int c = 0; c < pairs; ++c) sum = _mm512_dpbf16_ps(sum, qb[head * pairs + c], k[t][c]);
          partial[t] = (v16)sum;
        }
        alignas(64) float out[kLanes];
        const v16 total = transpose_sum(partial) * scale;
        std::memcpy(out, &total, sizeof out);
        std::memcpy(scores + head * length + first, out, n * sizeof(float));
      }
    }
  }
}

inline uint32_t bf16_bits(float x) {  // x holds a bf16 value (softmax_rows rounded it): its top half
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  return bits >> 16;
}

// weigh_values for a bf16 pool on a CPU with AVX512-BF16: two keys at a time, their V rows interleaved dim by
// dim (one unpack per 32 dims) and multiplied by the pair of their weights with the bf16 dot-product
// instruction; the unpack's lane order is undone once at the end.
constexpr int kValueHeadsBf16 = 4;

template <int D>
void weigh_values_bf16(const float* weights, int64_t queries, const at::BFloat16* value, const int64_t* offsets,
                       int64_t length, const Geometry& g, float* acc) {
  constexpr int pairs = D / (2 * kLanes), block = kValueHeadsBf16;
  const int64_t group = g.heads / g.kv_heads, count_all = queries * group;
  for (int64_t kvh = 0; kvh < g.kv_heads; ++kvh) {
    for (int64_t first = 0; first < count_all; first += block) {
      const int64_t count = std::min<int64_t>(block, count_all - first);
      int64_t heads[block];
      for (int64_t j = 0; j < count; ++j) heads[j] = pair_head(first + j, kvh, g);
      const int64_t visible = visible_keys(length, queries, (first + count - 1) / group);
      __m512 sums[block][2 * pairs];
      for (auto& head : sums)
        for (auto& v : head) v = _mm512_setzero_ps();
      for (int64_t pos = 0; pos < visible; pos += 2) {
        const bool two = pos + 1 < visible;
        const at::BFloat16* a = value + offsets[pos] + kvh * g.k_head;
        const at::BFloat16* b = two ? value + offsets[pos + 1] + kvh * g.k_head : nullptr;
        __m512i lo[pairs], hi[pairs];
        for (int c = 0; c < pairs; ++c) {
          const __m512i va = _mm512_loadu_si512(a + c * 2 * kLanes);
          const __m512i vb = two ? _mm512_loadu_si512(b + c * 2 * kLanes) : _mm512_setzero_si512();
          lo[c] = _mm512_unpacklo_epi16(va, vb);
          hi[c] = _mm512_unpackhi_epi16(va, vb);
        }
        for (int j = 0; j < block; ++j) {
          if (j >= count) break;
          const float* w = weights + heads[j] * length + pos;
          const uint32_t both = bf16_bits(w[0]) | (two ? bf16_bits(w[1]) << 16 : 0u);
          const __m512bh p = (__m512bh)_mm512_set1_epi32(static_cast<int>(both));
          for (int c = 0; c < pairs; ++c) {
            sums[j][2 * c] = _mm512_dpbf16_ps(sums[j][2 * c], (__m512bh)lo[c], p);
            sums[j][2 * c + 1] = _mm512_dpbf16_ps(sums[j][2 * c + 1], (__m512bh)hi[c], p);
          }
        }
      }
      for (int64_t j = 0; j < count; ++j) {
        float* o = acc + heads[j] * D;
        for (int c = 0; c < pairs; ++c) {
          alignas(64) float low[kLanes], high[kLanes];
          _mm512_store_ps(low, sums[j][2 * c]);
          _mm512_store_ps(high, sums[j][2 * c + 1]);
          for (int lane = 0; lane < kLanes; ++lane) {  // unpack lane -> dim: 8 dims per 128-bit lane, 4 from each half
            const int dim = c * 2 * kLanes + 8 * (lane / 4) + lane % 4;
            o[dim] = low[lane];
            o[dim + 4] = high[lane];
          }
        }
      }
    }
  }
}
#else
constexpr bool kBf16Dot = false;
template <int D, typename index_t>
void score_keys_bf16(const at::BFloat16*, int64_t, int64_t, float, const at::BFloat16*, const index_t*, const int64_t*, int64_t,
                     const Geometry&, float*) {}
template <int D>
void weigh_values_bf16(const float*, int64_t, const at::BFloat16*, const int64_t*, int64_t, const Geometry&, float*) {}
#endif

// One row: queries q[first_query : first_query + queries], the last `queries` positions of `length` keys.
template <int D, typename scalar_t, typename index_t>
void attend_row(const scalar_t* q, const scalar_t* key, const scalar_t* value, const index_t* table, int64_t length,
                int64_t first_query, int64_t queries, float scale, const Geometry& g, scalar_t* out, Scratch& scratch) {
  const int64_t heads = queries * g.heads;  // (query, head) pairs
  scratch.floats.resize(heads * (2 * D + length + 1));
  float* qf = scratch.floats.data();  // [queries * H, D] scaled queries
  float* acc = qf + heads * D;        // [queries * H, D]
  float* scores = acc + heads * D;    // [queries * H, length]
  float* inverse_sums = scores + heads * length;  // [queries * H]
  scratch.offsets.resize(length);
  token_offsets(table, length, g, scratch.offsets.data());
  const int64_t* offsets = scratch.offsets.data();
  constexpr bool bf16_dot = std::is_same_v<scalar_t, at::BFloat16> && kBf16Dot && D % (2 * kLanes) == 0;
  prefetch_block(key, table, 0, 1, g);
  for (int64_t i = 0; i < queries; ++i) {
    for (int64_t h = 0; h < g.heads; ++h) {
      float* qh = qf + (i * g.heads + h) * D;
      load_row<D>(q + (first_query + i) * g.q_row + h * g.q_head, qh);
      for (int d = 0; d < D; ++d) qh[d] *= scale;
    }
  }
  if constexpr (bf16_dot)
    score_keys_bf16<D>(q, first_query, queries, scale, key, table, offsets, length, g, scores);
  else
    score_keys<D>(qf, queries, key, table, offsets, length, g, scores);
  softmax_rows<scalar_t>(scores, queries, g.heads, length, inverse_sums);
  prefetch_block(value, table, 0, 1, g);
  if constexpr (bf16_dot)
    weigh_values_bf16<D>(scores, queries, value, offsets, length, g, acc);
  else
    weigh_values<D>(scores, queries, value, offsets, length, g, acc);
  for (int64_t i = 0; i < queries; ++i) {
    for (int64_t h = 0; h < g.heads; ++h) {
      const int64_t head = i * g.heads + h;
      scalar_t* o = out + (first_query + i) * g.o_row + h * g.o_head;
      for (int d = 0; d < D; ++d) o[d] = static_cast<scalar_t>(acc[head * D + d] * inverse_sums[head]);
    }
  }
}

template <typename scalar_t, typename index_t>
void run(const torch::Tensor& q, const torch::Tensor& key, const torch::Tensor& value, const torch::Tensor& table,
         const torch::Tensor& lens, const index_t* starts, float scale, torch::Tensor& out) {
  const Geometry g{q.size(1), key.size(2), q.size(2), key.size(1), table.size(1),
                   q.stride(0), q.stride(1), key.stride(0), key.stride(1), key.stride(2), out.stride(0), out.stride(1)};
  const int64_t rows = lens.size(0);
  const auto* qp = q.data_ptr<scalar_t>();
  const auto* kp = key.data_ptr<scalar_t>();
  const auto* vp = value.data_ptr<scalar_t>();
  const auto* tp = table.data_ptr<index_t>();
  const auto* lp = lens.data_ptr<index_t>();
  auto* op = out.data_ptr<scalar_t>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    Scratch scratch;
    for (int64_t row = begin; row < end; ++row) {
      const int64_t length = static_cast<int64_t>(lp[row]);
      const int64_t first = starts ? static_cast<int64_t>(starts[row]) : row;
      const int64_t queries = starts ? static_cast<int64_t>(starts[row + 1]) - first : 1;
      TORCH_CHECK(length >= 1 && length <= g.table_width * g.block_size, "context_lens[", row, "] = ", length,
                  " is outside [1, table width * block size]");
      TORCH_CHECK(queries >= 1 && queries <= length, "row ", row, " has ", queries, " queries for ", length, " keys");
      const index_t* row_table = tp + row * g.table_width;
      switch (g.dim) {
#define PDSERVE_HEAD_DIM(D)                                                                  \
  case D:                                                                                    \
    attend_row<D>(qp, kp, vp, row_table, length, first, queries, scale, g, op, scratch); \
    break;
        PDSERVE_HEAD_DIMS(PDSERVE_HEAD_DIM)
#undef PDSERVE_HEAD_DIM
        default:
          TORCH_CHECK(false, "paged_decode: unsupported head_dim ", g.dim);
      }
    }
  });
}

torch::Tensor paged_decode(torch::Tensor q, torch::Tensor key, torch::Tensor value, torch::Tensor block_table,
                           torch::Tensor context_lens, double scale, std::optional<torch::Tensor> query_starts) {
  TORCH_CHECK(q.dim() == 3 && key.dim() == 4 && value.sizes() == key.sizes(), "q [T, H, D], key/value [N, bs, Hkv, D]");
  TORCH_CHECK(q.size(2) == key.size(3) && q.size(1) % key.size(2) == 0, "head_dim must match and Hkv divide H");
  TORCH_CHECK(q.stride(2) == 1 && key.stride(3) == 1 && value.strides() == key.strides(), "head_dim must be contiguous");
  TORCH_CHECK(q.scalar_type() == key.scalar_type(), "q and the pool must have one dtype");
  TORCH_CHECK(block_table.is_contiguous() && context_lens.is_contiguous(), "block_table / context_lens must be contiguous");
  TORCH_CHECK(block_table.scalar_type() == context_lens.scalar_type(), "block_table and context_lens: one index dtype");
  TORCH_CHECK(block_table.size(0) == context_lens.size(0), "one block table row per context length");
  const bool multi = query_starts.has_value();
  if (multi) {
    TORCH_CHECK(query_starts->is_contiguous() && query_starts->scalar_type() == context_lens.scalar_type(),
                "query_starts: contiguous, the index dtype of context_lens");
    TORCH_CHECK(query_starts->numel() == context_lens.numel() + 1, "query_starts must hold rows + 1 offsets");
  } else {
    TORCH_CHECK(q.size(0) == context_lens.size(0), "one query per row without query_starts");
  }
  auto out = torch::empty_like(q, at::MemoryFormat::Contiguous);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode", [&] {
    if (block_table.scalar_type() == at::kInt) {
      const int32_t* starts = multi ? query_starts->data_ptr<int32_t>() : nullptr;
      TORCH_CHECK(!multi || (starts[0] == 0 && starts[context_lens.numel()] == q.size(0)), "query_starts must run from 0 to T");
      run<scalar_t, int32_t>(q, key, value, block_table, context_lens, starts, static_cast<float>(scale), out);
    } else {
      TORCH_CHECK(block_table.scalar_type() == at::kLong, "block_table must be int32 or int64");
      const int64_t* starts = multi ? query_starts->data_ptr<int64_t>() : nullptr;
      TORCH_CHECK(!multi || (starts[0] == 0 && starts[context_lens.numel()] == q.size(0)), "query_starts must run from 0 to T");
      run<scalar_t, int64_t>(q, key, value, block_table, context_lens, starts, static_cast<float>(scale), out);
    }
  });
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode, "decode attention over a paged KV pool (CPU), one or more queries per row",
        pybind11::arg("q"), pybind11::arg("key"), pybind11::arg("value"), pybind11::arg("block_table"),
        pybind11::arg("context_lens"), pybind11::arg("scale"), pybind11::arg("query_starts") = pybind11::none());
  m.def("supported_head_dims", [] {
#define PDSERVE_LIST(D) D,
    return std::vector<int64_t>{PDSERVE_HEAD_DIMS(PDSERVE_LIST)};
#undef PDSERVE_LIST
  });
}
