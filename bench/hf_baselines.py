"""The transformers baselines of the engine benchmark, on a separately loaded copy of the model with
transformers' default attention: `generate` in static batches (`run_hf_static`) and transformers'
own continuous batching (`run_hf_continuous`). Each returns a tokens/s record (`measure.token_rate`)."""

from __future__ import annotations

import os

import torch
from tqdm import tqdm

from bench.engine_workload import Workload
from bench.measure import Clock, progress_bar, token_rate
from engine.model_loader import LoadedModel


def hf_copy(loaded: LoadedModel) -> torch.nn.Module:
    """A second instance of the model with transformers' default attention (sdpa)."""
    from transformers import AutoModelForCausalLM

    if os.path.isdir(loaded.path):
        return AutoModelForCausalLM.from_pretrained(loaded.path, dtype=loaded.dtype, attn_implementation="sdpa").eval()
    model = loaded.model
    config = type(model.config).from_dict(model.config.to_dict())
    config._attn_implementation = "sdpa"
    clone = type(model)(config).to(loaded.dtype).eval()
    clone.load_state_dict(model.state_dict())
    clone.generation_config = model.generation_config
    return clone


def pad_id(loaded: LoadedModel) -> int:
    tok = loaded.tokenizer
    for candidate in (getattr(tok, "pad_token_id", None), getattr(tok, "eos_token_id", None)):
        if candidate is not None:
            return int(candidate)
    return 0


@torch.inference_mode()
def run_hf_static(model: torch.nn.Module, w: Workload, batch_size: int, pad_id: int) -> dict:
    _hf_generate(model, [w.prompts[0][:32]], 4, pad_id)  # warm-up
    generated = 0
    with progress_bar("hf static", w.useful_tokens) as bar:
        clock = Clock()
        for b in range(0, len(w.prompts), batch_size):
            prompts, outs = w.prompts[b : b + batch_size], w.output_lens[b : b + batch_size]
            new = _hf_generate(model, prompts, max(outs), pad_id)
            if new != max(outs):
                raise RuntimeError(f"generate produced {new} tokens, expected {max(outs)}")
            generated += new * len(prompts)
            bar.update(sum(outs))
        wall, cpu = clock.stop()
    return {**token_rate(w.useful_tokens, wall, cpu), "batch_size": batch_size, "generated_tokens_incl_padding": generated}


def _hf_generate(model: torch.nn.Module, prompts: list[list[int]], max_new: int, pad_id: int) -> int:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, p in enumerate(prompts):  # left padding
        ids[row, width - len(p) :] = torch.tensor(p)
        mask[row, width - len(p) :] = 1
    out = model.generate(
        input_ids=ids.to(model.device),
        attention_mask=mask.to(model.device),
        max_new_tokens=max_new,
        min_new_tokens=max_new,  # EOS ignored: every row runs to the batch's longest output
        do_sample=False,
        pad_token_id=pad_id,
    )
    return out.shape[1] - width


@torch.inference_mode()
def run_hf_continuous(model: torch.nn.Module, w: Workload, max_batch_tokens: int, pad_id: int) -> dict:
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    page = 256
    pages = sum(-(-(len(p) + o + 1) // page) for p, o in zip(w.prompts, w.output_lens)) + 4
    gen = GenerationConfig(do_sample=False, max_new_tokens=max(w.output_lens), eos_token_id=-1, pad_token_id=pad_id)
    page_field = "page_size" if "page_size" in ContinuousBatchingConfig.__dataclass_fields__ else "block_size"  # < 5.20: block_size
    cb = ContinuousBatchingConfig(**{page_field: page}, num_blocks=pages, max_batch_tokens=max_batch_tokens)
    manager = model.init_continuous_batching(generation_config=gen, continuous_batching_config=cb)
    manager.start()
    try:
        _cb_generate(manager, [w.prompts[0][:32]], [4], "warmup", None)
        with progress_bar("hf continuous", w.useful_tokens) as bar:
            clock = Clock()
            lengths = _cb_generate(manager, w.prompts, w.output_lens, "bench", bar)
            wall, cpu = clock.stop()
    finally:
        manager.stop(block=True, timeout=30)
        model.destroy_cached_continuous_batching_manager()
    if lengths != w.output_lens:
        raise RuntimeError("transformers continuous batching did not produce each request's output length")
    return {**token_rate(w.useful_tokens, wall, cpu), "page_size": page, "num_pages": pages, "max_batch_tokens": max_batch_tokens}


def _cb_generate(manager, prompts: list[list[int]], outs: list[int], prefix: str, bar: tqdm | None) -> list[int]:
    for i, (p, n) in enumerate(zip(prompts, outs)):
        manager.add_request(p, request_id=f"{prefix}-{i}", max_new_tokens=n, eos_token_id=-1)
    lengths: dict[str, int] = {}
    while len(lengths) < len(prompts):
        result = manager.get_result(timeout=1)
        if result is None:
            if not manager.is_running():
                raise RuntimeError("transformers continuous batching stopped before finishing")
            continue
        if result.error is not None:
            raise RuntimeError(f"transformers continuous batching failed: {result.error}")
        if result.is_finished():
            lengths[result.request_id] = len(result.generated_tokens)
            if bar is not None:
                bar.update(len(result.generated_tokens))
    return [lengths[f"{prefix}-{i}"] for i in range(len(prompts))]
