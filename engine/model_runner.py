"""Run one scheduled step through the model: packed inputs in, logits of sampling requests out.

Lifecycle per step: `execute(batch)` builds token ids, positions and the slot mapping of every packed
token and the `AttentionMetadata` (block tables, lengths: everything attention needs, once for all
layers), runs the HF model once on the whole packed row with the paged attention function
(engine.attention), and returns logits only for the requests whose last known token was computed. Batch
bookkeeping is plain Python on ints, turned into a few tensors at the end.

On a CPU with the C++ kernel (engine.kernels, built once per machine) every request of the step is one
row of one `paged_decode` kernel call per layer: decodes, verifying rows and short prefill chunks after
cached keys alike (and every prompt, whole or after cached keys, where engine.prompt_attention measured the
kernel clearly faster than SDPA on this machine), in the batch's order, followed by the other prefill chunks
(each attended on its own by SDPA, as transformers attends a prompt, over its context gathered from the pool
when it has one; engine.attention); its linear layers run as engine.linears decides
(the small-matmul kernel for float32 inputs of few rows, bf16 weights packed once). On CUDA, or on a CPU without the C++ kernel (or with `batched=True`, how the CPU
tests run the GPU path), single-token decodes go first through the decode kernel (triton on CUDA, the
torch gather otherwise) and all prefill chunks follow in one SDPA call per layer; a pure decode step (no
prefill, no layer hook) whose batch fits `cuda_graph_max_batch` is padded to a bucket and replayed from
a CUDA graph (engine.cuda_graphs) when the triton decode kernel is available; the triton kernel runs at the
tile, warps and pipeline stages it measured fastest when the runner started, and Llama's rotary embedding
and RMSNorm run as triton kernels (engine.llama_layers, engine.triton_layers). `set_decode_kernel`
switches kernels (the device check measures both).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np
import torch

from engine import attention, host_memory, kernels, linears, llama_layers, paged_decode, prompt_attention, triton_layers
from engine.attention import AttentionMetadata, DecodeBatch, DecodeRows, block_table, decode_rows, prefill_batch, prompt_chunk
from engine.cuda_graphs import DecodeGraphs
from engine.kv_cache import KVCache
from engine.one_row_linear import LoneRows
from engine.step import StepItem

log = logging.getLogger(__name__)

def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


SDPA_CHUNK_AFTER_CONTEXT = 16
"""Where SDPA attends prompts faster than the C++ kernel, a prefill chunk after cached keys of at least this many
tokens is attended by SDPA over its gathered context (CPU path); shorter ones cost less as rows of the kernel,
which reads the context in place."""


def _attended_apart(item: StepItem, prompts_apart: bool) -> bool:
    """A prefill chunk attended by its own SDPA call (CPU path), apart from the kernel's rows: only where SDPA attends
    prompts faster here (`prompts_apart`, engine.prompt_attention), a whole prompt or a long chunk after cached keys.
    Where the kernel attends whole prompts faster it takes chunks after cached keys too: on a Zen 4 EPYC a prefill
    step of 512 tokens after 256 cached ones went from 1045 to 718 ms in bf16 and from 1541 to 1486 in float32, 128
    after 256 from 238 to 198 ms in bf16 (one thread; `pdserve profile` before and after, sim/profiles/)."""
    if item.num_tokens == 1 or item.num_proposed or not prompts_apart:
        return False
    return item.start == 0 or item.num_tokens >= SDPA_CHUNK_AFTER_CONTEXT


def install_kernels(model: torch.nn.Module, device: torch.device | str) -> LoneRows | None:
    """What a runner installs on its model, each part giving transformers' bits: the one-pass rotary embedding and
    RMSNorm (engine.llama_layers: the C++ kernels on a CPU where they build, triton's on CUDA where it is there)
    and, on a CPU, each linear layer's kernel (engine.linears, whose LoneRows it returns) and malloc's settings for
    the step's tensors (engine.host_memory.keep_freed_memory). bench.ceilings installs the same, so that its
    attention-free ceilings run what the engine runs."""
    if torch.device(device).type == "cuda":
        if triton_layers.available():
            llama_layers.install(model, triton_layers)
        return None
    host_memory.keep_freed_memory()
    built = kernels.load()
    if built is not None:
        llama_layers.install(model, built)
    return linears.install(model)


class ModelRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        kv_cache: KVCache,
        device: torch.device | str = "cpu",
        *,
        max_model_len: int | None = None,
        cuda_graph_max_batch: int = 0,
        batched: bool | None = None,
    ):
        self.model = model
        self.kv_cache = kv_cache
        self.device = torch.device(device)
        self.block_size = kv_cache.layout.block_size
        self.batched = self.device.type == "cuda" if batched is None else batched
        self.max_blocks_per_seq = _cdiv(max_model_len or model.config.max_position_embeddings, self.block_size)
        self.cuda_graph_max_batch = cuda_graph_max_batch if self.device.type == "cuda" else 0
        self.graphs: DecodeGraphs | None = None
        self.fallback_reason: str | None = None
        """Why the default decode kernel / graphs could not be used here (None: they are)."""
        self.decode_tuning: dict | None = None
        """The triton kernel's configuration and every candidate's time (CUDA; paged_decode.tune_triton)."""
        model.set_attn_implementation(attention.register())
        self.lone_rows = install_kernels(model, self.device)
        """Told each step which rows decode, for bf16 layers that sum them as lone rows (engine.linears)."""
        self.prompts_apart = True
        """Prompts (whole, or long chunks after cached keys) attended by SDPA, not as rows of the C++ kernel (CPU path:
        measured, `set_decode_kernel`)."""
        try:
            self.set_decode_kernel(paged_decode.default_kernel(self.device, kv_cache.layout.head_dim))
        except Exception as exc:  # a kernel that does not compile or a graph that does not capture here
            self.fallback_reason = f"{type(exc).__name__}: {exc}"
            log.warning("decode kernel %r / CUDA graphs unavailable, decoding eagerly with the torch kernel: %s", self.decode_kernel, exc)
            self.set_decode_kernel("torch")

    def set_decode_kernel(self, name: str) -> None:
        """Use paged_decode.KERNELS[name] for decode rows (triton on CUDA at the configuration it measures fastest
        here, once: `decode_tuning`); (re)captures the CUDA graphs when they apply. Only the C++ kernel takes
        prefill chunks as rows: with any other the step takes the batched path."""
        self.decode_kernel = name
        self.batched = self.batched or name != "cpp"
        if not self.batched:
            layout = self.kv_cache.layout
            self.prompts_apart = not prompt_attention.kernel_attends_prompts(
                layout.dtype, self._query_heads(), layout.num_kv_heads, layout.head_dim, layout.block_size)
        self.graphs = None
        self.decode_fn = paged_decode.KERNELS[name]
        if name == "triton" and self.device.type == "cuda":
            if self.decode_tuning is None:
                self._tuned, self.decode_tuning = self._tune_triton()
            self.decode_fn = self._tuned
        if self.cuda_graph_max_batch and name == "triton":
            graphs = DecodeGraphs(self.model, self.kv_cache, self.cuda_graph_max_batch, self.max_blocks_per_seq, self.decode_fn)
            graphs.capture()
            self.graphs = graphs

    def _tune_triton(self) -> tuple[Callable, dict]:
        """paged_decode.tune_triton over layer 0's pool; its default configuration if timing fails."""
        cache, heads = self.kv_cache, self._query_heads()
        try:
            tuned, report = paged_decode.tune_triton(cache.key_caches[0], cache.value_caches[0], heads)
        except Exception as exc:  # the kernel still runs at its defaults; its own failure is caught by the caller
            log.warning("triton decode kernel not timed (%s); using its default configuration", exc)
            return paged_decode.decode_triton, {"error": f"{type(exc).__name__}: {exc}"}
        log.info("triton decode kernel: %s", report)
        return tuned, report

    def _query_heads(self) -> int:
        """This rank's query heads (its share of the KV heads, each with its group)."""
        config = self.model.config
        return self.kv_cache.layout.num_kv_heads * (config.num_attention_heads // getattr(config, "num_key_value_heads", config.num_attention_heads))

    @torch.inference_mode()
    def execute(
        self, batch: list[StepItem], on_layer_written: Callable[[int], None] | None = None
    ) -> tuple[list[int], torch.Tensor]:
        """Returns the packed order (indices into `batch`) and the logits `[num_sampling_rows, vocab]` of
        the sampling members of the batch, in that order (1 + num_proposed rows per member)."""
        if self.batched:
            return self._execute_batched(batch, on_layer_written)
        apart = [_attended_apart(s, self.prompts_apart) for s in batch]
        order = [i for i, alone in enumerate(apart) if not alone] + [i for i, alone in enumerate(apart) if alone]
        ordered = [batch[i] for i in order]
        rows = ordered[: apart.count(False)]
        prompts = [prompt_chunk(s.block_ids, s.start, s.num_tokens, self.block_size, self.device) for s in ordered[len(rows) :]]
        input_ids, positions, slots, sampling_rows = self._pack(ordered)
        meta = AttentionMetadata(
            kv_cache=self.kv_cache,
            slot_mapping=slots,
            num_decode_tokens=sum(s.num_tokens for s in rows),
            decode=self._decode_batch(rows),
            prefill=None,
            on_layer_written=on_layer_written,
            prompts=prompts or None,
        )
        return order, self._forward(input_ids, positions, sampling_rows, meta)

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor, sampling_rows: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The model once over the packed row: the logits of `sampling_rows`."""
        out = self.model(
            input_ids=input_ids.unsqueeze(0), position_ids=positions.unsqueeze(0), use_cache=False, logits_to_keep=sampling_rows, paged=meta
        )
        return out.logits[0]

    def _pack(self, ordered: list[StepItem]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The step's packed token ids, positions, slots and sampling rows; tells the bf16 layers that sum decode
        rows as lone rows which rows those are (engine.one_row_linear)."""
        if self.lone_rows is not None:
            self.lone_rows.set(ordered)
        bs = self.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        sampling_rows: list[int] = []
        for item in ordered:
            start, n, table = item.start, item.num_tokens, item.block_ids
            ids.extend(item.token_ids)
            positions.extend(range(start, start + n))
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, start + n))
            if item.samples:
                sampling_rows.extend(range(len(ids) - 1 - item.num_proposed, len(ids)))
        dev = self.device
        return (
            torch.tensor(ids, dtype=torch.long, device=dev),
            torch.tensor(positions, dtype=torch.long, device=dev),
            torch.tensor(slots, dtype=torch.long, device=dev),
            torch.tensor(sampling_rows, dtype=torch.long, device=dev),
        )

    def _decode_batch(self, decodes: list[StepItem]) -> DecodeBatch | None:
        """The kernel rows' block tables (as wide as the longest context) and lengths; with rows of several
        queries (verifying rows, prefill chunks) also where each row's queries start."""
        if not decodes:
            return None
        lens = np.array([s.start + s.num_tokens for s in decodes], dtype=np.int32)
        table = block_table([s.block_ids for s in decodes], len(decodes), _cdiv(int(lens.max()), self.block_size), self.kv_cache.scratch_block)
        kernel = self.decode_fn
        counts = [s.num_tokens for s in decodes]
        if max(counts) == 1:
            return DecodeBatch(self._to_device(table), self._to_device(lens), kernel)
        starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
        return DecodeBatch(self._to_device(table), self._to_device(lens), kernel, self._to_device(starts))

    # ---- batched path (CUDA) -------------------------------------------------------------------
    def _execute_batched(
        self, batch: list[StepItem], on_layer_written: Callable[[int], None] | None
    ) -> tuple[list[int], torch.Tensor]:
        order = [i for i, s in enumerate(batch) if s.num_tokens == 1]
        order += [i for i, s in enumerate(batch) if s.num_tokens > 1]
        ordered = [batch[i] for i in order]
        decodes = [s for s in ordered if s.num_tokens == 1]
        sampling = [i for i, s in enumerate(ordered) if s.samples]
        graphs = self.graphs
        if graphs is not None and len(decodes) == len(ordered) and on_layer_written is None and len(decodes) <= graphs.max_batch:
            logits = graphs.run(self._decode_rows(decodes, graphs.bucket(len(decodes)), graphs.width))
            rows = slice(0, len(decodes)) if len(sampling) == len(decodes) else torch.tensor(sampling, device=self.device)
            return order, logits[rows]
        input_ids, positions, slots, sampling_rows = self._pack(ordered)
        decode = self._decode_batch(decodes)
        chunks = [(s.block_ids, s.start, s.num_tokens) for s in ordered[len(decodes) :]]
        meta = AttentionMetadata(
            kv_cache=self.kv_cache,
            slot_mapping=slots,
            num_decode_tokens=len(decodes),
            decode=decode,
            prefill=prefill_batch(chunks, self.block_size, self.device) if chunks else None,
            on_layer_written=on_layer_written,
        )
        return order, self._forward(input_ids, positions, sampling_rows, meta)

    def _decode_rows(self, decodes: list[StepItem], rows: int, width: int) -> DecodeRows:
        return decode_rows(
            [s.block_ids for s in decodes],
            [s.start for s in decodes],
            [s.token_ids[0] for s in decodes],
            rows,
            width,
            self.block_size,
            self.kv_cache.scratch_block,
        )

    def _to_device(self, array) -> torch.Tensor:
        return torch.from_numpy(array).to(self.device, non_blocking=True)
