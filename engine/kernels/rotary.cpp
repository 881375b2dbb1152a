// Rotary position embedding of a step's queries and keys, in place, in one pass (CPU, float32 and bf16).
//
// transformers' apply_rotary_pos_emb computes q * cos + rotate_half(q) * sin (and the same for k) as six
// tensor operations per layer, each a pass over memory with its own rounding to the model's dtype: the
// products, rounded; rotate_half (a negation and a concatenation: exact); the sum, rounded. Here every
// (token, head) row is read once and written once, with the same operations in the same order and the
// same roundings (round_to: nearest even to bf16, as torch's ops round; `settled` keeps the compiler from
// fusing a product into the sum), so the output is transformers' bit for bit.
// Shapes: q [B, T, Hq, D] and k [B, T, Hk, D], contiguous (the projections' outputs viewed as heads);
// cos and sin [B, T, D] (transformers' position embeddings), contiguous; D a multiple of 2 * kLanes.

#include "kernels.h"
#include "vector.h"

#include <ATen/Parallel.h>

namespace pdserve {
namespace {

template <typename scalar_t>
inline void store_vector(scalar_t* dst, vf x) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    *reinterpret_cast<vf_unaligned*>(dst) = x;
  } else {  // x already holds a bf16 value in each lane's top half
    typedef uint16_t vh __attribute__((vector_size(kLanes * sizeof(uint16_t))));
    *reinterpret_cast<vh_unaligned*>(dst) = __builtin_convertvector((vi)x >> 16, vh);
  }
}

// x as computed, rounded: the compiler may not fuse the product it holds into a later sum (a multiply-add
// rounds once, torch's two operations twice).
inline vf settled(vf x) {
  asm("" : "+v"(x));
  return x;
}

// One (token, head) row of D values: x[i] and x[i + D / 2] rotate together by cos/sin at i and i + D / 2.
template <typename scalar_t>
inline void rotate_row(scalar_t* x, const scalar_t* cos, const scalar_t* sin, int64_t half) {
  for (int64_t i = 0; i < half; i += kLanes) {
    vf lo, hi, c_lo, c_hi, s_lo, s_hi;
    load_vectors<1>(x + i, &lo);
    load_vectors<1>(x + half + i, &hi);
    load_vectors<1>(cos + i, &c_lo);
    load_vectors<1>(cos + half + i, &c_hi);
    load_vectors<1>(sin + i, &s_lo);
    load_vectors<1>(sin + half + i, &s_hi);
    const vf lo_cos = settled(round_to<scalar_t>(lo * c_lo));
    const vf hi_sin = settled(round_to<scalar_t>(-hi * s_lo));  // rotate_half puts -x[i + D / 2] at i
    const vf hi_cos = settled(round_to<scalar_t>(hi * c_hi));
    const vf lo_sin = settled(round_to<scalar_t>(lo * s_hi));   // and x[i] at i + D / 2
    const vf new_lo = lo_cos + hi_sin;
    const vf new_hi = hi_cos + lo_sin;
    store_vector(x + i, round_to<scalar_t>(new_lo));
    store_vector(x + half + i, round_to<scalar_t>(new_hi));
  }
}

template <typename scalar_t>
void rotate(at::Tensor& q, at::Tensor& k, const at::Tensor& cos, const at::Tensor& sin) {
  const int64_t tokens = q.size(0) * q.size(1), q_heads = q.size(2), k_heads = k.size(2), dim = q.size(3);
  scalar_t* qp = q.data_ptr<scalar_t>();
  scalar_t* kp = k.data_ptr<scalar_t>();
  const scalar_t* cp = cos.data_ptr<scalar_t>();
  const scalar_t* sp = sin.data_ptr<scalar_t>();
  at::parallel_for(0, tokens, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t h = 0; h < q_heads; ++h) rotate_row(qp + (t * q_heads + h) * dim, cp + t * dim, sp + t * dim, dim / 2);
      for (int64_t h = 0; h < k_heads; ++h) rotate_row(kp + (t * k_heads + h) * dim, cp + t * dim, sp + t * dim, dim / 2);
    }
  });
}

}  // namespace

bool rotary_supports(int64_t head_dim) { return head_dim % (2 * kLanes) == 0; }

void rotary_embedding_(at::Tensor q, at::Tensor k, at::Tensor cos, at::Tensor sin) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && cos.dim() == 3 && sin.dim() == 3, "q, k: [B, T, heads, D]; cos, sin: [B, T, D]");
  TORCH_CHECK(q.is_contiguous() && k.is_contiguous() && cos.is_contiguous() && sin.is_contiguous(), "q, k, cos, sin: contiguous");
  const auto dtype = q.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "q: float32 or bfloat16");
  TORCH_CHECK(k.scalar_type() == dtype && cos.scalar_type() == dtype && sin.scalar_type() == dtype, "q, k, cos, sin: one dtype");
  const int64_t dim = q.size(3);
  TORCH_CHECK(rotary_supports(dim) && k.size(3) == dim && cos.size(2) == dim && sin.size(2) == dim, "head dim: a multiple of 2 x the vector lanes, the same everywhere");
  TORCH_CHECK(k.size(0) == q.size(0) && k.size(1) == q.size(1) && cos.size(0) == q.size(0) && cos.size(1) == q.size(1) && sin.sizes() == cos.sizes(),
              "q, k, cos, sin: the same [B, T]");
  if (dtype == at::kFloat)
    rotate<float>(q, k, cos, sin);
  else
    rotate<at::BFloat16>(q, k, cos, sin);
}

}  // namespace pdserve
