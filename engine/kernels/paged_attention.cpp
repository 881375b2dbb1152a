// Decode attention that reads K and V where they live in the paged pool (CPU, fp32 and bf16).
//
// One task per row. The row's token offsets into the pool are computed once (no division per key). K pass:
// 16 keys at a time (their rows of every KV head prefetched 16 keys ahead); each KV head's 16 K rows are
// converted to fp32 once into L1 and every query head sharing them accumulates its 16 dot products in
// registers, reduced by one transposing sum. The scores of the whole context (a few KB) are softmaxed in
// fp32. V pass: per KV head, its query heads accumulate in registers while that head's V rows stream by.
// A bf16 pool on a CPU with AVX512-BF16 skips the conversions: both passes use the bf16 dot-product
// instruction on the rows as stored (products exact in fp32, sums in fp32). No workspace, no padding: a
// row reads exactly `context_lens[row]` keys.
// Shapes: q [B, H, D]; key/value [blocks, block_size, Hkv, D] (head_dim contiguous);
// block_table [B, W] int32 or int64; context_lens [B] int32 or int64; returns [B, H, D] in q's dtype.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
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
  std::vector<v16> partial;
  std::vector<int64_t> offsets;
};

// Ask for key/value rows [from, to) of the row's context (all KV heads of each) before they are needed: a
// row's blocks are scattered over the pool, which the hardware prefetchers cannot guess.
template <typename scalar_t>
inline void prefetch_rows(const scalar_t* pool, const int64_t* offsets, int64_t from, int64_t to, const Geometry& g) {
  const int64_t bytes = g.k_token * static_cast<int64_t>(sizeof(scalar_t));
  for (int64_t pos = from; pos < to; ++pos) {
    const char* start = reinterpret_cast<const char*>(pool + offsets[pos]);
    for (int64_t offset = 0; offset < bytes; offset += 64) __builtin_prefetch(start + offset);
  }
}

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

// scores[h * length + t] = q_h . K_t for every (scaled) query head and every key of the row, 16 keys at a
// time: per query head, 16 accumulators (one per key, in registers) of vertical multiply-adds over the
// dims, then one transposing sum. The 16 K rows stay in L1 while the G heads sharing them pass.
template <int D, typename scalar_t>
void score_keys(const float* qf, const scalar_t* key, const int64_t* offsets, int64_t length,
                const Geometry& g, float* scores, v16*) {
  constexpr int chunks = D / kLanes;
  const int64_t group = g.heads / g.kv_heads;
  alignas(64) float rows[kLanes][D];
  for (int64_t first = 0; first < length; first += kLanes) {
    const int64_t n = std::min<int64_t>(kLanes, length - first);
    prefetch_rows(key, offsets, std::min(first + kLanes, length), std::min(first + 2 * kLanes, length), g);
    for (int64_t kvh = 0; kvh < g.kv_heads; ++kvh) {
      for (int64_t t = 0; t < kLanes; ++t) {
        if (t < n) load_row<D>(key + offsets[first + t] + kvh * g.k_head, rows[t]);
        else std::memset(rows[t], 0, sizeof rows[t]);
      }
      for (int64_t h = kvh * group; h < (kvh + 1) * group; ++h) {
        v16 q[chunks];
        std::memcpy(q, qf + h * D, sizeof q);
        v16 acc[kLanes];
        for (int t = 0; t < kLanes; ++t) {
          v16 k[chunks];
          std::memcpy(k, rows[t], sizeof k);
          v16 sum = q[0] * k[0];
          for (int c = 1; c < chunks; ++c) sum += q[c] * k[c];
          acc[t] = sum;
        }
        alignas(64) float out[kLanes];
        const v16 total = transpose_sum(acc);
        std::memcpy(out, &total, sizeof out);
        std::memcpy(scores + h * length + first, out, n * sizeof(float));
      }
    }
  }
}

