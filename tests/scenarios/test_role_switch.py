"""A worker switches role (decode -> prefill -> decode) under load, without a restart of its process.

Real processes: a router, one prefill worker, one decode worker and one role-switching worker
(`python -m role_worker`, starting as decode). Sixteen client streams send greedy requests back to
back while `pdserve role` switches the worker twice. No request fails, every output equals HF's
greedy `generate`, the router's registry holds the new role when the switch returns (it waits at most
one heartbeat interval for the re-registration) and routes by it, and no KV block leaked anywhere.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading

import grpc
import pytest

from bench.cluster import REPO, LocalCluster, start_process, write_config
from proto.pdserve.v1 import pdserve_pb2 as pb
from proto.pdserve.v1 import pdserve_pb2_grpc as pb_grpc
from tests.conftest import wait_until

STREAMS = 16
MAX_TOKENS = 24
SWITCHER = "switch0"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    config = write_config(tmp_path_factory.mktemp("role") / "pdserve.yaml", transport="ucx", engine={"dtype": "float32"})
    with LocalCluster(config, num_prefill=1, num_decode=1, register=True) as c:
        internal = c.router.ready["internal_address"]
        switcher = start_process(SWITCHER, ["-m", "role_worker", "--role", "decode", "-c", str(config), "--worker-id", SWITCHER,
                                            "--router", internal])
        c.decode.append(switcher)  # stopped and checked for leaks with the others
        wait_until(lambda: registry(c).get(SWITCHER) == "decode", 120, "the role worker registered as decode")
        yield c


def registry(cluster: LocalCluster) -> dict[str, str]:
    """The router's registry as its metrics publish it: worker id -> role, for workers in rotation."""
    return {labels["worker"]: labels["role"] for (name, items), value in cluster.metrics().items()
            if name == "pdserve_worker_healthy" and value == 1 for labels in [dict(items)]}


def routed(cluster: LocalCluster, worker: str, role: str) -> float:
    return cluster.metrics().get(("pdserve_worker_routed_requests", (("role", role), ("worker", worker))), 0.0)


def switch(cluster: LocalCluster, role: str, worker: str = SWITCHER) -> subprocess.CompletedProcess:
    """`pdserve role WORKER ROLE --router INTERNAL --json`, the real CLI in its own process."""
    return subprocess.run([sys.executable, "-c", "from deploy.cli import main; raise SystemExit(main())", "role", worker, role,
                           "--router", cluster.router.ready["internal_address"], "--json"],
                          cwd=REPO, capture_output=True, text=True, timeout=600)


class Streams:
    """STREAMS client threads, each sending greedy requests back to back until `stop`."""

    def __init__(self, address: str, prompts: list[list[int]]):
        self.address, self.prompts = address, prompts
        self.results: list[tuple[list[int], list[int], int]] = []
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(i,)) for i in range(STREAMS)]

    def __enter__(self) -> Streams:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(300)

    def _run(self, index: int) -> None:
        with grpc.insecure_channel(self.address) as channel:
            stub = pb_grpc.RouterStub(channel)
            n = index
            while not self._stop.is_set():
                ids = self.prompts[n % len(self.prompts)]
                n += STREAMS
                request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids), sampling=pb.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))
                try:
                    responses = list(stub.Generate(request, timeout=300))
                except grpc.RpcError as exc:
                    self.errors.append(f"stream {index}: {exc.code().name} {exc.details()}")
                    continue
                tokens = [t for r in responses for t in r.chunk.token_ids]
                self.results.append((ids, tokens, responses[-1].finish_reason))


def test_role_switch_twice_under_load(cluster, demo_prompt_ids, hf_greedy):
    prompts = demo_prompt_ids
    with Streams(cluster.router.address, prompts) as streams:
        wait_until(lambda: routed(cluster, SWITCHER, "decode") >= 2, 120, "the role worker decodes requests")
        to_prefill = switch(cluster, "prefill")
        assert to_prefill.returncode == 0, to_prefill.stderr
        assert json.loads(to_prefill.stdout)["role"] == "prefill"
        print("switch 1:", to_prefill.stdout.strip())  # drain and switch times (shown with -s; not asserted)
        # the router answers only once its registry holds the new role (waiting at most one heartbeat
        # interval); its metrics, refreshed every 0.5 s, show it next
        wait_until(lambda: registry(cluster).get(SWITCHER) == "prefill", 10, "the router's metrics show the new role")
        wait_until(lambda: routed(cluster, SWITCHER, "prefill") >= 2, 120, "the router routes prefills to the switched worker")

        to_decode = switch(cluster, "decode")
        assert to_decode.returncode == 0, to_decode.stderr
        assert json.loads(to_decode.stdout)["previous_role"] == "prefill"
        print("switch 2:", to_decode.stdout.strip())
        wait_until(lambda: registry(cluster).get(SWITCHER) == "decode", 10, "the router's metrics show the new role")
        wait_until(lambda: routed(cluster, SWITCHER, "decode") >= 2, 120, "the router routes decodes to the switched worker again")
    assert not streams.errors, streams.errors[:5]
    assert len(streams.results) >= STREAMS
    print(f"{len(streams.results)} requests over {STREAMS} streams, none failed")
    for ids, tokens, finish in streams.results:
        assert finish in (pb.FINISH_REASON_STOP, pb.FINISH_REASON_LENGTH)
        assert tokens == hf_greedy(tuple(ids), MAX_TOKENS)
    cluster.assert_no_leaked_blocks()


def test_bad_role_switches_name_the_field(cluster):
    unknown = switch(cluster, "decode", worker="nobody")
    assert unknown.returncode == 2 and "worker_id" in unknown.stderr and "nobody" in unknown.stderr
    bad_role = switch(cluster, "colocated")
    assert bad_role.returncode == 2 and "role" in bad_role.stderr and "colocated" in bad_role.stderr
    same = switch(cluster, "decode")
    assert same.returncode == 2 and "role: the worker is already a decode worker" in same.stderr
    fixed = switch(cluster, "prefill", worker=next(w for w, role in registry(cluster).items() if role == "prefill"))
    assert fixed.returncode == 2 and "cannot switch role" in fixed.stderr
    assert registry(cluster).get(SWITCHER) == "decode"
    cluster.assert_no_leaked_blocks()
