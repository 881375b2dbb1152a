"""The router's KV index against real processes: a router (kv_aware policy, 2 s heartbeat timeout),
two prefill workers and one decode worker with the demo model, small KV pools (evictions) and a
cluster secret. After a load that evicts, the index equals every worker's prefix cache; a
stranger's events (wrong or no secret, unknown worker id, a former epoch) are refused; a restarted
router rebuilds the index from the workers' snapshots; a restarted worker starts over in a new epoch; a killed worker's entries are gone within one heartbeat (the index's
lease: two heartbeat intervals after the last one, before the worker leaves rotation) and
the next request that shares its prefix is served by the other worker, with the same greedy tokens.
Every test ends with no KV block leaked.
"""

from __future__ import annotations

import random
import time

import grpc
import pytest

from bench.cluster import Proc, start_process, stop_process, write_config
from common.block_hash import chain_hashes
from common.security import Security
from proto.pdserve.v1 import pdserve_pb2 as pb
from proto.pdserve.v1 import pdserve_pb2_grpc as pb_grpc
from tests.conftest import wait_until

pytestmark = pytest.mark.timeout(600)

SECRET = "kv-index-test-secret-0123456789abcdef"
MD = Security(secret=SECRET).call_metadata()
WRONG_MD = Security(secret="not-the-cluster-secret-0123456789").call_metadata()
BLOCK = 16
NUM_BLOCKS = 40  # 640 tokens a pool: the load below evicts
HEARTBEAT_TIMEOUT_S = 4.0  # rotation; heartbeats keep time during long engine steps (common/registration.py)
INDEX_LEASE_S = 2.0  # the router's heartbeat interval (1 s) twice: one heartbeat missed
MAX_NEW = 4


class Cluster:
    def __init__(self, config):
        self.config = config
        self.router: Proc | None = None
        self.workers: dict[str, Proc] = {}

    def start(self) -> Cluster:
        self.router = start_process("router", ["-m", "router", "-c", str(self.config), "--grpc-port", "0", "--http-port", "0"])
        for worker_id in ("decode-a", "prefill-a", "prefill-b"):
            self.start_worker(worker_id)
        wait_until(lambda: {w.worker_id for w in self.index().values() if w.exact} == set(self.workers), 60,
                   "every worker registered and sent its snapshot")
        return self

    def restart_router(self) -> None:
        """SIGKILL the router and start a new one on the same gRPC ports: the workers register again."""
        old = self.router
        old.popen.kill()
        old.popen.wait(10)
        self.router = start_process("router", ["-m", "router", "-c", str(self.config), "--grpc-port", str(old.ready["grpc_port"]),
                                               "--internal-port", str(old.ready["internal_port"]), "--http-port", "0"])

    def start_worker(self, worker_id: str, port: int = 0) -> Proc:
        role = worker_id.split("-")[0]
        self.workers[worker_id] = start_process(worker_id, [
            "-m", f"{role}_worker", "-c", str(self.config), "--router", self.router.ready["internal_address"],
            "--worker-id", worker_id, "--port", str(port)])
        return self.workers[worker_id]

    def stop(self) -> None:
        for proc in [*self.workers.values(), self.router]:
            if proc is not None:
                stop_process(proc)

    # ---- probes (the cluster secret on every internal call) ----------------------------------------
    def registry(self, channel: grpc.Channel) -> pb_grpc.RegistryStub:
        return pb_grpc.RegistryStub(channel)

    def index(self) -> dict[str, pb.KVIndexWorker]:
        with grpc.insecure_channel(self.router.ready["internal_address"]) as channel:
            reply = self.registry(channel).KVIndex(pb.KVIndexRequest(include_hashes=True), metadata=MD, timeout=10)
        return {w.worker_id: w for w in reply.workers}

    def stats(self, worker_id: str) -> pb.WorkerStats:
        proc = self.workers[worker_id]
        with grpc.insecure_channel(proc.address) as channel:
            stub = (pb_grpc.DecodeWorkerStub if worker_id.startswith("decode") else pb_grpc.PrefillWorkerStub)(channel)
            return stub.Stats(pb.StatsRequest(include_block_hashes=True), metadata=MD, timeout=10)

    def generate(self, prompt: list[int]) -> list[int]:
        request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), sampling=pb.SamplingParams(max_tokens=MAX_NEW, temperature=0.0))
        tokens = []
        with grpc.insecure_channel(self.router.address) as channel:
            for response in pb_grpc.RouterStub(channel).Generate(request, timeout=120):
                assert response.finish_reason != pb.FINISH_REASON_ERROR, response.error
                tokens.extend(response.chunk.token_ids)
        assert len(tokens) == MAX_NEW
        return tokens

    def assert_index_equals_caches(self, timeout: float = 15.0) -> dict[str, pb.KVIndexWorker]:
        """At quiescence (events flush every heartbeat interval) the index holds exactly each live worker's cache."""
        caches: dict[str, set[int]] = {}
        index: dict[str, pb.KVIndexWorker] = {}

        def equal() -> bool:
            caches.update({w: set(self.stats(w).cached_block_hashes) for w in self.live()})
            index.clear()
            index.update(self.index())
            return set(index) == set(caches) and all(index[w].exact and set(index[w].block_hashes) == caches[w] for w in caches)

        wait_until(equal, timeout, "the index equals every worker's cache")
        return index

    def live(self) -> list[str]:
        return [w for w, p in self.workers.items() if p.alive()]

    def assert_no_leaked_blocks(self, timeout: float = 15.0) -> None:
        def free() -> bool:
            return all(s.free_kv_blocks == s.total_kv_blocks and not s.running_requests for s in (self.stats(w) for w in self.live()))

        wait_until(free, timeout, "every live worker's KV blocks are free")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    config = write_config(tmp_path_factory.mktemp("kv_index") / "pdserve.yaml", transport="tcp",
                          engine={"num_kv_blocks": NUM_BLOCKS, "block_size": BLOCK},
                          router={"policy": "kv_aware", "heartbeat_timeout_s": HEARTBEAT_TIMEOUT_S, "local_prefill_threshold": 0},
                          security={"shared_secret": SECRET})
    c = Cluster(config)
    try:
        yield c.start()
    finally:
        c.stop()


