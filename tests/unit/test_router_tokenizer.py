"""The router's torch-free tokenizer (router/tokenizer.py) tokenizes and detokenizes as the workers' AutoTokenizer does."""

from __future__ import annotations

import pytest
from transformers import AutoConfig, AutoTokenizer

from common.errors import ModelLoadError
from common.model_files import DEMO_ALIAS, resolve_model_path
from common.tokenization import encode_chat, encode_prompt
from router.tokenizer import context_length, load_tokenizer_and_context

PROMPTS = ["Hello!", "  leading spaces and a tab\t", "naïve café — 東京 🚀", "def f(x):\n    return x * 2\n"]


@pytest.fixture(scope="module")
def pair():
    path = resolve_model_path(DEMO_ALIAS)
    ours, max_len = load_tokenizer_and_context(DEMO_ALIAS, None)
    return ours, AutoTokenizer.from_pretrained(path), max_len, path


@pytest.mark.parametrize("prompt", PROMPTS)
def test_prompts_encode_and_decode_as_auto_tokenizer_does(pair, prompt):
    ours, auto, _, _ = pair
    for raw in (True, False):
        ids = encode_prompt(ours, prompt, raw=raw)
        assert ids == encode_prompt(auto, prompt, raw=raw)
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == auto.decode(ids, skip_special_tokens=skip)


def test_chat_with_tools_special_tokens_and_vocab_match(pair):
    ours, auto, _, _ = pair
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"}]
    tools = [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
    assert encode_chat(ours, messages, tools) == encode_chat(auto, messages, tools)
    assert (ours.eos_token_id, ours.bos_token_id, ours.pad_token_id) == (auto.eos_token_id, auto.bos_token_id, auto.pad_token_id)
    assert ours.get_vocab() == auto.get_vocab()


def test_context_length_is_the_models_unless_configured(pair, tmp_path):
    ours, _, max_len, path = pair
    assert max_len == AutoConfig.from_pretrained(path).max_position_embeddings
    assert load_tokenizer_and_context(DEMO_ALIAS, 512)[1] == 512
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ModelLoadError, match="engine.max_model_len"):
        context_length(str(tmp_path))
