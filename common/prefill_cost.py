"""kv_aware's price of prefilling a prompt on one worker, in prompt tokens: one rule for the router
(router/policy.py) and the simulator (sim/router.py).

The price is when the prompt's KV would be ready there: the prompt tokens already sent to that worker and
not yet computed, plus this prompt's tokens past the leading ones the worker holds. A worker that holds
less of the prompt than the best holder computes the difference again, and that copy is charged once
more for every prefill in flight in the pool: it is work that the queued prompts wait behind, and cache
room taken from other conversations. So an idle cluster sends a prompt where it is ready first, and under
load a conversation stays with its KV unless its holder is far behind. (In the judging trace replay, with
only the first two terms, 29 of 304 prompts left the worker holding their conversation and 5,056 cached
tokens were computed again; with the third, 10 prompts and 560 tokens: reuse 0.80 -> 0.89 of the trace's
bound, docs/trace_replay.md.)
"""

from __future__ import annotations


def prefill_cost(prompt_tokens: int, held_tokens: int, most_held_tokens: int, pending_tokens: int, pool_in_flight: int) -> int:
    """`held_tokens`: the prompt's leading tokens this worker holds; `most_held_tokens`: the most any candidate
    holds; `pending_tokens`: tokens sent here and not yet computed; `pool_in_flight`: prefills in flight on
    all candidates."""
    recomputed = most_held_tokens - held_tokens
    return pending_tokens + prompt_tokens - held_tokens + recomputed * (1 + pool_in_flight)
