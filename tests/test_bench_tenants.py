"""bench/tenants_bench.py part 1 at tiny sizes, on a real kvmanager process: the result's shape and
what the policy decides deterministically (no timing)."""
from __future__ import annotations

import json

import pytest

from bench import tenants_bench


def test_roc_auc_counts_lower_ttft_as_cached_and_ties_as_half():
    assert tenants_bench.roc_auc([1.0, 2.0], [3.0, 4.0]) == 1.0
    assert tenants_bench.roc_auc([3.0, 4.0], [1.0, 2.0]) == 0.0
    assert tenants_bench.roc_auc([1.0], [1.0]) == 0.5
    assert tenants_bench.roc_auc([], [1.0]) is None


def test_quiet_requests_replay_each_chat_with_its_history():
    w = tenants_bench.Workload("synthetic", [9, 9], [[([1], [2]), ([3], [4])], [([5], [6])]], [])
    assert w.quiet_requests() == [(0, 0, [9, 9, 1], [2]), (1, 0, [9, 9, 5], [6]), (0, 1, [9, 9, 1, 2, 3], [4])]


@pytest.mark.timeout(60)
def test_noisy_neighbour_part_at_tiny_sizes(tmp_path):
    out = tmp_path / "out"
    # 8 quiet chats x 4 turns behind a 64-token system prompt; pool of 256 blocks: the quiet
    # working set fits in half of it, the noisy tenant's 10x traffic flushes all of it.
    argv = ["--synthetic", "--num-blocks", "256", "--conversations", "8", "--turns", "4", "--system-tokens", "64",
            "--max-message-tokens", "48", "--max-noisy-tokens", "96", "--out", str(out)]
    assert tenants_bench.main(argv) == 0
    results = json.loads((out / "results.json").read_text())
    assert (out / "lscpu.txt").exists() and results["lscpu"]
    part = results["noisy_neighbour"]
    assert part["workload"]["quiet_requests"] == 32 and part["workload"]["noisy_requests"] == 320
    rows = {r["scenario"]: r for r in part["scenarios"]}
    assert list(rows) == list(tenants_bench.SCENARIOS)
    for r in rows.values():
        assert 0.0 <= r["quiet_hit_rate"] <= 1.0 and len(r["quiet_by_round"]) == 4
    alone, governed, ungoverned = rows["alone"], rows["governed"], rows["ungoverned"]
    assert alone["drop_vs_alone"] == 0.0 and alone["noisy_hit_rate"] is None
    assert governed["drop_vs_alone"] < ungoverned["drop_vs_alone"]  # fair eviction protects the quiet tenant
    assert ungoverned["quiet_evictions_suffered"] is None  # one tenant: not the quiet tenant's alone
    assert governed["noisy_hit_rate"] == 0.0  # every noisy prompt unique
    for name in ("pinned", "ungoverned-pinned"):  # computed by the first request, then hit on every one
        assert rows[name]["pinned"] and rows[name]["system_prompt_misses"] == 0
        assert rows[name]["system_prompt_hit_rate"] == 1.0 and rows[name]["pin_blocks_held"] == 4
    assert {t["target"].split(":")[0] for t in part["targets"]} >= {"governed", "pinned"}
    table = tenants_bench.format_part1(part)
    assert "| governed |" in table and "met" in table
