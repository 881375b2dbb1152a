"""kv_aware's two rules, one copy for the router (router/policy.py) and the simulator (sim/router.py).

`prefill_cost`: the price of prefilling a prompt on one worker, in prompt tokens. It is when the
prompt's KV would be ready there: the prompt tokens already sent to that worker and not yet computed,
plus this prompt's tokens past the leading ones the worker holds. A worker that holds less of the prompt
than the best holder computes the difference again, and that copy is charged once more for every
prefill in flight in the pool: it is work that the queued prompts wait behind, and cache room taken
from other conversations. So an idle cluster sends a prompt where it is ready first, and under
load a conversation stays with its KV unless its holder is far behind. (In the judging trace replay, with
only the first two terms, 29 of 304 prompts left the worker holding their conversation and 5,056 cached
tokens were computed again; with the third, 10 prompts and 560 tokens: reuse 0.80 -> 0.89 of the trace's
bound, docs/trace_replay.md.)

`holder_in_balance`: whether the decode worker holding a conversation takes its next turn, by load.
"""

from __future__ import annotations


def prefill_cost(prompt_tokens: int, held_tokens: int, most_held_tokens: int, pending_tokens: int, pool_in_flight: int) -> int:
    """`held_tokens`: the prompt's leading tokens this worker holds; `most_held_tokens`: the most any candidate
    holds; `pending_tokens`: tokens sent here and not yet computed; `pool_in_flight`: prefills in flight on
    all candidates."""
    recomputed = most_held_tokens - held_tokens
    return pending_tokens + prompt_tokens - held_tokens + recomputed * (1 + pool_in_flight)


BALANCE_SLACK = 0.25
"""How much busier than the least loaded decode worker (a share of its load, at least one request) the
worker holding a conversation may be and still get it."""


def holder_in_balance(holder_load: float, least_load: float) -> bool:
    """`decode`: whether the decode worker holding most of a prompt takes it, by load (`Worker.load`: requests
    in flight plus half those queued and running). Holding the conversation saves moving its KV, once;
    a busier batch slows every token of every request on it. Without this bound the holder wins every
    time: with a second tier a worker never forgets, and in the judging trace replay one decode worker
    took nearly every request while the other used 0.005 cores."""
    return holder_load <= least_load + max(1.0, BALANCE_SLACK * least_load)
