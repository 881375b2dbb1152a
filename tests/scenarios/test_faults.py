"""Faults under a steady load: 2 prefill + 2 decode workers registered with a router, real model.

One module-scoped cluster serves every scenario; each scenario leaves it healthy (killed workers
are replaced). Throughout a scenario a `SteadyLoad` keeps 16 streaming greedy Generate calls in
flight; at the end every call has either finished with exactly HF `generate`'s tokens or ended
with a clear error status (none ran into its deadline, none streamed a token HF would not have),
and no live worker holds a KV block. Scenarios, in file order:

  KV transfer faults      corrupt / truncate / drop / cut / delay injected on chosen requests
                          (PDSERVE_KV_FAULTS on both prefill workers, first attempt only)
  decode worker paused    SIGSTOP past the heartbeat timeout, out of rotation, SIGCONT, back
  decode worker killed    SIGKILL mid-decode (test hook stalls it after N tokens); migration
  prefill worker killed   SIGKILL mid-transfer (test hook stalls it after layer 10); retry
  router restarted        SIGKILL, new router on the same port; workers re-register

Each scenario writes its measured recovery time to faults.json in the results directory (tests/scenarios/conftest.py:
bench/results/faults.json when PDSERVE_RESULTS_DIR=bench/results).
"""

from __future__ import annotations

import datetime
import json
import signal
import statistics
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Self

import grpc
import pytest

from bench.cluster import LocalCluster, Proc, write_config
from proto.pdserve.v1 import pdserve_pb2 as pb
from proto.pdserve.v1 import pdserve_pb2_grpc as pb_grpc
from tests.conftest import wait_for, wait_until

pytestmark = pytest.mark.timeout(420)

TRANSPORT = "ucx"
MAX_TOKENS = 24
CONCURRENCY = 16
DEADLINE_S = 90.0
HEARTBEAT_TIMEOUT_S = 3.0
STALL_TIMEOUT_S = 5.0
KV_TIMEOUT_S = 12.0
COMMAND = ".venv/bin/pytest tests/scenarios/test_faults.py"

# First attempts only (`.0-`), so the router's retry succeeds; `badkv-` requests fail on every attempt.
KV_FAULTS = ("corrupt:corrupt-*.0-*:7,truncate:trunc-*.0-*:3,drop:drop-*.0-*:5,cut:cut-*.0-*:4,"
             "delay:delay-*:2:500,corrupt:badkv-*:7")
PREFILL_HOOK = "prefill.after_layer:10:pkill-*.0"
DECODE_HOOK = "decode.after_tokens:6:dkill-*.0"
CLEAR_CODES = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.INTERNAL}


# --- load -----------------------------------------------------------------------------------


@dataclass
class Outcome:
    request_id: str
    prompt: tuple[int, ...]
    started: float
    ended: float = 0.0
    tokens: list[int] = field(default_factory=list)
    finish: int = 0
    error: str = ""
    code: grpc.StatusCode | None = None

    @property
    def ok(self) -> bool:
        return self.code is None and self.finish in (pb.FINISH_REASON_STOP, pb.FINISH_REASON_LENGTH)


def generate(address: str, request_id: str, prompt: list[int], max_tokens: int = MAX_TOKENS) -> Outcome:
    """One streaming greedy Generate call, never raising: the outcome says how it ended."""
    outcome = Outcome(request_id, tuple(prompt), time.monotonic())
    request = pb.GenerateRequest(request_id=request_id, token_ids=pb.TokenIds(ids=prompt),
                                 sampling=pb.SamplingParams(max_tokens=max_tokens, temperature=0.0))
    try:
        with grpc.insecure_channel(address) as channel:
            for response in pb_grpc.RouterStub(channel).Generate(request, timeout=DEADLINE_S):
                outcome.tokens.extend(response.chunk.token_ids)
                if response.finish_reason:
                    outcome.finish, outcome.error = response.finish_reason, response.error.message
    except grpc.RpcError as exc:
        outcome.code, outcome.error = exc.code(), exc.details() or ""
    outcome.ended = time.monotonic()
    return outcome