RNG = random.Random(44)
CONVERSATIONS = [[RNG.randrange(100, 20000) for _ in range(200)] for _ in range(3)]
"""Three conversations; turn t sends the first 40 + 40 t tokens of one (growing prefixes)."""


def turn(conversation: int, t: int) -> list[int]:
    return CONVERSATIONS[conversation][: 40 + 40 * t]


def test_after_a_load_with_evictions_the_index_equals_every_workers_cache(cluster):
    for t in range(4):
        for c in range(len(CONVERSATIONS)):
            cluster.generate(turn(c, t))
    index = cluster.assert_index_equals_caches()
    chains = [chain_hashes(turn(c, 3), BLOCK) for c in range(len(CONVERSATIONS))]
    for c, chain in enumerate(chains):  # kv_aware sent each turn where the conversation's earlier turns were
        holders = [w for w in ("prefill-a", "prefill-b") if chain[0] in set(index[w].block_hashes)]
        assert len(holders) == 1 and set(chain) <= set(index[holders[0]].block_hashes), f"conversation {c}: {holders}"
    for _ in range(6):  # unrelated prompts push the conversations out of the small pools
        cluster.generate([RNG.randrange(100, 20000) for _ in range(200)])
    index = cluster.assert_index_equals_caches()
    held = set().union(*(set(index[w].block_hashes) for w in ("prefill-a", "prefill-b")))
    assert set().union(*chains) - held, "the load evicted nothing: the test proves less"
    assert all(index[w].blocks for w in index), {w: index[w].blocks for w in index}
    metrics = cluster_metrics(cluster)
    for worker_id, entry in index.items():
        assert metrics[("pdserve_kv_index_blocks", worker_id, "pool")] == entry.blocks
        assert metrics[("pdserve_kv_index_exact", worker_id, "")] == 1.0
    cluster.assert_no_leaked_blocks()


