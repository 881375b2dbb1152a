"""pdserve as a user installs it: the wheel built from this checkout, installed into a fresh virtualenv
outside the checkout (pdserve's dependencies resolved by pip from the configured index, torch first, as
scripts/setup.sh does), run from a temporary directory: `pdserve serve` on the demo model, one gRPC request
(`pdserve generate --router`, == transformers' greedy tokens) and one OpenAI chat request, `pdserve status`,
a small `pdserve bench serve` run against the deployment, then a clean stop (SIGTERM: drained, exit 0).

`make test-package` runs it (CI: .ci/run). Phase times print with -s (building the wheel ~10 s, the
virtualenv ~5 min here, most of it unpacking torch and ray; `pdserve serve` up to 4 min the first time, its C++ kernels
compiled into the test's own cache); no assertion on time.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from common.serving import parse_ready
from common.tokenization import encode_prompt
from tests.conftest import hf_generate

REPO = Path(__file__).resolve().parents[2]
LEFT_OUT = ("bench/results/", "docs/", ".ci/")
"""Not needed to build the wheel (bench/results: 8 MB of measurements that do not ship)."""
PROMPT = "What is the capital of France?"
MAX_TOKENS = 12

pytestmark = pytest.mark.timeout(1500)


def phase(what: str, since: float) -> float:
    now = time.monotonic()
    print(f"[{now - since:6.1f} s] {what}", flush=True)
    return now


def run(cmd: list, cwd: Path, env: dict, timeout: float) -> subprocess.CompletedProcess:
    done = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    assert done.returncode == 0, f"{' '.join(map(str, cmd))} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done


def clean_env() -> dict:
    """This process's environment without what points into the checkout or its virtualenv."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    venv_bin = str(Path(sys.executable).parent)
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep) if p != venv_bin)
    return env