class SteadyLoad:
    """Keeps `concurrency` streaming requests in flight (each slot sends its next request as soon as
    the previous one ended) until `stop()`; every outcome is kept."""

    def __init__(self, address: str, prompts: list[list[int]], concurrency: int = CONCURRENCY, tag: str = "load"):
        self.address, self.prompts, self.tag = address, prompts, tag
        self.outcomes: list[Outcome] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._slot, args=(i,), daemon=True) for i in range(concurrency)]

    def _slot(self, slot: int) -> None:
        n = 0
        while not self._stop.is_set():
            prompt = self.prompts[(slot + n) % len(self.prompts)]
            outcome = generate(self.address, f"{self.tag}-{slot}-{n}", prompt)
            self.outcomes.append(outcome)
            if not outcome.ok:
                time.sleep(0.2)  # e.g. the router is down: do not spin
            n += 1

    def __enter__(self) -> Self:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> list[Outcome]:
        self._stop.set()
        for thread in self._threads:
            thread.join(DEADLINE_S + 10)
        assert not any(t.is_alive() for t in self._threads), "a load request outlived its deadline"
        return self.outcomes

    def wait_ok(self, count: int, after: float = 0.0, timeout: float = 120.0) -> float:
        """Wait until `count` requests started after `after` finished OK; returns when the first did."""
        def first_of_enough() -> float | None:
            done = sorted(o.ended for o in list(self.outcomes) if o.ok and o.started >= after)
            return done[0] if len(done) >= count else None

        try:
            return wait_for(first_of_enough, timeout, f"{count} requests started after t={after:.1f} succeed")
        except AssertionError:
            raise AssertionError(f"fewer than {count} requests succeeded after t={after:.1f}: {summary(self.outcomes)}") from None


def summary(outcomes: list[Outcome]) -> dict:
    """Counts of how the requests ended, with the first message of each kind of failure (what a red run needs)."""
    errors: dict[str, int] = {}
    first_messages: dict[str, str] = {}
    for o in outcomes:
        if not o.ok:
            key = o.code.name if o.code else f"finish={o.finish}"
            errors[key] = errors.get(key, 0) + 1
            first_messages.setdefault(key, o.error[:300])
    ok = [o.ended - o.started for o in outcomes if o.ok]
    return {"requests": len(outcomes), "ok": len(ok), "errors": errors, "first_error_messages": first_messages,
            "median_ok_request_s": round(statistics.median(ok), 2) if ok else None}


def check_outcomes(outcomes: list[Outcome], hf_greedy) -> dict:
    """Zero lost requests: each finished == HF or ended with a clear error before its deadline, and
    no request streamed a token HF would not have (never garbage)."""
    for o in outcomes:
        reference = hf_greedy(o.prompt, MAX_TOKENS)
        assert o.code != grpc.StatusCode.DEADLINE_EXCEEDED and o.ended - o.started < DEADLINE_S, f"{o.request_id} hung: {o}"
        assert o.tokens == reference[: len(o.tokens)], f"{o.request_id}: tokens diverge from HF: {o.tokens} vs {reference}"
        if o.ok:
            assert o.tokens == reference, f"{o.request_id}: {o.tokens} != HF {reference}"
        else:
            assert o.error, f"{o.request_id} failed without a message: {o}"
            assert o.code in CLEAR_CODES or (o.code is None and o.finish == pb.FINISH_REASON_ERROR), o
    return summary(outcomes)


# --- observation and results ----------------------------------------------------------------


def worker_metric(cluster: LocalCluster, name: str, worker_id: str) -> float | None:
    """One sample of a per-worker router metric (pdserve_worker_healthy / _routed_requests)."""
    for (sample, labels), value in cluster.metrics().items():
        if sample == name and dict(labels).get("worker") == worker_id:
            return value
    return None


def healthy_workers(cluster: LocalCluster) -> set[str]:
    return {dict(labels)["worker"] for (sample, labels), value in cluster.metrics().items()
            if sample == "pdserve_worker_healthy" and value == 1}


