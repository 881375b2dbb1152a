"""Measurement helpers of the benchmarks: timed regions (wall and own CPU time), tokens/s records,
progress bars, memory, and how busy the rest of the machine was during each phase (/proc/stat)."""

from __future__ import annotations

import os
import platform
import resource
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from tqdm import tqdm

from bench.history import git_commit
from common.hardware import cpu_info


class Machine:
    """How busy the rest of the machine was while a phase ran, from /proc/stat: CPU cores used by other
    processes and cores' worth of time the hypervisor gave to other guests (steal)."""

    def __init__(self) -> None:
        self.phases: dict[str, dict] = {}

    @staticmethod
    def _cpu_seconds() -> tuple[float, float] | None:
        """(busy, steal) seconds summed over all CPUs since boot."""
        try:
            with open("/proc/stat") as f:
                fields = [int(x) for x in f.readline().split()[1:9]]
        except (OSError, ValueError):
            return None
        fields += [0] * (8 - len(fields))
        user, nice, system, _idle, _iowait, irq, softirq, steal = fields
        tick = os.sysconf("SC_CLK_TCK")
        return (user + nice + system + irq + softirq) / tick, steal / tick

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        cpu0, wall0, own0 = self._cpu_seconds(), time.perf_counter(), own_cpu_seconds()
        load0 = os.getloadavg()[0]
        try:
            yield
        finally:
            wall = time.perf_counter() - wall0
            own = own_cpu_seconds() - own0
            cpu1 = self._cpu_seconds()
            other = steal = None
            if cpu0 is not None and cpu1 is not None:
                other = round(max(0.0, (cpu1[0] - cpu0[0] - own) / wall), 2)
                steal = round((cpu1[1] - cpu0[1]) / wall, 2)
            self.phases[name] = {
                "wall_s": round(wall, 3),
                "own_cpu_cores": round(own / wall, 2),
                "other_processes_cpu_cores": other,
                "hypervisor_steal_cores": steal,
                "loadavg_1m_start": round(load0, 2),
                "loadavg_1m_end": round(os.getloadavg()[0], 2),
            }

    def record(self) -> dict:
        return {"phases": self.phases, "load_note": _load_note(self.phases)}


def own_cpu_seconds() -> float:
    return time.process_time()  # all threads of this process


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def current_rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


class Clock:
    """Wall time and this process's CPU time (all threads) of a timed region."""

    def __init__(self) -> None:
        self.wall, self.cpu = time.perf_counter(), own_cpu_seconds()

    def stop(self) -> tuple[float, float]:
        return time.perf_counter() - self.wall, own_cpu_seconds() - self.cpu


def token_rate(tokens: int, wall: float, cpu: float) -> dict:
    """tokens/s of wall time (the figure) and tokens per CPU-second of this process: with one torch
    thread the latter hardly moves when other processes take CPU, so it shows what a busy machine hid."""
    return {
        "useful_tokens": tokens,
        "seconds": round(wall, 3),
        "cpu_seconds": round(cpu, 3),
        "tokens_per_s": round(tokens / wall, 2),
        "tokens_per_cpu_s": round(tokens / max(cpu, 1e-9), 2),
    }


def progress_bar(desc: str, total: int, unit: str = "tok") -> tqdm:
    return tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, dynamic_ncols=True, leave=True)


def machine_record() -> dict:
    """The host and the software versions (the CPU's model and the features that decide `dtype: auto`)."""
    import transformers

    return {
        **cpu_info().record(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "git_commit": git_commit(),
        "started_unix": int(time.time()),
    }


def _load_note(phases: dict[str, dict]) -> str:
    parts = [
        f"{name} {p['other_processes_cpu_cores']}+{p['hypervisor_steal_cores']}"
        for name, p in phases.items()
        if p["other_processes_cpu_cores"] is not None
    ]
    busiest = max(
        ((p["other_processes_cpu_cores"] or 0) + (p["hypervisor_steal_cores"] or 0) for p in phases.values()), default=0.0
    )
    verdict = "the machine was quiet" if busiest <= 0.25 else "figures of the busier phases are pessimistic (see tokens_per_cpu_s)"
    return f"CPU cores taken by other processes + hypervisor steal during each phase: {', '.join(parts) or 'unknown'}; {verdict}"
