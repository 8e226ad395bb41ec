"""Where KV lives, in the words of KV events (vLLM's ``medium``): shared by the gateway, which
registers it per pool, and kvmanager, which publishes it."""
from __future__ import annotations


def medium_for_device(device: str) -> str:
    """vLLM's medium name for an executor's ``Describe.device``: "cpu" -> "CPU", any
    accelerator ("cuda:0", "musa", ...) -> "GPU", empty -> empty (the default applies)."""
    kind = device.split(":", 1)[0].strip().lower()
    if not kind:
        return ""
    return "CPU" if kind == "cpu" else "GPU"
