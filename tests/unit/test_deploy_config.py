"""Deploy configuration: pools, router resources and the autoscaler section are validated with
field-named errors, and `pdserve serve -c bad.yaml` refuses to start before touching Ray."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import yaml

from bench.cluster import REPO
from common.config import AutoscalerConfig, ConfigError, config_from_dict, load_config
from deploy.commands import custom_resources, logical_cpus, parse_scale_targets


def test_default_config_has_autoscaler_and_router_resources():
    cfg = load_config()
    assert isinstance(cfg.autoscaler, AutoscalerConfig) and cfg.autoscaler.enabled is False
    assert cfg.autoscaler.prefill.queued_prompt_tokens_per_worker > 0 and 0 < cfg.autoscaler.decode.kv_usage <= 1
    assert cfg.router.num_cpus > 0
    # the embedded Ray can hold every pool at max_replicas plus the router, even on a 2-core machine
    needed = cfg.router.num_cpus + sum(p.max_replicas * p.num_cpus for p in (cfg.pools.prefill, cfg.pools.decode))
    assert logical_cpus(cfg) >= needed


def test_embedded_ray_declares_the_custom_resources_the_config_asks_for():
    cfg = config_from_dict({"router": {"resources": {"head": 1}},
                            "pools": {"decode": {"max_replicas": 3, "replicas": 1, "resources": {"fast_nic": 0.5}}}})
    assert custom_resources(cfg) == {"head": 1, "fast_nic": 1.5}


def test_autoscaler_section_loads_nested_fields():
    cfg = config_from_dict({"autoscaler": {"enabled": True, "interval_s": 0.5, "prefill": {"ttft_slo_s": 1.5},
                                           "decode": {"kv_usage": 0.5}}})
    assert cfg.autoscaler.enabled and cfg.autoscaler.interval_s == 0.5
    assert cfg.autoscaler.prefill.ttft_slo_s == 1.5 and cfg.autoscaler.decode.kv_usage == 0.5
    assert cfg.autoscaler.decode.itl_slo_s == AutoscalerConfig().decode.itl_slo_s


def test_port_overrides_are_validated():
    cfg = load_config().with_router_ports(0, 0)
    assert (cfg.router.grpc_port, cfg.router.http_port) == (0, 0)
    with pytest.raises(ConfigError) as info:
        load_config().with_router_ports(grpc_port=70000)
    assert info.value.field == "router.grpc_port"


BAD_CONFIGS = [
    ({"pools": {"decode": {"replicaz": 2}}}, "pools.decode.replicaz"),
    ({"autoscaler": {"bogus": 1}}, "autoscaler.bogus"),
    ({"autoscaler": {"prefill": {"bogus": 1}}}, "autoscaler.prefill.bogus"),
    ({"pools": {"prefill": {"replicas": -1}}}, "pools.prefill.replicas"),
    ({"pools": {"decode": {"min_replicas": -2}}}, "pools.decode.min_replicas"),
    ({"pools": {"decode": {"min_replicas": 3, "max_replicas": 2, "replicas": 2}}}, "pools.decode.min_replicas"),
    ({"pools": {"decode": {"min_replicas": 0, "replicas": 0}}}, "pools.decode.min_replicas"),
    ({"pools": {"prefill": {"num_cpus": 0, "num_gpus": 0}}}, "pools.prefill.num_cpus"),
    ({"pools": {"prefill": {"num_gpus": -1}}}, "pools.prefill.num_gpus"),
    ({"kv_transfer": {"transport": "smoke-signals"}}, "kv_transfer.transport"),
    ({"router": {"num_cpus": 0}}, "router.num_cpus"),
    ({"router": {"stall_timeout_s": -1}}, "router.stall_timeout_s"),
    ({"router": {"internal_port": 70000}}, "router.internal_port"),
    ({"router": {"internal_host": 5}}, "router.internal_host"),
    ({"autoscaler": {"enabled": "yes"}}, "autoscaler.enabled"),
    ({"autoscaler": {"interval_s": 0}}, "autoscaler.interval_s"),
    ({"autoscaler": {"interval_s": "fast"}}, "autoscaler.interval_s"),
    ({"autoscaler": {"upscale_cooldown_s": -1}}, "autoscaler.upscale_cooldown_s"),
    ({"autoscaler": {"downscale_cooldown_s": -5}}, "autoscaler.downscale_cooldown_s"),
    ({"autoscaler": {"downscale_ratio": 1.5}}, "autoscaler.downscale_ratio"),
    ({"autoscaler": {"latency_quantile": 0}}, "autoscaler.latency_quantile"),
    ({"autoscaler": {"drain_timeout_s": 0}}, "autoscaler.drain_timeout_s"),
    ({"autoscaler": {"prefill": {"queued_prompt_tokens_per_worker": 0}}}, "autoscaler.prefill.queued_prompt_tokens_per_worker"),
    ({"autoscaler": {"prefill": {"ttft_slo_s": -1}}}, "autoscaler.prefill.ttft_slo_s"),
    ({"autoscaler": {"decode": {"kv_usage": 1.2}}}, "autoscaler.decode.kv_usage"),
    ({"autoscaler": {"decode": {"running_requests_per_worker": 2.5}}}, "autoscaler.decode.running_requests_per_worker"),
    ({"autoscaler": {"decode": {"itl_slo_s": 0}}}, "autoscaler.decode.itl_slo_s"),
    ({"router": {"resources": {"CPU": 1}}}, "router.resources.CPU"),
    ({"pools": {"decode": {"resources": {"head": -1}}}}, "pools.decode.resources.head"),
    ({"pools": {"decode": {"resources": ["head"]}}}, "pools.decode.resources"),
    ({"autoscaler": "on"}, "autoscaler"),
    ({"autoscaler": {"decode": [1]}}, "autoscaler.decode"),
]


@pytest.mark.parametrize("data,field", BAD_CONFIGS)
def test_bad_deploy_config_names_the_field(data, field):
    with pytest.raises(ConfigError) as info:
        config_from_dict(data)
    assert info.value.field == field, str(info.value)
    assert field in str(info.value)


@pytest.fixture
def no_ray(tmp_path):
    """An environment in which importing `ray` fails loudly: proof that nothing touched Ray."""
    fake = tmp_path / "fake_ray"
    (fake / "ray").mkdir(parents=True)
    (fake / "ray" / "__init__.py").write_text("raise ImportError('pdserve must not import ray for a bad config')\n")
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(fake), str(REPO)])}


@pytest.mark.parametrize(
    "data,field",
    [
        ({"bogus": 1}, "bogus"),
        ({"pools": {"decode": {"replicas": -1}}}, "pools.decode.replicas"),
        ({"pools": {"prefill": {"min_replicas": 3, "max_replicas": 2, "replicas": 2}}}, "pools.prefill.min_replicas"),
        ({"kv_transfer": {"transport": "carrier-pigeon"}}, "kv_transfer.transport"),
        ({"autoscaler": {"interval_s": -1}}, "autoscaler.interval_s"),
        ({"autoscaler": {"decode": {"kv_usage": 2}}}, "autoscaler.decode.kv_usage"),
    ],
)
def test_serve_with_bad_config_exits_before_ray(tmp_path, monkeypatch, capsys, data, field):
    """`pdserve serve -c bad.yaml` in this process, with `import ray` made impossible."""
    from deploy import cli

    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(data))
    monkeypatch.setitem(sys.modules, "ray", None)  # any `import ray` now raises ImportError
    assert cli.main(["serve", "-c", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "invalid config" in err and field in err, err


def test_serve_process_with_bad_config_exits_before_ray(tmp_path, no_ray):
    """The same through the real `pdserve` entry point in a fresh process (ray cannot even be imported)."""
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"pools": {"decode": {"min_replicas": 3, "max_replicas": 2, "replicas": 2}}}))
    result = subprocess.run([sys.executable, "-m", "deploy.cli", "serve", "-c", str(bad)], cwd=REPO, env=no_ray,
                            capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 2, result
    assert "pools.decode.min_replicas" in result.stderr and "invalid config" in result.stderr, result.stderr
    assert "must not import ray" not in result.stderr


def test_serve_with_bad_port_flag_exits_before_ray(monkeypatch, capsys):
    from deploy import cli

    monkeypatch.setitem(sys.modules, "ray", None)
    assert cli.main(["serve", "--grpc-port", "99999"]) == 2
    assert "router.grpc_port" in capsys.readouterr().err


def test_the_fake_ray_really_blocks_ray(no_ray):
    result = subprocess.run([sys.executable, "-c", "import ray"], env=no_ray, capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode != 0 and "must not import ray" in result.stderr


@pytest.mark.parametrize("specs,expected", [(["decode=2"], {"decode": 2}), (["prefill=1", "decode=3"], {"prefill": 1, "decode": 3})])
def test_scale_targets_parse(specs, expected):
    assert parse_scale_targets(specs) == expected


@pytest.mark.parametrize("spec", ["decode", "gpu=2", "decode=two", "decode=-1"])
def test_bad_scale_targets_are_refused(spec):
    with pytest.raises(ValueError, match=spec.split("=")[0]):
        parse_scale_targets([spec])


def test_k8s_manifests_carry_a_valid_config_and_run_pdserve_serve():
    docs = list(yaml.safe_load_all((REPO / "deploy" / "k8s" / "raycluster.yaml").read_text()))
    kinds = {d["kind"]: d for d in docs}
    assert set(kinds) == {"ConfigMap", "RayCluster", "Service"}
    cfg = config_from_dict(yaml.safe_load(kinds["ConfigMap"]["data"]["pdserve.yaml"]))
    head = kinds["RayCluster"]["spec"]["headGroupSpec"]
    # the router's custom resource is declared by the head only, and the Service targets the head
    assert set(cfg.router.resources) == {"pdserve_head"} and "pdserve_head" in head["rayStartParams"]["resources"]
    ports = {p["port"] for p in kinds["Service"]["spec"]["ports"]}
    assert ports == {cfg.router.grpc_port, cfg.router.http_port}
    job = yaml.safe_load((REPO / "deploy" / "k8s" / "rayjob.yaml").read_text())
    assert job["kind"] == "RayJob" and job["spec"]["entrypoint"].startswith("pdserve serve --address auto")


def test_a_deployment_without_a_configured_secret_gets_a_fresh_one(monkeypatch):
    from common.secrets import SECRET_ENV
    from deploy.controller import deployment_secret

    monkeypatch.delenv(SECRET_ENV, raising=False)
    first, auth = deployment_secret(config_from_dict({}))
    second, _ = deployment_secret(config_from_dict({}))
    assert len(first.value) >= 32 and first.value != second.value
    assert auth == {"authenticated": True, "secret": "generated for this deployment", "tls": False}
    handed, auth = deployment_secret(config_from_dict({"security": {"shared_secret": "x" * 20}}))
    assert handed is None and auth["secret"] == "configured (security.shared_secret)"  # each actor resolves it
    monkeypatch.setenv(SECRET_ENV, "y" * 20)
    assert deployment_secret(config_from_dict({}))[1]["secret"] == f"configured ({SECRET_ENV})"
