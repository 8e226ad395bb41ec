"""kvmanager micro-benchmark: prints numbers, asserts nothing.

    python -m bench.kvmanager_bench [--quick]

1. In process (the domain, validation included, no gRPC): sequences admitted
   with a 512-token prompt (32 blocks of 16, hashed into the prefix cache),
   decoded token by token (one Allocate per token, crossing block boundaries),
   then freed; on pools of 10K and 1M blocks. Per-block cost should not depend on
   the pool size: nothing scans the pool. Timed in CPU seconds of this process
   (the machine may be shared).
2. Over gRPC on loopback against ``python -m kvmanager``: the round trip of one
   batched decode Allocate (1 token each) for 1, 32 and 256 sequences; median
   and p99 of wall-clock time, plus the CPU time per call of the server and the
   client (what the round trip costs on an idle machine, whatever the neighbours
   do). Target: 256 sequences under 2 ms median.
3. Over gRPC too: ``LookupPrefix`` of one published prompt of 16 and 256 blocks,
   queried by token ids, token ids + precomputed block hashes, hashes alone, and
   against 4 pools that hash alike; median, p99 and CPU per call as above.
   Target: 256 blocks under 1 ms median.
4. In process: ``LookupPrefix`` across tiers with 1M blocks indexed (a pool of 512K cached
   blocks and a store index of 512K entries), of a 256-block prompt whose first half is in the
   pool and second half in the store; median and p99 wall time. Target: p99 under 1 ms.
"""
from __future__ import annotations

import argparse
import gc
import os
import random
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench.cpu_usage import CLIENT, CpuMeter

REPO_ROOT = Path(__file__).resolve().parent.parent
BLOCK_SIZE = 16
PROMPT_LEN = 512
# In-process timings are CPU time of this process: the machine is shared, and
# wall time there measures the neighbours as much as the code.
clock = time.process_time


def in_process(num_blocks: int, num_seqs: int, decode_steps: int, batch: int) -> dict[str, float]:
    from kvmanager.manager import KVManager
    from kvmanager.pool import AllocationRequest, PoolConfig

    manager = KVManager()
    manager.register_pool(PoolConfig("bench", num_blocks, BLOCK_SIZE, "bench-model"))
    session = manager.open_session("bench").session_id
    rng = random.Random(0)
    prompts = [[rng.randrange(32000) for _ in range(PROMPT_LEN)] for _ in range(num_seqs)]
    t_admit = t_decode = t_free = 0.0
    blocks = 0
    for first in range(0, num_seqs, batch):
        ids = list(range(first, min(first + batch, num_seqs)))
        requests = [AllocationRequest(i, prompts[i], PROMPT_LEN) for i in ids]
        t0 = clock()
        results, _ = manager.allocate("bench", session, [], requests)
        t_admit += clock() - t0
        assert all(r.ok for r in results)
        # Each call carries the report of the previous step's written KV, as the
        # gateway sends it: the prompt's full blocks are published (hashed) there.
        for step in range(decode_steps):
            requests = [AllocationRequest(i, [step], 1) for i in ids]
            written = [PROMPT_LEN + step] * len(ids)
            t0 = clock()
            manager.allocate("bench", session, [], requests, ids, written)
            t_decode += clock() - t0
        blocks += sum(len(manager.pools["bench"].sequences[i].block_table) for i in ids)
        t0 = clock()
        manager.free("bench", session, ids, ids, [PROMPT_LEN + decode_steps] * len(ids))
        t_free += clock() - t0
    return {
        "admit_seq_per_s": num_seqs / t_admit,
        "admit_us_per_block": t_admit / (num_seqs * PROMPT_LEN / BLOCK_SIZE) * 1e6,
        "decode_tokens_per_s": num_seqs * decode_steps / t_decode,
        "free_us_per_block": t_free / blocks * 1e6,
        "cycle_seq_per_s": num_seqs / (t_admit + t_decode + t_free),
    }


