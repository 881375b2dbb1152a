"""Incremental detokenization for one request: token ids in, text deltas out.

Decoding each token alone breaks multi-byte UTF-8 characters and tokenizers that merge spaces, so
the detokenizer decodes a short window of recent tokens and emits only the new, complete suffix.
A delta is held back while it ends in an incomplete character (U+FFFD), and while it could be the
start of a stop string; `finish()` flushes what is left. Stop strings are matched on the text,
and the text is cut before the stop string (OpenAI semantics). With `min_tokens`, the text of the
first min_tokens output tokens is released as is, never matched (vLLM's rule: a stop string counts
only once more than min_tokens tokens were generated), like the EOS the sampler masks until then.
"""

from __future__ import annotations

from dataclasses import dataclass

_REPLACEMENT = "\ufffd"


@dataclass
class DetokenizerStep:
    text: str
    """Text newly safe to show after this call."""
    stopped: bool = False
    """A stop string was found; the request should end now."""
    num_tokens: int = 0
    """Tokens of this call's input consumed: all of them, or those up to the one that completed a stop string."""


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int] | None = None, stop: list[str] | None = None,
                 skip_special_tokens: bool = True, min_tokens: int = 0):
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = list(prompt_token_ids[-4:]) if prompt_token_ids else []
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._stop = [s for s in (stop or []) if s]
        self._unmatched_tokens = min_tokens  # output tokens still to come whose text no stop string may match
        self._pending = ""  # decoded but not yet emitted (possible stop-string prefix)
        self.text = ""
        self.stopped = False

    def add(self, token_ids: list[int]) -> DetokenizerStep:
        if self.stopped:
            return DetokenizerStep("", True)
        released = ""
        consumed = 0
        for token in token_ids:  # token by token: a chunk of several tokens stops where a stop string completes
            self._ids.append(token)
            self._pending += self._decode_new()
            consumed += 1
            if self._unmatched_tokens > 0:  # within min_tokens: final text, never matched
                self._unmatched_tokens -= 1
                released, self._pending = released + self._pending, ""
            elif any(stop in self._pending for stop in self._stop):
                break
        self.text += released
        step = self._release(final=False)
        return DetokenizerStep(released + step.text, step.stopped, consumed)

    def finish(self) -> DetokenizerStep:
        if self.stopped:
            return DetokenizerStep("", True)
        tail = self._decode(self._ids[self._prefix_offset:])[len(self._decode(self._ids[self._prefix_offset:self._read_offset])):]
        self._pending += tail
        self._read_offset = len(self._ids)
        return self._release(final=True)

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip)

    def _decode_new(self) -> str:
        prefix = self._decode(self._ids[self._prefix_offset:self._read_offset])
        full = self._decode(self._ids[self._prefix_offset:])
        if len(full) > len(prefix) and not full.endswith(_REPLACEMENT):
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._ids)
            return full[len(prefix):]
        return ""

    def _release(self, final: bool) -> DetokenizerStep:
        for stop in self._stop:
            at = self._pending.find(stop)
            if at >= 0:
                out = self._pending[:at]
                self.text += out
                self._pending = ""
                self.stopped = True
                return DetokenizerStep(out, True)
        keep = 0 if final else self._longest_stop_prefix_suffix()
        out = self._pending[: len(self._pending) - keep] if keep else self._pending
        self._pending = self._pending[len(out):]
        self.text += out
        return DetokenizerStep(out)

    def _longest_stop_prefix_suffix(self) -> int:
        best = 0
        for stop in self._stop:
            for k in range(min(len(stop) - 1, len(self._pending)), 0, -1):
                if self._pending.endswith(stop[:k]):
                    best = max(best, k)
                    break
        return best