def copy_checkout(target: Path) -> None:
    """The files git knows here (tracked and new, not ignored), as a fresh clone with this tree's edits would have them."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO, capture_output=True,
                            check=True).stdout.decode().split("\0")
    for name in listed:
        source = REPO / name
        if name and not name.startswith(LEFT_OUT) and source.is_file():
            (target / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target / name)


def torch_spec() -> str:
    import torch

    return os.environ.get("PDSERVE_TORCH") or f"torch=={torch.__version__.split('+')[0]}"


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """bin/ of a fresh virtualenv holding the wheel and what it depends on."""
    root = tmp_path_factory.mktemp("package")
    env, t = clean_env(), phase("building the wheel from a copy of the checkout", time.monotonic())
    copy_checkout(root / "src")
    run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", root / "dist", root / "src"], root, env, 600)
    (wheel,) = (root / "dist").glob("pdserve-*.whl")
    t = phase(f"built {wheel.name}; creating a virtualenv and installing {torch_spec()}, then the wheel and its dependencies", t)
    base = getattr(sys, "_base_executable", sys.executable)
    run([base, "-m", "venv", root / "venv"], root, env, 300)
    pip = [root / "venv" / "bin" / "python", "-m", "pip", "install", "-q"]
    run([*pip, torch_spec()], root, env, 1200)
    run([*pip, wheel], root, env, 1200)
    phase("installed", t)
    return root / "venv" / "bin"


class Serve:
    """`pdserve serve` of the installed package, run from a temporary directory."""

    def __init__(self, bin_dir: Path, cwd: Path, env: dict):
        self.popen = subprocess.Popen([str(bin_dir / "pdserve"), "serve", "--grpc-port", "0", "--http-port", "0"], cwd=cwd, env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
        self.lines: list[str] = []
        self.ready: dict = {}
        self.got_ready = threading.Event()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        for line in self.popen.stdout:
            self.lines.append(line.rstrip())
            event = None if self.got_ready.is_set() else parse_ready(line)
            if event is not None and event.get("role") == "pdserve":
                self.ready.update(event)
                self.got_ready.set()

    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not self.got_ready.wait(0.5):
            assert self.popen.poll() is None and time.monotonic() < deadline, "pdserve serve did not start:\n" + "\n".join(self.lines[-60:])

    def stop(self, timeout_s: float) -> int:
        self.popen.send_signal(signal.SIGTERM)
        try:
            return self.popen.wait(timeout_s)
        finally:
            if self.popen.poll() is None:
                os.killpg(self.popen.pid, signal.SIGKILL)
                self.popen.wait(10)


def test_the_installed_wheel_serves_the_demo_model(installed, tmp_path, demo_model):
    # its own kernel build: torch's extension builder rebuilds a directory whose compile flags (the include paths of
    # another virtualenv's torch) changed, which would pull the checkout's build from under its running tests
    env = clean_env() | {"PDSERVE_KERNEL_CACHE": str(tmp_path / "kernels")}
    python = installed / "python"
    where = run([python, "-c", "import bench, common, decode_worker, deploy, engine, kvtransfer, prefill_worker, proto, role_worker, router;"
                 "import sys; print(deploy.__file__); print(role_worker.__file__); print(sys.path)"], tmp_path, env, 120).stdout.splitlines()
    site = str(installed.parent / "lib")
    assert where[0].startswith(site) and where[1].startswith(site), where
    assert str(REPO) not in where[2], "the checkout must not be on the installed package's sys.path"

    t = phase("pdserve serve", time.monotonic())
    serve = Serve(installed, tmp_path, env)
    try:
        serve.wait_ready(900)
        t = phase(f"ready: {serve.ready['grpc']} {serve.ready['http']}", t)
        generated = json.loads(run([installed / "pdserve", "generate", PROMPT, "--router", serve.ready["grpc"], "--max-tokens", MAX_TOKENS,
                                    "--json"], tmp_path, env, 300).stdout)
        prompt_ids = encode_prompt(demo_model.tokenizer, PROMPT)
        assert generated["prompt_token_ids"] == prompt_ids
        assert generated["token_ids"] == hf_generate(demo_model.model, prompt_ids, MAX_TOKENS)[:len(generated["token_ids"])]
        assert generated["text"].strip()

        body = json.dumps({"model": "smollm2-135m", "messages": [{"role": "user", "content": "Name three colors."}], "max_tokens": 8})
        request = urllib.request.Request(f"{serve.ready['http']}/v1/chat/completions", body.encode(), {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=300) as response:
            answer = json.loads(response.read())
        assert answer["choices"][0]["message"]["content"] and answer["usage"]["completion_tokens"] > 0

        out = tmp_path / "serve_bench.json"
        run([installed / "pdserve", "bench", "serve", "--grpc", serve.ready["grpc"], "--num-prompts", "3", "--input-len", "8:16",
             "--output-len", "4", "--seed", "1", "--no-progress", "--no-plots", "--out", out], tmp_path, env, 600)
        assert json.loads(out.read_text())["runs"][0]["metrics"]["completed"] == 3

        report = wait_idle(installed, serve.ready["ray_address"], tmp_path, env)
        workers = [w for pool in report["pools"].values() for w in pool["workers"]]
        assert len(workers) == 2 and all(w["health"] == "healthy" for w in workers), workers
        t = phase("served: gRPC, OpenAI, status, bench serve; stopping", t)
        code = serve.stop(180)
    finally:
        if serve.popen.poll() is None:
            serve.stop(30)
    assert code == 0, "\n".join(serve.lines[-40:])
    assert any("pdserve: stopped" in line for line in serve.lines), "\n".join(serve.lines[-40:])
    phase("stopped", t)


def wait_idle(installed: Path, ray_address: str, cwd: Path, env: dict, timeout_s: float = 30.0) -> dict:
    """`pdserve status` once no worker holds a KV block (no block leaked)."""
    deadline = time.monotonic() + timeout_s
    while True:
        report = json.loads(run([installed / "pdserve", "status", "--json", "--address", ray_address], cwd, env, 120).stdout)
        used = [w["kv_usage"] for pool in report["pools"].values() for w in pool["workers"]]
        if not any(used) or time.monotonic() > deadline:
            assert not any(used), f"KV blocks still held after the requests finished: {used}"
            return report
        time.sleep(1)