def report_in_process(quick: bool) -> None:
    num_seqs = 256 if quick else 1024
    repeats = 1 if quick else 3
    print(f"in-process: {num_seqs} sequences x (admit {PROMPT_LEN}-token prompt, 64 decode steps, free), "
          f"batches of 64, block_size {BLOCK_SIZE}; CPU time, best of {repeats}")
    print(f"{'pool blocks':>12} {'admit seq/s':>12} {'us/block':>9} {'decode tok/s':>13} "
          f"{'free us/blk':>12} {'cycle seq/s':>12} {'setup s':>8}")
    for num_blocks in (10_000, 1_000_000):
        t0 = clock()
        from kvmanager.manager import KVManager
        from kvmanager.pool import PoolConfig

        KVManager().register_pool(PoolConfig("x", num_blocks, BLOCK_SIZE))
        setup = clock() - t0
        runs = [in_process(num_blocks, num_seqs, 64, 64) for _ in range(repeats)]
        # Best of the runs per column: the noise on a shared machine only ever slows down.
        r = {k: (min if k.endswith("per_block") else max)(run[k] for run in runs) for k in runs[0]}
        print(f"{num_blocks:>12,} {r['admit_seq_per_s']:>12,.0f} {r['admit_us_per_block']:>9.2f} "
              f"{r['decode_tokens_per_s']:>13,.0f} {r['free_us_per_block']:>12.2f} "
              f"{r['cycle_seq_per_s']:>12,.0f} {setup:>8.2f}")


def over_grpc(quick: bool) -> None:
    import grpc

    from kvserve.config import without_flag_env
    from kvserve.health import wait_until_serving
    from kvserve.ports import free_port
    from kvserve.v1 import kvmanager_pb2 as pb
    from kvserve.v1 import kvmanager_pb2_grpc

    port = free_port()
    env = without_flag_env()
    env["PYTHONPATH"] = str(REPO_ROOT)
    proc = subprocess.Popen([sys.executable, "-m", "kvmanager", "--port", str(port), "--log-level", "warning"],
                            cwd=REPO_ROOT, env=env, stdout=subprocess.DEVNULL)
    address = f"127.0.0.1:{port}"
    try:
        wait_until_serving(address, 60, is_alive=lambda: proc.poll() is None)
        with grpc.insecure_channel(address) as channel:
            stub = kvmanager_pb2_grpc.KVManagerStub(channel)
            stub.RegisterPool(pb.RegisterPoolRequest(pool_id="bench", num_blocks=100_000, block_size=BLOCK_SIZE,
                                                     model_fingerprint="bench", enable_prefix_caching=True))
            session = stub.OpenSession(pb.OpenSessionRequest(pool_id="bench")).session_id
            print(f"gRPC loopback: one batched decode Allocate (1 token per sequence, "
                  f"prompts of 128 tokens, block_size {BLOCK_SIZE}); client-side round trip")
            print(f"{'sequences':>10} {'median ms':>10} {'p99 ms':>8} {'mean ms':>8} "
                  f"{'server CPU':>11} {'client CPU':>11} {'calls':>6}   (CPU: ms per call)")
            base = 0
            for num_seqs in (1, 32, 256):
                ids = list(range(base, base + num_seqs))
                base += num_seqs
                stub.Allocate(pb.AllocateRequest(pool_id="bench", session_id=session, sequences=[
                    pb.SequenceAllocation(seq_id=i, token_ids=list(range(i % 1000, i % 1000 + 128)),
                                          num_new_tokens=128, enable_prefix_caching=True) for i in ids]))
                iterations = 200 if quick else 1000
                samples = []
                cpu = CpuMeter({"server": proc.pid})
                cpu.start()
                for step in range(iterations + 20):
                    request = pb.AllocateRequest(pool_id="bench", session_id=session, sequences=[
                        pb.SequenceAllocation(seq_id=i, token_ids=[step], num_new_tokens=1) for i in ids])
                    t0 = time.perf_counter()
                    response = stub.Allocate(request)
                    elapsed = time.perf_counter() - t0
                    if step >= 20:  # warm-up excluded
                        samples.append(elapsed * 1e3)
                calls = iterations + 20
                used = cpu.stop()
                server_cpu, client_cpu = used["server"] / calls * 1e3, used[CLIENT] / calls * 1e3
                assert all(r.status == pb.ALLOCATION_STATUS_OK for r in response.results)
                samples.sort()
                p99 = samples[min(len(samples) - 1, int(len(samples) * 0.99))]
                print(f"{num_seqs:>10} {statistics.median(samples):>10.3f} {p99:>8.3f} "
                      f"{statistics.fmean(samples):>8.3f} {server_cpu:>11.3f} {client_cpu:>11.3f} {len(samples):>6}")
                stub.Free(pb.FreeRequest(pool_id="bench", session_id=session, seq_ids=ids))
            routing_lookup(stub, session, quick, proc.pid)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)


