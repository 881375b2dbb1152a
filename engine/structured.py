"""Structured output: only tokens a request's constraint accepts can be sampled (xgrammar).

Lifecycle it owns, per engine and per request:
  - engine: the tokenizer's vocabulary is handed to xgrammar once (`TokenizerInfo`, on the first
    constrained request) and one `GrammarCompiler` compiles every constraint; compiled grammars are
    kept in an LRU keyed by the constraint (kind + text), so a schema is compiled once.
  - request: `check` compiles its constraint when it enters the engine (a bad schema, regex or
    grammar is an InvalidRequestError naming `structured_output`). At its first sampling step a
    `GrammarMatcher` is made for it; before every step the matcher is fed the request's output
    tokens it has not seen yet, so it follows every accepted token wherever it was sampled: the first
    token that a prefill worker sampled under the same constraint reaches a decode worker's matcher
    here, and a preempted request keeps its matcher; a migrated request's matcher is first fed the
    tokens its earlier attempts generated (`StructuredOutput.accepted`). `forget` drops it at the end.
  - step: `mask` fills one token bitmask for the rows of the constrained requests and sets every
    other token's logit to -inf in those rows (EOS is allowed only where the grammar is complete);
    a step without constrained requests does no work.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Iterable

import torch
import xgrammar as xgr

from common.errors import InvalidRequestError
from common.sampling import StructuredOutput
from engine.sequence import Sequence

log = logging.getLogger(__name__)

GRAMMAR_CACHE_SIZE = 128


class GrammarCache:
    """Compiled grammars of one vocabulary, built once per constraint."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: Iterable[int], capacity: int = GRAMMAR_CACHE_SIZE):
        self._tokenizer, self._vocab_size = tokenizer, vocab_size
        self._stop_ids = sorted(eos_token_ids)
        self._compiler: xgr.GrammarCompiler | None = None
        self._grammars: OrderedDict[StructuredOutput, xgr.CompiledGrammar] = OrderedDict()
        self.capacity = capacity
        self.hits = self.misses = 0

    def get(self, constraint: StructuredOutput) -> xgr.CompiledGrammar:
        grammar = self._grammars.get(constraint)
        if grammar is not None:
            self.hits += 1
            self._grammars.move_to_end(constraint)
            return grammar
        self.misses += 1
        try:
            grammar = self._compile(constraint)
        except RuntimeError as exc:  # xgrammar's parse / conversion errors
            reason = str(exc).strip().splitlines()[-1].split("] ", 1)[-1]
            raise InvalidRequestError("structured_output", f"the {constraint.kind} cannot be compiled: {reason}") from None
        self._grammars[constraint] = grammar
        if len(self._grammars) > self.capacity:
            self._grammars.popitem(last=False)
        return grammar

    def _compile(self, constraint: StructuredOutput) -> xgr.CompiledGrammar:
        compiler = self._compiler or self._new_compiler()
        if constraint.kind == "json_object":
            return compiler.compile_builtin_json_grammar()
        if constraint.kind == "json_schema":
            return compiler.compile_json_schema(constraint.spec, any_whitespace=False)
        if constraint.kind == "regex":
            return compiler.compile_regex(constraint.spec)
        return compiler.compile_grammar(constraint.spec)

    def _new_compiler(self) -> xgr.GrammarCompiler:
        info = xgr.TokenizerInfo.from_huggingface(self._tokenizer, vocab_size=self._vocab_size, stop_token_ids=self._stop_ids)
        self._compiler = xgr.GrammarCompiler(info, max_threads=1)
        return self._compiler


class StructuredOutputs:
    """The matchers of the constrained requests and the per-step logits mask."""

    def __init__(self, grammars: GrammarCache):
        self.grammars = grammars
        self._matchers: dict[str, tuple[xgr.GrammarMatcher | None, int]] = {}
        """request id -> (matcher, how many output tokens it has accepted); None: it rejected one."""

    def check(self, constraint: StructuredOutput) -> None:
        self.grammars.get(constraint)

    def forget(self, request_id: str) -> None:
        self._matchers.pop(request_id, None)

    def mask(self, logits: torch.Tensor, seqs: list[Sequence], in_place: bool) -> torch.Tensor:
        """`logits` (row i is seqs[i]'s) with the constrained rows masked; a copy unless `in_place`."""
        rows = [i for i, seq in enumerate(seqs) if seq.params.structured is not None]
        if not rows:
            return logits
        bitmask = xgr.allocate_token_bitmask(len(seqs), logits.shape[-1])
        masked = []
        for row in rows:
            matcher = self._matcher(seqs[row])
            if matcher is not None and not matcher.is_terminated():
                matcher.fill_next_token_bitmask(bitmask, row)
                masked.append(row)
        if not masked:
            return logits
        out = logits if in_place else logits.clone()
        xgr.apply_token_bitmask_inplace(out, bitmask.to(out.device, non_blocking=True), indices=masked)
        return out

    def _matcher(self, seq: Sequence) -> xgr.GrammarMatcher | None:
        """The request's matcher, fed the output tokens it has not seen; None once it rejected one."""
        known = self._matchers.get(seq.request_id)
        if known is None:
            known = (xgr.GrammarMatcher(self.grammars.get(seq.params.structured)), 0)
            if not all(known[0].accept_token(t) for t in seq.params.structured.accepted):
                known = (None, 0)
        matcher, seen = known
        if matcher is None:
            self._matchers[seq.request_id] = known
            return None
        tokens = seq.output_token_ids
        for token in tokens[seen:]:
            if not matcher.accept_token(token):
                log.warning("request %s: token %d breaks its structured output constraint; unconstrained from here",
                            seq.request_id, token)
                self._matchers[seq.request_id] = (None, len(tokens))
                return None
        self._matchers[seq.request_id] = (matcher, len(tokens))
        return matcher
