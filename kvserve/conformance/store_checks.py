"""Conformance rules for an executor's store tier (``docs/executor-contract.md``, "The store tier").

They run only against an executor whose ``Describe.kv_store`` names a store (an executor may
decline the tier: kvmanager then never orders a store operation for it, and these rules
SKIP). They write a few entries under random block keys, which no prompt's chained hash can
ever equal, into the executor's namespace, and delete them again.

Importing this module registers the rules in ``executor_checks.rules``, after the others.
"""
from __future__ import annotations

import re

import grpc
import xxhash

from kvserve.conformance import Fail, Skip, expect_status, require
from kvserve.conformance.comparison import Comparison, sampled_from
from kvserve.conformance.executor_checks import rules
from kvserve.conformance.executor_context import ExecutorContext, greedy, sequence
from kvserve.v1 import executor_pb2 as pb


def _store(ctx: ExecutorContext) -> pb.DescribeResponse:
    info = ctx.info
    if not info.kv_store:
        raise Skip("the executor offers no store tier (Describe.kv_store is empty)")
    return info


def _entry_names(ctx: ExecutorContext, n: int) -> tuple[list[bytes], list[bytes]]:
    """``n`` (hash, key) pairs: random keys, and their xxh3-128 hashes as the entry names."""
    keys = [b"kvserve-conformance\x00" + ctx.rng.randbytes(32) for _ in range(n)]
    return [xxhash.xxh3_128_digest(key) for key in keys], keys


def _save(ctx: ExecutorContext, blocks: list[int], hashes: list[bytes], keys: list[bytes]) -> pb.ExecuteResponse:
    request = pb.ExecuteRequest(store_save_block_ids=blocks, store_save_hashes=hashes, store_save_keys=keys,
                                expected_instance_id=ctx.info.instance_id)
    return ctx.stub.Execute(request, timeout=ctx.timeout)


def _loading(step: pb.ExecuteSequence, blocks: list[int], hashes: list[bytes]) -> pb.ExecuteSequence:
    """``step`` with store loads: block ``blocks[i]`` gets the entry ``hashes[i]`` first."""
    step.store_load_block_ids.extend(blocks)
    step.store_load_hashes.extend(hashes)
    return step


def _delete(ctx: ExecutorContext, hashes: list[bytes]) -> None:
    ctx.stub.Execute(pb.ExecuteRequest(store_delete_hashes=hashes), timeout=ctx.timeout)


@rules.rule("store.describe",
            "an executor with a store names it, a lowercase-hex namespace and a capacity of at least one block")
def store_describe(ctx: ExecutorContext) -> str:
    info = _store(ctx)
    require(bool(re.fullmatch(r"[0-9a-f]{1,128}", info.kv_store_namespace)),
            f"kv_store_namespace {info.kv_store_namespace!r} is not lowercase hex")
    require(info.kv_store_capacity_blocks >= 1, "kv_store_capacity_blocks is 0")
    return f"namespace {info.kv_store_namespace[:12]}…, {info.kv_store_capacity_blocks} blocks"


@rules.rule("store.save_then_load",
            "blocks saved (a step with saves and no sequence) and loaded into other blocks give the reference: "
            "a sequence that loads its prefix and computes only its tail samples what the whole prompt does")
def store_save_then_load(ctx: ExecutorContext) -> str:
    _store(ctx)
    ref = ctx.reference()
    bs, n = ctx.block_size, len(ref.prompt)
    full = (n - 1) // bs
    if full == 0:
        raise Skip("the reference prompt has no full block")
    hashes, keys = _entry_names(ctx, full)
    saved = _save(ctx, ref.table[:full], hashes, keys)
    require(list(saved.store_saves_ok) == [True] * full, f"store_saves_ok {list(saved.store_saves_ok)}")
    table = ctx.take(ctx.seq_blocks)
    ctx.write_garbage(table)
    seq_id = ctx.seq_id()
    reply = ctx.execute([_loading(sequence(seq_id, ref.prompt[full * bs:], full * bs, table, greedy()),
                                  table[:full], hashes)])
    require(not reply.dropped_seq_ids and not reply.store_missing_hashes,
            f"loads of entries just saved missed: {[h.hex() for h in reply.store_missing_hashes]}")
    got = [sampled_from(reply, 0)] + ctx.decode_forced(seq_id, table, n, ref.fed)
    _delete(ctx, hashes)
    comparison = Comparison(ctx.tolerance)
    comparison.add_all(ref.steps, got, f"{full} blocks loaded from the store")
    return comparison.verdict()


