"""Generate the Python stubs in ``kvserve/v1`` from ``protos/kvserve/v1/*.proto``.

The stubs are committed so that an installed package needs no code generation;
``tests/test_foundation.py`` (``test_committed_stubs_match_the_protos``) compiles
the protos afresh and fails when the committed stubs describe something else.
Run ``python -m kvserve.protogen`` after editing a ``.proto`` file.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = REPO_ROOT / "protos"
PROTO_FILES = sorted((PROTO_ROOT / "kvserve" / "v1").glob("*.proto"))


def _protoc(*outputs: str) -> None:
    """Runs grpcio-tools' protoc over PROTO_FILES with the given output flags."""
    from grpc_tools import protoc

    import grpc_tools

    include = Path(grpc_tools.__file__).parent / "_proto"
    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"-I{include}",
        *outputs,
        *[str(p.relative_to(PROTO_ROOT)) for p in PROTO_FILES],
    ]
    if protoc.main(args) != 0:
        raise RuntimeError("protoc failed: " + " ".join(args))


def generate(out_dir: Path) -> list[Path]:
    """Writes ``kvserve/v1/*_pb2*.py(i)`` under ``out_dir``; returns the files written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    _protoc(f"--python_out={out_dir}", f"--pyi_out={out_dir}", f"--grpc_python_out={out_dir}")
    return sorted((out_dir / "kvserve" / "v1").glob("*_pb2*"))


def file_descriptors() -> dict:
    """What protoc makes of each ``.proto``: ``{"kvserve/v1/x.proto": FileDescriptorProto}``
    (no source info, so comments are not part of it)."""
    from google.protobuf import descriptor_pb2

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "descriptors.pb"
        _protoc(f"--descriptor_set_out={out}")
        descriptor_set = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes())
    return {file.name: file for file in descriptor_set.file}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO_ROOT, help="root to write kvserve/v1/ under")
    args = parser.parse_args(argv)
    for path in generate(args.out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
