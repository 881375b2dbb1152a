"""Decode attention straight over the paged pool: one call per layer for all decode rows, no host sync.

Inputs (all device tensors, fixed shapes, so a CUDA graph can capture the call):
  q              [B, H, D]               one query token per row
  key/value      [blocks, bs, Hkv, D]    one layer of the pool
  block_table    [B, W] int              each row's blocks (padding rows/columns may hold any valid id)
  context_lens   [B] int                 keys each row attends to (>= 1)
  query_starts   [B + 1] int, optional   rows with several queries (a request verifying proposed tokens):
                                         q is then [T, H, D] and row b's queries are
                                         q[query_starts[b] : query_starts[b + 1]], the last positions of
                                         its context, each seeing the keys up to its own (causal)
Three kernels compute the same thing:
  torch   gathers the rows' blocks (`index_select` through the padded table) and runs SDPA with a
          length mask; reads every row to the table's full width, so the caller sizes W to the batch.
  triton  one program per (row, KV head) walks the row's own blocks only (`context_lens` bounds the
          loop), its G = H / Hkv query heads share each K/V load (as rows of a `tl.dot`, padded to
          16), operands and online softmax in fp32. The table width costs
          nothing, so one table as wide as `max_model_len` serves every step (graphs).
  cpp     the CPU kernel of engine.kernels (built once per machine): one task per row (per 32 queries of a
          long row) walks the row's own blocks in place, K then V, each KV row read once for its G query
          heads. On a CPU it attends prefill chunks too (rows of many queries; engine.attention).
The cpp kernel takes several queries per row natively (each K/V row read once for all of them); torch
and triton get `one_query_rows`: every query becomes a row of its own (its request's table, its own length).
`TRITON_INTERPRET=1` runs the triton kernel on CPU (numpy), which is how it is tested without a GPU
(tests/unit/test_engine_batched.py; with numpy 2 the interpreter needs `interpreter_loop_fix()` for a
loop bounded by a loaded value). `triton.compile(..., target=GPUTarget("cuda", 90, 32))` builds it for
a Hopper GPU without one, which is how its compilation was checked here.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F

from engine import kernels

try:  # triton is optional: present with CUDA builds of torch, absent on most CPU hosts
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the host
    triton = None

TOKENS_PER_TILE = 32


def one_query_rows(block_table, context_lens, query_starts, num_queries: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The block table and lengths of the same attention as one query per row: query i of a row with n
    queries and L keys becomes a row of L - n + 1 + i keys with the row's table. Device ops only."""
    counts = (query_starts[1:] - query_starts[:-1]).long()
    owner = torch.repeat_interleave(torch.arange(counts.numel(), device=counts.device), counts, output_size=num_queries)
    offset = torch.arange(num_queries, device=counts.device) - query_starts[:-1].long()[owner]
    lens = context_lens.long()[owner] - counts[owner] + 1 + offset
    return block_table[owner], lens.to(context_lens.dtype)


def decode_torch(q, key, value, block_table, context_lens, scale: float | None, query_starts=None) -> torch.Tensor:
    if query_starts is not None:
        block_table, context_lens = one_query_rows(block_table, context_lens, query_starts, q.shape[0])
    b, h, d = q.shape
    hkv, bs, width = key.shape[2], key.shape[1], block_table.shape[1]
    flat = block_table.reshape(-1).long()
    k = key.index_select(0, flat).view(b, width * bs, hkv, d).transpose(1, 2)  # [B, Hkv, L, D]
    v = value.index_select(0, flat).view(b, width * bs, hkv, d).transpose(1, 2)
    valid = torch.arange(width * bs, device=q.device).unsqueeze(0) < context_lens.unsqueeze(1)
    qg = q.reshape(b, hkv, h // hkv, d)  # the query heads sharing a KV head are that head's query rows
    out = F.scaled_dot_product_attention(qg, k, v, attn_mask=valid.view(b, 1, 1, -1), scale=scale)
    return out.reshape(b, h, d)


if triton is not None:

    @triton.jit(do_not_specialize=["stride_btb"])  # the eager path's table width changes every step: one compile
    def _paged_decode_kernel(
        Q, K, V, BT, LENS, O, scale,
        stride_qb, stride_qh, stride_kb, stride_kt, stride_kh, stride_btb, stride_ob, stride_oh,
        G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, TILE: tl.constexpr, PRECISION: tl.constexpr,
    ):
        row = tl.program_id(0)
        kvh = tl.program_id(1)
        length = tl.load(LENS + row)
        offs_g = tl.arange(0, G_PAD)
        offs_d = tl.arange(0, D)
        offs_t = tl.arange(0, TILE)
        heads = kvh * G + offs_g
        q = tl.load(Q + row * stride_qb + heads[:, None] * stride_qh + offs_d[None, :], mask=(offs_g < G)[:, None], other=0.0).to(tl.float32)
        m = tl.full([G_PAD], float("-inf"), tl.float32)
        denom = tl.zeros([G_PAD], tl.float32)
        acc = tl.zeros([G_PAD, D], tl.float32)
        for start in range(0, length, TILE):  # a `for` loop: triton pipelines its loads (num_stages)
            tok = start + offs_t
            live = tok < length
            blk = tl.load(BT + row * stride_btb + tok // BS, mask=live, other=0).to(tl.int64)
            at = blk * stride_kb + (tok % BS).to(tl.int64) * stride_kt + kvh * stride_kh
            k = tl.load(K + at[:, None] + offs_d[None, :], mask=live[:, None], other=0.0).to(tl.float32)
            v = tl.load(V + at[:, None] + offs_d[None, :], mask=live[:, None], other=0.0).to(tl.float32)  # in flight with k
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # [G_PAD, TILE], fp32
            s = tl.where(live[None, :], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, axis=1))
            p = tl.exp(s - m_new[:, None])
            alpha = tl.exp(m - m_new)
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=PRECISION)
            denom = denom * alpha + tl.sum(p, axis=1)
            m = m_new
        out = acc / denom[:, None]
        tl.store(O + row * stride_ob + heads[:, None] * stride_oh + offs_d[None, :], out.to(O.dtype.element_ty), mask=(offs_g < G)[:, None])