def counter(cluster: LocalCluster, name: str) -> float:
    return sum(v for (sample, _), v in cluster.metrics().items() if sample == name)


def live_ids(cluster: LocalCluster) -> set[str]:
    return {p.ready["worker_id"] for p in [*cluster.prefill, *cluster.decode] if p.alive()}


def record(results_dir: Path, scenario: str, **values) -> None:
    """Merge one scenario's measurements into faults.json (bench/results/faults.json: the docs quote it)."""
    results = results_dir / "faults.json"
    data = json.loads(results.read_text()) if results.exists() else {}
    data.setdefault("scenarios", {})
    data.update({
        "command": COMMAND,
        "setup": f"2 prefill + 2 decode workers + router on 127.0.0.1, SmolLM2-135M fp32 CPU, kv_transfer.transport={TRANSPORT}, "
                 f"{CONCURRENCY} concurrent streaming requests of {MAX_TOKENS} tokens, heartbeat_timeout_s={HEARTBEAT_TIMEOUT_S}, "
                 f"kv_transfer.timeout_s={KV_TIMEOUT_S}",
    })
    values["recorded_at"] = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    data["scenarios"][scenario] = {k: round(v, 2) if isinstance(v, float) else v for k, v in values.items()}
    results.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def hooked(procs: list[Proc], marker: str, timeout: float = 120.0) -> Proc:
    """The process whose log shows `marker` (a test hook firing)."""

    def first() -> Proc | None:
        return next((p for p in procs if any(marker in line for line in list(p.log_lines))), None)

    wait_until(lambda: first() is not None, timeout, f"a process to log {marker!r}")
    return first()


# --- fixtures -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def prompts(demo_prompt_ids, hf_greedy) -> list[list[int]]:
    """The demo prompts, with HF references computed before any worker competes for the CPU."""
    for ids in demo_prompt_ids:
        hf_greedy(tuple(ids), MAX_TOKENS)
    return demo_prompt_ids


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, prompts):
    config = write_config(
        tmp_path_factory.mktemp("faults") / "c.yaml", transport=TRANSPORT,
        kv_transfer={"timeout_s": KV_TIMEOUT_S},
        router={"heartbeat_timeout_s": HEARTBEAT_TIMEOUT_S, "stall_timeout_s": STALL_TIMEOUT_S, "prefill_retries": 2, "max_migrations": 3, "max_queued_requests": 128},
    )
    env = {f"prefill{i}": {"PDSERVE_KV_FAULTS": KV_FAULTS, "PDSERVE_TEST_FAULT_POINT": PREFILL_HOOK} for i in range(2)}
    env |= {f"decode{i}": {"PDSERVE_TEST_FAULT_POINT": DECODE_HOOK} for i in range(2)}
    with LocalCluster(config, num_prefill=2, num_decode=2, register=True, process_env=env) as c:
        wait_until(lambda: healthy_workers(c) >= live_ids(c), 60, "all four workers in rotation", 0.5)
        yield c


def finish_scenario(cluster: LocalCluster, load: SteadyLoad, hf_greedy) -> dict:
    outcomes = load.stop()
    result = check_outcomes(outcomes, hf_greedy)
    cluster.assert_no_leaked_blocks(timeout=30)
    return result


def start_special(address: str, request_id: str, prompt: list[int]) -> tuple[threading.Thread, list[Outcome]]:
    box: list[Outcome] = []
    thread = threading.Thread(target=lambda: box.append(generate(address, request_id, prompt)), daemon=True)
    thread.start()
    return thread, box


# --- scenarios ------------------------------------------------------------------------------


