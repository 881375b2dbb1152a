// The Python module of pdserve's CPU kernels (engine.kernels builds it from every source of this folder).
#include "kernels.h"

#include <torch/extension.h>

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &pdserve::paged_decode, "decode attention over a paged KV pool (CPU), one or more queries per row",
        pybind11::arg("q"), pybind11::arg("key"), pybind11::arg("value"), pybind11::arg("block_table"),
        pybind11::arg("context_lens"), pybind11::arg("scale"), pybind11::arg("query_starts") = pybind11::none());
  m.def("supported_head_dims", &pdserve::supported_head_dims);
  m.def("small_matmul", &pdserve::small_matmul, "x @ weight.T (+ bias) for an input of few rows (float32, CPU)",
        pybind11::arg("x"), pybind11::arg("weight"), pybind11::arg("bias") = pybind11::none());
  m.def("one_row_linear_available", &pdserve::one_row_linear_available);
  m.def("pack_dim_pairs", &pdserve::pack_dim_pairs, "a bf16 weight [N, K] as words of dim pairs, column tile by column tile (for one_row_linear)");
  m.def("one_row_linear", &pdserve::one_row_linear, "bf16 x @ weight.T, each row summed as torch sums a lone row (CPU)",
        pybind11::arg("x"), pybind11::arg("packed"));
  m.def("argmax_rows", &pdserve::argmax_rows, "each row's argmax, as torch.argmax(logits, -1) (CPU, float32 or bf16)",
        pybind11::arg("logits"));
  m.def("rotary_supports", &pdserve::rotary_supports, "whether rotary_embedding_ takes this head size");
  m.def("rotary_embedding_", &pdserve::rotary_embedding_, "q, k rotated in place as transformers' apply_rotary_pos_emb (CPU)",
        pybind11::arg("q"), pybind11::arg("k"), pybind11::arg("cos"), pybind11::arg("sin"));
  m.def("rms_squares", &pdserve::rms_squares, "x^2 in float32, as transformers' RMSNorm squares (CPU)", pybind11::arg("x"));
  m.def("rms_scale", &pdserve::rms_scale, "weight * (x * rsqrt(variance + eps)) as transformers' RMSNorm rounds it (CPU)",
        pybind11::arg("x"), pybind11::arg("variance"), pybind11::arg("weight"), pybind11::arg("eps"));
}