def routing_lookup(stub, session: str, quick: bool, server_pid: int) -> None:
    """LookupPrefix (the routing question) for one prompt whose blocks are all published:
    sent as token ids (the kvmanager hashes them), as token ids plus the block hashes
    the gateway computed (``kvserve.prefix_hashes.prefix_block_hashes``: no hashing, every
    hit still checked against the tokens), and as block hashes alone; then against 4
    pools that hash alike (one chain hashed for all of them). Target: 256 blocks under
    1 ms median. The CPU columns (server and client, per call) do not depend on what
    the neighbours of a shared machine do."""
    from kvserve.prefix_hashes import prefix_block_hashes
    from kvserve.v1 import kvmanager_pb2 as pb

    print(f"gRPC loopback: LookupPrefix of one prompt, all its blocks published (block_size {BLOCK_SIZE}); "
          f"client-side round trip")
    print(f"{'blocks':>10} {'query':>15} {'pools':>6} {'median ms':>10} {'p99 ms':>8} {'server CPU':>11} "
          f"{'client CPU':>11} {'calls':>6}   (CPU: ms per call)")
    extra_pools = [f"bench-{i}" for i in range(1, 4)]
    for pool_id in extra_pools:
        stub.RegisterPool(pb.RegisterPoolRequest(pool_id=pool_id, num_blocks=100_000, block_size=BLOCK_SIZE,
                                                 model_fingerprint="bench", enable_prefix_caching=True))
    for num_blocks in (16, 256):
        prompt = list(range(50_000, 50_000 + num_blocks * BLOCK_SIZE + 1))
        seq_id = 10**9 + num_blocks
        for pool_id in ["bench", *extra_pools]:
            pool_session = session if pool_id == "bench" else \
                stub.OpenSession(pb.OpenSessionRequest(pool_id=pool_id)).session_id
            stub.Allocate(pb.AllocateRequest(pool_id=pool_id, session_id=pool_session, sequences=[
                pb.SequenceAllocation(seq_id=seq_id, token_ids=prompt, num_new_tokens=len(prompt),
                                      enable_prefix_caching=True)]))
            stub.Free(pb.FreeRequest(pool_id=pool_id, session_id=pool_session, seq_ids=[seq_id],
                                     written_seq_ids=[seq_id], written_num_tokens=[len(prompt)]))
        hashes = prefix_block_hashes("bench", BLOCK_SIZE, prompt)
        with_hashes = dict(block_hashes=hashes, hashes_block_size=BLOCK_SIZE, hashes_model_fingerprint="bench")
        cases = [
            ("tokens", ["bench"], pb.PrefixQuery(token_ids=prompt)),
            ("tokens+hashes", ["bench"], pb.PrefixQuery(token_ids=prompt, **with_hashes)),
            ("hashes", ["bench"], pb.PrefixQuery(**with_hashes)),
            ("tokens", ["bench", *extra_pools], pb.PrefixQuery(token_ids=prompt)),
        ]
        for label, pool_ids, query in cases:
            request = pb.LookupPrefixRequest(pool_ids=pool_ids, queries=[query])
            samples = []
            calls = (200 if quick else 1000) + 20
            cpu = CpuMeter({"server": server_pid})
            cpu.start()
            for call in range(calls):
                t0 = time.perf_counter()
                reply = stub.LookupPrefix(request)
                if call >= 20:
                    samples.append((time.perf_counter() - t0) * 1e3)
            used = cpu.stop()
            server_cpu, client_cpu = used["server"] / calls * 1e3, used[CLIENT] / calls * 1e3
            assert all(hit.num_cached_tokens == num_blocks * BLOCK_SIZE for hit in reply.matches[0].pools), reply
            samples.sort()
            p99 = samples[min(len(samples) - 1, int(len(samples) * 0.99))]
            print(f"{num_blocks:>10} {label:>15} {len(pool_ids):>6} {statistics.median(samples):>10.3f} "
                  f"{p99:>8.3f} {server_cpu:>11.3f} {client_cpu:>11.3f} {len(samples):>6}")


