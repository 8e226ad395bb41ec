"""bench.multiturn_store without services: the conversations, the pool sizing and the report."""
from __future__ import annotations

from types import SimpleNamespace

from bench import multiturn_store as mts
from bench.routing_bench import Conversation, ModelChatTokenizer, load_conversations


def rendered_last_turn(tokenizer: ModelChatTokenizer, chat: mts.Chat, reply: str) -> int:
    """Tokens of the last turn's prompt, every earlier reply ``reply``, plus one more reply."""
    messages = []
    for user in chat.user_turns:
        messages += [{"role": "user", "content": user}, {"role": "assistant", "content": reply}]
    return len(tokenizer.chat_ids(messages[:-1])) + len(tokenizer.encode(reply))


def test_conversations_fit_their_context_the_pool_is_a_quarter_of_them_and_the_report_reads(default_model_dir):
    tokenizer = ModelChatTokenizer(default_model_dir)
    reply = tokenizer.decode(tokenizer.encode(" word" * 32))  # a reply of max_tokens tokens
    long_one = Conversation("long", tuple((f"question {t}: " + "lorem ipsum " * 2000, "answer") for t in range(3)))
    chats = mts.build_chats([long_one, *load_conversations(min_turns=3)], tokenizer, num=16, turns=3, max_tokens=32,
                            max_context=1024, seed=0)
    assert len(chats) == 16 and all(len(c.user_turns) == 3 for c in chats)
    assert chats == mts.build_chats([long_one, *load_conversations(min_turns=3)], tokenizer, num=16, turns=3,
                                    max_tokens=32, max_context=1024, seed=0), "the draw is seeded"
    for chat in chats:
        assert chat.context_tokens <= 1024
        assert rendered_last_turn(tokenizer, chat, reply) <= 1024 + 8  # re-encoding a cut text may shift a few
    cut = mts.build_chats([long_one], tokenizer, num=1, turns=3, max_tokens=32, max_context=1024, seed=0)[0]
    assert 1000 <= rendered_last_turn(tokenizer, cut, reply) <= 1024 + 8, "the long turns share the budget"
    assert mts.fair_caps([10, 500, 1000], 600) == [10, 295, 295]

    pool = mts.plan_pool(chats)
    assert pool["working_set_tokens"] == sum(c.context_tokens for c in chats)
    assert pool["pool_tokens"] == (pool["num_blocks"] - 1) * mts.BLOCK  # one block is the null block
    assert pool["ratio"] >= 4 and pool["pool_tokens"] >= max(c.context_tokens for c in chats)
    half = pool["two_num_blocks"] - 1  # each of two executors: half the pool rounded up, the longest chat fits
    assert half >= -(-(pool["num_blocks"] - 1) // 2) and half * mts.BLOCK >= max(c.context_tokens for c in chats)
    assert pool["two_ratio"] == pool["working_set_tokens"] / (2 * half * mts.BLOCK)
    assert mts.plan_pool([mts.Chat([], 400)] * 15)["two_num_blocks"] == 47 + 1  # a pool of 93 blocks: 47 each
    assert mts.plan_pool([mts.Chat([], 400)] * 8)["two_num_blocks"] == 26 + 1  # of 50: a 400-token chat needs 26

    def row(slug, p50, tput, hit, store):
        return {"slug": slug, "name": mts.ROWS[slug].name, "ttft_p50_ms": p50, "ttft_p90_ms": 2 * p50,
                "output_tok_s": tput, "hit_rate": hit, "store_hit_tokens": store, "failed": 0, "errors": []}

    results = {"workload": {"conversations": 16, "turns": 3, "max_tokens": 32, "concurrency": 4}, "pool": pool,
               "rows": [row("off", 900.0, 10.0, 0.1, 0.0), row("directory", 300.0, 20.0, 0.8, 5000.0),
                        {"slug": "redis", "name": mts.ROWS["redis"].name, "skipped": "RuntimeError: no redis"},
                        row("restart", 450.0, 15.0, 0.76, 7000.0), row("two-off", 800.0, 12.0, 0.2, 0.0),
                        row("two-directory", 400.0, 18.0, 0.85, 6000.0)],
               "load_vs_prefill": {"tokens": 512, "dtype": "bfloat16", "threads": 2, "prefill_us_per_token": 2000.0,
                                   "stores": {"directory": {"load_us_per_token": 20.0, "MB_per_s": 900.0,
                                                            "load_over_prefill": 0.01}}},
               "lscpu": "".join(f"line {i}\n" for i in range(30))}
    text = mts.format_report(results)
    assert "| row | TTFT p50 (ms) | TTFT p90 (ms) | output tok/s | prefix hit rate | store hit tokens |" in text
    assert "| directory store | 300 | 600 | 20.0 | 80.0% | 5000 |" in text
    assert "| redis store | skipped: RuntimeError: no redis |" in text
    assert "directory store: TTFT p50 off/store = 3.00x, throughput store/off = 2.00x" in text
    assert "| two executors, one shared directory store | 400 | 800 | 18.0 | 85.0% | 6000 |" in text
    assert "two executors, one shared directory store: TTFT p50 two-off/two-directory = 2.00x, " \
           "throughput two-directory/two-off = 1.50x" in text
    assert text.count("TTFT p50 off/store") == 2, "directory and restart; two-executor rows compare with two-off"
    assert "76.0% vs 80.0% without the restart = 95% (target >= 90%: HOLDS)" in text
    assert "= 1.0% (target <= 5%: HOLDS)" in text
    assert f"= {pool['ratio']:.1f}x; two executors: {pool['two_num_blocks']} blocks each" in text.splitlines()[0]
    assert "line 19" in text and "line 20" not in text  # lscpu | head -20


def flag_values(flags: list[str], name: str) -> list[str]:
    return [flags[i + 1] for i, flag in enumerate(flags) if flag == name]


def test_two_executor_rows_get_one_thread_each_and_share_one_store_directory(tmp_path):
    args = SimpleNamespace(model=tmp_path / "model", dtype="auto", num_threads=2)  # the defaults: 2 cores
    pool = mts.plan_pool([mts.Chat([], 1000)] * 16)
    store_dir, redis_url = str(tmp_path / "store"), "redis://127.0.0.1:6379/0"
    for slug, spec in mts.ROWS.items():
        setup = mts.row_setup(slug, pool, args, store_dir, redis_url)
        assert len(setup["executors"]) == spec.executors
        threads = 1 if spec.executors == 2 else 2  # two executors split the 2 cores, one keeps both
        assert setup["threads"] == threads and setup["env"]["OMP_NUM_THREADS"] == str(threads)
        blocks = pool["two_num_blocks"] if spec.executors == 2 else pool["num_blocks"]
        for flags in setup["executors"]:
            assert flag_values(flags, "--num-threads") == [str(threads)]
            assert flag_values(flags, "--num-blocks") == [str(blocks)]
            assert flag_values(flags, "--model") == [str(args.model)]
        stores = {tuple(flag_values(flags, "--kv-store")) for flags in setup["executors"]}
        expected = {"": (), "redis": (redis_url,), "directory": (store_dir,)}[spec.store]
        assert stores == {expected}, f"{slug}: every executor of the row on the same store"
    assert mts.ROWS["two-directory"].executors == 2 and mts.ROWS["two-directory"].store == "directory"
    assert mts.ROWS["two-off"].executors == 2 and mts.ROWS["two-off"].store == ""
    four = mts.row_setup("two-directory", pool, SimpleNamespace(**{**vars(args), "num_threads": 4}), store_dir, "")
    assert [flag_values(f, "--num-threads") for f in four["executors"]] == [["2"], ["2"]]