@rules.rule("store.load_miss_drops_the_sequence",
            "a sequence whose load misses is not run (dropped_seq_ids, store_missing_hashes, no sampled token); "
            "the other sequences of the step run as usual")
def store_load_miss(ctx: ExecutorContext) -> str:
    _store(ctx)
    ref = ctx.reference()
    bs = ctx.block_size
    if len(ref.prompt) <= bs:
        raise Skip("the reference prompt has no full block")
    (absent,), _ = _entry_names(ctx, 1)
    missing_table = ctx.take(ctx.seq_blocks)
    missing_id = ctx.seq_id()
    doomed = _loading(sequence(missing_id, ref.prompt[bs:], bs, missing_table, greedy()), missing_table[:1], [absent])
    other_id = ctx.seq_id()
    other = sequence(other_id, ref.prompt, 0, ctx.take(ctx.seq_blocks), greedy())
    reply = ctx.execute([doomed, other])
    require(list(reply.dropped_seq_ids) == [missing_id], f"dropped_seq_ids {list(reply.dropped_seq_ids)}")
    require(list(reply.store_missing_hashes) == [absent], "store_missing_hashes does not name the absent entry")
    require(len(reply.sampled_token_ids) == 1, f"{len(reply.sampled_token_ids)} sampled tokens, expected 1 "
                                               "(the dropped sequence's is absent)")
    comparison = Comparison(ctx.tolerance)
    comparison.add_all(ref.steps[:1], [sampled_from(reply, 0)], "the other sequence of the step")
    return comparison.verdict()


@rules.rule("store.stale_instance_refused",
            "a step whose expected_instance_id is not the executor's is refused whole with ABORTED")
def store_stale_instance(ctx: ExecutorContext) -> str:
    _store(ctx)
    hashes, keys = _entry_names(ctx, 1)
    request = pb.ExecuteRequest(store_save_block_ids=ctx.take(1), store_save_hashes=hashes, store_save_keys=keys,
                                expected_instance_id="not-" + ctx.info.instance_id)
    error = expect_status(lambda: ctx.stub.Execute(request, timeout=ctx.timeout), grpc.StatusCode.ABORTED,
                          "a step for another instance")
    blocks = ctx.take(2)
    probe = _loading(sequence(ctx.seq_id(), [0], ctx.block_size, blocks, greedy()), blocks[:1], hashes)
    reply = ctx.execute([probe])
    if list(reply.dropped_seq_ids) != [probe.seq_id]:
        raise Fail("the refused step's save was written anyway: a load of it hit")
    return f"ABORTED: {error.details()}"


@rules.rule("store.delete", "an entry deleted (store_delete_hashes) is a miss afterwards")
def store_delete(ctx: ExecutorContext) -> str:
    _store(ctx)
    blocks = ctx.take(2)
    ctx.write_garbage(blocks)
    hashes, keys = _entry_names(ctx, 1)
    require(list(_save(ctx, blocks[:1], hashes, keys).store_saves_ok) == [True], "the save failed")
    _delete(ctx, hashes)
    reply = ctx.execute([_loading(sequence(ctx.seq_id(), [0], ctx.block_size, blocks, greedy()), blocks[:1], hashes)])
    require(list(reply.store_missing_hashes) == hashes, "a deleted entry was still loaded")
    return "deleted, then missed"
