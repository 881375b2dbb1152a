// Attention that reads K and V where they live in the paged pool (CPU, fp32 and bf16): decodes, requests
// verifying proposed tokens and prefill chunks alike.
//
// A row is one request: its block table, its context length, and its queries, the last `n` positions of
// that context (n = 1 for a decode; 1 + k for a request verifying k proposed tokens; the chunk's tokens for
// a prefill chunk), query i seeing the context up to its own position (causal inside the row). A row of
// many queries is cut into tiles of kQueryTile queries (tasks_of), one task each; a decode row is one task.
// Per task, K pass: the row's keys in order (each KV head's rows requested kKeysAhead keys ahead, a few at
// a time between the arithmetic: RowsAhead), 16 keys at a time: their rows of a KV head are converted to
// fp32 once and dotted with the G = H / Hkv query heads of every query that share it. Each query head's
// scores (a few KB) are softmaxed in fp32 over its own keys; the keys past a query's position get weight 0.
// V pass: per KV head, a few (query, head) pairs accumulate in registers while that head's V rows stream
// by, as far as the last of those queries sees. No workspace, no padding: a task reads exactly the keys its
// last query sees. A tile of a whole prompt's queries (many pairs per K tile) is scored the other way
// round: the K tile is transposed once and each pair takes D broadcast multiply-adds
// (score_keys_transposed). The row's token offsets into the pool are computed once (no division per key and
// head). A bf16 pool on a CPU with AVX512-BF16 (head sizes that are multiples of 32) skips the fp32
// conversions: both passes use the bf16 dot-product instruction on the rows as stored (products exact in
// fp32, sums in fp32), and sum in the order of torch's CPU flash attention (what transformers' SDPA runs),
// so that a bf16 decode or prompt gives transformers' bits (score_keys_bf16, score_keys_bf16_chains for
// decodes, softmax_rows, weigh_values_bf16 say how). A query after cached keys (a row verifying proposals, a
// later prefill chunk) is softmaxed and summed as a decode of its own length, so it gives bit for bit what
// that one-query row gives; a whole prompt's queries are softmaxed over the prompt's length, as torch does.
// Shapes: q [T, H, D]; key/value [blocks, block_size, Hkv, D] (head_dim contiguous); block_table [B, W]
// int32 or int64; context_lens [B] (same dtype); query_starts [B + 1] (same dtype, optional: row b's
// queries are q[query_starts[b] : query_starts[b + 1]]; without it T = B, one query per row); returns
// [T, H, D] in q's dtype.

#include "kernels.h"
#include "vector.h"

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <optional>
#include <cstring>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

namespace pdserve {
namespace {

template <int D, typename scalar_t>
inline void load_row(const scalar_t* src, float* dst) {
#pragma omp simd
  for (int i = 0; i < D; ++i) dst[i] = as_float(src[i]);
}

constexpr int64_t kKeysAhead = 32;  // how far ahead of its reads a pass asks for K/V rows

// Head sizes the kernel is compiled for (multiples of 16 lanes); `supported_head_dims()` lists them.
#define PDSERVE_HEAD_DIMS(X) X(16) X(32) X(48) X(64) X(80) X(96) X(128) X(256)

struct Geometry {
  int64_t heads, kv_heads, dim, block_size, table_width;
  int64_t q_row, q_head, k_block, k_token, k_head, o_row, o_head;
};

struct Scratch {  // one per thread, reused across its tasks
  std::vector<float> floats;
  std::vector<int64_t> offsets;
  std::vector<int64_t> next_offsets;  // the next task's first keys (up to kKeysAhead): this task's V pass asks for them
  bool keys_requested = false;        // this task's first keys were asked for by the task before it
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

// Ask for the rows [begin, end) of one KV head (`head_rows`: the pool at that head) before they are read: a
// row's blocks are scattered over the pool, which the hardware prefetchers cannot guess. Callers ask for a
// few rows at a time between their arithmetic, kKeysAhead keys before they read them: a burst of requests
// holds the core until memory serves it (on an Intel Xeon with AMX, 1 thread, the arithmetic and the
// memory's time then add up), while requests spread over the arithmetic are served under it.
template <int D, typename scalar_t>
inline void prefetch_rows(const scalar_t* head_rows, const int64_t* offsets, int64_t begin, int64_t end) {
  constexpr uintptr_t bytes = D * sizeof(scalar_t);
  for (int64_t t = begin; t < end; ++t) {
    const auto start = reinterpret_cast<uintptr_t>(head_rows + offsets[t]);
    for (uintptr_t line = start & ~uintptr_t{63}; line < start + bytes; line += 64)
      prefetch_line(reinterpret_cast<const void*>(line));
  }
}

// Every KV head's first kKeysAhead rows: what a pass reads before its own requests run ahead of it.
template <int D, typename scalar_t>
inline void prefetch_first_rows(const scalar_t* pool, const int64_t* offsets, int64_t length, const Geometry& g) {
  for (int64_t kvh = 0; kvh < g.kv_heads; ++kvh) prefetch_rows<D>(pool + kvh * g.k_head, offsets, 0, std::min(kKeysAhead, length));
}

// One KV head's rows in the order a pass reads them: `count` rows at `offsets` from `head` (the pool at that
// head; `of_head` moves rows given at KV head 0 to head kvh).
template <typename scalar_t>
struct HeadRows {
  const scalar_t* head;
  const int64_t* offsets;
  int64_t count;

  HeadRows of_head(int64_t kvh, const Geometry& g) const { return {head + kvh * g.k_head, offsets, count}; }
};

// What a pass asks for ahead of its reads, by position: its own rows, then the rows read after it (after a
// task's K rows its V rows; after its V rows the next task's first K rows), so that no pass starts on rows
// nobody asked for.
template <typename scalar_t>
struct RowsAhead {
  HeadRows<scalar_t> now, next;