def tiered_lookup(quick: bool) -> None:
    """LookupPrefix (with store tokens) over 1M indexed blocks: half in a pool's prefix cache,
    half in its store's index; the prompt hits 128 blocks in each."""
    from types import SimpleNamespace

    from kvserve.prefix_hashes import block_key, extra_keys, prefix_block_hashes, root_hash
    from kvmanager.manager import KVManager, StoreConfig
    from kvmanager.pool import AllocationRequest, PoolConfig

    half = 1 << 19
    manager = KVManager(freeze_gc=True, store_save_policy="off")  # as the server runs it; nobody carries saves here
    manager.register_pool(PoolConfig("tiers", half + 1024, BLOCK_SIZE, "bench"),  # + the fillers' partial blocks
                          store=StoreConfig("file:///bench", "ns", 0, "DISK"))
    session = manager.open_session("tiers").session_id
    rng = random.Random(0)
    prompt = [rng.randrange(1, 49_000) for _ in range(256 * BLOCK_SIZE + 1)]
    filler_blocks, seq_id = 0, 0
    while filler_blocks < half - 128:  # the pool's cache, filled with other prompts' published blocks
        n = min(4096, half - 128 - filler_blocks) * BLOCK_SIZE
        seq_id += 1
        tokens = [seq_id] + [rng.randrange(1, 49_000) for _ in range(n)]
        manager.allocate("tiers", session, [], [AllocationRequest(seq_id, tokens, len(tokens))])
        manager.free("tiers", session, [seq_id], [seq_id], [len(tokens)])
        filler_blocks += n // BLOCK_SIZE
    head = prompt[:128 * BLOCK_SIZE + 1]
    (admitted,), _ = manager.allocate("tiers", session, [], [AllocationRequest(0, head, len(head))])
    assert admitted.ok, admitted
    manager.free("tiers", session, [0], [0], [len(head)])
    index = manager.pools["tiers"].store
    hashes = prefix_block_hashes("bench", BLOCK_SIZE, prompt)
    parents = [root_hash("bench"), *hashes]
    # The store holds the prompt's whole chain (a chain is found from its first block: an index
    # keeps no entry whose parent it lacks) and one-block chains of other prompts.
    entries = [(hashes[i], block_key(parents[i], extra_keys("", ""), prompt[i * BLOCK_SIZE:(i + 1) * BLOCK_SIZE]))
               for i in range(256)]
    entries += [(rng.randbytes(16), block_key(parents[0], extra_keys("", ""), [rng.randrange(1, 49_000)] * BLOCK_SIZE))
                for _ in range(half - 256)]
    index.rebuild(entries)
    del entries
    gc.collect()
    gc.freeze()  # the server freezes its long-lived objects too (KVManager freeze_gc)
    query = SimpleNamespace(token_ids=prompt, cache_salt="", adapter_id="")
    samples = []
    for call in range((200 if quick else 2000) + 20):
        t0 = time.perf_counter()
        ((_, cached, stored),) = manager.lookup_prefix(["tiers"], [query], with_store=True)[0]
        if call >= 20:
            samples.append((time.perf_counter() - t0) * 1e3)
    assert (cached, stored) == (128 * BLOCK_SIZE, 128 * BLOCK_SIZE), (cached, stored)
    samples.sort()
    print(f"in process: LookupPrefix across tiers, {manager.stats('tiers').num_cached_blocks} pool blocks cached + "
          f"{len(index)} store entries; a 256-block prompt, 128 hit in each")
    print(f"  median {statistics.median(samples):.3f} ms, p99 {samples[int(len(samples) * 0.99)]:.3f} ms "
          f"({len(samples)} calls; target p99 < 1 ms)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.kvmanager_bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer sequences and calls")
    parser.add_argument("--skip-grpc", action="store_true", help="only the in-process part")
    args = parser.parse_args(argv)
    from kvserve.logs import configure_logging

    configure_logging("warning")
    print(f"python {sys.version.split()[0]}, {os.cpu_count()} CPUs, load average "
          f"{' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    # gRPC first: the client's timings must not pay for collecting the 1M-block pool.
    if not args.skip_grpc:
        over_grpc(args.quick)
        print()
    report_in_process(args.quick)
    print()
    tiered_lookup(args.quick)
    return 0


if __name__ == "__main__":
    sys.exit(main())
