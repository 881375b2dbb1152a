// x @ weight^T for bf16 rows, each row summed as torch's bf16 linear sums a row that comes alone (CPU with
// AVX512-BF16).
//
// torch's bf16 linear on a CPU (oneDNN) sums an input of one row in another order than an input of several
// rows when the inner size K is large: alone, a row's dims go in blocks of 512, each block one chain of bf16
// dot-product instructions over its dim pairs in order, and the blocks' sums are added in order (measured on
// an AMD EPYC with AVX512-BF16 for K = 1536; engine.one_row_linear checks it on the machine before use).
// transformers decodes one token at a time, so its decode rows come alone; the engine's come many at once,
// and this kernel gives each of them the lone row's sum, bit for bit.
//
// The weight [N, K] is packed once (`pack_dim_pairs`: 32-bit words, word (c, n) = dims 2c and 2c + 1 of
// output n), column tile by column tile: the words of a tile's kColumnVectors * 16 outputs (fewer for the
// last) for pair 0, then for pair 1, and so on, so that a vector load takes one dim pair of 16 outputs and a
// tile's weight is one contiguous run of bytes read front to back (the hardware prefetchers follow it; the
// [K / 2, N] layout had them jump a whole row of N words per pair). A tile of up to kRows rows x
// kColumnVectors * 16 outputs keeps its sums in registers over a block of pairs: each step loads the tile's
// weight pairs once and broadcasts each row's pair. With each weight word read once per kRows rows, a
// few rows cost little more than reading the weight. 8 rows x 48 outputs (24 sums) beat 4 x 96: on an AMD
// EPYC (Zen 4) with AVX512-BF16, one pass over SmolLM2-135M's linear layers, weights from memory, takes
// 10 ms for 1 row, 13 for 8, 23 for 16 and 81 for 64 (4 x 96: 10, 17, 29 and 97; torch: 37 for 1 row and
// 117 for 64), 213 GFLOP/s at 64 rows where one core issues 231.

#include "kernels.h"

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace pdserve {
namespace {

constexpr int64_t kTileOutputs = 48;  // outputs per column tile: kColumnVectors vectors of 16

#if defined(__AVX512BF16__)
constexpr int64_t kBlockPairs = 256;  // 512 dims
constexpr int kRows = 8;
constexpr int kLanes = 16;
constexpr int kColumnVectors = kTileOutputs / kLanes;  // kRows * kColumnVectors sums + the weight vectors fit the 32 registers

template <int R, int V>
void tile(const uint32_t* x, int64_t x_pairs, const uint32_t* w, int64_t pairs, at::BFloat16* out, int64_t out_row) {
  __m512 total[R][V];
  for (int64_t first = 0; first < pairs; first += kBlockPairs) {
    const int64_t last = std::min(pairs, first + kBlockPairs);
    __m512 sum[R][V];
    for (auto& row : sum)
      for (auto& v : row) v = _mm512_setzero_ps();
    for (int64_t c = first; c < last; ++c) {
      __m512bh wv[V];
      for (int v = 0; v < V; ++v) wv[v] = (__m512bh)_mm512_loadu_si512(w + (c * V + v) * kLanes);
      for (int r = 0; r < R; ++r) {
        const __m512bh xr = (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(x[r * x_pairs + c]));
        for (int v = 0; v < V; ++v) sum[r][v] = _mm512_dpbf16_ps(sum[r][v], wv[v], xr);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < V; ++v) total[r][v] = first == 0 ? sum[r][v] : _mm512_add_ps(total[r][v], sum[r][v]);
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + r * out_row + v * kLanes), (__m256i)_mm512_cvtneps_pbh(total[r][v]));
}

template <int R>
void tile_of_rows(const uint32_t* x, int64_t x_pairs, const uint32_t* w, int64_t pairs, int vectors, at::BFloat16* out,
                  int64_t out_row) {
  switch (vectors) {
    case 1: return tile<R, 1>(x, x_pairs, w, pairs, out, out_row);
    case 2: return tile<R, 2>(x, x_pairs, w, pairs, out, out_row);
    default: return tile<R, kColumnVectors>(x, x_pairs, w, pairs, out, out_row);
  }
}

using TileOfRows = void (*)(const uint32_t*, int64_t, const uint32_t*, int64_t, int, at::BFloat16*, int64_t);
constexpr TileOfRows kTileOfRows[kRows] = {tile_of_rows<1>, tile_of_rows<2>, tile_of_rows<3>, tile_of_rows<4>,
                                           tile_of_rows<5>, tile_of_rows<6>, tile_of_rows<7>, tile_of_rows<8>};  // by rows - 1
#endif

}  // namespace

bool one_row_linear_available() {
#if defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

at::Tensor pack_dim_pairs(at::Tensor weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16 && weight.size(1) % 2 == 0, "weight: [N, K] bf16, K even");
  const auto words = weight.contiguous().view(at::kInt);  // [N, K / 2]
  const int64_t n = words.size(0), pairs = words.size(1), width = kTileOutputs;
  std::vector<at::Tensor> tiles;
  for (int64_t first = 0; first < n; first += width) tiles.push_back(words.narrow(0, first, std::min(width, n - first)).t().reshape(-1));
  return at::cat(tiles).view({pairs, n});  // sizes say how many pairs and outputs; the words lie tile by tile
}

at::Tensor one_row_linear(at::Tensor x, at::Tensor packed) {
  TORCH_CHECK(one_row_linear_available(), "one_row_linear needs a CPU with AVX512-BF16");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && packed.scalar_type() == at::kInt && packed.dim() == 2, "x bf16, packed int32 [K/2, N]");
  const int64_t pairs = packed.size(0), n = packed.size(1);
  TORCH_CHECK(x.size(-1) == 2 * pairs && n % 16 == 0, "x [..., K] with K = 2 * packed.size(0); N a multiple of 16");
  auto rows = x.reshape({-1, 2 * pairs}).contiguous();
  const int64_t m = rows.size(0);
  auto out = at::empty({m, n}, x.options());
#if defined(__AVX512BF16__)
  const auto* xp = reinterpret_cast<const uint32_t*>(rows.data_ptr<at::BFloat16>());
  const auto* wp = reinterpret_cast<const uint32_t*>(packed.data_ptr<int32_t>());
  auto* op = out.data_ptr<at::BFloat16>();
  const int64_t column_tiles = (n / kLanes + kColumnVectors - 1) / kColumnVectors;
  at::parallel_for(0, column_tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t column = t * kColumnVectors * kLanes;
      const int vectors = static_cast<int>(std::min<int64_t>(kColumnVectors, (n - column) / kLanes));
      for (int64_t r = 0; r < m; r += kRows) {
        const uint32_t* x_rows = xp + r * pairs;
        at::BFloat16* o = op + r * n + column;
        kTileOfRows[std::min<int64_t>(kRows, m - r) - 1](x_rows, pairs, wp + column * pairs, pairs, vectors, o, n);
      }
    }
  });
#endif
  auto sizes = x.sizes().vec();
  sizes.back() = n;
  return out.view(sizes);
}

}  // namespace pdserve
