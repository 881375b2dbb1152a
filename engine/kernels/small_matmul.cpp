// Linear layers on inputs of few rows (CPU, float32): y = x @ weight^T (+ bias), x [..., K], weight [N, K].
//
// With few rows (a decode step of a small batch, a request verifying proposed tokens) a linear layer is
// bound by reading its weight, which torch's GEMM does at a fraction of the memory's rate on some CPUs
// (an AMD EPYC with AVX2: a third of it at 2 to 8 rows, while one row streams at full rate). Here every
// weight row is read from memory once for all rows of x: the weight is walked kWeightRows rows at a time,
// and each such block in tiles of kTileDims dims that stay in L1 while the rows of x take their turns,
// kXRows rows of x at a time, each accumulating kWeightRows dot products in registers; transposing sums
// (kLanes accumulators each) turn a group's accumulators into outputs. Tasks split the weight's rows
// (at::parallel_for). engine.small_matmul decides when this beats torch's GEMM.

#include "kernels.h"
#include "vector.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <vector>

namespace pdserve {
namespace {

constexpr int kWeightRows = kVectorRegisters >= 32 ? 6 : 4;
constexpr int kXRows = kVectorRegisters >= 32 ? 4 : 2;  // kXRows * kWeightRows accumulators + kXRows rows of x + 1 weight
constexpr int64_t kTileDims = 256;
constexpr int64_t kMaxRows = 64;  // rows of x whose accumulators one pass over a weight block keeps

inline vf load(const float* p) { return *reinterpret_cast<const vf_unaligned*>(p); }

// sums[j][i] += x[j, k0:k1] * w[i, k0:k1] lane by lane, for R rows of x and the block's weight rows; `Ahead`
// also asks, per line of the weight it reads, for the same line of the next block of weight rows. The sums
// are added up in local registers: multiply-adds straight into the caller's array were each stored back to
// memory (the compiler cannot tell that x and w do not point into it). Each step loads the R rows' vectors
// once and streams the weight rows past them. Measured on an AMD EPYC (Zen 4), one thread, one pass over
// SmolLM2-135M's float32 layers, against the kernel before (its sums in the caller's array, x reloaded per
// weight row, 4 x 4 blocks, nothing asked for ahead above 4 rows): 4 rows 30 -> 24 ms, 8 rows 63 -> 39 ms,
// 16 rows 94 -> 68 ms (torch's GEMM: 63, 73, 94 ms).
template <int R, bool Ahead>
inline void accumulate(const float* x, int64_t K, const float* w, int64_t k0, int64_t k1, vf (&sums)[R][kWeightRows]) {
  constexpr int64_t kLineFloats = 64 / sizeof(float);
  vf acc[R][kWeightRows];
  for (int j = 0; j < R; ++j)
    for (int i = 0; i < kWeightRows; ++i) acc[j][i] = sums[j][i];
  for (int64_t k = k0; k < k1; k += kLanes) {
    vf xs[R];
    for (int j = 0; j < R; ++j) xs[j] = load(x + j * K + k);
    if (Ahead && k % kLineFloats == 0)
      for (int i = 0; i < kWeightRows; ++i) prefetch_line(w + (kWeightRows + i) * K + k);
    for (int i = 0; i < kWeightRows; ++i) {
      const vf weight = load(w + i * K + k);
      for (int j = 0; j < R; ++j) acc[j][i] += weight * xs[j];
    }
  }
  for (int j = 0; j < R; ++j)
    for (int i = 0; i < kWeightRows; ++i) sums[j][i] = acc[j][i];
}

// y[j, i] for the block's `live` weight rows: the lanes of acc[j][i] summed, plus the dims past the last
// whole vector (`vector_dims` .. K) one by one.
template <int R>
inline void finish(const float* x, int64_t K, const float* w, int64_t vector_dims, vf (&acc)[R][kWeightRows], float* y,
                   int64_t N, int live) {
  constexpr int kSums = R * kWeightRows;
  float sums[(kSums + kLanes - 1) / kLanes * kLanes];
  for (int first = 0; first < kSums; first += kLanes) {  // kLanes accumulators per transposing sum
    vf partial[kLanes] = {};
    for (int t = first; t < std::min(kSums, first + kLanes); ++t) partial[t - first] = acc[t / kWeightRows][t % kWeightRows];
    const vf summed = transpose_sum(partial);
    for (int lane = 0; lane < kLanes; ++lane) sums[first + lane] = summed[lane];
  }
  for (int j = 0; j < R; ++j) {
    for (int i = 0; i < live; ++i) {
      float sum = sums[j * kWeightRows + i];
      for (int64_t k = vector_dims; k < K; ++k) sum += x[j * K + k] * w[i * K + k];
      y[j * N + i] = sum;
    }
  }
}

// Rows [0, M) of x (M <= kMaxRows) against one block of kWeightRows weight rows, `live` of them real. The
// first pass over each tile asks for the next block while reading this one (the later passes read the tile
// from L1): the hardware prefetchers alone, following kWeightRows streams a row apart, kept one row of x at
// ~10 GB/s where a thread reads ~25 GB/s (an AMD EPYC with AVX-512, a pass over SmolLM2's fp32 layers: 1
// row 45 -> 29 ms, 4 rows 53 -> 40 ms).
void weight_block(const float* x, int64_t M, int64_t K, const float* w, float* y, int64_t N, int live) {
  const int64_t vector_dims = K / kLanes * kLanes, groups = M / kXRows;
  vf acc[kMaxRows / kXRows][kXRows][kWeightRows];
  vf last[kXRows][1][kWeightRows];  // the rows past the last whole group, one at a time
  for (int64_t g = 0; g < groups; ++g)
    for (auto& row : acc[g])
      for (auto& v : row) v = vf{};
  for (auto& row : last)
    for (auto& v : row[0]) v = vf{};
  for (int64_t k0 = 0; k0 < vector_dims; k0 += kTileDims) {
    const int64_t k1 = std::min(vector_dims, k0 + kTileDims);
    for (int64_t g = 0; g < groups; ++g)
      if (g == 0) accumulate<kXRows, true>(x, K, w, k0, k1, acc[0]);
      else accumulate<kXRows, false>(x + g * kXRows * K, K, w, k0, k1, acc[g]);
    for (int64_t m = groups * kXRows; m < M; ++m)
      if (m == 0) accumulate<1, true>(x, K, w, k0, k1, last[0]);
      else accumulate<1, false>(x + m * K, K, w, k0, k1, last[m - groups * kXRows]);
  }
  for (int64_t g = 0; g < groups; ++g) finish<kXRows>(x + g * kXRows * K, K, w, vector_dims, acc[g], y + g * kXRows * N, N, live);
  for (int64_t m = groups * kXRows; m < M; ++m)
    finish<1>(x + m * K, K, w, vector_dims, last[m - groups * kXRows], y + m * N, N, live);
}

}  // namespace

at::Tensor small_matmul(at::Tensor x, at::Tensor weight, std::optional<at::Tensor> bias) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat, "small_matmul: float32 only");
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous() && x.size(-1) == weight.size(1), "small_matmul: weight [N, K] contiguous, x [..., K]");
  const int64_t K = weight.size(1), N = weight.size(0);
  const auto rows = x.reshape({-1, K}).contiguous();
  const int64_t M = rows.size(0);
  auto y = at::empty({M, N}, x.options());
  const float* xp = rows.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, (N + kWeightRows - 1) / kWeightRows, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> padded;  // the weight's last, partial block, zero-filled to kWeightRows rows
    for (int64_t block = begin; block < end; ++block) {
      const int64_t n = block * kWeightRows;
      const int live = static_cast<int>(std::min<int64_t>(kWeightRows, N - n));
      const float* w = wp + n * K;
      if (live < kWeightRows) {
        padded.assign(kWeightRows * K, 0.f);
        std::copy(w, w + live * K, padded.begin());
        w = padded.data();
      }
      for (int64_t m = 0; m < M; m += kMaxRows) weight_block(xp + m * K, std::min(kMaxRows, M - m), K, w, yp + m * N + n, N, live);
    }
  });
  if (bias) y.add_(*bias);
  auto shape = x.sizes().vec();
  shape.back() = N;
  return y.view(shape);
}

}  // namespace pdserve
