"""deploy/docker/Dockerfile and the KubeRay manifests that run its image agree: what it copies exists and is every
package the wheel ships, its entrypoint is the CLI, its Ray is the clusters', the head runs the CPU build and GPU
workers the CUDA build, and docs/deploy.md has the command for each tag. (tests/image/test_container_image.py
builds and starts it where a container builder can run.)"""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "deploy" / "docker" / "Dockerfile"


def instructions() -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1] if " " in line.strip() else "")
            for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def args() -> dict[str, str]:
    return dict(value.split("=", 1) for kind, value in instructions() if kind == "ARG" and "=" in value)


def cluster() -> dict:
    return next(d for d in yaml.safe_load_all((REPO / "deploy" / "k8s" / "raycluster.yaml").read_text()) if d["kind"] == "RayCluster")


def containers(group: dict) -> list[dict]:
    return group["template"]["spec"]["containers"]


def test_what_the_image_copies_exists_and_is_every_package_the_wheel_ships():
    copied = set()
    for kind, value in instructions():
        if kind == "COPY":
            *sources, _ = value.split()
            for source in sources:
                assert (REPO / source).exists(), f"COPY {source}: not in the repository"
                copied.add(source)
    packages = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    assert {p.rstrip("*") for p in packages} <= copied, "a package the wheel ships is not copied into the image"
    assert "pyproject.toml" in copied


def test_the_entrypoint_is_the_cli_the_wheel_installs():
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    entry = next(json.loads(value) for kind, value in instructions() if kind == "ENTRYPOINT")
    assert entry[0] in scripts
    module, _, function = scripts[entry[0]].partition(":")
    assert function in (REPO / (module.replace(".", "/") + ".py")).read_text()


def test_ray_in_the_image_is_the_clusters():
    spec = cluster()["spec"]
    assert args()["RAY_VERSION"] == spec["rayVersion"]
    major_minor = ".".join(spec["rayVersion"].split(".")[:2])
    for group in [spec["headGroupSpec"], *spec["workerGroupSpecs"]]:
        for c in containers(group):
            assert c["image"].split(":")[-1].split("-")[:2] == ["0.1.0", f"ray{major_minor}"], c["image"]


def test_head_runs_the_cpu_build_and_gpu_workers_the_cuda_build_and_the_docs_build_both():
    spec = cluster()["spec"]
    deploy_md = (REPO / "docs" / "deploy.md").read_text()
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    for group in [spec["headGroupSpec"], *spec["workerGroupSpecs"]]:
        for c in containers(group):
            gpu = "nvidia.com/gpu" in c.get("resources", {}).get("limits", {})
            assert c["image"].endswith("-cuda") == gpu, c["image"]
            assert c["image"].split(":")[-1].startswith(version + "-")
            build = re.search(r"buildah bud -f deploy/docker/Dockerfile ((?:(?!buildah).)*?)-t " + re.escape(c["image"]) + r" \.", deploy_md, re.S)
            assert build is not None, f"docs/deploy.md has no build command for {c['image']}"
            assert ("TORCH_INDEX=https://download.pytorch.org/whl/cu" in build.group(1)) == gpu


def test_the_build_context_leaves_out_the_checkout_state():
    ignored = (REPO / ".dockerignore").read_text().split()
    assert {".git", ".venv", "bench/results"} <= set(ignored)
