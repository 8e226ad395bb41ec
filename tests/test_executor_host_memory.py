"""A CPU KV cache larger than the memory the host (or the container's cgroup) leaves is refused at
the executor's start, naming the flag, instead of starting and being killed for memory under load."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from executor.host_memory import available_bytes
from executor.kv_cache import kv_bytes_per_block, size_kv_cache
from executor.model import ModelConfig
from tests.conftest import REPO_ROOT, free_port, service_env
from tests.test_executor_model import LLAMA

GIB = 1 << 30


def fake_host(tmp_path: Path, mem_available: int | None, cgroup: str = "0::/\n",
              files: dict[str, str] | None = None) -> tuple[Path, Path]:
    proc, root = tmp_path / "proc", tmp_path / "cgroup"
    (proc / "self").mkdir(parents=True)
    root.mkdir()
    meminfo = "MemTotal:       33554432 kB\n"
    if mem_available is not None:
        meminfo += f"MemAvailable:   {mem_available >> 10} kB\n"
    (proc / "meminfo").write_text(meminfo)
    (proc / "self" / "cgroup").write_text(cgroup)
    for name, text in (files or {}).items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return proc, root


def test_without_a_cgroup_limit_it_is_memavailable(tmp_path):
    proc, root = fake_host(tmp_path, 20 * GIB, "0::/user.slice/session\n",
                           {"user.slice/session/memory.max": "max\n", "user.slice/session/memory.current": "5\n"})
    assert available_bytes(proc, root) == 20 * GIB


def test_the_tightest_cgroup_v2_limit_on_the_way_up_wins(tmp_path):
    files = {"kubepods/pod1/ctr/memory.max": "max\n", "kubepods/pod1/ctr/memory.current": str(GIB),
             "kubepods/pod1/memory.max": str(6 * GIB), "kubepods/pod1/memory.current": str(2 * GIB),
             "kubepods/memory.max": str(100 * GIB), "kubepods/memory.current": str(50 * GIB)}
    proc, root = fake_host(tmp_path, 20 * GIB, "0::/kubepods/pod1/ctr\n", files)
    assert available_bytes(proc, root) == 4 * GIB
    # a container whose cgroup namespace shows its own cgroup as the root
    proc, root = fake_host(tmp_path / "ns", 20 * GIB, "0::/\n",
                           {"memory.max": str(3 * GIB), "memory.current": str(GIB)})
    assert available_bytes(proc, root) == 2 * GIB


def test_cgroup_v1_memory_controller(tmp_path):
    cgroup = "9:name=systemd:/\n4:memory,hugetlb:/docker/abc\n1:cpu:/\n"
    proc, root = fake_host(tmp_path, 20 * GIB, cgroup, {"memory/docker/abc/memory.limit_in_bytes": str(2 * GIB),
                                                        "memory/docker/abc/memory.usage_in_bytes": str(GIB // 2)})
    assert available_bytes(proc, root) == GIB + GIB // 2
    unlimited = {"memory/docker/abc/memory.limit_in_bytes": "9223372036854771712",
                 "memory/docker/abc/memory.usage_in_bytes": str(GIB)}
    proc, root = fake_host(tmp_path / "unlimited", 20 * GIB, cgroup, unlimited)
    assert available_bytes(proc, root) == 20 * GIB


def test_a_host_that_says_nothing_gives_none(tmp_path):
    proc, root = fake_host(tmp_path, None)
    assert available_bytes(proc, root) is None


def test_sizing_refuses_a_host_cache_past_what_is_left_naming_the_flag():
    config, cpu = ModelConfig.from_dict(LLAMA), torch.device("cpu")
    per_block = kv_bytes_per_block(config, 16, torch.bfloat16)

    def size(available, **flags):
        return size_kv_cache(config, 16, torch.bfloat16, cpu, host_available=available, **flags)

    assert size(10 * per_block, num_blocks=10).num_blocks == 10  # exactly what is left fits
    assert size(None, num_blocks=1 << 40).num_blocks == 1 << 40  # a host that does not say
    with pytest.raises(ValueError, match=r"^num_blocks: a KV cache of .* GiB \(num_blocks\) does not fit"):
        size(10 * per_block - 1, num_blocks=10)
    with pytest.raises(ValueError, match=rf"^kv_cache_memory: .*\(kv_cache_memory={8 * per_block}\)"):
        size(per_block, kv_cache_memory=8 * per_block)
    with pytest.raises(ValueError, match=r"^kv_cache_memory: a KV cache of 1\.00 GiB \(cpu default \(1 GiB\)\)"):
        size(GIB // 2)


@pytest.mark.skipif(available_bytes() is None, reason="the host does not say how much memory it has left")
def test_the_executor_refuses_a_kv_cache_larger_than_the_host_at_start(tiny_model_dir):
    too_big = available_bytes() + 8 * GIB
    proc = subprocess.run(
        [sys.executable, "-m", "executor", "--model", str(tiny_model_dir), "--port", str(free_port()),
         "--kv-cache-memory", str(too_big), "--num-threads", "1"],
        cwd=REPO_ROOT, env=service_env(), capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert proc.stderr.strip().count("\n") == 0, proc.stderr
    assert "executor: error: --kv-cache-memory: a KV cache of" in proc.stderr and "does not fit" in proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
