"""The engines a CPU user would pick instead of kvserve, run on the same requests.

``python -m bench --sweep seed-table --peers llama-server,openvino`` adds their rows beside
kvserve's. Each peer sets itself up once (a build, a venv, an export: cached under
``~/.cache/kvserve/peers/``) and is skipped with a printed reason when it cannot be set up;
nothing is built or installed under pytest.

  transformers  HF transformers, static batching (bench/peers/transformers_peer.py, in-process)
  llama-server  llama.cpp's llama-server built from source (bench/peers/llama_server.py, HTTP)
  openvino      OpenVINO GenAI ContinuousBatchingPipeline (bench/peers/openvino_peer.py, in-process)
"""
from __future__ import annotations

KNOWN_PEERS = ("transformers", "llama-server", "openvino")
LLAMA_SERVER_WEIGHTS = ("bf16", "q4_1")
OPENVINO_WEIGHTS = ("fp16", "int8", "fp32", "int4")


def parse_list(text: str, known: tuple[str, ...], what: str) -> list[str]:
    """Comma-separated names, in order, without repeats; ``none`` or empty means none."""
    names: list[str] = []
    for item in (text or "").split(","):
        item = item.strip().lower()
        if not item or item == "none":
            continue
        if item not in known:
            raise ValueError(f"unknown {what} {item!r} (known: {', '.join(known)})")
        if item not in names:
            names.append(item)
    return names


def parse_peers(text: str) -> list[str]:
    return parse_list(text, KNOWN_PEERS, "peer")
