"""The engine: requests in, tokens out, one scheduled step at a time.

Lifecycle of a request: `add_request` validates it and queues it (WAITING); every `step()` asks the
Scheduler what to run, has the ModelRunner compute it, samples the requests whose last token was
computed, applies stop rules and returns one `RequestOutput` per request that produced a token or
finished. A finished request's blocks are freed at once, except a prefill-only request
(FINISHED_PREFILLED), which keeps them until `release()` after its KV has been shipped: layer by
layer during that step to the `KVLayerSink` given at construction, or all at once via `prompt_kv`.
A decode worker adds requests whose prefill ran elsewhere with `add_remote_request`
(WAITING_FOR_REMOTE_KV) and makes them runnable with `commit_remote_kv` once the KV sits in their
blocks; that call returns the request's first output (the token the prefill worker sampled).
A request with `n` > 1 is a group of n sequences (engine.sequence): sequence 0 runs the prompt (or
receives its KV); once it is computed, `_fork` gives sequences 1..n-1 references to the prompt's full
blocks except the last one holding a prompt token. That block is not shared: each fork recomputes
its 1..block_size prompt tokens in its first step (which also yields the logits it samples its first
token from), so no block is ever written by two sequences (no copy-on-write needed), the scheduler
and block manager stay tensor-free, a tensor-parallel engine needs no block-copy command, and a
decode worker forks a received prompt the same way. Outputs carry the sequence's `index`.
The engine is single-threaded: use `AsyncEngine` to drive it from asyncio.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

import torch

from common.block_hash import BlockEvents
from common.engine_config import EngineConfig
from common.errors import InvalidRequestError
from common.hardware import cpu_info
from common.sampling import SamplingParams
from engine.block_manager import BlockManager
from engine.kv_sink import KVLayerSink, SinkRequest, layer_hook
from engine.kv_tier import KVTier
from engine.model_loader import LoadedModel
from engine.outputs import EngineStats, RemoteReservation, RequestOutput, StepCounters
from engine.parallel import RankLauncher, TensorParallelGroup
from engine.runtime import build_runtime
from engine.sampler import Sample, Sampler
from engine.scheduler import ScheduledSeq, Scheduler, SchedulerConfig
from engine.sequence import FinishReason, RequestState, Sequence, check_priority
from engine.speculative import Speculator
from engine.structured import GrammarCache, StructuredOutputs

log = logging.getLogger(__name__)


class Engine:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None, kv_sink: KVLayerSink | None = None,
                 rank_agent: tuple[str, Any] | None = None, rank_launcher: RankLauncher | None = None):
        """With tensor parallelism: rank_agent, ("module:function", settings) that builds each follower
        rank's agent (engine.parallel.follower.RankAgent: its KV endpoint; rank 0's is the worker itself);
        rank_launcher, what starts the follower processes (default: children of this process)."""
        self.config = config
        self.kv_sink = kv_sink
        self._apply_num_threads()
        if loaded is not None and config.tensor_parallel_size > 1:
            raise ValueError("a tensor-parallel engine loads its own shard on every rank: pass no loaded model")
        self.parallel = TensorParallelGroup.start(config, rank_agent, rank_launcher) if config.tensor_parallel_size > 1 else None
        runtime = build_runtime(config, loaded)
        self.loaded, self.layout, self.kv_cache = runtime.loaded, runtime.layout, runtime.kv_cache
        self.global_layout = dataclasses.replace(self.layout, num_kv_heads=self.layout.num_kv_heads * config.tensor_parallel_size)
        """The KV layout of the whole model (every rank's heads): what must match between workers."""
        self.max_model_len = runtime.max_model_len
        self.vocab_size = self.loaded.config.vocab_size
        self.runner = runtime.runner
        num_blocks = self.kv_cache.num_blocks
        self.tier = KVTier(self.kv_cache, config.kv_tier) if config.kv_tier.enabled else None
        """Where blocks evicted from the pool go (engine.kv_tier); None: they are lost."""
        self.blocks = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching, self.tier)
        self.scheduler = Scheduler(
            SchedulerConfig(config.max_num_batched_tokens, config.max_num_seqs, config.enable_chunked_prefill, config.kv_policy),
            self.blocks,
        )
        self.eos_token_ids = frozenset(self.loaded.eos_token_ids)
        grammars = GrammarCache(self.loaded.tokenizer, self.vocab_size, self.eos_token_ids)
        self.sampler = Sampler(config.seed, self.eos_token_ids, StructuredOutputs(grammars))
        self.speculator = Speculator(config.speculative, self.blocks, config.max_num_batched_tokens) if config.speculative.enabled else None
        self._requests: dict[str, Sequence] = {}
        self._pending_outputs: list[RequestOutput] = []
        self.counters = StepCounters()
        cpu = cpu_info()
        log.info("engine ready: %s, %s on %s, %d KV blocks (%.0f MiB); CPU %s, features %s", self.loaded.path, self.loaded.dtype,
                 config.device, num_blocks, self.kv_cache.nbytes / 2**20, cpu.model, ",".join(cpu.features) or "none")

    # ---- request intake ------------------------------------------------------------------------
    def add_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, *, prefill_only: bool = False, priority: int = 0,
        reuse_cached: bool = True,
    ) -> None:
        """`priority`: higher is admitted first and preempted last (engine.sequence.PRIORITY_RANGE); `reuse_cached`
        False computes the whole prompt, taking nothing from the prefix cache."""
        seq = self._new_sequence(request_id, prompt_token_ids, params, prefill_only, priority)
        seq.reuse_cached = reuse_cached
        self._requests[request_id] = seq
        self.scheduler.add(seq)

    def add_remote_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                           priority: int = 0) -> RemoteReservation | None:
        """Reserve blocks for a prompt whose KV will arrive from a prefill worker (those of its leading
        blocks this pool already holds are reused, not received), or None when the pool (or the KV policy)
        has no room now (backpressure)."""
        seq = self._new_sequence(request_id, prompt_token_ids, params, False, priority)
        if not self.scheduler.reserve_remote(seq):
            return None
        self._requests[request_id] = seq
        return RemoteReservation(list(seq.block_ids), seq.num_cached_tokens, seq.num_prompt_tokens, self.blocks.block_size)

    def accept_first_token(self, request_id: str, first: Sample) -> RequestOutput:
        """The prompt's KV is in the request's blocks and the prefill worker sampled `first` (with its
        logprobs when asked): append it and return the request's first output. This touches only that
        request, which no step schedules before `commit_remote_kv`, so the async front may call it the
        moment the KV is validated instead of waiting for the next step boundary."""
        seq = self._requests.get(request_id)
        if seq is None or seq.state is not RequestState.WAITING_FOR_REMOTE_KV or seq.output_token_ids:
            raise InvalidRequestError("request_id", f"{request_id!r} is not waiting for remote KV")
        seq.num_computed_tokens = seq.num_prompt_tokens
        out = RequestOutput(request_id, num_prompt_tokens=seq.num_prompt_tokens)
        self._emit(seq, first, out)
        return out

    def commit_remote_kv(self, request_id: str) -> None:
        """After `accept_first_token`: the prompt's blocks join the prefix cache and the request runs
        from the next step (or is freed, when its first token already finished it)."""
        seq = self._requests.get(request_id)
        if seq is None:
            return  # aborted in between
        self.blocks.commit_computed(seq)
        self._fork(seq)
        if seq.state.finished:
            self.scheduler.remove(seq)
            self._finish(seq)
        else:
            self.scheduler.add_running(seq)

    def abort(self, request_id: str) -> None:
        """Abort every live sequence of the request (and the forks it has not made yet)."""
        group = [s for s in self._requests.values() if s.group_id == request_id]
        indexes = [s.index for s in group] + [i for s in group for i in range(s.index + 1, s.index + 1 + s.forks_pending)]
        for seq in group:
            self.scheduler.remove(seq)
            seq.state = RequestState.FINISHED_ABORTED
            self._finish(seq)
        prompt = group[0].num_prompt_tokens if group else 0
        self._pending_outputs.extend(
            RequestOutput(request_id, index=i, finished=True, finish_reason=FinishReason.ABORT, num_prompt_tokens=prompt) for i in sorted(indexes)
        )

    def kv_events(self, snapshot: bool = False) -> list[BlockEvents]:
        """What the pool's prefix cache (and the second tier, if any) stored and evicted since the last call,
        one BlockEvents per tier; snapshots of both when asked or when either lost events."""
        snapshot = snapshot or self.blocks.events_lost or (self.tier is not None and self.tier.events_lost)
        pool = self.blocks.drain_events(snapshot)
        return [pool] if self.tier is None else [pool, self.tier.drain_events(pool.snapshot)]

    @property
    def num_pending_kv_events(self) -> int:
        return self.blocks.num_pending_events + (self.tier.num_pending_events if self.tier is not None else 0)

    def hold_prefix(self, request_id: str, token_ids: list[int]) -> bool:
        """Pin the cached blocks of a prefix (whole blocks) another worker pulls, until `release`; False:
        the prefix cache no longer holds all of it."""
        if request_id in self._requests:
            raise InvalidRequestError("request_id", f"{request_id!r} is already in the engine")
        seq = Sequence(request_id, list(token_ids), SamplingParams(max_tokens=1), prefill_only=True)
        if not token_ids or len(token_ids) % self.blocks.block_size or not self.blocks.pin(seq):
            return False
        seq.num_computed_tokens = seq.num_tokens
        self._requests[request_id] = seq
        return True

    def cache_received(self, request_id: str) -> None:
        """A prefix reserved with `add_remote_request` and pulled from another worker has landed: its blocks
        join the prefix cache and the reservation ends (the blocks stay cached, free to evict)."""
        seq = self._requests.pop(request_id, None)
        if seq is None:
            return
        seq.num_computed_tokens = seq.num_prompt_tokens
        self.blocks.commit_computed(seq)
        self.scheduler.remove(seq)
        self.blocks.free(seq)

    def prompt_kv(self, request_id: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Copies of every layer's K and V of a held prefill-only request's prompt, for sending."""
        seq = self._requests[request_id]
        return [self.kv_cache.read_tokens(layer, seq.block_ids, seq.num_prompt_tokens) for layer in range(self.layout.num_layers)]

    def release(self, request_id: str) -> None:
        """Free a prefill-only request's blocks once its KV has been sent (or given up on)."""
        seq = self._requests.pop(request_id, None)
        if seq is not None:
            self.blocks.free(seq)

    def close(self) -> None:
        """Stop the other ranks of a tensor-parallel engine, and empty the KV tier (its files go)."""
        if self.tier is not None:
            self.tier.close()
        if self.parallel is not None:
            self.parallel.close()
            self.parallel = None

    # ---- stepping ------------------------------------------------------------------------------
    def has_work(self) -> bool:
        return self.scheduler.num_unfinished > 0 or bool(self._pending_outputs)

    def step(self) -> list[RequestOutput]:
        outputs, self._pending_outputs = self._pending_outputs, []
        plan = self.scheduler.schedule()
        self.counters.preemptions += len(plan.preempted)
        if plan.empty:
            return outputs
        started, began = time.perf_counter(), time.monotonic()
        self._apply_num_threads()
        proposals = self.speculator.propose(plan.scheduled) if self.speculator else {}
        items = [s.step_item() for s in plan.scheduled]
        if proposals:
            items = Speculator.with_proposals(items, proposals)
        sends = self._sink_requests(plan.scheduled)
        hook = layer_hook(self.kv_cache, self.kv_sink, sends)
        if self.parallel is None:
            order, logits = self.runner.execute(items, hook)
        else:
            order, logits = self.parallel.run_step(self.runner, items, sends, hook)
        ordered = [plan.scheduled[i] for i in order]
        sampling = [s.seq for s in ordered if s.samples]
        if self.speculator:
            samples = self.speculator.sample(logits, self.sampler, sampling, [proposals.get(i, []) for i in order if plan.scheduled[i].samples])
        else:
            samples = [[sample] for sample in self.sampler.sample(logits, sampling)]
        seconds = time.perf_counter() - started
        prompt_tokens = self.counters.record(ordered, sum(map(len, samples)), seconds)
        if self.tier is not None and prompt_tokens * 2 >= sum(item.num_tokens for item in ordered):  # a step mostly of prompt
            self.tier.rates.observe_compute(seconds, prompt_tokens)
        if self.speculator:
            self.speculator.record_step(sum(item.num_tokens for item in items), len(proposals), seconds)
        for item in ordered:
            item.seq.first_step_at = item.seq.first_step_at or began
            item.seq.num_computed_tokens += item.num_tokens
            self.blocks.commit_computed(item.seq)
        for seq in sampling:
            self._fork(seq)
        for seq, accepted in zip(sampling, samples):
            out = RequestOutput(seq.group_id, index=seq.index, num_prompt_tokens=seq.num_prompt_tokens, num_cached_tokens=seq.num_cached_tokens,
                                first_step_at=seq.first_step_at)
            self._emit_all(seq, accepted, out)
            if seq.state.finished:
                self.scheduler.remove(seq)
                self._finish(seq)
                if seq.state is RequestState.FINISHED_PREFILLED and self.kv_sink is None:
                    out.prompt_kv = self.prompt_kv(seq.request_id)
            outputs.append(out)
        return outputs

    def stats(self) -> EngineStats:
        waiting = list(self.scheduler.waiting)
        return EngineStats(
            num_waiting=len(waiting),
            num_running=len(self.scheduler.running),
            num_waiting_for_kv=sum(1 for s in self._requests.values() if s.state is RequestState.WAITING_FOR_REMOTE_KV),
            num_held=sum(1 for s in self._requests.values() if s.state is RequestState.FINISHED_PREFILLED),
            waiting_for_kv_blocks=sum(len(s.block_ids) for s in self._requests.values() if s.state is RequestState.WAITING_FOR_REMOTE_KV),
            queued_prompt_tokens=sum(s.num_uncomputed_tokens for s in waiting),
            free_blocks=self.blocks.num_free_blocks,
            total_blocks=self.blocks.num_blocks,
            prefix_hit_tokens=self.blocks.prefix_stats.hit_tokens,
            prefix_query_tokens=self.blocks.prefix_stats.query_tokens,
            num_preemptions=self.counters.preemptions,
            steps=self.counters.steps,
            step_seconds=self.counters.step_seconds,
            prompt_tokens=self.counters.prompt_tokens,
            generation_tokens=self.counters.generation_tokens,
            prompt_steps=self.counters.prompt_steps,
            prompt_step_seconds=self.counters.prompt_step_seconds,
            **self._spec_stats(),
        )

    def _spec_stats(self) -> dict[str, int]:
        if self.speculator is None:
            return {}
        s = self.speculator.stats
        return {"spec_proposed_tokens": s.proposed_tokens, "spec_accepted_tokens": s.accepted_tokens, "spec_steps": s.steps}

    # ---- internals -----------------------------------------------------------------------------
    def _apply_num_threads(self) -> None:
        """torch's intra-op thread count is process-wide: re-apply ours if anything else changed it
        (on a small shared VM, one thread too many turns every parallel op into a scheduling wait)."""
        n = self.config.num_threads
        if n and torch.get_num_threads() != n:
            torch.set_num_threads(n)

    def _new_sequence(self, request_id: str, prompt: list[int], params: SamplingParams, prefill_only: bool, priority: int) -> Sequence:
        if request_id in self._requests:
            raise InvalidRequestError("request_id", f"{request_id!r} is already in the engine")
        if not prompt:
            raise InvalidRequestError("prompt", "must contain at least one token")
        if any(not isinstance(t, int) or t < 0 or t >= self.vocab_size for t in prompt):
            raise InvalidRequestError("prompt_token_ids", f"every id must be an integer in [0, {self.vocab_size})")
        params.validate(self.vocab_size)
        check_priority(priority)
        if params.structured is not None:
            self.sampler.structured.check(params.structured)
        total = len(prompt) + (1 if prefill_only else params.max_tokens)
        if total > self.max_model_len:
            raise InvalidRequestError(
                "max_tokens", f"prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens}) exceeds the model's context of {self.max_model_len}"
            )
        capacity = self.blocks.num_blocks * self.blocks.block_size
        if self.blocks.blocks_for_tokens(total) > self.blocks.num_blocks:
            raise InvalidRequestError("max_tokens", f"prompt + max_tokens ({total} tokens) exceeds this worker's KV capacity of {capacity} tokens")
        forks = 0 if prefill_only else params.n - 1
        if self.blocks.blocks_for_tokens(total) + forks * (self.blocks.blocks_for_tokens(params.max_tokens) + 1) > self.blocks.num_blocks:
            raise InvalidRequestError("n", f"n ({params.n}) sequences of max_tokens ({params.max_tokens}) after the prompt exceed this worker's KV capacity of {capacity} tokens")
        return Sequence(request_id, list(prompt), params, prefill_only=prefill_only, forks_pending=forks, priority=priority)

    def _fork(self, seq: Sequence) -> None:
        """Sequence 0's prompt is computed: start its pending siblings from its full prompt blocks."""
        if not seq.forks_pending:
            return
        shared = (seq.num_prompt_tokens - 1) // self.blocks.block_size
        for index in range(1, seq.forks_pending + 1):
            child = seq.fork(index, shared * self.blocks.block_size)
            self.blocks.share(seq, child, shared)
            self._requests[child.request_id] = child
            self.scheduler.add_running(child)
        seq.forks_pending = 0

    def _sink_requests(self, scheduled: list[ScheduledSeq]) -> list[SinkRequest]:
        """The prompts finishing prefill this step whose KV the sink wants layer by layer."""
        sink = self.kv_sink
        if sink is None:
            return []
        requests = []
        for s in scheduled:
            start = sink.wanted_from(s.seq.request_id) if s.samples and s.seq.prefill_only else None
            if start is not None:
                requests.append(SinkRequest(s.seq.request_id, s.seq.block_ids, s.seq.num_prompt_tokens, start))
        return requests

    def _emit(self, seq: Sequence, sample: Sample, out: RequestOutput) -> None:
        """Append a sampled token (and its logprobs, when asked) to the request and its output."""
        token_id = sample.token_id
        seq.append_token(token_id)
        out.new_token_ids.append(token_id)
        if sample.logprob is not None:
            out.logprobs.append(sample.logprob)
            out.top_logprobs.append(sample.top_logprobs)
        if seq.prefill_only:
            seq.state = RequestState.FINISHED_PREFILLED
        elif token_id in seq.params.stop_token_ids or (not seq.params.ignore_eos and token_id in self.eos_token_ids):
            seq.state = RequestState.FINISHED_STOPPED
        elif len(seq.output_token_ids) >= seq.params.max_tokens:
            seq.state = RequestState.FINISHED_LENGTH
        if seq.state.finished:
            out.finished = True
            out.finish_reason = seq.finish_reason

    def _emit_all(self, seq: Sequence, samples: list[Sample], out: RequestOutput) -> None:
        """Append a step's tokens one by one until one finishes the sequence. All but the last were
        verified proposals, whose KV this step computed; blocks past the tokens kept are freed."""
        for i, sample in enumerate(samples):
            if seq.state.finished:
                break
            self._emit(seq, sample, out)
            if i < len(samples) - 1:
                seq.num_computed_tokens += 1
        if len(samples) > 1 and not seq.state.finished:
            self.blocks.commit_computed(seq)
            self.blocks.shrink(seq, seq.num_tokens)

    def _finish(self, seq: Sequence) -> None:
        self.sampler.forget(seq.request_id)
        if self.speculator:
            self.speculator.forget(seq.request_id)
        if seq.state is RequestState.FINISHED_PREFILLED:
            return  # blocks held for the KV sender until release()
        self._requests.pop(seq.request_id, None)
        self.blocks.free(seq)
