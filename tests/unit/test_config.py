"""Configuration loads into typed objects; every bad field is named in the error."""

from __future__ import annotations

import pytest

from common.config import ConfigError, config_from_dict, load_config


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
        ({"kv_transfer": {"transport": "carrier-pigeon"}}, "kv_transfer.transport"),
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


def test_bad_yaml_is_reported(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("engine: [unclosed\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert info.value.field == "config"
