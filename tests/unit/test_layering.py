"""Imports go only down the layers, and the router's side of the house never loads torch.

The layers, bottom first (a module may import its own layer and the layers below it):

  0  proto (the generated pdserve.v1 stubs and        torch-free: config, security, serving,
     proto.convert), common                           registration, run_worker, plugin names, the
                                                      request types (errors, sampling, finish reason)
                                                      and where a model's files are
  1  engine                                           the model runtime (torch); engine.messages: its
                                                      outputs and stats as pdserve.v1 messages
  1  sim (engine's sibling: neither imports the other) the cluster simulator: torch-free, common/ only;
                                                      deploy (`pdserve plan`) and bench import it
  3  kvtransfer                                       needs engine (KVCache, KVLayout); engine never
                                                      imports kvtransfer (the KV layer sink is passed
                                                      in), so kvtransfer sits above engine
  4  prefill_worker, decode_worker                    siblings: neither imports the other
  4b role_worker                                      hosts both roles over one engine (role switch)
  5  router
  6  deploy                                           Ray, and the `pdserve` CLI on top
  7  bench                                            may import anything (tests are not checked)

Every import statement counts: module level, inside functions, and under `if TYPE_CHECKING:`
(a type-only import still couples the layers). Names resolved at run time from a table
(common/plugins.py, `pdserve bench NAME`) are data, not imports, and are not checked here;
test_plugins_resolve checks the tables instead.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from common.plugins import KV_TRANSPORTS, ROUTING_POLICIES, resolve

REPO = Path(__file__).resolve().parents[2]

LAYERS: list[tuple[str, ...]] = [
    ("proto", "common"),
    ("engine", "sim"),
    ("kvtransfer",),
    ("prefill_worker", "decode_worker"),
    ("role_worker",),
    ("router",),
    ("deploy",),
    ("bench",),
]
SIBLINGS = {"prefill_worker": "decode_worker", "decode_worker": "prefill_worker", "sim": "engine", "engine": "sim"}
RANK = {prefix: rank for rank, names in enumerate(LAYERS) for prefix in names}


def layer_of(module: str) -> str | None:
    """The most specific layer prefix `module` belongs to (None: not ours, e.g. torch)."""
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        prefix = ".".join(parts[:n])
        if prefix in RANK:
            return prefix
    return None


def production_modules() -> list[tuple[str, Path]]:
    found = []
    for top in {p for names in LAYERS for p in names if "." not in p}:
        for path in sorted((REPO / top).rglob("*.py")):
            if "_pb2" in path.name:
                continue
            parts = path.relative_to(REPO).with_suffix("").parts
            found.append((".".join(parts[:-1] if parts[-1] == "__init__" else parts), path))
    return found


def imported_modules(module: str, path: Path) -> list[tuple[int, str]]:
    """(line, module) of every import in the file, wherever it stands."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            out.append((node.lineno, base))
            out.extend((node.lineno, f"{base}.{alias.name}") for alias in node.names)  # `from pkg import submodule`
    return out


def upward_imports() -> list[str]:
    bad = []
    for module, path in production_modules():
        own = layer_of(module)
        for line, target in imported_modules(module, path):
            other = layer_of(target)
            if other is None or own == "bench":
                continue
            if RANK[other] > RANK[own] or SIBLINGS.get(own) == other:
                bad.append(f"{path.relative_to(REPO)}:{line}: {module} ({own}) imports from {other}")
    return sorted(set(bad))


def test_layers_cover_every_production_package():
    packages = {p.parent.name for p in REPO.glob("*/__init__.py")}
    assert packages - {"tests"} <= set(RANK), f"add {packages - set(RANK) - {'tests'}} to LAYERS"


def test_imports_only_go_down():
    assert upward_imports() == []


def test_the_package_ships_every_layer():
    """pyproject.toml's package list names every production package (role_worker was missing: a wheel could not start a worker)."""
    include = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"])
    assert {f"{top}*" for names in LAYERS for top in names if "." not in top} <= include


