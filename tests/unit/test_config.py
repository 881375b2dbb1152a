"""Configuration loads into typed objects; every bad field is named in the error."""

from __future__ import annotations

import pytest

from common import hardware
from common.config import ConfigError, config_from_dict, load_config
from common.engine_config import EngineConfig


def test_default_config_loads():
    cfg = load_config()
    assert cfg.model_name == "smollm2-135m"
    assert cfg.kv_transfer.transport == "ucx"
    assert cfg.pools.prefill.replicas == 1 and cfg.pools.decode.replicas == 1
    assert cfg.engine.block_size == 16


@pytest.mark.parametrize(
    "data,field",
    [
        ({"bogus": 1}, "bogus"),
        ({"engine": {"bogus": 1}}, "engine.bogus"),
        ({"engine": {"block_size": 7}}, "engine.block_size"),
        ({"engine": {"max_num_seqs": 0}}, "engine.max_num_seqs"),
        ({"engine": {"dtype": "fp8"}}, "engine.dtype"),
        ({"kv_transfer": {"transport": "carrier-pigeon"}}, "kv_transfer.transport"),
        ({"kv_transfer": {"layerwise": "yes"}}, "kv_transfer.layerwise"),
        ({"router": {"grpc_port": 70000}}, "router.grpc_port"),
        ({"router": {"policy": "random"}}, "router.policy"),
        ({"pools": {"decode": {"replicas": -1}}}, "pools.decode.replicas"),
        ({"pools": {"prefill": {"min_replicas": 3, "max_replicas": 2, "replicas": 2}}}, "pools.prefill.min_replicas"),
        ({"pools": {"prefill": {"replicas": 5, "max_replicas": 2}}}, "pools.prefill.replicas"),
        ({"pools": {"gpu": {}}}, "pools.gpu"),
        ({"pools": {"decode": {"placement_strategy": "RANDOM"}}}, "pools.decode.placement_strategy"),
        ({"engine": "fast"}, "engine"),
    ],
)
def test_bad_config_names_the_field(data, field):
    with pytest.raises(ConfigError) as info:
        config_from_dict(data)
    assert info.value.field == field, str(info.value)
    assert field in str(info.value)


def test_layerwise_kv_follows_the_device_unless_set():
    by_device = config_from_dict({}).kv_transfer
    assert by_device.layerwise is None and load_config().kv_transfer.layerwise is None
    assert by_device.streams_layerwise("cuda:0") and not by_device.streams_layerwise("cpu")
    forced = config_from_dict({"kv_transfer": {"layerwise": True}}).kv_transfer
    assert forced.streams_layerwise("cpu") and not config_from_dict({"kv_transfer": {"layerwise": False}}).kv_transfer.streams_layerwise("cuda")


def test_bad_yaml_is_reported(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("engine: [unclosed\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert info.value.field == "config"


@pytest.mark.parametrize("features, device, resolved", [
    (("avx2", "avx512f", "avx512_bf16"), "cpu", "bfloat16"),
    (("avx2", "amx_tile", "amx_bf16"), "cpu", "bfloat16"),
    (("avx2", "avx512f"), "cpu", "float32"),
    ((), "cuda:1", "bfloat16"),
])
def test_auto_dtype_resolves_once_from_the_cpu_features(monkeypatch, features, device, resolved):
    monkeypatch.setattr(hardware, "cpu_info", lambda: hardware.CpuInfo("test cpu", features))
    config = config_from_dict({"engine": {"device": device}}).engine
    assert config.dtype == resolved  # resolved when built: every reader sees the concrete dtype
    assert config_from_dict({"engine": {"dtype": "auto", "device": device}}).engine.dtype == resolved
    for explicit in ("float32", "bfloat16", "float16"):
        assert EngineConfig(dtype=explicit, device=device).dtype == explicit


def test_cpu_info_reads_this_host():
    info = hardware.cpu_info()
    assert info.model and set(info.features) <= set(hardware.RELEVANT_FEATURES)
    record = info.record()
    assert record["cpu"] == info.model and record["cpu_auto_dtype"] == hardware.auto_dtype("cpu")
    assert record["cpu_auto_dtype"] == ("bfloat16" if set(info.features) & set(hardware.BF16_FEATURES) else "float32")
