"""The KV index's parts without processes: block names that agree across processes, the pool's
store/evict events, the router's index (apply, evict, epochs, gaps), the worker's reporter against
the real Registry servicer over gRPC, and the kv_aware policy's choices."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

from common.block_hash import ROOT, BlockEvents, chain_hashes, next_hash
from common.config import RouterConfig
from common.plugins import ROUTING_POLICIES
from common.registration import KVEventReporter, RegistrationLoop
from common.sampling import SamplingParams
from engine.block_manager import BlockManager
from engine.sequence import Sequence
from proto.pdserve.v1 import pdserve_pb2 as pb
from proto.pdserve.v1 import pdserve_pb2_grpc as pb_grpc
from router.kv_index import KVIndex, StaleEvents
from router.policy import make_policy
from router.pool import Worker, WorkerPool
from router.registry_service import RegistryService

BS = 4
REPO = Path(__file__).resolve().parents[2]


# ---- block names ---------------------------------------------------------------------------------
def test_chain_hashes_are_the_same_in_another_process_whatever_its_hash_seed():
    tokens = list(range(1000, 1037))
    here = chain_hashes(tokens, 16)
    code = "from common.block_hash import chain_hashes; print(chain_hashes(list(range(1000, 1037)), 16))"
    for seed in ("1", "2"):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                             env={**os.environ, "PYTHONHASHSEED": seed}, cwd=REPO).stdout
        assert eval(out) == here
    assert len(here) == 2 and here[0] == next_hash(ROOT, tokens[:16]) and here[1] == next_hash(here[0], tokens[16:32])


def test_chain_depends_on_the_whole_prefix():
    a, b = chain_hashes([1, 2, 3, 4, 5, 6, 7, 8], BS), chain_hashes([9, 2, 3, 4, 5, 6, 7, 8], BS)
    assert a[1] != b[1]  # same second block's tokens, different first block
    assert chain_hashes(list(range(10)), BS, max_blocks=1) == chain_hashes(list(range(10)), BS)[:1]


# ---- the pool's events ---------------------------------------------------------------------------
def run(bm: BlockManager, request_id: str, tokens: list[int]) -> Sequence:
    seq = Sequence(request_id, list(tokens), SamplingParams())
    assert bm.admit(seq, len(tokens)) is not None
    seq.num_computed_tokens = len(tokens)
    bm.commit_computed(seq)
    return seq


def test_block_manager_reports_stores_then_evictions_and_snapshots():
    bm = BlockManager(num_blocks=4, block_size=BS)
    first = list(range(8))
    bm.free(run(bm, "a", first))
    events = bm.drain_events()
    assert not events.snapshot and events.runs == [(True, chain_hashes(first, BS))]
    assert bm.drain_events().runs == []  # drained
    # another 4-block prompt takes every block: both cached blocks are evicted when reused
    second = list(range(100, 116))
    bm.free(run(bm, "b", second))
    events = bm.drain_events()
    stored = [h for s, hs in events.runs if s for h in hs]
    removed = [h for s, hs in events.runs if not s for h in hs]
    assert sorted(removed) == sorted(chain_hashes(first, BS)) and stored == chain_hashes(second, BS)
    assert sorted(bm.cached_hashes()) == sorted(chain_hashes(second, BS))
    snap = bm.drain_events(snapshot=True)
    assert snap.snapshot and sorted(snap.runs[0][1]) == sorted(bm.cached_hashes())
    bm.reset_prefix_cache()
    assert sorted(bm.drain_events().runs[0][1]) == sorted(chain_hashes(second, BS)) and bm.cached_hashes() == []


def test_undrained_events_past_the_cap_turn_the_next_drain_into_a_snapshot():
    bm = BlockManager(num_blocks=8, block_size=BS)
    bm.max_pending_events = 3
    bm.free(run(bm, "a", list(range(16))))  # 4 stores: one more than the cap
    events = bm.drain_events()
    assert events.snapshot and sorted(events.runs[0][1]) == sorted(bm.cached_hashes()) and len(bm.cached_hashes()) == 4
    bm.free(run(bm, "b", list(range(50, 54))))
    assert bm.drain_events().runs == [(True, chain_hashes(list(range(50, 54)), BS))]  # back to events


def test_block_events_group_runs_in_order():
    events = BlockEvents.of([(True, 1), (True, 2), (False, 1), (True, 1)])
    assert events.runs == [(True, [1, 2]), (False, [1]), (True, [1])] and events.num_hashes == 4


# ---- the index -----------------------------------------------------------------------------------
class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_index_applies_snapshot_stores_and_evictions_in_order():
    clock = Clock()
    index = KVIndex(clock)
    epoch = index.open("w")
    assert not index.entry("w").exact and index.lag_s(index.entry("w")) is None
    assert index.apply("w", epoch, 1, True, [(True, "pool", [1, 2, 3])]) is False
    clock.now += 2
    assert index.apply("w", epoch, 2, False, [(False, "pool", [2]), (True, "pool", [4]), (True, "host", [2])]) is False
    entry = index.entry("w")
    assert entry.exact and entry.blocks() == {1, 3, 4} and entry.blocks("host") == {2}
    assert (entry.stored, entry.removed) == (5, 1) and index.lag_s(entry) == 0
    assert index.leading_blocks("w", [1, 3, 9, 4]) == 2 and index.leading_blocks("w", [2, 1]) == 0
    assert index.holders(4) == ["w"] and index.holders(2) == [] and index.holders(2, "host") == ["w"]
    clock.now += 3
    assert index.lag_s(entry) == 3


def test_index_gap_turns_inexact_until_a_snapshot_and_duplicates_are_ignored():
    index = KVIndex()
    epoch = index.open("w")
    index.apply("w", epoch, 1, True, [(True, "pool", [1])])
    index.apply("w", epoch, 2, False, [(True, "pool", [2])])
    assert index.apply("w", epoch, 2, False, [(True, "pool", [99])]) is False  # duplicate: not applied twice
    assert index.entry("w").blocks() == {1, 2}
    assert index.apply("w", epoch, 5, False, [(True, "pool", [5])]) is True  # 3 and 4 lost
    entry = index.entry("w")
    assert not entry.exact and entry.missing_batches == 2 and entry.blocks() == {1, 2}  # the batch after a gap is not applied
    assert index.apply("w", epoch, 6, True, [(True, "pool", [7, 8])]) is False
    assert entry.exact and entry.missing_batches == 0 and entry.blocks() == {7, 8} and entry.applied_seq == 6


def test_index_refuses_unknown_workers_and_former_epochs_and_forgets_on_close():
    index = KVIndex()
    with pytest.raises(StaleEvents) as unknown:
        index.apply("nobody", 1, 1, True, [])
    assert unknown.value.field == "worker_id"
    old = index.open("w")
    index.apply("w", old, 1, True, [(True, "pool", [1, 2])])
    new = index.open("w")  # re-registered (restart): the former blocks are gone at once
    assert new > old and index.entry("w").blocks() == set() and index.leading_blocks("w", [1]) == 0
    with pytest.raises(StaleEvents) as stale:
        index.apply("w", old, 2, False, [(True, "pool", [3])])
    assert stale.value.field == "epoch" and index.entry("w").blocks() == set()
    index.close("w")
    assert index.entry("w") is None and index.epoch("w") is None and index.distinct_blocks() == 0


def test_an_entry_counts_only_while_its_workers_heartbeats_renew_its_lease():
    clock = Clock()
    index = KVIndex(clock, lease_s=2.0)
    epoch = index.open("w")
    index.apply("w", epoch, 1, True, [(True, "pool", [1, 2]), (True, "disk", [3])])
    clock.now += 1.5
    assert index.renew("w") == epoch  # a heartbeat: two more seconds
    clock.now += 1.9
    assert index.leading_blocks("w", [1, 2]) == 2 and index.lapse() == []
    clock.now += 0.2  # one heartbeat missed: the entry counts for nothing before anyone drops it
    assert index.entry("w") is None and index.epoch("w") is None and index.entries() == []
    assert index.leading_blocks("w", [1, 2]) == 0 and index.usable_blocks("w", [1, 2, 3]) == 0 and index.holders(1) == []
    assert index.distinct_blocks() == 0
    with pytest.raises(StaleEvents) as late:
        index.apply("w", epoch, 2, False, [(True, "pool", [4])])
    assert late.value.field == "worker_id"
    assert index.lapse() == ["w"] and index.lapse() == []
    assert index.renew("w") is None  # a late heartbeat finds no entry: the pool opens a new epoch


async def test_a_late_heartbeat_drops_the_entry_and_opens_a_new_epoch_while_the_worker_stays_in_rotation():
    pool = WorkerPool(heartbeat_timeout_s=5.0, heartbeat_interval_s=1.0)
    clock = Clock()
    pool.kv_index = KVIndex(clock, lease_s=2.0)
    pool.add("p0", "prefill", "127.0.0.1:1")
    epoch = pool.heartbeat("p0", None)
    pool.kv_index.apply("p0", epoch, 1, True, [(True, "pool", [1])])
    clock.now += 2.5  # its heartbeat is late by more than an interval; the worker is not yet expired
    pool.expire()
    assert pool.kv_index.entry("p0") is None and pool.workers["p0"].healthy
    new = pool.heartbeat("p0", None)
    assert new is not None and new != epoch and pool.kv_index.entry("p0").blocks() == set()
    assert WorkerPool(heartbeat_interval_s=0.5).kv_index.lease_s == 1.0
    await pool.close()


def test_index_epochs_never_repeat_across_index_instances():
    assert KVIndex().open("w") < KVIndex().open("w")


# ---- the pool drops a worker's entries whenever it leaves rotation ---------------------------------
async def test_pool_drops_entries_on_expiry_failure_and_removal_and_a_heartbeat_opens_a_new_epoch():
    pool = WorkerPool(heartbeat_timeout_s=5.0)
    worker = pool.add("p0", "prefill", "127.0.0.1:1")
    epoch = pool.kv_index.open("p0")
    pool.kv_index.apply("p0", epoch, 1, True, [(True, "pool", [1])])
    worker.last_seen -= 10
    pool.expire()
    assert pool.kv_index.entry("p0") is None and not worker.healthy
    new = pool.heartbeat("p0", None)
    assert new is not None and new != epoch and pool.kv_index.epoch("p0") == new and worker.healthy
    assert pool.heartbeat("p0", None) == new  # steady
    pool.mark_failed(worker)
    assert pool.kv_index.entry("p0") is None
    pool.heartbeat("p0", None)
    pool.remove("p0")
    assert pool.kv_index.entry("p0") is None and pool.heartbeat("p0", None) is None
    await pool.close()


# ---- the reporter against the Registry servicer, over gRPC -----------------------------------------
class FakeEngine:
    """What the reporter reads of engine.AsyncEngine: a pool's events, here a BlockManager's."""

    def __init__(self, bm: BlockManager):
        self.bm = bm

    @property
    def pending_kv_events(self) -> int:
        return self.bm.num_pending_events

    async def kv_events(self, snapshot: bool = False) -> list[BlockEvents]:
        return [self.bm.drain_events(snapshot)]


@pytest.fixture
async def registry():
    pool = WorkerPool()
    server = grpc.aio.server()
    pb_grpc.add_RegistryServicer_to_server(RegistryService(pool), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    yield pool, pb_grpc.RegistryStub(channel)
    await channel.close()
    await server.stop(None)
    await pool.close()


async def test_reporter_keeps_the_index_equal_to_the_pool_through_evictions_and_a_lost_batch(registry):
    pool, stub = registry
    reply = await stub.Register(pb.RegisterRequest(worker=pb.WorkerInfo(worker_id="p0", role=pb.ROLE_PREFILL, address="127.0.0.1:9")))
    assert reply.epoch
    bm = BlockManager(num_blocks=6, block_size=BS)
    reporter = KVEventReporter(FakeEngine(bm), "p0", stub)
    reporter.begin(reply.epoch)
    await reporter.send()  # the first batch of an epoch: a snapshot (empty here)
    assert pool.kv_index.entry("p0").exact

    def index_blocks() -> set[int]:
        return pool.kv_index.entry("p0").blocks()

    for i in range(5):  # each 16-token prompt takes 4 of 6 blocks: earlier prompts get evicted
        bm.free(run(bm, f"r{i}", list(range(100 * i, 100 * i + 16))))
        await reporter.send()
        assert index_blocks() == set(bm.cached_hashes())
    assert pool.kv_index.entry("p0").removed > 0
    # a batch the router never saw: the next one is a gap, the router asks for a snapshot
    bm.free(run(bm, "lost", list(range(900, 912))))
    bm.drain_events()
    reporter.seq += 1
    bm.free(run(bm, "after", list(range(700, 708))))
    await reporter.send()
    assert reporter.snapshot_due and not pool.kv_index.entry("p0").exact
    await reporter.send()
    assert pool.kv_index.entry("p0").exact and index_blocks() == set(bm.cached_hashes())


async def test_registry_refuses_events_of_strangers_and_former_registrations(registry):
    pool, stub = registry
    info = pb.WorkerInfo(worker_id="d0", role=pb.ROLE_DECODE, address="127.0.0.1:9")
    old = (await stub.Register(pb.RegisterRequest(worker=info))).epoch
    await stub.ReportKVEvents(pb.KVEventBatch(worker_id="d0", epoch=old, seq=1, snapshot=True,
                                              events=[pb.KVEvent(stored=True, tier=pb.KV_TIER_POOL, block_hashes=[1, 2])]))
    with pytest.raises(grpc.aio.AioRpcError) as unknown:
        await stub.ReportKVEvents(pb.KVEventBatch(worker_id="stranger", epoch=old, seq=1, snapshot=True))
    assert unknown.value.code() == grpc.StatusCode.NOT_FOUND and "worker_id" in unknown.value.details()
    new = (await stub.Register(pb.RegisterRequest(worker=info))).epoch  # the same id registers again: a restart
    assert new != old and pool.kv_index.entry("d0").blocks() == set()
    with pytest.raises(grpc.aio.AioRpcError) as stale:
        await stub.ReportKVEvents(pb.KVEventBatch(worker_id="d0", epoch=old, seq=2,
                                                  events=[pb.KVEvent(stored=True, tier=pb.KV_TIER_POOL, block_hashes=[3])]))
    assert stale.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "epoch" in stale.value.details()
    with pytest.raises(grpc.aio.AioRpcError) as bad_tier:
        await stub.ReportKVEvents(pb.KVEventBatch(worker_id="d0", epoch=new, seq=1, snapshot=True, events=[pb.KVEvent(stored=True)]))
    assert bad_tier.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "events[0].tier" in bad_tier.value.details()
    view = await stub.KVIndex(pb.KVIndexRequest(include_hashes=True))
    assert [(w.worker_id, w.epoch, w.blocks, list(w.block_hashes)) for w in view.workers] == [("d0", new, 0, [])]
    await stub.Deregister(pb.DeregisterRequest(worker_id="d0"))
    assert not (await stub.KVIndex(pb.KVIndexRequest())).workers


def test_reporter_sends_once_events_wait_and_never_without_an_epoch():
    bm = BlockManager(num_blocks=1024, block_size=1)
    reporter = KVEventReporter(FakeEngine(bm), "p0", stub=None)
    assert not reporter.due(1.0)  # no epoch: a router without an index
    reporter.begin(7)
    assert reporter.due(1.0)  # the snapshot of a new epoch
    reporter.snapshot_due, reporter.sent_at = False, time.monotonic()
    assert not reporter.due(1.0)  # nothing changed, the interval not up
    bm.free(run(bm, "a", [1, 2, 3]))
    assert reporter.due(1.0)  # one stored block is enough: the index should not trail the cache
    bm.drain_events()
    assert not reporter.due(1.0)
    reporter.sent_at = time.monotonic() - 1.0
    assert reporter.due(1.0)  # and a batch goes every interval even without events
    reporter.begin(7)
    assert reporter.seq == 0 and not reporter.snapshot_due  # the same epoch again changes nothing


class FakeService:
    """A worker servicer as RegistrationLoop sees it: Stats for heartbeats, `engine` for KV events."""

    def __init__(self, bm: BlockManager):
        self.engine = FakeEngine(bm)

    async def Stats(self, request, context) -> pb.WorkerStats:
        return pb.WorkerStats(worker_id="p0")


@contextlib.asynccontextmanager
async def registry_server(heartbeat_interval_s: float = 0.25):
    """A Registry servicer over real gRPC on a pool heartbeating every `heartbeat_interval_s`: (pool, its port)."""
    pool = WorkerPool(heartbeat_interval_s=heartbeat_interval_s)
    server = grpc.aio.server()
    pb_grpc.add_RegistryServicer_to_server(RegistryService(pool), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield pool, port
    finally:
        await server.stop(None)
        await pool.close()


class BusyService(FakeService):
    """A worker whose Stats waits for long engine steps (four heartbeat intervals each)."""

    step_s = 1.0

    async def Stats(self, request, context) -> pb.WorkerStats:
        await asyncio.sleep(self.step_s)
        return pb.WorkerStats(worker_id="p0", running_requests=3)


async def test_a_busy_workers_heartbeats_keep_time_so_its_index_entry_never_lapses():
    bm = BlockManager(num_blocks=16, block_size=BS)
    bm.free(run(bm, "cached", list(range(8))))
    async with registry_server() as (pool, port):
        loop = RegistrationLoop(f"127.0.0.1:{port}", "prefill", "p0", "127.0.0.1:9", BusyService(bm), "m")
        loop.start()
        try:
            await wait_for(lambda: pool.kv_index.entry("p0") is not None and pool.kv_index.entry("p0").exact)
            epoch = pool.kv_index.epoch("p0")
            for _ in range(30):  # 3 s: three engine steps, twelve heartbeat intervals
                await asyncio.sleep(0.1)
                pool.expire()
                assert pool.kv_index.epoch("p0") == epoch, "the busy worker's entry lapsed"
            assert pool.workers["p0"].stats.running_requests == 3  # the stats read between steps still arrive
        finally:
            await loop.stop()


async def wait_for(condition, timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.02)


async def test_registration_loop_reports_and_rebuilds_its_entry_after_the_router_dropped_it():
    bm = BlockManager(num_blocks=16, block_size=BS)
    bm.free(run(bm, "before", list(range(8))))  # cached before registering: the first snapshot carries it
    async with registry_server() as (pool, port):
        loop = RegistrationLoop(f"127.0.0.1:{port}", "prefill", "p0", "127.0.0.1:9", FakeService(bm), "m")
        loop.start()
        try:
            def synced() -> bool:
                entry = pool.kv_index.entry("p0")
                return entry is not None and entry.exact and entry.blocks() == set(bm.cached_hashes())

            await wait_for(synced)
            first = pool.kv_index.epoch("p0")
            bm.free(run(bm, "more", list(range(100, 112))))
            await wait_for(synced)
            pool.mark_failed(pool.workers["p0"])  # out of rotation: the entry is gone at once
            assert pool.kv_index.entry("p0") is None
            await wait_for(synced)  # the next heartbeat opened a new epoch, the worker sent a snapshot
            assert pool.kv_index.epoch("p0") != first and pool.workers["p0"].healthy
        finally:
            await loop.stop()
    assert pool.kv_index.entry("p0") is None  # deregistered


# ---- kv_aware ------------------------------------------------------------------------------------
def workers(role: str, *ids: str) -> list[Worker]:
    return [Worker(i, role, f"{i}:1", channel=None, stub=None) for i in ids]


def holding(index: KVIndex, worker_id: str, hashes: list[int]) -> None:
    index.apply(worker_id, index.open(worker_id), 1, True, [(True, "pool", hashes)])


def test_kv_aware_is_registered_but_not_the_default():
    assert "kv_aware" in ROUTING_POLICIES
    assert RouterConfig().policy != "kv_aware"


def test_kv_aware_prefill_goes_where_the_prompts_kv_is_ready_first():
    index = KVIndex()
    policy = make_policy("kv_aware", BS, index)
    prompt = list(range(41))  # 10 full blocks
    hashes = chain_hashes(prompt, BS)
    a, b = workers("prefill", "a", "b")
    holding(index, "b", hashes[:8])  # b holds 32 of 41 tokens
    assert policy.choose("prefill", [a, b], prompt) is b
    # a would compute all 41 tokens and the 32 that b holds are charged once more: 73
    b.pending_prefill_tokens = 63  # b: 63 queued + 9 = 72 < 73
    assert policy.choose("prefill", [a, b], prompt) is b
    b.pending_prefill_tokens = 65  # b: 74 > 73: an idle cluster takes where the KV is ready first
    assert policy.choose("prefill", [a, b], prompt) is a
    a.in_flight = 1  # one prefill in flight in the pool: b's 32 tokens copied to a cost 41 + 2 x 32 = 105
    assert policy.choose("prefill", [a, b], prompt) is b
    a.in_flight, b.pending_prefill_tokens = 0, 0
    holding(index, "b", hashes[1:8])  # a chain without its first block is no prefix
    assert policy.choose("prefill", [b, a], prompt) is b  # equal cost: fewer routed first, then order
    a.routed = 1
    assert policy.choose("prefill", [a, b], prompt) is b


def test_kv_aware_decode_prefers_the_worker_holding_the_conversation_if_it_has_room_and_is_in_balance():
    index = KVIndex()
    policy = make_policy("kv_aware", BS, index)
    prompt = list(range(33))
    hashes = chain_hashes(prompt, BS)
    d0, d1, d2 = workers("decode", "d0", "d1", "d2")
    for w, free in ((d0, 90), (d1, 20), (d2, 50)):
        w.stats = pb.WorkerStats(free_kv_blocks=free, total_kv_blocks=100)
    assert policy.choose("decode", [d0, d1, d2], prompt) is d0  # nobody holds it: most free KV
    holding(index, "d1", hashes[:6])
    holding(index, "d2", hashes[:3])
    assert policy.choose("decode", [d0, d1, d2], prompt) is d1  # most leading blocks, though least free
    d1.in_flight = 1  # one request busier than the least loaded: still in balance
    assert policy.choose("decode", [d0, d1, d2], prompt) is d1
    d1.in_flight = 2  # out of balance (load 2 > 0 + 1): the next holder
    assert policy.choose("decode", [d0, d1, d2], prompt) is d2
    for w in (d0, d2):
        w.in_flight = 8  # a quarter of the least load: 8 + 2 = 10 >= d1's 10
    d1.in_flight = 10
    assert policy.choose("decode", [d0, d1, d2], prompt) is d1
    d0.in_flight = d1.in_flight = d2.in_flight = 0
    d1.stats = pb.WorkerStats(free_kv_blocks=1, total_kv_blocks=100)  # no room for the 10 - 6 = 4 blocks left
    assert policy.choose("decode", [d0, d1, d2], prompt) is d2
    index.close("d2")  # d2 left rotation: its blocks no longer count
    assert policy.choose("decode", [d0, d1, d2], prompt) is d0


def test_kv_aware_never_counts_the_prompts_last_token_as_cached():
    index = KVIndex()
    policy = make_policy("kv_aware", BS, index)
    prompt = list(range(8))  # exactly two blocks: the engine computes the last block again to sample
    a, b = workers("prefill", "a", "b")
    holding(index, "b", chain_hashes(prompt, BS))
    b.pending_prefill_tokens = 8  # b: 8 queued + (8 - 4) = 12 ties a's 8 + 4 b holds (counting both blocks: b 8 < a 16)
    assert policy.choose("prefill", [a, b], prompt) is a


# ---- what operators see ----------------------------------------------------------------------------
def test_status_and_metrics_show_index_size_exactness_and_lag():
    from deploy.commands import format_kv_index
    from router.metrics import RouterMetrics

    clock = Clock()
    index = KVIndex(clock)
    holding(index, "p0", [1, 2, 3])
    e1 = index.open("d0")
    index.apply("d0", e1, 1, True, [(True, "pool", [1])])
    index.apply("d0", e1, 4, False, [(True, "pool", [9])])  # 2 and 3 lost
    clock.now += 1.5
    lines = format_kv_index(index.summary({"p0": "prefill", "d0": "decode"}))
    assert lines[0] == "kv index 3 distinct block(s), 1/2 worker(s) exact"
    assert "3 block(s)  exact  lag 1.5 s" in lines[2] and "INEXACT (2 batch(es) missing)" in lines[1]
    metrics = RouterMetrics()
    p0, d0 = workers("prefill", "p0")[0], workers("decode", "d0")[0]
    metrics.observe_workers([p0, d0], index)
    text = metrics.render().decode()
    assert 'pdserve_kv_index_blocks{role="prefill",tier="pool",worker="p0"} 3.0' in text
    assert 'pdserve_kv_index_exact{role="decode",worker="d0"} 0.0' in text
    assert 'pdserve_kv_index_missing_batches{role="decode",worker="d0"} 2.0' in text
    assert 'pdserve_kv_index_lag_seconds{role="prefill",worker="p0"} 1.5' in text
    assert "pdserve_kv_index_distinct_blocks 3.0" in text
