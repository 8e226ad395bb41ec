"""What the front ends read: a request's outputs, and several requests' outputs merged.

``RequestStream`` yields one ``RequestOutput`` per step until the finished one
(raising the request's error, if it failed). ``MergedStream`` serves several
prompts in one completion request: choice ``j`` of prompt ``i`` becomes choice
``i * n + j`` (OpenAI's numbering); it finishes when every prompt has, with usage
summed.
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace

from gateway.sequence import GenerationRequest, PredictionTokens, RequestOutput


@dataclass(eq=False)
class RequestStream:
    """What a front end reads: the request's outputs, one per step, the last with ``finished``."""

    request: GenerationRequest
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)

    @property
    def request_id(self) -> str:
        return self.request.request_id

    def __aiter__(self):
        return self._iterate()

    async def _iterate(self):
        while True:
            output: RequestOutput = await self.queue.get()
            if output.error is not None:
                raise output.error
            yield output
            if output.finished:
                return


@dataclass
class MergedStream:
    """Async-iterable like ``RequestStream``: outputs of every prompt, choice indices shifted."""

    request_id: str
    streams: list[RequestStream]
    n: int

    def abort_all(self, abort: Callable[[str], bool]) -> None:
        for stream in self.streams:
            abort(stream.request_id)

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self._iterate()

    async def _iterate(self):
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(position: int, stream: RequestStream) -> None:
            try:
                async for output in stream:
                    queue.put_nowait((position, output, None))
            except Exception as exc:  # noqa: BLE001 — re-raised by the consumer
                queue.put_nowait((position, None, exc))

        tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(self.streams)]
        last: dict[int, RequestOutput] = {}
        try:
            while len(last) < len(self.streams):
                position, output, error = await queue.get()
                if error is not None:
                    raise error
                shift = position * self.n
                if output.finished:
                    last[position] = output
                done = len(last) == len(self.streams)
                yield RequestOutput(
                    request_id=self.request_id,
                    choices=[replace(c, index=c.index + shift) for c in output.choices],
                    finished=done,
                    prompt_tokens=sum(o.prompt_tokens for o in last.values()) if done else 0,
                    completion_tokens=sum(o.completion_tokens for o in last.values()) if done else 0,
                    cached_tokens=sum(o.cached_tokens for o in last.values()) if done else 0,
                    prediction_tokens=_summed_prediction(list(last.values())) if done else None,
                )
        finally:
            for task in tasks:
                task.cancel()


def _summed_prediction(outputs: list[RequestOutput]) -> PredictionTokens | None:
    """The prompts' prediction counts together (None where the request sent no prediction)."""
    counts = [o.prediction_tokens for o in outputs if o.prediction_tokens is not None]
    return sum(counts, PredictionTokens()) if counts else None
