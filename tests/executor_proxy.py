"""A test proxy in front of an executor: forwards Describe, Execute and ExecuteStream (each step of
a stream as one Execute; with ``streaming=False`` it answers ExecuteStream UNIMPLEMENTED, as an
executor with only Execute does), serves grpc.health.v1. It offers no step socket (it does not
pass the executor's on), so every step comes through it.

It lets a test put a step "on hold" (``pause``/``resume``: after a given number of
Executes, the next one waits at the proxy before it is forwarded), refuse any Execute that carries a marker token
id (INVALID_ARGUMENT, nothing forwarded, so no KV is written), and restart the
executor behind it while the gateway's connection to the proxy stays open: the
proxy forwards with ``wait_for_ready``, so a held step reaches the new executor
and its reply carries the new ``instance_id``.
"""
from __future__ import annotations

import threading
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from kvserve.v1 import executor_pb2, executor_pb2_grpc

CHANNEL_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 500),
]


class ExecutorProxy(executor_pb2_grpc.ExecutorServicer):
    def __init__(self, upstream: str, refuse_token_id: int | None = None, forward_timeout: float = 60.0,
                 streaming: bool = True):
        self.upstream = upstream
        self.streaming = streaming
        self.steps = {"unary": 0, "streamed": 0}  # Executes forwarded, by how they came
        self.refuse_token_id = refuse_token_id
        self.forward_timeout = forward_timeout
        self._channel = grpc.insecure_channel(upstream, options=CHANNEL_OPTIONS)
        self._stub = executor_pb2_grpc.ExecutorStub(self._channel)
        self._open = threading.Event()
        self._open.set()
        self._countdown = 0
        self.held = threading.Event()  # set when an Execute waits at the closed gate
        self.lock = threading.Lock()
        self.refused_batches: list[list[int]] = []  # seq_ids of each refused Execute
        self.instance_ids: list[str] = []  # instance_id of each forwarded Execute's reply
        self._server: grpc.Server | None = None
        self.address = ""

    # --- control ----------------------------------------------------------------------

    def start(self, host: str = "127.0.0.1") -> str:
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=8), options=[("grpc.so_reuseport", 0)])
        executor_pb2_grpc.add_ExecutorServicer_to_server(self, server)
        health_servicer = health.HealthServicer()
        for name in ("", executor_pb2.DESCRIPTOR.services_by_name["Executor"].full_name):
            health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
        port = server.add_insecure_port(f"{host}:0")
        server.start()
        self._server = server
        self.address = f"{host}:{port}"
        return self.address

    def stop(self) -> None:
        self._open.set()
        if self._server is not None:
            self._server.stop(0).wait(5)
            self._server = None
        self._channel.close()

    def pause(self, after: int = 0) -> None:
        """Lets ``after`` more Executes through, then holds the next one at the proxy (``held``
        is set) until ``resume``."""
        with self.lock:
            self._countdown = after
            self.held.clear()
            self._open.clear()

    def resume(self) -> None:
        self._open.set()

    # --- the Executor service --------------------------------------------------------------

    def _forward(self, method, request, context):
        try:
            return method(request, timeout=self.forward_timeout, wait_for_ready=True)
        except grpc.RpcError as exc:
            context.abort(exc.code(), exc.details() or "")

    def Describe(self, request, context):
        reply = self._forward(self._stub.Describe, request, context)
        reply.ClearField("step_socket")  # the steps come through here, as to an executor with gRPC only
        return reply

    def Execute(self, request, context):
        reply = self._step(request, context)
        with self.lock:
            self.steps["unary"] += 1
        return reply

    def ExecuteStream(self, request_iterator, context):
        if not self.streaming:
            context.abort(grpc.StatusCode.UNIMPLEMENTED, "this proxy forwards Execute only")
        for request in request_iterator:
            reply = self._step(request, context)
            with self.lock:
                self.steps["streamed"] += 1
            yield reply

    def _step(self, request, context):
        with self.lock:
            hold = not self._open.is_set() and self._countdown == 0
            if not self._open.is_set() and self._countdown > 0:
                self._countdown -= 1
        if hold:
            self.held.set()
            self._open.wait()
        marker = self.refuse_token_id
        if marker is not None:
            for i, sequence in enumerate(request.sequences):
                if marker in sequence.token_ids:
                    with self.lock:
                        self.refused_batches.append([s.seq_id for s in request.sequences])
                    context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                  f"sequences[{i}].token_ids: token id {marker} is refused by the test proxy")
        reply = self._forward(self._stub.Execute, request, context)
        with self.lock:
            self.instance_ids.append(reply.instance_id)
        return reply
