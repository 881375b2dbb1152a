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


def test_min_tokens_holds_stop_strings_until_enough_tokens(tokenizer):
    """vLLM's rule: a stop string counts only in text of tokens after the first min_tokens."""
    ids = tokenizer("one. two. three. four")["input_ids"]
    first_dot = next(i for i, t in enumerate(ids) if "." in tokenizer.decode([t]))
    detok = IncrementalDetokenizer(tokenizer, stop=["."], min_tokens=first_dot + 1)
    emitted, steps = "", 0
    for t in ids:
        step = detok.add([t])
        emitted, steps = emitted + step.text, steps + 1
        if step.stopped:
            break
    assert detok.stopped and emitted == "one. two" and steps > first_dot + 1
    plain = IncrementalDetokenizer(tokenizer, stop=["."])
    assert "".join(plain.add([t]).text for t in ids[:first_dot + 1]) == "one" and plain.stopped


def test_a_chunk_of_several_tokens_stops_at_the_token_completing_the_stop_string(tokenizer):
    """Speculative decoding sends several tokens at once: the stop applies token by token inside them."""
    ids = tokenizer("The answer is 42. STOP here please")["input_ids"]
    stop_end = next(i for i in range(len(ids)) if "STOP" in tokenizer.decode(ids[: i + 1]))
    detok = IncrementalDetokenizer(tokenizer, stop=["STOP"])
    first = detok.add(ids[:2])
    assert not first.stopped and first.num_tokens == 2
    step = detok.add(ids[2:])
    assert step.stopped and step.num_tokens == stop_end + 1 - 2
    assert first.text + step.text == "The answer is 42. "
