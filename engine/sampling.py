"""Per-request sampling parameters, validated once when a request enters the engine."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.errors import InvalidRequestError

MAX_STOP_TOKEN_IDS = 64
MAX_LOGPROBS = 20


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

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    def validate(self, vocab_size: int | None = None) -> None:
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            raise InvalidRequestError("max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
        if not isinstance(self.temperature, (int, float)) or self.temperature < 0:
            raise InvalidRequestError("temperature", f"must be >= 0, got {self.temperature!r}")
        if not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:
            raise InvalidRequestError("top_p", f"must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise InvalidRequestError("top_k", f"must be an integer >= 0 (0 disables), got {self.top_k!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or self.seed < 0):
            raise InvalidRequestError("seed", f"must be a non-negative integer, got {self.seed!r}")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise InvalidRequestError("stop_token_ids", f"at most {MAX_STOP_TOKEN_IDS} entries, got {len(self.stop_token_ids)}")
        for tok in self.stop_token_ids:
            if not isinstance(tok, int) or tok < 0 or (vocab_size is not None and tok >= vocab_size):
                raise InvalidRequestError("stop_token_ids", f"{tok!r} is not a token id of this model")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise InvalidRequestError("logprobs", f"must be an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")