def cluster_metrics(cluster: Cluster) -> dict[tuple[str, str, str], float]:
    import requests
    from prometheus_client.parser import text_string_to_metric_families

    text = requests.get(f"http://127.0.0.1:{cluster.router.ready['http_port']}/metrics", timeout=10).text
    return {(s.name, s.labels.get("worker", ""), s.labels.get("tier", "")): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_a_strangers_kv_events_are_refused(cluster):
    before = cluster.assert_index_equals_caches()
    target = before["prefill-a"]
    forged = pb.KVEventBatch(worker_id="prefill-a", epoch=target.epoch, seq=target.applied_seq + 1,
                             events=[pb.KVEvent(stored=True, tier=pb.KV_TIER_POOL, block_hashes=[12345])])
    with grpc.insecure_channel(cluster.router.ready["internal_address"]) as channel:
        stub = cluster.registry(channel)
        for metadata in (WRONG_MD, None):  # another cluster's secret, none at all
            with pytest.raises(grpc.RpcError) as refused:
                stub.ReportKVEvents(forged, metadata=metadata, timeout=10)
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        unknown = pb.KVEventBatch(worker_id="prefill-z", epoch=target.epoch, seq=1, snapshot=True, events=forged.events)
        with pytest.raises(grpc.RpcError) as refused:
            stub.ReportKVEvents(unknown, metadata=MD, timeout=10)
        assert refused.value.code() == grpc.StatusCode.NOT_FOUND and "worker_id" in refused.value.details()
        stale = pb.KVEventBatch(worker_id="prefill-a", epoch=target.epoch - 1, seq=target.applied_seq + 1, events=forged.events)
        with pytest.raises(grpc.RpcError) as refused:
            stub.ReportKVEvents(stale, metadata=MD, timeout=10)
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "epoch" in refused.value.details()
    after = cluster.index()
    assert 12345 not in set().union(*(set(w.block_hashes) for w in after.values()))
    assert after["prefill-a"].epoch == target.epoch and after["prefill-a"].exact
    cluster.assert_no_leaked_blocks()


def test_a_restarted_router_rebuilds_the_index_from_the_workers_snapshots(cluster):
    before = cluster.assert_index_equals_caches()
    assert all(w.blocks for w in before.values())
    cluster.restart_router()
    after = cluster.assert_index_equals_caches(timeout=30.0)  # every worker registered again and sent its whole cache
    assert {w: after[w].blocks for w in after} == {w: before[w].blocks for w in before}
    assert all(after[w].epoch > before[w].epoch and after[w].applied_seq >= 1 for w in after)
    cluster.generate(turn(1, 4))
    cluster.assert_index_equals_caches()
    cluster.assert_no_leaked_blocks()


def test_a_restarted_worker_starts_a_new_epoch_and_its_former_blocks_are_gone(cluster):
    before = cluster.assert_index_equals_caches()
    old = before["prefill-b"]
    assert old.blocks > 0
    proc = cluster.workers["prefill-b"]
    port = proc.ready["grpc_port"]
    proc.popen.kill()
    proc.popen.wait(10)
    cluster.start_worker("prefill-b", port)  # same id, same address: a restart
    after = cluster.assert_index_equals_caches()
    assert after["prefill-b"].epoch != old.epoch and after["prefill-b"].blocks == 0  # the fresh process holds nothing yet
    with grpc.insecure_channel(cluster.router.ready["internal_address"]) as channel:
        late = pb.KVEventBatch(worker_id="prefill-b", epoch=old.epoch, seq=old.applied_seq + 1,
                               events=[pb.KVEvent(stored=True, tier=pb.KV_TIER_POOL, block_hashes=list(old.block_hashes))])
        with pytest.raises(grpc.RpcError) as refused:  # the former process's last batch, arriving late
            cluster.registry(channel).ReportKVEvents(late, metadata=MD, timeout=10)
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    cluster.assert_index_equals_caches()
    cluster.assert_no_leaked_blocks()


def test_a_killed_workers_entries_are_gone_within_one_heartbeat_and_nothing_is_routed_by_them(cluster):
    prompt = turn(0, 4)
    reference = cluster.generate(prompt)
    index = cluster.assert_index_equals_caches()
    hashes = chain_hashes(prompt, BLOCK)
    holder = next(w for w in ("prefill-a", "prefill-b") if hashes[0] in set(index[w].block_hashes))
    other = "prefill-b" if holder == "prefill-a" else "prefill-a"
    served_before = cluster.stats(other).prompt_tokens
    proc = cluster.workers[holder]
    proc.popen.kill()
    killed = time.monotonic()
    proc.popen.wait(10)
    wait_until(lambda: holder not in cluster.index(), INDEX_LEASE_S + 5.0, f"{holder}'s entries are dropped")
    dropped_after = time.monotonic() - killed
    assert dropped_after <= INDEX_LEASE_S + 1.0, f"the dead worker's entries lasted {dropped_after:.2f} s"
    assert cluster.generate(prompt) == reference  # the index pointed at the dead worker: the survivor computes it
    assert cluster.stats(other).prompt_tokens > served_before
    index = cluster.assert_index_equals_caches()
    assert holder not in index
    cluster.assert_no_leaked_blocks()