#if defined(__AVX512BF16__)
constexpr bool kBf16Dot = true;
// score_keys for a bf16 pool on a CPU with AVX512-BF16: the query heads stay in bf16 and each K row is
// used as loaded, two dims per lane with the bf16 dot-product instruction (products exact in fp32, sums
// in fp32); the scale is applied to the fp32 scores.
template <int D>
void score_keys_bf16(const at::BFloat16* q, float scale, const at::BFloat16* key, const int64_t* offsets,
                     int64_t length, const Geometry& g, float* scores, v16* partial) {
  constexpr int pairs = D / (2 * kLanes);  // 512-bit registers of 32 bf16 per row
  const int64_t group = g.heads / g.kv_heads;
  std::vector<__m512bh> qb(g.heads * pairs);
  for (int64_t h = 0; h < g.heads; ++h)
    for (int c = 0; c < pairs; ++c) qb[h * pairs + c] = (__m512bh)_mm512_loadu_si512(q + h * g.q_head + c * 2 * kLanes);
  for (int64_t first = 0; first < length; first += kLanes) {
    const int64_t n = std::min<int64_t>(kLanes, length - first);
    prefetch_rows(key, offsets, std::min(first + kLanes, length), std::min(first + 2 * kLanes, length), g);
    for (int64_t t = 0; t < kLanes; ++t) {
      for (int64_t kvh = 0; kvh < g.kv_heads; ++kvh) {
        __m512bh k[pairs];
        for (int c = 0; c < pairs; ++c)
          k[c] = t < n ? (__m512bh)_mm512_loadu_si512(key + offsets[first + t] + kvh * g.k_head + c * 2 * kLanes)
                       : (__m512bh)_mm512_setzero_si512();
        for (int64_t h = kvh * group; h < (kvh + 1) * group; ++h) {
          __m512 sum = _mm512_setzero_ps();
          for (int c = 0; c < pairs; ++c) sum = _mm512_dpbf16_ps(sum, qb[h * pairs + c], k[c]);
          partial[h * kLanes + t] = (v16)sum;
        }
      }
    }
    for (int64_t h = 0; h < g.heads; ++h) {
      alignas(64) float out[kLanes];
      const v16 total = transpose_sum(partial + h * kLanes) * scale;
      std::memcpy(out, &total, sizeof out);
      std::memcpy(scores + h * length + first, out, n * sizeof(float));
    }
  }
}
#else
constexpr bool kBf16Dot = false;
template <int D>
void score_keys_bf16(const at::BFloat16*, float, const at::BFloat16*, const int64_t*, int64_t, const Geometry&, float*, v16*) {}
#endif

// In place: each head's scores become exp(score - max), rounded to the pool's dtype as torch's CPU
// flash attention rounds them before its P @ V product (so a bf16 pool gives what transformers' bf16
// SDPA gives); inverse_sums[h] = 1 / the sum of the unrounded values, applied to the output.
template <typename scalar_t>
inline void softmax_rows(float* scores, int64_t heads, int64_t length, float* inverse_sums) {
  for (int64_t h = 0; h < heads; ++h) {
    float* s = scores + h * length;
    const float top = *std::max_element(s, s + length);
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t t = 0; t < length; ++t) {
      const float e = exp_nonpositive(s[t] - top);
      sum += e;
      s[t] = as_float(static_cast<scalar_t>(e));
    }
    inverse_sums[h] = 1.f / sum;
  }
}

// acc[h] = sum_t weights[h * length + t] * V_t. Per KV head, up to kHeadsAtOnce of the query heads that
// share it accumulate in registers while the row's V rows of that head stream by (the row's blocks stay in
// L2 between the KV heads' passes).
constexpr int kHeadsAtOnce = 4;

template <int D, typename scalar_t>
void weigh_values(const float* weights, const scalar_t* value, const int64_t* offsets, int64_t length,
                  const Geometry& g, float* acc) {
  constexpr int chunks = D / kLanes;
  const int64_t group = g.heads / g.kv_heads;
  alignas(64) float row[D];
  for (int64_t kvh = 0; kvh < g.kv_heads; ++kvh) {
    for (int64_t first = kvh * group; first < (kvh + 1) * group; first += kHeadsAtOnce) {
      const int64_t heads = std::min<int64_t>(kHeadsAtOnce, (kvh + 1) * group - first);
      v16 sums[kHeadsAtOnce][chunks] = {};
      for (int64_t pos = 0; pos < length; ++pos) {
        load_row<D>(value + offsets[pos] + kvh * g.k_head, row);
        v16 v[chunks];
        std::memcpy(v, row, sizeof row);
        for (int j = 0; j < kHeadsAtOnce; ++j) {
          if (j >= heads) break;
          const float p = weights[(first + j) * length + pos];
          for (int c = 0; c < chunks; ++c) sums[j][c] += p * v[c];
        }
      }
      for (int64_t j = 0; j < heads; ++j) std::memcpy(acc + (first + j) * D, sums[j], sizeof sums[j]);
    }
  }
}