def test_kv_transfer_faults_are_detected_and_retried(cluster, prompts, hf_greedy, results_dir):
    retries_before = counter(cluster, "pdserve_prefill_retries_total")
    special = {kind: prompts[i] for i, kind in enumerate(["corrupt", "trunc", "drop", "cut", "delay", "badkv"])}
    with SteadyLoad(cluster.router.address, prompts) as load:
        load.wait_ok(4)
        # `cut` closes its P->D connection, which the other transfers between the same two workers
        # share: it runs after them, so each fault is seen as itself
        waves = [[kind for kind in special if kind != "cut"], ["cut"]]
        results = {}
        for wave in waves:
            started = {kind: start_special(cluster.router.address, f"{kind}-1", special[kind]) for kind in wave}
            for thread, _ in started.values():
                thread.join(DEADLINE_S + 10)
            results.update({kind: box[0] for kind, (_, box) in started.items()})
        result = finish_scenario(cluster, load, hf_greedy)

    for kind in ("corrupt", "trunc", "drop", "cut", "delay"):
        o = results[kind]
        assert o.ok and o.tokens == hf_greedy(o.prompt, MAX_TOKENS), f"{kind}: {o}"
    bad = results["badkv"]
    assert bad.tokens == [], "corrupted KV must never turn into text"
    assert bad.finish == pb.FINISH_REASON_ERROR and "CHECKSUM" in bad.error.upper(), bad
    # the receivers saw each fault for what it is
    decode_log = [line for p in cluster.decode for line in p.log_lines if "KV transfer failed" in line]
    for kind, evidence in [("corrupt", "!= sent"), ("trunc", "carries"), ("drop", "not complete after")]:
        assert any(f"[{kind}-1.0-" in line and evidence in line for line in decode_log), (kind, decode_log)
    # a cut connection: the sender loses it; D either sees the disconnect first or the router's cancel
    # (P's failed Prefill reached the router first): both free the blocks, and the retry succeeded above
    prefill_log = [line for p in cluster.prefill for line in p.log_lines if "KV transfer failed" in line]
    assert any("[cut-1.0-" in line and "connection lost" in line for line in prefill_log), prefill_log
    assert any("[cut-1.0-" in line and ("disconnected" in line or "cancelled" in line) for line in decode_log), decode_log
    assert counter(cluster, "pdserve_prefill_retries_total") - retries_before >= 6  # 4 first attempts + badkv twice
    typical = statistics.median(o.ended - o.started for o in load.outcomes if o.ok)
    record(results_dir, "kv_transfer_faults", load=result, typical_request_s=typical,
           **{f"{kind}_request_s": results[kind].ended - results[kind].started for kind in special},
           what="e2e latency of the faulted request (detection + retry on a prefill worker) vs the median request")


