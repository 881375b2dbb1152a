"""The one-pass Llama operations of engine.llama_layers for a CUDA device, as triton kernels.

The same three operations as the CPU kernels (engine.kernels: rotary.cpp, rms_norm.cpp), with the same
signatures and transformers' operations and roundings in the same order: `rotary_embedding_` rotates q and
k in place (q * cos + rotate_half(q) * sin, each product and the sum rounded to the model's dtype),
`rms_squares` gives x² in float32 for torch's own mean, and `rms_scale` finishes RMSNorm (x * rsqrt(variance
+ eps), rounded to the model's dtype, times the weight). Products are kept apart from sums
(`enable_fp_fusion=False`): a multiply-add rounds once where torch's two kernels round twice.

On a GPU a decode step's time is mostly kernel launches, not bytes: transformers' rotation is ten kernels
per layer and its RMSNorm eight, each over a few kilobytes; here they are one and three. The kernels run
under TRITON_INTERPRET=1 on a CPU, which is how their bits are tested without a GPU
(tests/unit/test_triton_layers.py).
"""

from __future__ import annotations

import torch

try:  # triton is optional: present with CUDA builds of torch, absent on most CPU hosts
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the host
    triton = None

DTYPES = (torch.float32, torch.bfloat16)


def available() -> bool:
    return triton is not None


