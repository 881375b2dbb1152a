"""The committed generated protobuf modules match the .proto (regenerated into a temp dir)."""

from __future__ import annotations

from pathlib import Path

import pytest

from proto import generate as gen


def test_generated_modules_are_fresh(tmp_path: Path) -> None:
    pytest.importorskip("grpc_tools")
    gen.generate(tmp_path)
    stale = []
    for proto_file in gen.PROTO_FILES:
        for name in gen.generated_files(proto_file):
            committed = gen.REPO_ROOT / name
            fresh = tmp_path / name
            if not committed.exists() or committed.read_bytes() != fresh.read_bytes():
                stale.append(name)
    assert not stale, f"stale generated files {stale}: run scripts/gen_proto.sh and commit"


def test_generated_modules_import_cleanly() -> None:
    from proto.pdserve.v1 import pdserve_pb2, pdserve_pb2_grpc

    assert pdserve_pb2.DESCRIPTOR.package == "pdserve.v1"
    for service in ("Router", "Registry", "PrefillWorker", "DecodeWorker"):
        assert hasattr(pdserve_pb2_grpc, f"{service}Stub")
    first = pdserve_pb2.DecodeResponse(admission=pdserve_pb2.KVAdmission(num_blocks=3))
    assert first.WhichOneof("event") == "admission"
