// The functions pdserve's CPU kernels export to Python (bindings.cpp).
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <vector>

namespace pdserve {

// paged_attention.cpp: decode attention over the paged KV pool, and the head sizes it is compiled for.
at::Tensor paged_decode(at::Tensor q, at::Tensor key, at::Tensor value, at::Tensor block_table,
                           at::Tensor context_lens, double scale, std::optional<at::Tensor> query_starts);
std::vector<int64_t> supported_head_dims();

// small_matmul.cpp: x [..., K] @ weight[N, K]^T (+ bias) for inputs of few rows, float32.
at::Tensor small_matmul(at::Tensor x, at::Tensor weight, std::optional<at::Tensor> bias);

// one_row_linear.cpp: bf16 x @ weight^T with every row summed as torch sums a row that comes alone.
bool one_row_linear_available();
at::Tensor pack_dim_pairs(at::Tensor weight);
at::Tensor one_row_linear(at::Tensor x, at::Tensor packed);

// argmax_rows.cpp: each row's argmax (as torch.argmax: the first on ties), float32 or bf16 rows.
at::Tensor argmax_rows(at::Tensor logits);

// rotary.cpp: transformers' rotary position embedding of q and k, in place, in one pass (float32 or bf16).
bool rotary_supports(int64_t head_dim);
void rotary_embedding_(at::Tensor q, at::Tensor k, at::Tensor cos, at::Tensor sin);

// rms_norm.cpp: transformers' RMSNorm in two passes around torch's mean (float32 or bf16).
at::Tensor rms_squares(at::Tensor x);
at::Tensor rms_scale(at::Tensor x, at::Tensor variance, at::Tensor weight, double eps);

}  // namespace pdserve