def test_decode_worker_paused_leaves_and_rejoins_rotation(cluster, prompts, hf_greedy, results_dir):
    victim = cluster.decode[0]
    vid = victim.ready["worker_id"]
    stalls_before = counter(cluster, "pdserve_decode_stalls_total")
    with SteadyLoad(cluster.router.address, prompts) as load:
        load.wait_ok(4)
        stopped_at = cluster.send_signal(victim, signal.SIGSTOP)
        try:
            out_at = wait_until(lambda: worker_metric(cluster, "pdserve_worker_healthy", vid) == 0, 60, "the paused worker out of rotation")
            routed_out = worker_metric(cluster, "pdserve_worker_routed_requests", vid)
            # its streams go silent: after stall_timeout_s the router moves them to the other decode worker
            stalled_at = wait_until(lambda: counter(cluster, "pdserve_decode_stalls_total") > stalls_before, 60,
                                    "the paused worker's streams migrated")
            load.wait_ok(CONCURRENCY // 2, after=out_at)  # new requests succeed on the other decode worker
            assert worker_metric(cluster, "pdserve_worker_routed_requests", vid) == routed_out, "routed to a worker out of rotation"
        finally:
            resumed_at = cluster.send_signal(victim, signal.SIGCONT)
        back_at = wait_until(lambda: worker_metric(cluster, "pdserve_worker_healthy", vid) == 1, 60, "the resumed worker back in rotation")
        wait_until(lambda: worker_metric(cluster, "pdserve_worker_routed_requests", vid) > routed_out, 60, "new requests routed to it")
        load.wait_ok(CONCURRENCY, after=back_at)
        result = finish_scenario(cluster, load, hf_greedy)
    record(results_dir, "decode_paused", load=result, out_of_rotation_after_s=out_at - stopped_at,
           back_in_rotation_after_s=back_at - resumed_at, paused_for_s=resumed_at - stopped_at, its_streams_migrated_after_s=stalled_at - stopped_at,
           what="SIGSTOP -> router marks it unhealthy (heartbeat timeout) and moves its silent streams (stall timeout); "
                "SIGCONT -> next heartbeat puts it back")


def _kill_mid_request(cluster, prompts, hf_greedy, pool: str, request_id: str, prompt, hook: str, counter_name: str) -> dict:
    """Under steady load, SIGKILL the `pool` worker whose fault hook stalled `request_id` at `hook`,
    then start a replacement; the stalled request and every other one must still equal HF."""
    before = counter(cluster, counter_name)
    with SteadyLoad(cluster.router.address, prompts) as load:
        load.wait_ok(4)
        thread, box = start_special(cluster.router.address, request_id, prompt)
        victim = hooked(getattr(cluster, pool), f"test hook: pausing at {hook}")
        killed_at = cluster.send_signal(victim, signal.SIGKILL)
        first_ok = load.wait_ok(1, after=killed_at)
        thread.join(DEADLINE_S + 10)
        replaced_at = time.monotonic()
        fresh = cluster.replace(victim)
        joined_at = wait_until(lambda: worker_metric(cluster, "pdserve_worker_healthy", fresh.ready["worker_id"]) == 1, 60,
                               f"the replacement {pool} worker in rotation")
        load.wait_ok(CONCURRENCY, after=joined_at)
        result = finish_scenario(cluster, load, hf_greedy)
    killed = box[0]
    assert killed.ok and killed.tokens == hf_greedy(killed.prompt, MAX_TOKENS), killed
    assert counter(cluster, counter_name) > before
    return dict(load=result, first_new_success_after_s=first_ok - killed_at,
                victim_request_done_after_s=killed.ended - killed_at, replacement_joined_after_s=joined_at - replaced_at)


def test_decode_worker_killed_mid_decode_migrates(cluster, prompts, hf_greedy, results_dir):
    figures = _kill_mid_request(cluster, prompts, hf_greedy, "decode", "dkill-1", prompts[3], "decode.after_tokens",
                                "pdserve_migrations_total")
    record(results_dir, "decode_killed", **figures,
           what="SIGKILL mid-decode -> in-flight requests migrate; first request started after the kill completes")


def test_prefill_worker_killed_mid_transfer_is_retried(cluster, prompts, hf_greedy, results_dir):
    figures = _kill_mid_request(cluster, prompts, hf_greedy, "prefill", "pkill-1", prompts[6], "prefill.after_layer",
                                "pdserve_prefill_retries_total")
    record(results_dir, "prefill_killed", **figures,
           what="SIGKILL after layer 10 of 30 was sent -> the router retries the prefill on the other worker")


def test_router_restart_workers_reregister(cluster, prompts, hf_greedy, results_dir):
    with SteadyLoad(cluster.router.address, prompts) as load:
        load.wait_ok(4)
        killed_at = cluster.restart_router(signal.SIGKILL)
        ready_at = time.monotonic()
        registered_at = wait_until(lambda: healthy_workers(cluster) >= live_ids(cluster), 60, "all workers re-registered", 0.2)
        first_ok = load.wait_ok(1, after=killed_at)
        load.wait_ok(CONCURRENCY, after=registered_at)
        result = finish_scenario(cluster, load, hf_greedy)
    late = [o for o in load.outcomes if o.started >= registered_at]
    assert late and all(o.ok for o in late), summary(late)
    record(results_dir, "router_restarted", load=result, first_new_success_after_s=first_ok - killed_at,
           new_router_ready_after_s=ready_at - killed_at, workers_reregistered_after_s=registered_at - killed_at,
           what="SIGKILL the router, start a new one on the same gRPC port; in-flight requests end UNAVAILABLE")