#if defined(__AVX512BF16__)
inline uint32_t bf16_bits(float x) {  // x holds a bf16 value (softmax_rows rounded it): its top half
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  return bits >> 16;
}

// weigh_values for a bf16 pool on a CPU with AVX512-BF16: two tokens at a time, their V rows interleaved
// dim by dim (one unpack per 32 dims) and multiplied by the pair of their weights with the bf16 dot-product
// instruction; the unpack's lane order is undone once at the end.
template <int D>
void weigh_values_bf16(const float* weights, const at::BFloat16* value, const int64_t* offsets, int64_t length,
                       const Geometry& g, float* acc) {
  constexpr int pairs = D / (2 * kLanes);
  const int64_t group = g.heads / g.kv_heads;
  for (int64_t kvh = 0; kvh < g.kv_heads; ++kvh) {
    for (int64_t first = kvh * group; first < (kvh + 1) * group; first += kHeadsAtOnce) {
      const int64_t heads = std::min<int64_t>(kHeadsAtOnce, (kvh + 1) * group - first);
      __m512 sums[kHeadsAtOnce][2 * pairs];
      for (auto& head : sums)
        for (auto& v : head) v = _mm512_setzero_ps();
      for (int64_t pos = 0; pos < length; pos += 2) {
        if (kvh == 0 && first == 0 && pos % kLanes == 0)
          prefetch_rows(value, offsets, std::min(pos + kLanes, length), std::min(pos + 2 * kLanes, length), g);
        const bool pair = pos + 1 < length;
        const at::BFloat16* a = value + offsets[pos] + kvh * g.k_head;
        const at::BFloat16* b = pair ? value + offsets[pos + 1] + kvh * g.k_head : nullptr;
        __m512i lo[pairs], hi[pairs];
        for (int c = 0; c < pairs; ++c) {
          const __m512i va = _mm512_loadu_si512(a + c * 2 * kLanes);
          const __m512i vb = pair ? _mm512_loadu_si512(b + c * 2 * kLanes) : _mm512_setzero_si512();
          lo[c] = _mm512_unpacklo_epi16(va, vb);
          hi[c] = _mm512_unpackhi_epi16(va, vb);
        }
        for (int j = 0; j < kHeadsAtOnce; ++j) {
          if (j >= heads) break;
          const float* w = weights + (first + j) * length + pos;
          const uint32_t both = bf16_bits(w[0]) | (pair ? bf16_bits(w[1]) << 16 : 0u);
          const __m512bh p = (__m512bh)_mm512_set1_epi32(static_cast<int>(both));
          for (int c = 0; c < pairs; ++c) {
            sums[j][2 * c] = _mm512_dpbf16_ps(sums[j][2 * c], (__m512bh)lo[c], p);
            sums[j][2 * c + 1] = _mm512_dpbf16_ps(sums[j][2 * c + 1], (__m512bh)hi[c], p);
          }
        }
      }
      for (int64_t j = 0; j < heads; ++j) {
        float* o = acc + (first + j) * D;
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
template <int D>
void weigh_values_bf16(const float*, const at::BFloat16*, const int64_t*, int64_t, const Geometry&, float*) {}
#endif

template <int D, typename scalar_t, typename index_t>
void attend_row(const scalar_t* q, const scalar_t* key, const scalar_t* value, const index_t* table, int64_t length,
                int64_t row, float scale, const Geometry& g, scalar_t* out, Scratch& scratch) {
  scratch.floats.resize(g.heads * (2 * D + length + 1));
  scratch.partial.resize(g.heads * kLanes);
  scratch.offsets.resize(length);
  token_offsets(table, length, g, scratch.offsets.data());
  prefetch_rows(key, scratch.offsets.data(), 0, std::min<int64_t>(kLanes, length), g);
  float* qf = scratch.floats.data();  // [H, D] scaled queries
  float* acc = qf + g.heads * D;      // [H, D]
  float* scores = acc + g.heads * D;  // [H, length]
  float* inverse_sums = scores + g.heads * length;  // [H]
  for (int64_t h = 0; h < g.heads; ++h) {
    load_row<D>(q + row * g.q_row + h * g.q_head, qf + h * D);
    for (int i = 0; i < D; ++i) qf[h * D + i] *= scale;
  }
  if constexpr (std::is_same_v<scalar_t, at::BFloat16> && kBf16Dot && D % (2 * kLanes) == 0)
    score_keys_bf16<D>(q + row * g.q_row, scale, key, scratch.offsets.data(), length, g, scores, scratch.partial.data());
  else
    score_keys<D>(qf, key, scratch.offsets.data(), length, g, scores, scratch.partial.data());
  softmax_rows<scalar_t>(scores, g.heads, length, inverse_sums);
  prefetch_rows(value, scratch.offsets.data(), 0, std::min<int64_t>(kLanes, length), g);
  if constexpr (std::is_same_v<scalar_t, at::BFloat16> && kBf16Dot && D % (2 * kLanes) == 0)
    weigh_values_bf16<D>(scores, value, scratch.offsets.data(), length, g, acc);
  else
    weigh_values<D>(scores, value, scratch.offsets.data(), length, g, acc);
  for (int64_t h = 0; h < g.heads; ++h) {
    scalar_t* o = out + row * g.o_row + h * g.o_head;
    for (int i = 0; i < D; ++i) o[i] = static_cast<scalar_t>(acc[h * D + i] * inverse_sums[h]);
  }
}

template <typename scalar_t, typename index_t>
void run(const torch::Tensor& q, const torch::Tensor& key, const torch::Tensor& value, const torch::Tensor& table,
         const torch::Tensor& lens, float scale, torch::Tensor& out) {
  const Geometry g{q.size(1), key.size(2), q.size(2), key.size(1), table.size(1),
                   q.stride(0), q.stride(1), key.stride(0), key.stride(1), key.stride(2), out.stride(0), out.stride(1)};
  const int64_t rows = q.size(0);
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
      TORCH_CHECK(length >= 1 && length <= g.table_width * g.block_size, "context_lens[", row, "] = ", length,
                  " is outside [1, table width * block size]");
      const index_t* row_table = tp + row * g.table_width;
      switch (g.dim) {
#define PDSERVE_HEAD_DIM(D)                                                 \
  case D:                                                                   \
    attend_row<D>(qp, kp, vp, row_table, length, row, scale, g, op, scratch); \
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
                           torch::Tensor context_lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && key.dim() == 4 && value.sizes() == key.sizes(), "q [B, H, D], key/value [N, bs, Hkv, D]");
  TORCH_CHECK(q.size(2) == key.size(3) && q.size(1) % key.size(2) == 0, "head_dim must match and Hkv divide H");
  TORCH_CHECK(q.stride(2) == 1 && key.stride(3) == 1 && value.strides() == key.strides(), "head_dim must be contiguous");
  TORCH_CHECK(q.scalar_type() == key.scalar_type(), "q and the pool must have one dtype");
  TORCH_CHECK(block_table.is_contiguous() && context_lens.is_contiguous(), "block_table / context_lens must be contiguous");
  TORCH_CHECK(block_table.scalar_type() == context_lens.scalar_type(), "block_table and context_lens: one index dtype");
  auto out = torch::empty_like(q, at::MemoryFormat::Contiguous);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode", [&] {
    if (block_table.scalar_type() == at::kInt) {
      run<scalar_t, int32_t>(q, key, value, block_table, context_lens, static_cast<float>(scale), out);
    } else {
      TORCH_CHECK(block_table.scalar_type() == at::kLong, "block_table must be int32 or int64");
      run<scalar_t, int64_t>(q, key, value, block_table, context_lens, static_cast<float>(scale), out);
    }
  });
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode, "decode attention over a paged KV pool (CPU)");
  m.def("supported_head_dims", [] {
#define PDSERVE_LIST(D) D,
    return std::vector<int64_t>{PDSERVE_HEAD_DIMS(PDSERVE_LIST)};
#undef PDSERVE_LIST
  });
}
