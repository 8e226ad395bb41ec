"""Executors joining and leaving a serving gateway: the Engine in-process over real
kvmanager and executor processes, its dns:/// resolution replaced by a list the test edits."""
from __future__ import annotations

import asyncio

import pytest

import gateway.engine as engine_module
from gateway.detokenizer import ModelTokenizer
from gateway.engine import Engine, EngineConfig
from gateway.metrics import GatewayMetrics
from gateway.sequence import SamplingOptions

pytestmark = pytest.mark.timeout(300)


async def collect(stream) -> tuple[list[int], object]:
    tokens = []
    while True:
        output = await stream.queue.get()
        for choice in output.choices:
            tokens += choice.token_ids
        if output.finished:
            return tokens, output.error


def test_executors_join_and_leave_while_serving(start_service, tiny_model_dir, monkeypatch):
    kvmanager = start_service("kvmanager")
    executors = [start_service("executor", "--model", str(tiny_model_dir), "--dtype", "float32", timeout=300,
                               env={"OMP_NUM_THREADS": "1"}) for _ in range(2)]
    resolved = [executors[0].address]

    async def fake_resolve(targets, previous):
        return {targets[0]: list(resolved)}

    monkeypatch.setattr(engine_module, "resolve_targets", fake_resolve)

    async def scenario():
        config = EngineConfig(kvmanager_address=kvmanager.address, executor_address="dns:///executors:50053",
                              executor_discovery_interval_s=0.1, unavailable_timeout_s=60)
        engine = Engine(config, ModelTokenizer(tiny_model_dir), GatewayMetrics("tiny"))
        await engine.start()
        try:
            assert list(engine.backends) == [executors[0].address]
            options = SamplingOptions(max_tokens=300, ignore_eos=True)
            # The first executor's requests must outlast its leaving: long enough that a fast CPU cannot
            # finish them while the second executor connects (300 tokens could, on an idle AMX Xeon).
            long_options = SamplingOptions(max_tokens=1500, ignore_eos=True)
            prompts = [[1000 + i] * 20 for i in range(6)]
            first = [await engine.submit(p, long_options) for p in prompts]
            resolved.append(executors[1].address)  # a second executor joins
            for _ in range(100):
                if executors[1].address in engine.backends and engine.backends[executors[1].address].is_up:
                    break
                await asyncio.sleep(0.1)
            assert engine.backends[executors[1].address].is_up
            second = [await engine.submit(p, options) for p in prompts]
            assert engine.backends[executors[1].address].scheduler.requests or \
                engine.backends[executors[1].address].inbox, "nothing was routed to the new executor"
            leaving = engine.backends[executors[0].address]
            assert leaving.scheduler.requests or leaving.inbox, "the first executor's requests ended too soon"
            resolved.remove(executors[0].address)  # the first one leaves while its requests run
            results = await asyncio.gather(*(collect(s) for s in first + second))
            assert list(engine.backends) == [executors[1].address]
            migrated = engine.metrics.registry.get_sample_value(
                "kvserve:requests_migrated_total", {"model_name": "tiny", "executor": executors[0].address})
            assert migrated, "no request was running on the executor that left"
            fresh_options = SamplingOptions(max_tokens=long_options.max_tokens, ignore_eos=True, cache_salt="fresh")
            fresh = await asyncio.gather(*[collect(await engine.submit(p, fresh_options)) for p in prompts])
        finally:
            await engine.shutdown()
        for i, (tokens, error) in enumerate(results):
            asked = (long_options if i < len(prompts) else options).max_tokens
            assert error is None and len(tokens) == asked, f"request {i}"
            assert tokens == fresh[i % len(prompts)][0][:asked], f"request {i}"

    asyncio.run(scenario())
