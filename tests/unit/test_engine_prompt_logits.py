"""A prompt's last hidden state through the engine is transformers' own, bit for bit, in float32 and bfloat16.

On a CPU with the C++ kernel the ModelRunner attends a chunk that starts its request's context apart from
the kernel's rows, with one SDPA call over its own keys (engine.attention `prompts`): the call transformers
makes on a prompt (unless engine.prompt_attention measured the kernel clearly faster on the machine, as on a
Zen 4 EPYC: there a prompt's hidden state can differ in its last bits, and the test forces SDPA, whose property
it is). A prompt alone in its step then passes through the same operations on the same shapes as
in transformers' forward, so the final norm's output at its last position (what the LM head turns into the
first token's logits) is the same bits, on every CPU (the kernel's sums follow torch's only where they were
measured, and never exactly for long prompts). The linear layers stay torch's here: in float32 a prompt of
at most the crossover's rows (engine.small_matmul, measured per machine) would otherwise take the small-matmul
kernel, which sums in its own order by design, as it would for the LM head's one row. Prompts from under one block to
the demo's longest (no prefix cache: the demo prompts share their chat template's start, and cached keys were
summed in another prompt's call, over other key splits); the pool's blocks are all free again afterwards.
"""

import pytest
import torch

from engine import SamplingParams, prompt_attention
from engine.model_loader import load_model
from engine.small_matmul import FewRowsLinear
from tests.conftest import assert_no_leaked_blocks, make_engine


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def model_pair(request):
    from transformers import AutoModelForCausalLM

    loaded = load_model("smollm2-135m", dtype=request.param)
    hf = AutoModelForCausalLM.from_pretrained(loaded.path, dtype=loaded.dtype).eval()
    return loaded, hf


def _last_hidden(model: torch.nn.Module, store: list[torch.Tensor]) -> None:
    model.model.norm.register_forward_hook(lambda module, args, out: store.append(out[0, -1].detach().clone()))


def test_a_prompt_alone_reaches_the_lm_head_as_in_transformers(model_pair, demo_prompt_ids, monkeypatch):
    loaded, hf = model_pair
    monkeypatch.setattr(prompt_attention, "kernel_attends_prompts", lambda *args: False)
    engine = make_engine(loaded, enable_prefix_caching=False)  # a cached prefix would make a later chunk of the prompt
    for layer in loaded.model.modules():  # float32: prompts up to the measured crossover would take the small-matmul kernel
        if type(layer) is FewRowsLinear:
            monkeypatch.setattr(layer, "few_rows", 0)
    assert not engine.runner.batched, "the CPU path with the C++ kernel is what this test is about"
    ours: list[torch.Tensor] = []
    theirs: list[torch.Tensor] = []
    _last_hidden(loaded.model, ours)
    _last_hidden(hf, theirs)
    prompts = sorted(demo_prompt_ids, key=len)
    for i, ids in enumerate(prompts):
        engine.add_request(f"p{i}", ids, SamplingParams(max_tokens=1))
        while engine.has_work():
            engine.step()
        with torch.inference_mode():
            hf(torch.tensor([ids]), logits_to_keep=1)
        assert torch.equal(ours[-1], theirs[-1]), f"prompt of {len(ids)} tokens: max difference {(ours[-1].float() - theirs[-1].float()).abs().max()}"
    assert len(prompts[-1]) > 2 * engine.config.block_size
    assert_no_leaked_blocks(engine)
