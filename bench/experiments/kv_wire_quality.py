"""Experiment: what lossy KV on the wire (kvtransfer/codec.py) costs in output quality.

    python -m bench.experiments.kv_wire_quality [--max-tokens 64]

The decode worker continues from the prompt's KV as it arrived: exactly the prompt's K/V went
through `codec.encode`/`decode`, everything the decode worker computes afterwards is native.
This reproduces that with transformers on the demo model (fp32): prefill each prompt once,
round-trip the prompt's cache through the codec (int8, fp8), then decode greedily:

  exact_match        greedy continuation identical to the one from uncompressed KV (all tokens)
  first_divergence   mean index of the first differing token (max_tokens when identical)
  top1_agreement     teacher-forced on the uncompressed continuation: share of steps whose argmax agrees
  logprob_drift_*    teacher-forced |logprob(token) - logprob_uncompressed(token)|: mean and max
  kl_mean            mean KL(uncompressed || compressed) of the next-token distributions

Prompts: the demo prompt set of the tests (tests/conftest.py DEMO_PROMPTS) plus longer ones built
from it. Writes bench/results/kv_wire_quality.json.
"""

from __future__ import annotations

import argparse
import copy
import sys
import time

import torch

from bench.experiments import common
from kvtransfer import codec


def prompts() -> list[str]:
    from bench.prompts import DEMO_PROMPTS

    long = [" ".join(DEMO_PROMPTS[i:] + DEMO_PROMPTS[:i]) + " Answer the last question." for i in range(4)]
    return list(DEMO_PROMPTS) + long


def roundtrip_cache(cache, wire_dtype: str):
    """A copy of an HF cache whose K/V went through the wire codec ([1, heads, tokens, head_dim] per layer)."""
    out = copy.deepcopy(cache)
    for layer in out.layers:
        for name in ("keys", "values"):
            t = getattr(layer, name)
            rows = t[0].transpose(0, 1).contiguous()  # [tokens, heads, head_dim], as on the wire
            back = codec.decode(codec.encode(rows, rows.shape[-1], wire_dtype), rows.shape[0] * rows.shape[1],
                                rows.shape[-1], wire_dtype, t.dtype)
            t.copy_(back.reshape(rows.shape).transpose(0, 1).unsqueeze(0))
    return out


@torch.inference_mode()
def continue_from(model, cache, first: int, steps: int, forced: list[int] | None = None) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy tokens after `first` (or the `forced` ones) and the log-softmax at each step."""
    tokens, dists, token = [], [], first
    for i in range(steps):
        logits = model(torch.tensor([[token]]), past_key_values=cache, use_cache=True).logits[0, -1]
        dist = torch.log_softmax(logits.float(), -1)
        dists.append(dist)
        token = forced[i] if forced is not None else int(dist.argmax())
        tokens.append(int(dist.argmax()))
    return tokens, dists


def compare(model, ids: list[int], steps: int, wire_dtypes: list[str]) -> dict[str, dict[str, float]]:
    with torch.inference_mode():
        out = model(torch.tensor([ids]), use_cache=True)
    first = int(out.logits[0, -1].argmax())
    ref_tokens, ref_dists = continue_from(model, copy.deepcopy(out.past_key_values), first, steps)
    rows = {}
    for wire in wire_dtypes:
        free, _ = continue_from(model, roundtrip_cache(out.past_key_values, wire), first, steps)
        tf_tokens, tf_dists = continue_from(model, roundtrip_cache(out.past_key_values, wire), first, steps, ref_tokens)
        drift = [abs(float(a[t] - b[t])) for a, b, t in zip(ref_dists, tf_dists, ref_tokens, strict=True)]
        kl = [float(torch.sum(a.exp() * (a - b))) for a, b in zip(ref_dists, tf_dists, strict=True)]
        diverge = next((i for i, (a, b) in enumerate(zip(ref_tokens, free, strict=True)) if a != b), steps)
        rows[wire] = {"exact_match": float(free == ref_tokens), "first_divergence": diverge,
                      "top1_agreement": sum(a == b for a, b in zip(ref_tokens, tf_tokens, strict=True)) / steps,
                      "logprob_drift_mean": sum(drift) / steps, "logprob_drift_max": max(drift), "kl_mean": sum(kl) / steps}
    return rows


def summarize(per_prompt: list[dict[str, dict[str, float]]], wire_dtypes: list[str]) -> dict[str, dict[str, float]]:
    summary = {}
    for wire in wire_dtypes:
        rows = [p[wire] for p in per_prompt]
        summary[wire] = {k: max(r[k] for r in rows) if k == "logprob_drift_max" else sum(r[k] for r in rows) / len(rows)
                         for k in rows[0]}
    return summary


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.experiments.kv_wire_quality", description=__doc__.splitlines()[0])
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--wire-dtypes", nargs="+", default=["int8", "fp8"], choices=["int8", "fp8"])
    args = p.parse_args(argv)
    common.setup_logging()
    started, info = time.time(), common.machine()
    from transformers import AutoModelForCausalLM

    from common.tokenization import encode_prompt
    from engine.model_loader import load_model

    loaded = load_model("smollm2-135m")
    model = AutoModelForCausalLM.from_pretrained(loaded.path, dtype=torch.float32).eval()
    texts = prompts()
    per_prompt = []
    for text in texts:
        ids = encode_prompt(loaded.tokenizer, text)
        per_prompt.append({"prompt_tokens": len(ids), **compare(model, ids, args.max_tokens, args.wire_dtypes)})
        common.log.info("%4d tokens: %s", len(ids), {w: per_prompt[-1][w]["first_divergence"] for w in args.wire_dtypes})
    report = {"experiment": "kv_wire_quality", "command": common.command_line(), "machine": info, "params": vars(args),
              "num_prompts": len(texts), "summary": summarize(per_prompt, args.wire_dtypes), "per_prompt": per_prompt}
    common.finish(info, started)
    common.save("kv_wire_quality", report)
    for wire, row in report["summary"].items():
        print(wire, {k: round(v, 4) for k, v in row.items()}, file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
