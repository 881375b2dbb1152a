"""Build the CPU image of deploy/docker/Dockerfile with buildah and look inside it, where a container builder can run.

No image registry is reachable here, so the base is made from Debian packages: `debootstrap` a minimal bookworm
(python3, python3-venv) into a temporary directory and import it as localhost/pdserve-base:bookworm (kept in the
container storage for the next run; PDSERVE_IMAGE_BASE names another base). Python packages come from the local
mirror where the machine has one (/opt/pypi, /opt/wheels, mounted into the build read-only) and the default index. RUN steps use buildah's chroot isolation: here crun cannot create a container ("cgroups in hybrid mode not
supported"), and chroot isolation needs no cgroups. The image is inspected through a working container (its
entrypoint, Ray version, the packages a worker under Ray imports, the CLI) and removed at the end.
Needs root, buildah, and debootstrap with a Debian mirror unless the base exists; skipped otherwise.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from bench.cluster import REPO
from common.model_files import resolve_model_path

pytestmark = pytest.mark.timeout(2400)

BASE = os.environ.get("PDSERVE_IMAGE_BASE", "localhost/pdserve-base:bookworm")
IMAGE = "localhost/pdserve-test:0.1.0"
PROMPT = "What is the capital of France?"
MIRROR = [Path("/opt/pypi"), Path("/opt/wheels")]
HOST_CA = "/etc/ssl/certs/ca-certificates.crt"


def sh(*cmd: str, timeout: float = 1800, check: bool = True, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=check, **kw)


def have_image(name: str) -> bool:
    return sh("buildah", "inspect", "--type", "image", name, check=False).returncode == 0


def make_base(tmp: Path) -> None:
    """A minimal Debian bookworm from its packages, imported as BASE."""
    if shutil.which("debootstrap") is None:
        pytest.skip(f"no base image {BASE} and no debootstrap to make one")
    rootfs = tmp / "rootfs"
    made = sh("debootstrap", "--variant=minbase", "--include=python3,python3-venv,ca-certificates", "bookworm", str(rootfs),
              "http://deb.debian.org/debian", check=False, timeout=1200)
    if made.returncode != 0:
        pytest.skip(f"debootstrap could not make a base (no Debian mirror?): {made.stderr[-400:]}")
    tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
    imported = subprocess.run(["podman", "import", "-", BASE], stdin=tar.stdout, capture_output=True, text=True, timeout=600)
    tar.wait(60)
    assert imported.returncode == 0, imported.stderr


def build_args() -> list[str]:
    args, pip = ["--build-arg", f"BASE_IMAGE={BASE}"], []
    if all(p.exists() for p in MIRROR):
        pip += ["--extra-index-url file:///opt/pypi/simple --find-links /opt/wheels"]  # and the default index for the rest
        args += ["--build-arg", "TORCH_INDEX=file:///opt/pypi/simple", *(a for p in MIRROR for a in ("-v", f"{p}:{p}:ro"))]
    if Path(HOST_CA).exists():  # the host's CA bundle: a TLS-intercepting proxy may stand between it and the index
        pip += ["--cert /run/host-ca.crt"]
        args += ["-v", f"{HOST_CA}:/run/host-ca.crt:ro"]
    return args + ["--build-arg", f"PIP_ARGS={' '.join(pip)}"]


@pytest.fixture(scope="module")
def image(tmp_path_factory):
    if os.geteuid() != 0 or shutil.which("buildah") is None or shutil.which("podman") is None:
        pytest.skip("building the image needs root, buildah and podman (apt-get install buildah podman debootstrap)")
    if not have_image(BASE):
        make_base(tmp_path_factory.mktemp("base"))
    built = sh("buildah", "bud", "--isolation", "chroot", "--network", "host", "--layers", "-f", "deploy/docker/Dockerfile", *build_args(),
               "-t", IMAGE, ".", cwd=REPO, check=False, timeout=2000)
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    container = sh("buildah", "from", IMAGE).stdout.strip()
    try:
        yield container
    finally:
        sh("buildah", "rm", container, check=False)
        sh("buildah", "rmi", "-f", IMAGE, check=False)


def run(container: str, *cmd: str, volumes: tuple[str, ...] = (), timeout: float = 300) -> str:
    mounts = [a for v in volumes for a in ("-v", v)]
    done = sh("buildah", "run", "--isolation", "chroot", *mounts, container, "--", *cmd, check=False, timeout=timeout)
    assert done.returncode == 0, f"{cmd}: {done.stdout[-2000:]}{done.stderr[-2000:]}"
    return done.stdout


def test_the_image_is_what_the_manifests_expect(image):
    config = json.loads(sh("buildah", "inspect", "--type", "image", IMAGE).stdout)["OCIv1"]["config"]
    assert config["Entrypoint"] == ["pdserve"]
    assert config["User"] == "pdserve"
    ray_version = next(d for d in yaml.safe_load_all((REPO / "deploy/k8s/raycluster.yaml").read_text()) if d["kind"] == "RayCluster")["spec"]["rayVersion"]
    assert re.search(rf"\b{re.escape(ray_version)}\b", run(image, "ray", "--version"))
    for tool in ("bash", "wget", "g++"):  # KubeRay's command and probes; the CPU kernels' build
        run(image, "sh", "-c", f"command -v {tool}")


def test_the_installed_package_starts_a_worker_and_the_cli(image):
    where = run(image, "python", "-c", "import role_worker, deploy.actors, router.main, bench.cluster, engine; print(engine.__file__)")
    assert where.strip().startswith("/opt/pdserve/lib/"), where  # the installed wheel, not a checkout
    assert "serve" in run(image, "pdserve", "--help")
    assert "kv_cache_memory_mb" in run(image, "sh", "-c", "cat /opt/pdserve/lib/python3*/site-packages/deploy/configs/local.yaml")


def test_the_image_generates_what_the_checkout_generates(image, tmp_path):
    """The demo model, mounted as the manifests mount /models: greedy tokens from the installed image (its CPU kernels
    compiled inside it by its g++) equal those of this checkout on the same machine."""
    model = tmp_path / "smollm2-135m"
    host = subprocess.run([sys.executable, "-m", "deploy.cli", "generate", PROMPT, "--local", "--model", "smollm2-135m",
                           "--max-tokens", "8", "--json"], cwd=REPO, capture_output=True, text=True, timeout=900, check=True)
    shutil.copytree(resolve_model_path("smollm2-135m"), model)
    for path in [model, *model.iterdir()]:  # readable by the image's user
        path.chmod(0o755 if path.is_dir() else 0o644)
    inside = run(image, "pdserve", "generate", PROMPT, "--local", "--model", "/models/smollm2-135m", "--max-tokens", "8", "--json",
                 volumes=(f"{model}:/models/smollm2-135m:ro",), timeout=1200)
    assert _tokens(inside) == _tokens(host.stdout)


def _tokens(output: str) -> list[int]:
    return next(json.loads(line) for line in output.splitlines() if line.startswith("{"))["token_ids"]