def decode_triton(q, key, value, block_table, context_lens, scale: float | None, tile: int = TOKENS_PER_TILE, num_warps: int = 4,
                  query_starts=None, num_stages: int | None = None) -> torch.Tensor:
    if triton is None:
        raise RuntimeError("the triton decode kernel needs the triton package")
    if query_starts is not None:
        block_table, context_lens = one_query_rows(block_table, context_lens, query_starts, q.shape[0])
    b, h, d = q.shape
    bs, hkv = key.shape[1], key.shape[2]
    if key.stride(3) != 1 or q.stride(2) != 1:
        raise ValueError("paged decode needs a contiguous head_dim")
    g = h // hkv
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    scale = d**-0.5 if scale is None else scale
    _paged_decode_kernel[(b, hkv)](
        q, key, value, block_table, context_lens, out, scale,
        q.stride(0), q.stride(1), key.stride(0), key.stride(1), key.stride(2), block_table.stride(0), out.stride(0), out.stride(1),
        G=g, G_PAD=max(16, triton.next_power_of_2(g)), D=d, BS=bs, TILE=tile, num_warps=num_warps,
        **({} if num_stages is None else {"num_stages": num_stages}),
        # Operands go to the dot as fp32: bf16/fp16 values are exact in tf32, so tf32 loses nothing for
        # them; fp32 models need full fp32 products ("ieee") to match transformers token for token.
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
    )
    return out


TRITON_CONFIGS = ((32, 4, 2), (32, 4, 3), (64, 4, 2), (64, 4, 3), (64, 8, 3), (128, 8, 2))
"""(tokens per tile, warps, pipeline stages) at which a CUDA runner times the triton kernel when it starts."""


def tune_triton(key, value, num_heads: int, rows: int = 128, context: int = 512, iters: int = 10) -> tuple[Callable, dict]:
    """The triton kernel at the TRITON_CONFIGS entry that decodes `rows` rows of `context` keys fastest over this
    layer's pool (a random table of its blocks: scattered, as after a busy prefill), and every entry's time in
    microseconds. Which entry wins depends on the device and the head layout (on an H200 with a 1B model's pool,
    a tile of 32 with 4 warps took 94 us and one of 16 took 149 us), so it is measured, not guessed."""
    device = key.device
    gen = torch.Generator().manual_seed(0)
    table = torch.randint(0, key.shape[0], (rows, -(-context // key.shape[1])), generator=gen, dtype=torch.int32).to(device)
    lens = torch.full((rows,), context, dtype=torch.int32, device=device)
    q = torch.randn(rows, num_heads, key.shape[3], generator=gen).to(device=device, dtype=key.dtype)
    timings, failed = {}, {}
    for tile, warps, stages in TRITON_CONFIGS:
        call = partial(decode_triton, q, key, value, table, lens, None, tile=tile, num_warps=warps, num_stages=stages)
        try:
            call()  # compiles
            torch.cuda.synchronize(device)
        except Exception as exc:  # e.g. a tile that needs more shared memory than the device has
            failed[f"tile{tile}_warps{warps}_stages{stages}"] = f"{type(exc).__name__}: {exc}"[:200]
            continue
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            call()
        end.record()
        end.synchronize()
        timings[(tile, warps, stages)] = start.elapsed_time(end) * 1e3 / iters
    if not timings:
        raise RuntimeError(f"no triton decode configuration ran: {failed}")
    tile, warps, stages = min(timings, key=timings.get)
    report = {"tile": tile, "warps": warps, "stages": stages, "rows": rows, "context": context,
              "us": {f"tile{t}_warps{w}_stages{st}": round(us, 1) for (t, w, st), us in timings.items()}, "failed": failed}
    return partial(decode_triton, tile=tile, num_warps=warps, num_stages=stages), report


def decode_cpp(q, key, value, block_table, context_lens, scale: float | None, query_starts=None) -> torch.Tensor:
    built = kernels.load()
    if built is None:
        raise RuntimeError(f"the C++ decode kernel is not built here: {kernels.unavailable_reason()}")
    return built.paged_decode(q, key, value, block_table, context_lens, q.shape[2] ** -0.5 if scale is None else scale, query_starts)


KERNELS = {"torch": decode_torch, "triton": decode_triton, "cpp": decode_cpp}


def default_kernel(device: torch.device, head_dim: int) -> str:
    """triton on CUDA when the package is there; on CPU the C++ kernel when it builds here and was compiled
    for this head size; else the torch gather."""
    if device.type == "cuda":
        return "triton" if triton is not None else "torch"
    built = kernels.load()
    return "cpp" if built is not None and head_dim in built.supported_head_dims() else "torch"


def interpreter_loop_fix() -> None:
    """Let triton's CPU interpreter (TRITON_INTERPRET=1) use a loaded scalar as a `range` bound under numpy 2
    (it converts a 1-element array with int(), which numpy 2 refuses). Tests only; no effect on GPUs."""
    import triton.runtime.interpreter as interpreter

    original = interpreter._patch_lang_tensor

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = patched
