"""Generate the Python stubs in ``kvserve/v1`` from ``protos/kvserve/v1/*.proto``.

The stubs are committed so that an installed package needs no code generation;
``tests/test_protos.py`` regenerates them into a temporary directory and fails
when the committed ones are stale. Run ``python -m kvserve.protogen`` after
editing a ``.proto`` file.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = REPO_ROOT / "protos"
PROTO_FILES = sorted((PROTO_ROOT / "kvserve" / "v1").glob("*.proto"))


def generate(out_dir: Path) -> list[Path]:
    """Writes ``kvserve/v1/*_pb2*.py(i)`` under ``out_dir``; returns the files written."""
    from grpc_tools import protoc

    import grpc_tools

    out_dir.mkdir(parents=True, exist_ok=True)
    include = Path(grpc_tools.__file__).parent / "_proto"
    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"-I{include}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *[str(p.relative_to(PROTO_ROOT)) for p in PROTO_FILES],
    ]
    if protoc.main(args) != 0:
        raise RuntimeError("protoc failed: " + " ".join(args))
    return sorted((out_dir / "kvserve" / "v1").glob("*_pb2*"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO_ROOT, help="root to write kvserve/v1/ under")
    args = parser.parse_args(argv)
    for path in generate(args.out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
