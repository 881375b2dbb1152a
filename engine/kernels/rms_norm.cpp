// transformers' RMSNorm around torch's mean, in two passes instead of eight operations (CPU, float32 and bf16).
//
// LlamaRMSNorm computes w * (x * rsqrt(mean(x^2) + eps)) in the model's dtype as eight tensor operations
// (widen to fp32, square, mean, + eps, rsqrt, product, round to the dtype, product with the weight), each a
// pass over memory. The mean is a reduction whose order torch picks per CPU, so it stays torch's:
// rms_squares writes x^2 in fp32 (the widening is exact, the square rounds as torch's pow(x, 2) = x * x),
// the caller takes torch's mean of it, and rms_scale does the rest in one pass with the same operations and
// roundings: rsqrt as 1 / sqrt (both correctly rounded, as torch's vectorised and scalar rsqrt compute it),
// eps rounded to fp32 first (torch adds a Python float to an fp32 tensor in fp32), the products rounded to
// the dtype where transformers rounds them (nearest even). So the output is transformers' bit for bit.
// Shapes: x [..., H] contiguous; variance [..., 1] fp32 (torch's mean of rms_squares(x)); weight [H] of x's dtype.

#include "kernels.h"
#include "vector.h"

#include <ATen/Parallel.h>

#include <cmath>

namespace pdserve {
namespace {

template <typename scalar_t>
void squares(const scalar_t* x, float* out, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const float v = as_float(x[i]);
    out[i] = v * v;
  }
}

inline uint16_t bf16_bits(float rounded) {  // `rounded` holds a bf16 value: its top half
  uint32_t bits;
  std::memcpy(&bits, &rounded, sizeof bits);
  return static_cast<uint16_t>(bits >> 16);
}

template <typename scalar_t>
void scale_row(const scalar_t* x, float inverse_rms, const scalar_t* weight, scalar_t* out, int64_t n) {
  if constexpr (std::is_same_v<scalar_t, float>) {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) out[i] = weight[i] * (x[i] * inverse_rms);
  } else {
    uint16_t* o = reinterpret_cast<uint16_t*>(out);
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) {
      const float normed = round_to<scalar_t>(as_float(x[i]) * inverse_rms);
      o[i] = bf16_bits(round_to<scalar_t>(as_float(weight[i]) * normed));
    }
  }
}

void check(const at::Tensor& x) {
  TORCH_CHECK(x.dim() >= 1 && x.is_contiguous(), "x: [..., H], contiguous");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "x: float32 or bfloat16");
}

}  // namespace

at::Tensor rms_squares(at::Tensor x) {
  check(x);
  auto out = at::empty(x.sizes(), x.options().dtype(at::kFloat));
  const int64_t n = x.numel();
  float* o = out.data_ptr<float>();
  AT_DISPATCH_SWITCH(x.scalar_type(), "rms_squares",
      AT_DISPATCH_CASE(at::kFloat, [&] { at::parallel_for(0, n, 1 << 16, [&](int64_t b, int64_t e) { squares(x.data_ptr<float>() + b, o + b, e - b); }); })
      AT_DISPATCH_CASE(at::kBFloat16, [&] { at::parallel_for(0, n, 1 << 16, [&](int64_t b, int64_t e) { squares(x.data_ptr<at::BFloat16>() + b, o + b, e - b); }); }));
  return out;
}

at::Tensor rms_scale(at::Tensor x, at::Tensor variance, at::Tensor weight, double eps) {
  check(x);
  const int64_t hidden = x.size(-1), rows = x.numel() / std::max<int64_t>(hidden, 1);
  TORCH_CHECK(variance.scalar_type() == at::kFloat && variance.is_contiguous() && variance.numel() == rows, "variance: fp32, one per row");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type() && weight.is_contiguous() && weight.numel() == hidden, "weight: [H] of x's dtype");
  auto out = at::empty_like(x);
  const float* v = variance.data_ptr<float>();
  const float epsilon = static_cast<float>(eps);
  AT_DISPATCH_SWITCH(x.scalar_type(), "rms_scale",
      AT_DISPATCH_CASE(at::kFloat, [&] {
        at::parallel_for(0, rows, 16, [&](int64_t b, int64_t e) {
          for (int64_t r = b; r < e; ++r)
            scale_row(x.data_ptr<float>() + r * hidden, 1.0f / std::sqrt(v[r] + epsilon), weight.data_ptr<float>(), out.data_ptr<float>() + r * hidden, hidden);
        });
      })
      AT_DISPATCH_CASE(at::kBFloat16, [&] {
        at::parallel_for(0, rows, 16, [&](int64_t b, int64_t e) {
          for (int64_t r = b; r < e; ++r)
            scale_row(x.data_ptr<at::BFloat16>() + r * hidden, 1.0f / std::sqrt(v[r] + epsilon), weight.data_ptr<at::BFloat16>(),
                      out.data_ptr<at::BFloat16>() + r * hidden, hidden);
        });
      }));
  return out;
}

}  // namespace pdserve