  template <int D>
  void request(int64_t begin, int64_t end) const {
    prefetch_rows<D>(now.head, now.offsets, std::min(begin, now.count), std::min(end, now.count));
    const int64_t past = std::max<int64_t>(0, begin - now.count), past_end = std::max<int64_t>(0, end - now.count);
    prefetch_rows<D>(next.head, next.offsets, std::min(past, next.count), std::min(past_end, next.count));
  }
};

// The rows [first, first + span) requested in `steps` shares, one per step of a loop (ceil(span / steps) each).
struct Shares {
  int64_t first, per_step;
  Shares(int64_t first, int64_t span, int64_t steps) : first(first), per_step((span + steps - 1) / steps) {}
  int64_t begin(int64_t step) const { return first + step * per_step; }
  int64_t end(int64_t step) const { return first + (step + 1) * per_step; }
};

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

// f(std::integral_constant<int, count>{}) for a count in [1, N]: lets a block of `count` heads be a compile-time
// size, so that its accumulators live in registers.
template <int N, typename F>
inline void with_count(int64_t count, F&& f) {
  if constexpr (N > 1) {
    if (count < N) return with_count<N - 1>(count, f);
  }
  f(std::integral_constant<int, N>{});
}

// rows[t] = where key first + t's row of KV head `kvh` lies in the pool (a row of zeros past the context's end).
template <int D, typename scalar_t>
inline void tile_rows(const scalar_t* key, const int64_t* offsets, int64_t length, int64_t first, int64_t kvh, const Geometry& g,
                      const scalar_t* (&rows)[kLanes]) {
  alignas(64) static const scalar_t zeros[D] = {};
  for (int64_t t = 0; t < kLanes; ++t) rows[t] = first + t < length ? key + offsets[first + t] + kvh * g.k_head : zeros;
}

// scores[(i * H + h) * length + t] = q_{i,h} . K_t for every (scaled) query head h of every query i and
// every key t of the row, kLanes keys at a time: per KV head, each query head that shares it takes one
// vertical multiply-add per kLanes dims and key, the keys' rows read from memory (L1 after the first
// head: a tile of them in registers would not fit beside the partial sums), and one transposing sum per
// kLanes keys.
template <int D, typename scalar_t>
inline void score_head(const scalar_t* const (&rows)[kLanes], const float* qh, int64_t n, float* out) {
  constexpr int chunks = D / kLanes;
  vf qr[chunks];
  load_vectors<chunks>(qh, qr);
  vf partial[kLanes];
  for (int t = 0; t < kLanes; ++t) {
    vf k[chunks];
    load_vectors<chunks>(rows[t], k);
    vf sum = qr[0] * k[0];
    for (int c = 1; c < chunks; ++c) sum += qr[c] * k[c];
    partial[t] = sum;
  }
  store_lanes(transpose_sum(partial), out, n);
}

template <int D, typename scalar_t>
void score_keys(const float* qf, int64_t queries, const scalar_t* key, const scalar_t* value, const int64_t* offsets,
                int64_t length, const Geometry& g, float* scores) {
  const int64_t pairs = queries * (g.heads / g.kv_heads);
  for (int64_t first = 0; first < length; first += kLanes) {
    const int64_t n = std::min<int64_t>(kLanes, length - first);
    for (int64_t kvh = 0; kvh < g.kv_heads; ++kvh) {
      const scalar_t* rows[kLanes];
      tile_rows<D>(key, offsets, length, first, kvh, g, rows);
      const RowsAhead<scalar_t> ahead{{key + kvh * g.k_head, offsets, length}, {value + kvh * g.k_head, offsets, length}};
      const Shares shares(first + kKeysAhead, kLanes, pairs);
      for (int64_t j = 0; j < pairs; ++j) {
        ahead.template request<D>(shares.begin(j), shares.end(j));
        const int64_t head = pair_head(j, kvh, g);
        score_head<D>(rows, qf + head * D, n, scores + head * length + first);
      }
    }
  }
}

// kt[d] lane t = dim d of key t's row (`rows` as tile_rows gives them), in fp32: a K tile transposed.
template <int D, typename scalar_t>
inline void transpose_tile(const scalar_t* const (&rows)[kLanes], vf* kt) {
  for (int block = 0; block < D / kLanes; ++block) {
    vf* m = kt + block * kLanes;
    for (int t = 0; t < kLanes; ++t) load_vectors<1>(rows[t] + block * kLanes, m + t);
    transpose_lanes(m);
  }
}

// out[j][t] = qs[j] . K_t for N (query, head) pairs and the n keys of a transposed tile: per pair, one vector of
// kLanes scores summed over the dims in order (dim d's value broadcast against kt[d]), N independent chains.
template <int D, int N>
inline void score_pairs(const vf* kt, const float* const* qs, float* const* out, int64_t n) {
  vf acc[N];
  for (int j = 0; j < N; ++j) acc[j] = qs[j][0] * kt[0];
  for (int d = 1; d < D; ++d)
    for (int j = 0; j < N; ++j) acc[j] += qs[j][d] * kt[d];
  for (int j = 0; j < N; ++j) store_lanes(acc[j], out[j], n);
}

// score_keys for a tile of a whole prompt's queries (many pairs share each K tile): per tile of kLanes keys
// and KV head, the keys' rows are transposed once, and kScorePairs pairs at a time take D broadcast
// multiply-adds each, with no sum across lanes (score_keys spends a transposing sum per pair and tile,
// and a load per multiply-add). Measured on an AMD EPYC (Zen 4), fp32, 1 thread, 30 layers: 8 prompts of
// 300 tokens 630 -> 406 ms (SDPA 709 ms), 2 of 512 414 -> 260 ms. The dims are summed in another order than
// score_keys', so a whole prompt's scores differ from a decode's in rounding, as they do anyway (softmaxed
// over the prompt's length); a chunk after cached keys keeps score_keys (a decode's bits).
constexpr int kScorePairs = 8;
template <int D, typename scalar_t>
void score_keys_transposed(const float* qf, int64_t queries, const scalar_t* key, const scalar_t* value, const int64_t* offsets,
                           int64_t length, const Geometry& g, float* scores) {
  const int64_t pairs = queries * (g.heads / g.kv_heads), blocks = (pairs + kScorePairs - 1) / kScorePairs;
  vf kt[D];
  for (int64_t first = 0; first < length; first += kLanes) {
    const int64_t n = std::min<int64_t>(kLanes, length - first);
    for (int64_t kvh = 0; kvh < g.kv_heads; ++kvh) {
      const scalar_t* rows[kLanes];
      tile_rows<D>(key, offsets, length, first, kvh, g, rows);
      transpose_tile<D>(rows, kt);
      const RowsAhead<scalar_t> ahead{{key + kvh * g.k_head, offsets, length}, {value + kvh * g.k_head, offsets, length}};
      const Shares shares(first + kKeysAhead, kLanes, blocks);
      for (int64_t block = 0; block < blocks; ++block) {
        ahead.template request<D>(shares.begin(block), shares.end(block));
        const int64_t begin = block * kScorePairs, count = std::min<int64_t>(kScorePairs, pairs - begin);
        const float* qs[kScorePairs];
        float* out[kScorePairs];
        for (int64_t j = 0; j < count; ++j) {
          const int64_t head = pair_head(begin + j, kvh, g);
          qs[j] = qf + head * D;
          out[j] = scores + head * length + first;
        }
        with_count<kScorePairs>(count, [&](auto size) { score_pairs<D, decltype(size)::value>(kt, qs, out, n); });
      }
    }
  }
}

// The largest of s[0 .. n), 16 lanes at a time (a scalar max is one dependent instruction per score).
inline float max_of(const float* s, int64_t n) {
  vf lanes;
  for (int l = 0; l < kLanes; ++l) lanes[l] = -std::numeric_limits<float>::infinity();
  int64_t t = 0;
  for (; t + kLanes <= n; t += kLanes) {
    vf x;
    std::memcpy(&x, s + t, sizeof x);
    lanes = x > lanes ? x : lanes;
  }
  float top = -std::numeric_limits<float>::infinity();
  for (int l = 0; l < kLanes; ++l) top = std::max(top, lanes[l]);
  for (; t < n; ++t) top = std::max(top, s[t]);
  return top;
}

// 2^f for f in [-0.5, 0.5] on kLanes lanes: a degree-6 polynomial.
inline vf exp2_fraction(vf f) {
  vf p = vf{} + 1.5403530393381606e-4f;
  p = p * f + 1.3333558146428443e-3f;
  p = p * f + 9.6181291076284772e-3f;
  p = p * f + 5.5504108664821580e-2f;
  p = p * f + 2.4022650695910071e-1f;
  p = p * f + 6.9314718055994531e-1f;
  p = p * f + 1.0f;
  return p;
}

// exp(x) for x <= 0 as accurately as expf (relative error ~2e-7): 2^(x log2 e) split into an integer power
// (built in the exponent bits) and exp2_fraction. The fp32 pool's exp: its weights are not rounded, and
// torch's fp32 GEMM order is not reproduced here, so torch's fast exp would only add error.
inline vf exp_nonpositive(vf x) {
  const vf lowest = vf{} - 87.f, shifter = vf{} + 12582912.f;  // adding 1.5 * 2^23 rounds to an integer (nearest even)
  x = x > lowest ? x : lowest;
  const vf t = x * 1.4426950408889634f;
  const vf n = (t + shifter) - shifter;
  const vf p = exp2_fraction(t - n);
  return p * (vf)((__builtin_convertvector(n, vi) + 127) << 23);
}

// The softmax below is the one of torch's CPU flash attention (what transformers' SDPA runs on a CPU), step
// for step, so that the weights it rounds to the pool's dtype, and so the output, are the same bits:
//  - exp(x) for the keys of a row's whole multiples of kLanes: for a bf16 pool torch's vectorized fast exp
//    (`fexp_u20`: 2^(x log2 e) with a degree-3 polynomial for the fraction put together in the exponent
//    bits, ~1e-5 relative error), for an fp32 pool exp_nonpositive; for the row's last (length % kLanes)
//    keys the C library's expf;
//  - the sum: lane by lane over the vectors, the lanes folded in halves (8, 4, 2, 1 lanes apart), then
//    the remaining keys one by one.
// Close is not enough: a bf16 weight (8 bits) that rounds the other way moves the output by up to one bf16
// step, and a near tie between two tokens downstream then flips.
inline vf fma_lanes(vf a, vf b, vf c) {
#if defined(__AVX512F__)
  return (vf)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#elif defined(__FMA__) && defined(__AVX__)
  return (vf)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#else
  for (int l = 0; l < kLanes; ++l) a[l] = std::fma(a[l], b[l], c[l]);
  return a;
#endif
}

inline vf floor_lanes(vf x) {
#if defined(__AVX512F__)
  return (vf)_mm512_roundscale_ps((__m512)x, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
#elif defined(__AVX__)
  return (vf)_mm256_round_ps((__m256)x, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
#else
  for (int l = 0; l < kLanes; ++l) x[l] = std::floor(x[l]);
  return x;
#endif
}

inline float bits_as_float(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// exp(x) for x <= 0 as torch's Vectorized<float>::fexp_u20 computes it (0 below ln(FLT_MIN), -inf included).
inline vf fast_exp(vf x) {
  const vf log2e = vf{} + bits_as_float(0x3fb8aa3bu), ln_flt_min = vf{} + bits_as_float(0xc2aeac50u);
  const vf c0 = vf{} + 0.00010703434948458272f, c1 = vf{} + 0.30354260500649682f, c2 = vf{} - 0.22433836478672356f,
           c3 = vf{} - 0.079204240219773236f;
  vf t = x * log2e;  // one product with two uses: never contracted into an FMA
  const vf fraction = t - floor_lanes(t);
  vf p = fma_lanes(fraction, c3, c2);
  p = fma_lanes(fraction, p, c1);
  p = fma_lanes(fraction, p, c0);
  t = t - p;
  const vi bits = __builtin_convertvector(fma_lanes(vf{} + 8388608.f, t, vf{} + 8388608.f * 127.f), vi);  // truncates
  return x < ln_flt_min ? vf{} : (vf)bits;
}

// The sum of the lanes, folded in halves (lane l plus lane l ^ width, widest first), lane 0's.
inline float fold_lanes(vf v) {
  for (int width = kLanes / 2; width >= 1; width /= 2) {
    vi partner;
    for (int l = 0; l < kLanes; ++l) partner[l] = l ^ width;
    v = v + __builtin_shuffle(v, partner);
  }
  return v[0];
}

// In place: each query head's scores over the keys it sees become exp(score - max), rounded to the pool's
// dtype as torch's CPU flash attention rounds them before its P @ V product, and the keys it does not see
// weigh 0; inverse_sums[i * H + h] = 1 / the sum of the unrounded values, applied to the output. The split
// between fast_exp and expf is at the last whole vector of the query's row as torch sees it: the prompt's
// length for a query of a whole prompt (`prompt_length`: torch softmaxes every query of a prompt over all
// of its keys, the later ones masked), else the keys the query sees, as a decode of that length does (so a
// row verifying proposed tokens weighs each query as decoding it would).
template <typename scalar_t>
inline void softmax_rows(float* scores, int64_t queries, int64_t heads, int64_t length, int64_t prompt_length, float* inverse_sums) {
  constexpr bool as_torch = !std::is_same_v<scalar_t, float>;  // an fp32 pool: every key through the vector exp
  const auto exp_of = [](vf x) { return as_torch ? fast_exp(x) : exp_nonpositive(x); };
  for (int64_t i = 0; i < queries; ++i) {
    const int64_t visible = visible_keys(length, queries, i);
    const int64_t row_keys = prompt_length ? prompt_length : visible;
    const int64_t vector_end = as_torch ? std::min(visible, row_keys - row_keys % kLanes) : visible;
    for (int64_t h = i * heads; h < (i + 1) * heads; ++h) {
      float* s = scores + h * length;
      const float top = max_of(s, visible);
      vf sums = {};
      int64_t t = 0;
      for (; t + kLanes <= vector_end; t += kLanes) {
        const vf e = exp_of(*reinterpret_cast<const vf_unaligned*>(s + t) - top);
        sums += e;
        *reinterpret_cast<vf_unaligned*>(s + t) = round_to<scalar_t>(e);
      }
      if (t < vector_end) {  // a vector's first keys: the rest are past the query (torch's -inf, weight 0)
        const int64_t seen = vector_end - t;
        vf x = {};
        std::memcpy(&x, s + t, seen * sizeof(float));
        vf e = exp_of(x - top);
        for (int64_t l = seen; l < kLanes; ++l) e[l] = 0.f;
        sums += e;
        const vf w = round_to<scalar_t>(e);
        std::memcpy(s + t, &w, seen * sizeof(float));
        t = vector_end;
      }
      float sum = fold_lanes(sums);
      for (; t < visible; ++t) {
        const float e = std::exp(s[t] - top);
        sum += e;
        s[t] = round_to<scalar_t>(e);
      }
      std::fill(s + visible, s + length, 0.f);
      inverse_sums[h] = 1.f / sum;
    }
  }
}

// acc[i * H + h] = sum_t weights[(i * H + h) * length + t] * V_t, one pool block of V at a time (a head's
// rows requested kKeysAhead keys ahead by the first sweep over them): per KV head, up to kValueHeads of
// the (query, head) pairs that share it accumulate a slice of kValueSlice * kLanes dims in registers
// while the block's V rows of that head stream by, as far as the last of those queries sees; the
// accumulators go back to `acc` (L1) between blocks.
constexpr int largest_divisor_up_to(int n, int most) { return n % most == 0 ? most : largest_divisor_up_to(n, most - 1); }
template <int D>
constexpr int kValueSlice = largest_divisor_up_to(D / kLanes, 4);
template <int D>
constexpr int kValueHeads = std::max(1, std::min(8, (kVectorRegisters - 1 - kValueSlice<D>) / kValueSlice<D>));

// One slice of dims for N (query, head) pairs over the V rows [begin, end) of one KV head.
template <int D, int N, int S, typename scalar_t>
inline void weigh_slice(const float* weights, const int64_t* heads, int64_t length, const scalar_t* value, const int64_t* offsets,
                        int64_t begin, int64_t end, int64_t dim, const RowsAhead<scalar_t>* ahead, float* acc) {
  vf sums[N][S];
  for (int j = 0; j < N; ++j) load_vectors<S>(acc + heads[j] * D + dim, sums[j]);
  for (int64_t pos = begin; pos < end; ++pos) {
    if (ahead) ahead->template request<D>(pos + kKeysAhead, pos + kKeysAhead + 1);
    vf v[S];
    load_vectors<S>(value + offsets[pos] + dim, v);
    for (int j = 0; j < N; ++j) {
      const float p = weights[heads[j] * length + pos];
      for (int c = 0; c < S; ++c) sums[j][c] += p * v[c];
    }
  }
  for (int j = 0; j < N; ++j) store_vectors<S>(sums[j], acc + heads[j] * D + dim);
}

template <int D, typename scalar_t>
void weigh_values(const float* weights, int64_t queries, const scalar_t* value, const int64_t* offsets, int64_t length,
                  HeadRows<scalar_t> next_keys, const Geometry& g, float* acc) {
  constexpr int slice = kValueSlice<D>, block = kValueHeads<D>;
  const int64_t group = g.heads / g.kv_heads, pairs = queries * group;
  std::fill(acc, acc + queries * g.heads * D, 0.f);
  for (int64_t begin = 0; begin < length; begin += g.block_size) {
    for (int64_t kvh = 0; kvh < g.kv_heads; ++kvh) {
      for (int64_t first = 0; first < pairs; first += block) {
        int64_t heads[block];
        const int64_t count = std::min<int64_t>(block, pairs - first);
        for (int64_t j = 0; j < count; ++j) heads[j] = pair_head(first + j, kvh, g);
        const int64_t visible = visible_keys(length, queries, (first + count - 1) / group);
        const int64_t end = std::min(begin + g.block_size, visible);
        const RowsAhead<scalar_t> ahead{{value + kvh * g.k_head, offsets, visible}, next_keys.of_head(kvh, g)};
        for (int64_t dim = 0; dim < D; dim += slice * kLanes) {
          with_count<block>(count, [&](auto size) {  // one sweep per block and head asks ahead
            weigh_slice<D, decltype(size)::value, slice>(weights, heads, length, value + kvh * g.k_head, offsets, begin, end, dim,
                                                         first == 0 && dim == 0 ? &ahead : nullptr, acc);
          });
        }
      }
    }
  }
}

// Which of the two orders of score_keys_bf16 a query's scores are summed in.
struct FourChains {
  int64_t prompt_length;  // the row's keys when it is a whole prompt, else 0 (a query like a decode's)
  int64_t first;          // the tile's first query within its row

  bool operator()(int64_t query) const {
    if (!prompt_length) return true;
    const int64_t split = prompt_length >= 768 ? 256 : prompt_length >= 192 ? 64 : 32;  // torch's query blocks
    const int64_t index = first + query, block_queries = std::min(split, prompt_length - index / split * split);
    return prompt_length < 24 || block_queries < 4;
  }
};

// f(std::integral_constant<int, tiles>{}) with the K tiles score_keys_bf16 dots at a time for a task of
// `queries` queries: kScoreTiles for a task of many (a prompt's tile), whose heads keep the dot-product unit
// busy; one for a task of few (a prompt's last queries), which waits on memory, and whose next block,
// requested while the one before it is read, then arrives in time. On an AMD EPYC, 4 tiles at a time took
// bf16 decode attention at batch 64 1.27x as long, 1 tile a 300-token prompt 1.15x. (Decodes and rows
// verifying a few proposed tokens, every query in four chains, go to score_keys_bf16_chains instead.)
constexpr int kScoreTiles = 4;
constexpr int64_t kFewQueries = 4;
template <typename F>
inline void with_tiles(int64_t queries, F&& f) {
  if (queries <= kFewQueries) return f(std::integral_constant<int, 1>{});
  f(std::integral_constant<int, kScoreTiles>{});
}

#if defined(__AVX512BF16__)
constexpr bool kBf16Dot = true;

// score_keys for a bf16 pool on a CPU with AVX512-BF16, in the order of the GEMM under torch's CPU flash
// attention (MKL's bf16 GEMM, on the unscaled query; the product then scaled), which depends on its shape.
// Measured on an AMD EPYC with AVX512-BF16: a block of at most 3 queries (a decode; the last queries of a
// prompt), or a prompt of fewer than 24 keys, sums each score in 4 chains, dims d = j mod 4 in chain j,
// added as (0 + 2) + (1 + 3); larger blocks sum it in one chain over the dims in order. Each addition is
// rounded to fp32. `FourChains` says which a query gets.
//
// One key per lane: per KV head, a tile's kLanes K rows are transposed into D / 2 vectors of dim pairs, and
// each query head runs its chains of bf16 dot-product instructions against its own pairs broadcast. The
// instruction adds the product of a pair's high half first, then the low half's (rounding after each), so
// a pair holds the chain's earlier dim in its high half, on both sides. Tiles tiles at a time give a head
// that many independent chains (with_tiles says how many).

// words[w] lane t = the 32-bit word w (dims 2w, 2w + 1) of key t's row (transpose_lanes, vector.h).
template <int D>
inline void transpose_words(const at::BFloat16* const (&rows)[kLanes], __m512i* words) {
  for (int block = 0; block < D / (2 * kLanes); ++block) {
    vf m[kLanes];  // the words moved as fp32 lanes: the same bits
    for (int t = 0; t < kLanes; ++t) m[t] = (vf)_mm512_loadu_si512(rows[t] + block * 2 * kLanes);
    transpose_lanes(m);
    for (int t = 0; t < kLanes; ++t) words[block * kLanes + t] = (__m512i)m[t];
  }
}

// The halves of 32-bit words moved, for one word (a query's) or sixteen (a tile's keys).
inline uint32_t up16(uint32_t w) { return w << 16; }
inline __m512i up16(__m512i w) { return _mm512_slli_epi32(w, 16); }
inline uint32_t down16(uint32_t w) { return w >> 16; }
inline __m512i down16(__m512i w) { return _mm512_srli_epi32(w, 16); }
inline uint32_t high_low(uint32_t high, uint32_t low) { return (high & 0xFFFF0000u) | (low & 0xFFFFu); }
inline __m512i high_low(__m512i high, __m512i low) {
  return _mm512_ternarylogic_epi32(high, low, _mm512_set1_epi32(0xFFFF), 0xD8);  // mask ? low : high, bit by bit
}

// Dim pairs for one chain over all dims in order: pair c = dim 2c high, 2c + 1 low.
template <typename word_t>
inline word_t one_chain_pair(word_t word) { return high_low(up16(word), down16(word)); }

// Dim pairs for four chains: of the dims 8k .. 8k + 7 (words w = 4k .. 4k + 3), chain j's pair k holds dims
// 8k + j (high) and 8k + 4 + j (low); pairs[j * D / 8 + k].
template <int D, typename word_t>
inline void four_chain_pairs(const word_t* words, word_t* pairs) {
  for (int k = 0; k < D / 8; ++k) {
    const word_t* w = words + 4 * k;
    for (int j = 0; j < 4; ++j) {
      const word_t first = w[j / 2], second = w[2 + j / 2];  // dims 8k + j and 8k + 4 + j: even j low, odd j high
      pairs[j * (D / 8) + k] = j % 2 == 0 ? high_low(up16(first), second) : high_low(first, down16(second));
    }
  }
}

template <int D, int Tiles>
void score_keys_bf16(const at::BFloat16* q, int64_t first_query, int64_t queries, float scale, FourChains four_chains,
                     const at::BFloat16* key, const at::BFloat16* value, const int64_t* offsets, int64_t length, const Geometry& g,
                     float* scores) {
  constexpr int pairs = D / 2, chain_pairs = D / 8;
  const int64_t group = g.heads / g.kv_heads, count = queries * group;
  std::vector<uint32_t> qp(queries * g.heads * pairs);  // each query head's pairs, in its chains' layout
  bool any_one = false, any_four = false;
  for (int64_t i = 0; i < queries; ++i) {
    const bool four = four_chains(i);
    (four ? any_four : any_one) = true;
    for (int64_t h = 0; h < g.heads; ++h) {
      const auto* words = reinterpret_cast<const uint32_t*>(q + (first_query + i) * g.q_row + h * g.q_head);
      uint32_t* out = qp.data() + (i * g.heads + h) * pairs;
      if (four)
        four_chain_pairs<D>(words, out);
      else
        for (int c = 0; c < pairs; ++c) out[c] = one_chain_pair(words[c]);
    }
  }
  __m512i one[Tiles][pairs], four[Tiles][pairs];
  for (int64_t first = 0; first < length; first += Tiles * kLanes) {
    const int64_t used = std::min<int64_t>(Tiles, (length - first + kLanes - 1) / kLanes);
    for (int64_t kvh = 0; kvh < g.kv_heads; ++kvh) {
      for (int64_t tile = 0; tile < Tiles; ++tile) {  // past the row's end (tile >= used): zeros, dotted and not stored
        __m512i words[pairs];
        if (tile < used) {
          const at::BFloat16* rows[kLanes];
          tile_rows<D>(key, offsets, length, first + tile * kLanes, kvh, g, rows);
          transpose_words<D>(rows, words);
        } else {
          for (auto& w : words) w = _mm512_setzero_si512();
        }
        if (any_one)
          for (int c = 0; c < pairs; ++c) one[tile][c] = one_chain_pair(words[c]);
        if (any_four) four_chain_pairs<D>(words, four[tile]);
      }
      const RowsAhead<at::BFloat16> ahead{{key + kvh * g.k_head, offsets, length}, {value + kvh * g.k_head, offsets, length}};
      const Shares shares(first + std::max<int64_t>(kKeysAhead, Tiles * kLanes), Tiles * kLanes, count);
      for (int64_t j = 0; j < count; ++j) {
        ahead.request<D>(shares.begin(j), shares.end(j));
        const int64_t head = pair_head(j, kvh, g);
        const uint32_t* qh = qp.data() + head * pairs;
        const auto pair_of = [&](int c) { return (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(qh[c])); };
        __m512 total[Tiles];
        if (four_chains(head / g.heads)) {
          __m512 acc[Tiles][4];
          for (auto& tile : acc)
            for (auto& chain : tile) chain = _mm512_setzero_ps();
          for (int k = 0; k < chain_pairs; ++k)
            for (int chain = 0; chain < 4; ++chain) {
              const __m512bh qc = pair_of(chain * chain_pairs + k);
              for (int tile = 0; tile < Tiles; ++tile)
                acc[tile][chain] = _mm512_dpbf16_ps(acc[tile][chain], (__m512bh)four[tile][chain * chain_pairs + k], qc);
            }
          for (int tile = 0; tile < Tiles; ++tile)
            total[tile] = _mm512_add_ps(_mm512_add_ps(acc[tile][0], acc[tile][2]), _mm512_add_ps(acc[tile][1], acc[tile][3]));
        } else {
          for (auto& t : total) t = _mm512_setzero_ps();
          for (int c = 0; c < pairs; ++c) {
            const __m512bh qc = pair_of(c);
            for (int tile = 0; tile < Tiles; ++tile) total[tile] = _mm512_dpbf16_ps(total[tile], (__m512bh)one[tile][c], qc);
          }
        }
#pragma GCC unroll 8
        for (int tile = 0; tile < Tiles; ++tile) {  // unrolled: a loop over `total` would keep it in memory (a store per dot)
          if (tile == used) break;
          const int64_t at = first + tile * kLanes, n = std::min<int64_t>(kLanes, length - at);
          store_lanes((vf)_mm512_mul_ps(total[tile], _mm512_set1_ps(scale)), scores + head * length + at, n);
        }
      }
    }
  }
}

// score_keys_bf16 for a task of few queries that all sum in four chains (decodes, rows verifying a few
// proposed tokens), without transposing keys to one per 32-bit lane: one key per 128-bit lane, four chains per
// key. A key's dims 8k .. 8k + 7 are 16 bytes of its row; step k of chain j takes dims 8k + j (high half) and
// 8k + 4 + j (low half), the word a byte shuffle puts in 32-bit lane j of those 16 bytes, so a vector of four
// keys' step-k bytes (a 4 x 4 transpose of 128-bit lanes from their rows) runs four keys' four chains at once
// against the query's step-k word pattern repeated. The chains are added as (0 + 2) + (1 + 3) inside each 128-bit lane, as score_keys_bf16 adds them:
// the same bits with a third fewer instructions per key (score_keys_bf16 transposes each 16 keys' words, then
// moves their halves into the chains' pairs, then broadcasts a query pair per instruction). On an AMD EPYC
// (Zen 4), 1 thread, bf16 decode attention at batch 64 over <= 400 keys, 30 layers: 36 -> 29 ms with the keys'
// blocks scattered in memory, 25 -> 18 ms with them in cache. Scoring four heads at once (8 chains in flight
// instead of 2) did not take less time.
template <int D>
void score_keys_bf16_chains(const at::BFloat16* q, int64_t first_query, int64_t queries, float scale, const at::BFloat16* key,
                            const at::BFloat16* value, const int64_t* offsets, int64_t length, const Geometry& g, float* scores) {
  constexpr int steps = D / 8, halves = D / 32;
  constexpr int kKeys = 8;  // two vectors of four keys per block
  const int64_t group = g.heads / g.kv_heads, count = queries * group;
  const __m512i chain_words = _mm512_broadcast_i32x4(_mm_setr_epi8(8, 9, 0, 1, 10, 11, 2, 3, 12, 13, 4, 5, 14, 15, 6, 7));
  std::vector<__m512i> qv(queries * g.heads * steps);  // per (query, head): step k's word pattern in every 128-bit lane
  for (int64_t i = 0; i < queries; ++i)
    for (int64_t h = 0; h < g.heads; ++h) {
      const at::BFloat16* row = q + (first_query + i) * g.q_row + h * g.q_head;
      for (int k = 0; k < steps; ++k)
        qv[(i * g.heads + h) * steps + k] =
            _mm512_shuffle_epi8(_mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 8 * k))), chain_words);
    }
  alignas(64) static const at::BFloat16 zeros[D] = {};
  const __m512i first_lanes = _mm512_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28, 0, 0, 0, 0, 0, 0, 0, 0);
  for (int64_t first = 0; first < length; first += kKeys) {
    const int64_t n = std::min<int64_t>(kKeys, length - first);
    for (int64_t kvh = 0; kvh < g.kv_heads; ++kvh) {
      const RowsAhead<at::BFloat16> ahead{{key + kvh * g.k_head, offsets, length}, {value + kvh * g.k_head, offsets, length}};
      ahead.request<D>(first + kKeysAhead, first + kKeysAhead + kKeys);
      __m512i steps_of[2][steps];  // [four keys][k]
      for (int four = 0; four < 2; ++four) {
        const at::BFloat16* rows[4];
        for (int t = 0; t < 4; ++t) {
          const int64_t pos = first + four * 4 + t;
          rows[t] = pos < length ? key + offsets[pos] + kvh * g.k_head : zeros;
        }
        for (int half = 0; half < halves; ++half) {
          __m512i x[4];
          for (int t = 0; t < 4; ++t) x[t] = _mm512_loadu_si512(rows[t] + 32 * half);
          const __m512i a = _mm512_shuffle_i64x2(x[0], x[1], 0x44), b = _mm512_shuffle_i64x2(x[0], x[1], 0xEE);
          const __m512i c = _mm512_shuffle_i64x2(x[2], x[3], 0x44), d = _mm512_shuffle_i64x2(x[2], x[3], 0xEE);
          steps_of[four][4 * half + 0] = _mm512_shuffle_epi8(_mm512_shuffle_i64x2(a, c, 0x88), chain_words);
          steps_of[four][4 * half + 1] = _mm512_shuffle_epi8(_mm512_shuffle_i64x2(a, c, 0xDD), chain_words);
          steps_of[four][4 * half + 2] = _mm512_shuffle_epi8(_mm512_shuffle_i64x2(b, d, 0x88), chain_words);
          steps_of[four][4 * half + 3] = _mm512_shuffle_epi8(_mm512_shuffle_i64x2(b, d, 0xDD), chain_words);
        }
      }
      for (int64_t j = 0; j < count; ++j) {
        const int64_t head = pair_head(j, kvh, g);
        const __m512i* qh = qv.data() + head * steps;
        __m512 acc[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
        for (int k = 0; k < steps; ++k) {
          const __m512bh qk = (__m512bh)qh[k];
          acc[0] = _mm512_dpbf16_ps(acc[0], (__m512bh)steps_of[0][k], qk);
          acc[1] = _mm512_dpbf16_ps(acc[1], (__m512bh)steps_of[1][k], qk);
        }
        for (auto& v : acc) {
          v = _mm512_add_ps(v, _mm512_permute_ps(v, 0x4E));  // lanes 0, 1 of each 128: chains 0 + 2, 1 + 3
          v = _mm512_add_ps(v, _mm512_permute_ps(v, 0xB1));  // lane 0: (0 + 2) + (1 + 3)
        }
        const __m512 total = _mm512_mul_ps(_mm512_permutex2var_ps(acc[0], first_lanes, acc[1]), _mm512_set1_ps(scale));
        _mm512_mask_storeu_ps(scores + head * length + first, static_cast<__mmask16>((1u << n) - 1), total);
      }
    }
  }
}

// In place: each (query, head) pair's weights (softmax_rows left them fp32 values that bf16 holds exactly)
// become the bf16 values of two consecutive keys per 32 bits, t + 1 in the low half and t in the high half
// for even t (the instruction adds the high half's product first: key t before key t + 1, the order of
// torch's P @ V GEMM), a zero after an odd count: the V pass broadcasts one such pair per two keys. Row h's
// pairs start where its floats started.
inline void pack_weight_pairs(float* weights, int64_t rows, int64_t length) {
  const int64_t padded = length + (length & 1);
  for (int64_t h = 0; h < rows; ++h) {
    const float* row = weights + h * length;
    auto* packed = reinterpret_cast<uint16_t*>(weights + h * length);
    for (int64_t t = 0; t < padded; t += 2 * kLanes) {  // reads [4t, 4t + 128) bytes, then writes [2t, 2t + 64)
      const int64_t n = std::min<int64_t>(2 * kLanes, length - t);
      const __mmask16 low = n >= kLanes ? 0xFFFF : static_cast<__mmask16>((1u << n) - 1);
      const __mmask16 high = n >= 2 * kLanes ? 0xFFFF : n > kLanes ? static_cast<__mmask16>((1u << (n - kLanes)) - 1) : 0;
      const __m512bh both = _mm512_cvtne2ps_pbh(_mm512_maskz_loadu_ps(high, row + t + kLanes), _mm512_maskz_loadu_ps(low, row + t));
      const int64_t stored = std::min<int64_t>(2 * kLanes, padded - t);
      _mm512_mask_storeu_epi16(packed + t, stored >= 2 * kLanes ? ~0u : (1u << stored) - 1, one_chain_pair((__m512i)both));
    }
  }
}

// weigh_values for a bf16 pool on a CPU with AVX512-BF16: two keys at a time, their V rows interleaved dim by
// dim (one unpack per 32 dims, key t + 1 low and key t high, as their weights) and multiplied by the pair of
// their weights (pack_weight_pairs) with the bf16 dot-product instruction, so that each dim is one chain of
// rounded additions over the keys in order; the unpack's lane order is undone once at the end. N (query, head) pairs of one
// KV head at a time, each with 2 * pairs accumulators in registers.
template <int D>
constexpr int kValueHeadsBf16 = std::max(1, std::min(6, (kVectorRegisters - 2 - D / kLanes) / (D / kLanes)));

template <int D, int N>
void weigh_pairs_bf16(const uint32_t* weights, const int64_t* heads, int64_t stride, int64_t visible, const at::BFloat16* value,
                      const int64_t* offsets, const RowsAhead<at::BFloat16>* ahead, float* acc) {
  constexpr int pairs = D / (2 * kLanes);
  __m512 sums[N][2 * pairs];
  for (auto& head : sums)
    for (auto& v : head) v = _mm512_setzero_ps();
  for (int64_t pos = 0; pos < visible; pos += 2) {
    if (ahead) ahead->request<D>(pos + kKeysAhead, pos + kKeysAhead + 2);
    const bool two = pos + 1 < visible;
    const at::BFloat16* a = value + offsets[pos];
    const at::BFloat16* b = two ? value + offsets[pos + 1] : nullptr;
    __m512i lo[pairs], hi[pairs];
    for (int c = 0; c < pairs; ++c) {
      const __m512i va = _mm512_loadu_si512(a + c * 2 * kLanes);
      const __m512i vb = two ? _mm512_loadu_si512(b + c * 2 * kLanes) : _mm512_setzero_si512();
      lo[c] = _mm512_unpacklo_epi16(vb, va);
      hi[c] = _mm512_unpackhi_epi16(vb, va);
    }
    for (int j = 0; j < N; ++j) {
      const __m512bh p = (__m512bh)_mm512_set1_epi32(static_cast<int>(weights[heads[j] * stride + pos / 2]));
      for (int c = 0; c < pairs; ++c) {
        sums[j][2 * c] = _mm512_dpbf16_ps(sums[j][2 * c], (__m512bh)lo[c], p);
        sums[j][2 * c + 1] = _mm512_dpbf16_ps(sums[j][2 * c + 1], (__m512bh)hi[c], p);
      }
    }
  }
  // The unpacks' lane order undone in registers: 128-bit lane k of `lo` holds dims 8k .. 8k + 3 of the pair's 32,
  // of `hi` dims 8k + 4 .. 8k + 7. (Through arrays and a loop over lanes, the sums stayed in memory: a store per add.)
  const __m512i first_half = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i second_half = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  for (int j = 0; j < N; ++j) {
    float* o = acc + heads[j] * D;
    for (int c = 0; c < pairs; ++c) {
      _mm512_storeu_ps(o + c * 2 * kLanes, _mm512_permutex2var_ps(sums[j][2 * c], first_half, sums[j][2 * c + 1]));
      _mm512_storeu_ps(o + c * 2 * kLanes + kLanes, _mm512_permutex2var_ps(sums[j][2 * c], second_half, sums[j][2 * c + 1]));
    }
  }
}

template <int D>
void weigh_values_bf16(float* weights, int64_t queries, const at::BFloat16* value, const int64_t* offsets, int64_t length,
                       HeadRows<at::BFloat16> next_keys, const Geometry& g, float* acc) {
  constexpr int block = kValueHeadsBf16<D>;
  const int64_t group = g.heads / g.kv_heads, count_all = queries * group;
  pack_weight_pairs(weights, queries * g.heads, length);
  const auto* packed = reinterpret_cast<const uint32_t*>(weights);
  for (int64_t kvh = 0; kvh < g.kv_heads; ++kvh) {
    for (int64_t first = 0; first < count_all; first += block) {
      const int64_t count = std::min<int64_t>(block, count_all - first);
      int64_t heads[block];
      for (int64_t j = 0; j < count; ++j) heads[j] = pair_head(first + j, kvh, g);
      const int64_t visible = visible_keys(length, queries, (first + count - 1) / group);
      const RowsAhead<at::BFloat16> ahead{{value + kvh * g.k_head, offsets, visible}, next_keys.of_head(kvh, g)};
      with_count<block>(count, [&](auto size) {  // the first sweep over this head's V rows asks ahead: the others find them in cache
        weigh_pairs_bf16<D, decltype(size)::value>(packed, heads, length, visible, value + kvh * g.k_head, offsets,
                                                   first == 0 ? &ahead : nullptr, acc);
      });
    }
  }
}
#else
constexpr bool kBf16Dot = false;
template <int D, int Tiles>
void score_keys_bf16(const at::BFloat16*, int64_t, int64_t, float, FourChains, const at::BFloat16*, const at::BFloat16*,
                     const int64_t*, int64_t, const Geometry&, float*) {}
template <int D>
void weigh_values_bf16(float*, int64_t, const at::BFloat16*, const int64_t*, int64_t, HeadRows<at::BFloat16>, const Geometry&,
                       float*) {}
template <int D>
void score_keys_bf16_chains(const at::BFloat16*, int64_t, int64_t, float, const at::BFloat16*, const at::BFloat16*, const int64_t*,
                            int64_t, const Geometry&, float*) {}
#endif

// One row: queries q[first_query : first_query + queries], the last `queries` positions of `length` keys.
template <int D, typename scalar_t, typename index_t>
void attend_row(const scalar_t* q, const scalar_t* key, const scalar_t* value, const index_t* table, int64_t length,
                int64_t prompt_length, int64_t row_query, int64_t first_query, int64_t queries, float scale, const Geometry& g, scalar_t* out,
                Scratch& scratch) {
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
  if (!scratch.keys_requested) prefetch_first_rows<D>(key, offsets, length, g);
  const HeadRows<scalar_t> next_keys{key, scratch.next_offsets.data(), static_cast<int64_t>(scratch.next_offsets.size())};
  for (int64_t i = 0; i < queries; ++i) {
    for (int64_t h = 0; h < g.heads; ++h) {
      float* qh = qf + (i * g.heads + h) * D;
      load_row<D>(q + (first_query + i) * g.q_row + h * g.q_head, qh);
      for (int d = 0; d < D; ++d) qh[d] *= scale;
    }
  }
  if constexpr (bf16_dot) {
    const FourChains four_chains{prompt_length, row_query};
    bool all_four = queries <= kFewQueries;
    for (int64_t i = 0; i < queries && all_four; ++i) all_four = four_chains(i);
    if (all_four)
      score_keys_bf16_chains<D>(q, first_query, queries, scale, key, value, offsets, length, g, scores);
    else
      with_tiles(queries, [&](auto tiles) {
        score_keys_bf16<D, decltype(tiles)::value>(q, first_query, queries, scale, four_chains, key, value, offsets, length, g, scores);
      });
  } else if (prompt_length && queries > kFewQueries)
    score_keys_transposed<D>(qf, queries, key, value, offsets, length, g, scores);
  else
    score_keys<D>(qf, queries, key, value, offsets, length, g, scores);
  softmax_rows<scalar_t>(scores, queries, g.heads, length, prompt_length, inverse_sums);
  if constexpr (bf16_dot)
    weigh_values_bf16<D>(scores, queries, value, offsets, length, next_keys, g, acc);
  else
    weigh_values<D>(scores, queries, value, offsets, length, next_keys, g, acc);
  for (int64_t i = 0; i < queries; ++i) {
    for (int64_t h = 0; h < g.heads; ++h) {
      const int64_t head = i * g.heads + h;
      scalar_t* o = out + (first_query + i) * g.o_row + h * g.o_head;
      for (int d = 0; d < D; ++d) o[d] = static_cast<scalar_t>(acc[head * D + d] * inverse_sums[head]);
    }
  }
  scratch.keys_requested = next_keys.count > 0 && length - queries + 1 >= kKeysAhead;  // every V sweep ran kKeysAhead past its rows
}

// A row with many queries (a prefill chunk) is cut into tiles of kQueryTile queries, each attended as a row
// of its own: the tile's queries are the last positions of the keys up to its last query, so a tile reads
// only the keys it sees (causal: the first tile of a prompt reads its first kQueryTile keys) and its scores
// ([tile queries * H, keys] floats) stay in the core's cache. A query gives bit for bit the same whatever
// its tile (weights past a query's position are exactly 0; what depends on the whole row travels in the
// Task: the prompt's length and the tile's place in it).
constexpr int64_t kQueryTile = 32;

struct Task {
  int64_t row, row_query, first_query, queries, length, prompt_length;
};

template <typename index_t>
std::vector<Task> tasks_of(const index_t* lens, const index_t* starts, int64_t rows, const Geometry& g) {
  std::vector<Task> tasks;
  tasks.reserve(rows);
  for (int64_t row = 0; row < rows; ++row) {
    const int64_t length = static_cast<int64_t>(lens[row]);
    const int64_t first = starts ? static_cast<int64_t>(starts[row]) : row;
    const int64_t queries = starts ? static_cast<int64_t>(starts[row + 1]) - first : 1;
    TORCH_CHECK(length >= 1 && length <= g.table_width * g.block_size, "context_lens[", row, "] = ", length,
                " is outside [1, table width * block size]");
    TORCH_CHECK(queries >= 1 && queries <= length, "row ", row, " has ", queries, " queries for ", length, " keys");
    for (int64_t begin = 0; begin < queries; begin += kQueryTile) {
      const int64_t end = std::min(queries, begin + kQueryTile);
      tasks.push_back({row, begin, first + begin, end - begin, length - queries + end, queries == length ? length : 0});
    }
  }
  return tasks;
}

template <typename scalar_t, typename index_t>
void run(const at::Tensor& q, const at::Tensor& key, const at::Tensor& value, const at::Tensor& table,
         const at::Tensor& lens, const index_t* starts, float scale, at::Tensor& out) {
  const Geometry g{q.size(1), key.size(2), q.size(2), key.size(1), table.size(1),
                   q.stride(0), q.stride(1), key.stride(0), key.stride(1), key.stride(2), out.stride(0), out.stride(1)};
  const auto* qp = q.data_ptr<scalar_t>();
  const auto* kp = key.data_ptr<scalar_t>();
  const auto* vp = value.data_ptr<scalar_t>();
  const auto* tp = table.data_ptr<index_t>();
  auto* op = out.data_ptr<scalar_t>();
  const std::vector<Task> tasks = tasks_of(lens.data_ptr<index_t>(), starts, lens.size(0), g);
  at::parallel_for(0, static_cast<int64_t>(tasks.size()), 1, [&](int64_t begin, int64_t end) {
    Scratch scratch;
    for (int64_t i = begin; i < end; ++i) {
      const Task& t = tasks[i];
      const index_t* row_table = tp + t.row * g.table_width;
      scratch.next_offsets.resize(i + 1 < end ? std::min(kKeysAhead, tasks[i + 1].length) : 0);
      if (i + 1 < end) token_offsets(tp + tasks[i + 1].row * g.table_width, static_cast<int64_t>(scratch.next_offsets.size()), g,
                                     scratch.next_offsets.data());
      switch (g.dim) {
#define PDSERVE_HEAD_DIM(D)                                                                                 \
  case D:                                                                                                   \
    attend_row<D>(qp, kp, vp, row_table, t.length, t.prompt_length, t.row_query, t.first_query, t.queries, scale, g, op, scratch); \
    break;
        PDSERVE_HEAD_DIMS(PDSERVE_HEAD_DIM)
#undef PDSERVE_HEAD_DIM
        default:
          TORCH_CHECK(false, "paged_decode: unsupported head_dim ", g.dim);
      }
    }
  });
}

}  // namespace

at::Tensor paged_decode(at::Tensor q, at::Tensor key, at::Tensor value, at::Tensor block_table,
                           at::Tensor context_lens, double scale, std::optional<at::Tensor> query_starts) {
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
  auto out = at::empty_like(q, at::MemoryFormat::Contiguous);
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

std::vector<int64_t> supported_head_dims() {
#define PDSERVE_LIST(D) D,
  return {PDSERVE_HEAD_DIMS(PDSERVE_LIST)};
#undef PDSERVE_LIST
}

}  // namespace pdserve
