"""Per-request sampling parameters, validated once when a request enters the engine.

The logits adjustments (penalties, logit_bias, min_tokens) are applied by
`engine.logits_processors` before the sampler picks a token; `adjusts_logits` tells it which
requests need any of that work. A `StructuredOutput` constraint (JSON, JSON schema, regex, grammar)
is compiled and enforced by `engine.structured`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from common.errors import InvalidRequestError

MAX_N = 16
"""Sequences per request (`n`): each holds its own KV beyond the shared prompt."""
MAX_STOP_TOKEN_IDS = 64
MAX_LOGPROBS = 20
MAX_LOGIT_BIAS_ENTRIES = 300
MAX_ABS_LOGIT_BIAS = 100.0
MAX_ABS_PENALTY = 2.0
"""presence_penalty and frequency_penalty lie in [-2, 2], as in OpenAI's API."""
REPETITION_PENALTY_RANGE = (0.01, 100.0)
"""vLLM asks only > 0; the bounds keep a divided logit finite in float32 (1e-300 would round to 0)."""


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


STRUCTURED_KINDS = ("json_object", "json_schema", "regex", "grammar")
"""json_object: any JSON object; json_schema: a JSON schema (JSON text); regex; grammar: EBNF (GBNF)."""


@dataclass(frozen=True)
class StructuredOutput:
    """A constraint on the whole output; `spec` is the schema / regex / grammar text (empty for json_object)."""

    kind: str
    spec: str = ""
    accepted: tuple[int, ...] = field(default=(), compare=False)
    """Tokens an earlier attempt generated under this constraint (a migrated request: now the end of its
    prompt); the matcher starts after them. Not part of the constraint's identity (its compile cache key)."""

    def validate(self) -> None:
        if self.kind not in STRUCTURED_KINDS:
            raise InvalidRequestError("structured_output", f"kind must be one of {', '.join(STRUCTURED_KINDS)}, got {self.kind!r}")
        if self.kind != "json_object" and not self.spec:
            raise InvalidRequestError("structured_output", f"a {self.kind} constraint needs its text")


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    logprobs: int | None = None
    """None: no logprobs; 0: the sampled token's; k > 0: also the k most likely tokens'."""
    presence_penalty: float = 0.0
    """Subtracted once from the logit of every token that occurs in the output so far (OpenAI)."""
    frequency_penalty: float = 0.0
    """Subtracted from a token's logit once per occurrence in the output so far (OpenAI)."""
    repetition_penalty: float = 1.0
    """Tokens of the prompt or output: positive logits divided by it, negative multiplied (HF, vLLM); 1 = off."""
    logit_bias: tuple[tuple[int, float], ...] = field(default_factory=tuple)
    """(token id, bias) pairs added to the logits; a mapping is accepted and stored sorted by id."""
    min_tokens: int = 0
    """EOS (unless ignore_eos) and stop_token_ids cannot be sampled before this many output tokens."""
    structured: StructuredOutput | None = None
    """Only tokens the constraint accepts can be sampled; EOS only where it is complete."""
    n: int = 1
    """Sequences to generate from the prompt (computed once, its KV shared); sequence i samples with seed + i."""

    def __post_init__(self):
        if isinstance(self.logit_bias, Mapping):
            object.__setattr__(self, "logit_bias", tuple(sorted(self.logit_bias.items())))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def adjusts_logits(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias or self.min_tokens)

    def validate(self, vocab_size: int | None = None) -> None:
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise InvalidRequestError("max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
        if not _is_int(self.n) or not 1 <= self.n <= MAX_N:
            raise InvalidRequestError("n", f"must be an integer in [1, {MAX_N}], got {self.n!r}")
        if not _is_number(self.temperature) or self.temperature < 0:
            raise InvalidRequestError("temperature", f"must be >= 0, got {self.temperature!r}")
        if not _is_number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise InvalidRequestError("top_p", f"must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise InvalidRequestError("top_k", f"must be an integer >= 0 (0 disables), got {self.top_k!r}")
        if self.seed is not None and (not _is_int(self.seed) or self.seed < 0):
            raise InvalidRequestError("seed", f"must be a non-negative integer, got {self.seed!r}")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise InvalidRequestError("stop_token_ids", f"at most {MAX_STOP_TOKEN_IDS} entries, got {len(self.stop_token_ids)}")
        _check_token_ids("stop_token_ids", self.stop_token_ids, vocab_size)
        if self.logprobs is not None and (not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise InvalidRequestError("logprobs", f"must be an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")
        self._validate_adjustments(vocab_size)
        if self.structured is not None:
            self.structured.validate()

    def _validate_adjustments(self, vocab_size: int | None) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -MAX_ABS_PENALTY <= value <= MAX_ABS_PENALTY:
                raise InvalidRequestError(name, f"must be a number in [-{MAX_ABS_PENALTY:g}, {MAX_ABS_PENALTY:g}], got {value!r}")
        rep, (low, high) = self.repetition_penalty, REPETITION_PENALTY_RANGE
        if not _is_number(rep) or not low <= rep <= high:
            raise InvalidRequestError("repetition_penalty", f"must be a number in [{low:g}, {high:g}] (1 disables), got {rep!r}")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise InvalidRequestError("min_tokens", f"must be an integer in [0, max_tokens={self.max_tokens}], got {self.min_tokens!r}")
        if len(self.logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
            raise InvalidRequestError("logit_bias", f"at most {MAX_LOGIT_BIAS_ENTRIES} entries, got {len(self.logit_bias)}")
        _check_token_ids("logit_bias", (tok for tok, _ in self.logit_bias), vocab_size)
        for tok, bias in self.logit_bias:
            if not _is_number(bias) or not -MAX_ABS_LOGIT_BIAS <= bias <= MAX_ABS_LOGIT_BIAS:
                raise InvalidRequestError(f"logit_bias[{tok}]", f"must be a number in [-{MAX_ABS_LOGIT_BIAS:g}, {MAX_ABS_LOGIT_BIAS:g}], got {bias!r}")


def _check_token_ids(name: str, ids: Iterable[int], vocab_size: int | None) -> None:
    for tok in ids:
        if not _is_int(tok) or tok < 0 or (vocab_size is not None and tok >= vocab_size):
            bound = f" (ids are < {vocab_size})" if vocab_size is not None else ""
            raise InvalidRequestError(name, f"{tok!r} is not a token id of this model{bound}")
