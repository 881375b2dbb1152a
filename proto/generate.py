"""Regenerate the Python modules of `proto/pdserve/v1/pdserve.proto`.

Lifecycle: run by hand (or `scripts/gen_proto.sh`) after editing the .proto; the outputs are
committed. `tests/unit/test_proto_fresh.py` calls `generate()` into a temporary directory and
fails when the committed files differ, so a stale checkout cannot pass CI.

protoc runs from the repository root with `-I .`, so the generated gRPC module imports
`from proto.pdserve.v1 import pdserve_pb2`, which resolves because `proto` is a package.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
PROTO_FILES = ("proto/pdserve/v1/pdserve.proto",)
GENERATED_SUFFIXES = ("_pb2.py", "_pb2_grpc.py", "_pb2.pyi")

log = logging.getLogger(__name__)


def generated_files(proto_file: str) -> list[str]:
    """Paths (relative to the output root) that protoc writes for one .proto file."""
    stem = proto_file.removesuffix(".proto")
    return [stem + suffix for suffix in GENERATED_SUFFIXES]


def generate(out_dir: Path = REPO_ROOT) -> list[Path]:
    """Run protoc for every proto file, writing under `out_dir`; return the files written."""
    from grpc_tools import protoc  # dev dependency, imported late

    written: list[Path] = []
    for proto_file in PROTO_FILES:
        target = out_dir / Path(proto_file).parent
        target.mkdir(parents=True, exist_ok=True)
        args = [
            "grpc_tools.protoc",
            f"-I{REPO_ROOT}",
            f"--python_out={out_dir}",
            f"--pyi_out={out_dir}",
            f"--grpc_python_out={out_dir}",
            str(REPO_ROOT / proto_file),
        ]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed for {proto_file}")
        written.extend(out_dir / name for name in generated_files(proto_file))
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO_ROOT, help="output root (default: repo root)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    for path in generate(args.out):
        log.info("wrote %s", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