def test_nothing_that_ships_imports_tests():
    """tests/ is not in the package: a shipped module (bench included) importing it breaks an installed pdserve."""
    bad = [f"{path.relative_to(REPO)}:{line}: {target}" for module, path in production_modules()
           for line, target in imported_modules(module, path) if target == "tests" or target.startswith("tests.")]
    assert bad == []


def test_the_check_sees_function_level_and_type_checking_imports(tmp_path):
    """The walker must not miss an import hidden inside a function or under TYPE_CHECKING."""
    sample = tmp_path / "sample.py"
    sample.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import router.pool\n"
                      "def f():\n    from deploy import cli\n    from . import sibling\n")
    found = [m for _, m in imported_modules("common.sample", sample)]
    assert "router.pool" in found and "deploy.cli" in found and "common.sibling" in found


def test_plugins_resolve():
    """Every name the config accepts resolves to its implementation (the tables are data, not imports)."""
    from kvtransfer.transport.base import Transport
    from router.policy import RoundRobin

    for name in KV_TRANSPORTS:
        if name != "ucx":  # ucxx may be absent on a dev machine; its module path is checked below
            assert issubclass(resolve(KV_TRANSPORTS, name, "KV transport"), Transport)
    assert (REPO / "kvtransfer" / "transport" / "ucx.py").exists() and KV_TRANSPORTS["ucx"].endswith(":UcxTransport")
    for name in ROUTING_POLICIES:
        assert issubclass(resolve(ROUTING_POLICIES, name, "routing policy"), RoundRobin)
    with pytest.raises(ValueError, match="round_robin"):
        resolve(ROUTING_POLICIES, "random", "routing policy")


TORCH_FREE = """
import importlib, pkgutil, sys
import common, router, router.client
for info in pkgutil.iter_modules(common.__path__):  # common/ is torch-free, every module of it
    importlib.import_module(f"common.{info.name}")
from deploy import cli
# `pdserve generate --router` end to end, against a port nobody listens on: the client's real path
code = cli.main(["generate", "hi", "--router", "127.0.0.1:9", "--timeout", "5"])
heavy = sorted(m for m in ("torch", "ray", "transformers") if m in sys.modules)
print(code, ",".join(heavy) or "-")
"""


ROUTER_WITHOUT_TORCH = """
import asyncio, sys
import deploy.actors, deploy.controller  # what the router's (and the controller's) Ray actor process imports
import router.main
from common.config import load_config
from common.serving import ServerControl

async def run():
    control = ServerControl()
    control.bind()
    args = router.main.parse_args(["--host", "127.0.0.1", "--grpc-port", "0", "--http-port", "0", "--internal-port", "0"])
    server = asyncio.create_task(router.main.serve(load_config(None), args, control))
    while not control.is_ready.is_set() and not server.done():
        await asyncio.sleep(0.05)
    loaded = sorted(m for m in ("torch", "transformers.modeling_utils", "engine") if m in sys.modules)
    control.stop.set()
    await server
    return loaded, control.info

loaded, info = asyncio.run(run())
print(",".join(loaded) or "-", info.get("grpc_port", 0) > 0)
"""


def test_the_router_process_does_not_load_torch():
    """The router as `python -m router` and its Ray actor run it (config, tokenizer, both gRPC planes, HTTP), up to
    ready and stopped, with the modules of the actor classes imported."""
    result = subprocess.run([sys.executable, "-c", ROUTER_WITHOUT_TORCH], cwd=REPO, capture_output=True, text=True, timeout=180,
                            check=False)
    assert result.returncode == 0, result.stderr
    loaded, served = result.stdout.split()
    assert served == "True", result.stderr
    assert loaded == "-", f"the router loaded {loaded}"


def test_common_router_and_generate_client_do_not_load_torch():
    result = subprocess.run([sys.executable, "-c", TORCH_FREE], cwd=REPO, capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    code, heavy = result.stdout.split()
    assert code == "2", result.stderr  # the request failed (no router there) and was reported
    assert heavy == "-", f"loaded {heavy}"
