"""Incremental detokenization matches a one-shot decode, including multi-byte UTF-8 and stop strings."""

from __future__ import annotations

import pytest

from router.detokenizer import IncrementalDetokenizer


@pytest.fixture(scope="module")
def tokenizer(demo_model):
    return demo_model.tokenizer


@pytest.mark.parametrize(
    "text",
    ["Hello, world! How are you?", "naïve café — déjà vu 日本語のテキスト 🙂🚀 end", "  spaced   out\n\nlines\t tabs"],
)
def test_token_by_token_equals_full_decode(tokenizer, text):
    ids = tokenizer(text)["input_ids"]
    detok = IncrementalDetokenizer(tokenizer, prompt_token_ids=tokenizer("Say:")["input_ids"])
    pieces = [detok.add([t]).text for t in ids]
    pieces.append(detok.finish().text)
    assert "".join(pieces) == tokenizer.decode(ids, skip_special_tokens=True)
    assert all("\ufffd" not in p for p in pieces)


def test_stop_string_cuts_text_and_is_never_emitted(tokenizer):
    ids = tokenizer("The answer is 42. STOP here please")["input_ids"]
    detok = IncrementalDetokenizer(tokenizer, stop=["STOP"])
    emitted = ""
    for t in ids:
        step = detok.add([t])
        emitted += step.text
        if step.stopped:
            break
    assert detok.stopped
    assert emitted == "The answer is 42. "
    assert "ST" not in emitted