def rotary_supports(head_dim: int) -> bool:
    return head_dim % 2 == 0 and head_dim >= 16 and (head_dim // 2) & (head_dim // 2 - 1) == 0


if triton is not None:

    @triton.jit
    def _rounded(x, DTYPE: tl.constexpr):
        """x as torch holds it after an operation on DTYPE tensors: computed in float32, rounded to nearest even
        (by hand: triton's CPU interpreter truncates a cast to bfloat16; a GPU rounds; this is the same on both)."""
        if DTYPE == tl.bfloat16:
            bits = x.to(tl.uint32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
            return bits.to(tl.float32, bitcast=True)
        return x

    @triton.jit
    def _rotate_heads(X, token, c_lo, c_hi, s_lo, s_hi, HEADS: tl.constexpr, HEADS_PAD: tl.constexpr, HALF: tl.constexpr,
                      DTYPE: tl.constexpr):
        heads = tl.arange(0, HEADS_PAD)
        dims = tl.arange(0, HALF)
        at = X + token * HEADS * 2 * HALF + heads[:, None] * 2 * HALF + dims[None, :]
        live = (heads < HEADS)[:, None]
        lo = tl.load(at, mask=live, other=0.0).to(tl.float32)
        hi = tl.load(at + HALF, mask=live, other=0.0).to(tl.float32)
        lo_cos = _rounded(lo * c_lo[None, :], DTYPE)
        hi_sin = _rounded(-hi * s_lo[None, :], DTYPE)  # rotate_half puts -x[i + D / 2] at i
        hi_cos = _rounded(hi * c_hi[None, :], DTYPE)
        lo_sin = _rounded(lo * s_hi[None, :], DTYPE)  # and x[i] at i + D / 2
        tl.store(at, _rounded(lo_cos + hi_sin, DTYPE).to(DTYPE), mask=live)
        tl.store(at + HALF, _rounded(hi_cos + lo_sin, DTYPE).to(DTYPE), mask=live)

    @triton.jit
    def _rotary_kernel(Q, K, COS, SIN, HQ: tl.constexpr, HQ_PAD: tl.constexpr, HK: tl.constexpr, HK_PAD: tl.constexpr,
                       HALF: tl.constexpr, DTYPE: tl.constexpr):
        token = tl.program_id(0)
        dims = tl.arange(0, HALF)
        row = token * 2 * HALF
        c_lo = tl.load(COS + row + dims).to(tl.float32)
        c_hi = tl.load(COS + row + HALF + dims).to(tl.float32)
        s_lo = tl.load(SIN + row + dims).to(tl.float32)
        s_hi = tl.load(SIN + row + HALF + dims).to(tl.float32)
        _rotate_heads(Q, token, c_lo, c_hi, s_lo, s_hi, HQ, HQ_PAD, HALF, DTYPE)
        _rotate_heads(K, token, c_lo, c_hi, s_lo, s_hi, HK, HK_PAD, HALF, DTYPE)

    @triton.jit
    def _squares_kernel(X, OUT, N: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        x = tl.load(X + row * N + cols, mask=cols < N, other=0.0).to(tl.float32)
        tl.store(OUT + row * N + cols, x * x, mask=cols < N)

    @triton.jit
    def _scale_kernel(X, VAR, W, OUT, eps, N: tl.constexpr, BLOCK: tl.constexpr, DTYPE: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        live = cols < N
        x = tl.load(X + row * N + cols, mask=live, other=0.0).to(tl.float32)
        inv = tl.math.rsqrt(tl.load(VAR + row) + eps)
        w = tl.load(W + cols, mask=live, other=0.0).to(tl.float32)
        normed = _rounded(x * inv, DTYPE)
        tl.store(OUT + row * N + cols, _rounded(w * normed, DTYPE).to(DTYPE), mask=live)


def _dtype(t: torch.Tensor):
    if t.dtype not in DTYPES:
        raise ValueError(f"triton layers take float32 or bfloat16 tensors, got {t.dtype}")
    return tl.float32 if t.dtype == torch.float32 else tl.bfloat16


def _pad(n: int) -> int:
    return max(1, triton.next_power_of_2(n))


def rotary_embedding_(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """q [B, T, Hq, D] and k [B, T, Hk, D] rotated in place by cos/sin [B, T, D] (all contiguous, one dtype)."""
    if q.dim() != 4 or k.dim() != 4 or q.shape[:2] != k.shape[:2] or cos.shape != (*q.shape[:2], q.shape[3]) or sin.shape != cos.shape:
        raise ValueError(f"rotary_embedding_: q {tuple(q.shape)}, k {tuple(k.shape)}, cos {tuple(cos.shape)}, sin {tuple(sin.shape)}")
    if not rotary_supports(q.shape[3]) or k.shape[3] != q.shape[3]:
        raise ValueError(f"rotary_embedding_: head size {q.shape[3]} (needs a power of two >= 16)")
    if not all(t.is_contiguous() and t.dtype == q.dtype for t in (q, k, cos, sin)):
        raise ValueError("rotary_embedding_: q, k, cos and sin must be contiguous and of one dtype")
    tokens = q.shape[0] * q.shape[1]
    hq, hk = q.shape[2], k.shape[2]
    _rotary_kernel[(tokens,)](q, k, cos, sin, HQ=hq, HQ_PAD=_pad(hq), HK=hk, HK_PAD=_pad(hk), HALF=q.shape[3] // 2,
                              DTYPE=_dtype(q), enable_fp_fusion=False)


def rms_squares(x: torch.Tensor) -> torch.Tensor:
    """x² in float32 (transformers' `hidden_states.to(torch.float32).pow(2)`), x contiguous."""
    if not x.is_contiguous():
        raise ValueError("rms_squares: x must be contiguous")
    _dtype(x)
    out = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    n = x.shape[-1]
    _squares_kernel[(x.numel() // n,)](x, out, N=n, BLOCK=_pad(n))
    return out


def rms_scale(x: torch.Tensor, variance: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * (x * rsqrt(variance + eps)).to(x.dtype), as transformers' LlamaRMSNorm rounds it."""
    n = x.shape[-1]
    if not x.is_contiguous() or weight.shape != (n,) or weight.dtype != x.dtype or variance.numel() != x.numel() // n:
        raise ValueError(f"rms_scale: x {tuple(x.shape)} {x.dtype}, variance {tuple(variance.shape)}, weight {tuple(weight.shape)} {weight.dtype}")
    if variance.dtype != torch.float32 or not variance.is_contiguous():
        raise ValueError("rms_scale: variance must be contiguous float32")
    out = torch.empty_like(x)
    _scale_kernel[(x.numel() // n,)](x, variance, weight, out, eps, N=n, BLOCK=_pad(n), DTYPE=_dtype(x), enable_fp_fusion=False)
    return out
