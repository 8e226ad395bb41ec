"""bench.multiturn_store without services: the conversations, the pool sizing and the report."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

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


def long_context(**overrides) -> SimpleNamespace:
    """The flags of ``--workload long-context`` at their defaults, with ``overrides``."""
    args, _ = mts.parse_args(["--workload", "long-context"])
    return SimpleNamespace(**{**vars(args), **overrides})


def turn_prompts(tokenizer: ModelChatTokenizer, chat: mts.Chat, reply: str) -> list[list[int]]:
    """Each turn's rendered prompt, every earlier reply ``reply``."""
    messages, prompts = [], []
    for user in chat.user_turns:
        messages.append({"role": "user", "content": user})
        prompts.append(tokenizer.chat_ids(messages))
        messages.append({"role": "assistant", "content": reply})
    return prompts


def test_long_context_turns_share_their_document_fit_their_context_and_outgrow_the_pool(default_model_dir):
    tokenizer = ModelChatTokenizer(default_model_dir)
    conversations = load_conversations(min_turns=3)
    reply = tokenizer.decode(tokenizer.encode(" word" * 32))  # a reply of max_tokens tokens
    args = long_context()
    assert (args.document_tokens, args.question_tokens, args.num_conversations, args.max_context) == (768, 48, 16, 1024)
    assert args.out.name == "multiturn-store-long-context"
    chats = mts.build_workload(conversations, tokenizer, args)
    assert chats == mts.build_workload(conversations, tokenizer, long_context()), "the draw is seeded"
    assert chats != mts.build_workload(conversations, tokenizer, long_context(seed=1))
    assert len(chats) == 16 and all(len(c.user_turns) == 3 for c in chats)
    firsts = []
    for chat in chats:
        assert chat.context_tokens <= 1024 and chat.user_turns[0].startswith(mts.DOCUMENT_INTRO)
        prompts = turn_prompts(tokenizer, chat, reply)
        assert len(prompts[-1]) + len(tokenizer.encode(reply)) <= 1024 + 8  # re-encoding a cut text may shift a few
        assert all(p[:len(prompts[0])] == prompts[0] for p in prompts[1:]), "every turn starts with the document"
        assert len(prompts[0]) >= chat.document_tokens and chat.document_tokens <= 768
        assert all(0 < len(tokenizer.encode(q)) <= 48 + 2 for q in chat.user_turns[1:])  # short questions
        firsts.append(tuple(prompts[0][:4 * mts.BLOCK]))
    assert len(set(firsts)) == 16, "no two documents open alike: at most the template's blocks are shared"
    assert sum(c.document_tokens == 768 for c in chats) >= 8, "most documents are whole at --max-context 1024"

    pool = mts.plan_pool(chats)
    assert pool["ratio"] >= 4 and pool["pool_tokens"] >= max(c.context_tokens for c in chats)
    assert pool["working_set_tokens"] >= 16 * 900, "the working set is mostly documents"
    two = pool["two_num_blocks"] - 1
    assert two * mts.BLOCK >= max(c.context_tokens for c in chats) and 2 * two <= pool["num_blocks"]

    small = mts.build_workload(conversations, tokenizer, long_context(max_context=600, num_conversations=4))
    assert all(c.context_tokens <= 600 and c.document_tokens < 600 for c in small), "the document shrinks to fit"
    assert all(len(turn_prompts(tokenizer, c, reply)[-1]) + 32 <= 600 + 8 for c in small)
    with pytest.raises(ValueError, match="no room for a document"):
        mts.build_workload(conversations, tokenizer, long_context(max_context=300))

    workload = mts.describe_workload(args, chats)
    assert workload["kind"] == "long-context" and workload["document_tokens"] == 768
    docs = [c.document_tokens for c in chats]
    assert (workload["document_tokens_min"], workload["document_tokens_max"]) == (min(docs), max(docs))
    assert [c["document_tokens"] for c in workload["chats"]] == docs
    text = mts.format_report({"workload": workload, "pool": pool, "rows": [], "lscpu": ""})
    assert text.startswith(f"16 long-context conversations (workload long-context: a pasted document of 768 tokens "
                           f"asked, {min(docs)}-{max(docs)} kept, mean ")
    assert "questions of up to 48 tokens) x 3 turns" in text.splitlines()[0]
    sharegpt, _ = mts.parse_args([])
    assert sharegpt.workload == "sharegpt" and str(sharegpt.out) == "bench/results/multiturn-store"
    plain = mts.describe_workload(sharegpt, chats)
    assert plain["kind"] == "sharegpt" and "document_tokens" not in plain
    assert mts.format_report({"workload": plain, "pool": pool, "rows": []}).startswith("16 ShareGPT conversations x 3")
