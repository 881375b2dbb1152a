"""engine.host_memory: large CPU tensors start on a huge page and, where Linux's transparent huge pages take
advice, are backed by huge pages; the KV pool and large parameters are allocated that way; with
`keep_freed_memory` a thread that makes and frees a step's tensors again and again stops faulting pages in."""

import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from engine import host_memory, linears
from engine.kv_cache import KVCache, KVLayout

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _huge_kib_at(address: int) -> int:
    """AnonHugePages of this process's mapping that holds `address` (/proc/self/smaps)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            start, end = (int(x, 16) for x in head.split("-"))
            inside = start <= address < end
        elif inside and head == "AnonHugePages:":
            return int(line.split()[1])
    raise AssertionError("no mapping holds the address")


def test_large_tensors_start_on_a_huge_page_and_small_ones_are_plain():
    big = host_memory.zeros((3, 1024, 1024), torch.float32)  # 12 MiB
    assert big.shape == (3, 1024, 1024) and big.dtype == torch.float32 and big.is_contiguous()
    assert big.data_ptr() % host_memory.HUGE_PAGE == 0
    assert torch.count_nonzero(big) == 0
    big[2, 1023, 1023] = 5.0
    assert big.sum().item() == 5.0
    small = host_memory.empty((16, 16), torch.bfloat16)
    assert small.shape == (16, 16) and small.dtype == torch.bfloat16


@pytest.mark.skipif(not THP.exists() or "[never]" in THP.read_text(),
                    reason="this kernel has transparent huge pages disabled, so no advice can give any")
def test_advised_memory_is_backed_by_huge_pages():
    tensor = host_memory.zeros((8 << 20,), torch.float32)  # 32 MiB, touched by zero_() after the advice
    assert _huge_kib_at(tensor.data_ptr()) >= 2048


def test_the_kv_pool_and_large_parameters_sit_on_huge_pages():
    layout = KVLayout(num_layers=2, num_kv_heads=3, head_dim=64, block_size=16, dtype=torch.float32)
    pool = KVCache(layout, num_blocks=256)  # 3 MiB per layer and kind
    assert all(t.data_ptr() % host_memory.HUGE_PAGE == 0 and torch.count_nonzero(t) == 0
               for t in pool.key_caches + pool.value_caches)

    model = nn.Linear(1024, 1024)  # a 4 MiB weight, on a cache line but not on a huge page
    model.weight.data = torch.randn(1024 * 1024 + 16)[16:].view(1024, 1024)
    before = model.weight.detach().clone()
    assert model.weight.data_ptr() % linears.ALIGNMENT == 0 and model.weight.data_ptr() % host_memory.HUGE_PAGE != 0
    assert linears.align_parameters(model) == 1
    assert model.weight.data_ptr() % host_memory.HUGE_PAGE == 0 and torch.equal(model.weight, before)
    assert linears.align_parameters(model) == 0


STEPS_IN_A_THREAD = """
import resource, sys, threading, torch
from engine import host_memory
torch.set_num_threads(1)
if sys.argv[1] == "keep":
    assert host_memory.keep_freed_memory()
faults = []
def steps():  # a step's activations: tensors of 12 and 4 MiB made, combined and freed
    for _ in range(20):
        before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
        a = torch.ones(3 << 20); b = torch.ones(1 << 20); c = a[: 1 << 20] + b; del a, b, c
        faults.append(resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before)
thread = threading.Thread(target=steps); thread.start(); thread.join()
print(sum(faults[-8:]))
"""


def _faults_in_the_last_steps(mode: str) -> int:
    """Page faults of the last 8 of 20 steps in a fresh process (malloc's settings are the process's)."""
    done = subprocess.run([sys.executable, "-c", STEPS_IN_A_THREAD, mode], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 0, done.stderr
    return int(done.stdout.split()[-1])


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="malloc's settings are glibc's (mallopt)")
def test_kept_freed_memory_ends_the_page_faults_of_each_step():
    assert _faults_in_the_last_steps("default") >= 8 * 3000  # glibc's own settings: 12 MiB faulted in every step
    assert _faults_in_the_last_steps("keep") < 100
