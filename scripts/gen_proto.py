#!/usr/bin/env python
"""Regenerate the Python gRPC/protobuf modules from proto/*.proto.

    python scripts/gen_proto.py             # writes proto/*_pb2.py, *_pb2.pyi, *_pb2_grpc.py
    python scripts/gen_proto.py --out DIR   # writes DIR/proto/... instead (used by the freshness test)

protoc runs with the repository root as include path (``-I .``, files named ``proto/x.proto``), so
generated modules import each other as ``from proto import x_pb2``. The output depends only on the
.proto files and the pinned grpcio-tools version, so it is deterministic.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = "proto"
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


def proto_files(root: Path = REPO_ROOT) -> list[str]:
    """The .proto files, as paths relative to ``root`` (sorted, '/'-separated)."""
    return sorted(p.relative_to(root).as_posix() for p in (root / PROTO_DIR).glob("*.proto"))


def expected_outputs(proto: str) -> list[str]:
    """Generated file paths (relative to the output root) for one ``proto/x.proto``."""
    stem = proto[: -len(".proto")]
    return [stem + suffix for suffix in GENERATED_SUFFIXES]


def _well_known_include() -> str:
    import grpc_tools

    return str(Path(grpc_tools.__file__).resolve().parent / "_proto")


def generate(out: Path = REPO_ROOT) -> list[Path]:
    """Run protoc on every proto/*.proto, writing into ``out``/proto/. Returns the written files."""
    out = Path(out).resolve()
    protos = proto_files()
    if not protos:
        raise SystemExit(f"no .proto files under {REPO_ROOT / PROTO_DIR}")
    dest = out / PROTO_DIR
    dest.mkdir(parents=True, exist_ok=True)
    # Remove stale generated files (e.g. from a deleted .proto) before regenerating.
    for suffix in GENERATED_SUFFIXES:
        for stale in dest.glob("*" + suffix):
            stale.unlink()
    cmd = [
        sys.executable,
        "-m",
        "grpc_tools.protoc",
        "-I",
        ".",
        "-I",
        _well_known_include(),
        f"--python_out={out}",
        f"--pyi_out={out}",
        f"--grpc_python_out={out}",
        *protos,
    ]
    result = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"protoc failed ({result.returncode}):\n{result.stderr}{result.stdout}")
    written = [out / f for p in protos for f in expected_outputs(p)]
    missing = [str(f) for f in written if not f.is_file()]
    if missing:
        raise SystemExit(f"protoc did not produce: {', '.join(missing)}")
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out",
        type=Path,
        default=REPO_ROOT,
        help="output root; files go to OUT/proto/ (default: the repository root)",
    )
    args = parser.parse_args(argv)
    for path in generate(args.out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
