"""``python -m gateway``: the OpenAI-compatible HTTP API and gRPC Gateway in one asyncio loop."""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
from pathlib import Path

import uvicorn

from gateway.clients import ChannelSecurity
from gateway.constraints import GrammarCompiler
from gateway.detokenizer import ModelTokenizer
from gateway.engine import Engine, EngineConfig
from gateway.grpc_api import GatewayServicer
from gateway.http_api import create_app
from gateway.metrics import GatewayMetrics
from gateway.response_store import DEFAULT_CAPACITY_BYTES, DEFAULT_TTL_S, open_response_store
from gateway.routing import ROUTING_POLICIES
from gateway.scheduler import SchedulerConfig
from gateway.tenants import TenantResolver, load_api_keys, parse_tenant_list
from kvserve.aio import wait_within
from kvserve.auth import token_or_none
from kvserve.config import EnvArgumentParser, add_server_flags, check_server_flags, config_from_args
from kvserve.errors import StartupError
from kvserve.logs import configure_logging, get_logger
from kvserve.paths import default_model_dir
from kvserve.ports import DEFAULT_EXECUTOR_ADDRESS, DEFAULT_GATEWAY_PORT, DEFAULT_HTTP_PORT, DEFAULT_KVMANAGER_ADDRESS
from kvserve.server import GrpcServer, Service, TlsFiles, run_service, wait_for_shutdown_signal
from kvserve.v1 import gateway_pb2, gateway_pb2_grpc

log = get_logger("gateway")


def build_parser() -> EnvArgumentParser:
    parser = EnvArgumentParser(prog="gateway", description="kvserve gateway: requests, continuous batching, "
                               "OpenAI-compatible HTTP and gRPC APIs")
    add_server_flags(parser, default_port=DEFAULT_GATEWAY_PORT)
    # Each dest that names an EngineConfig or SchedulerConfig field sets it (see serve).
    parser.add_argument("--http-port", type=int, default=DEFAULT_HTTP_PORT, help="OpenAI-compatible HTTP port")
    parser.add_argument("--http-keep-alive", dest="http_keep_alive_s", type=float, default=75.0,
                        help="seconds an idle HTTP connection stays open; longer than a load balancer's or client "
                             "pool's idle timeout, so the gateway is not the side that closes a connection a client "
                             "is about to reuse")
    parser.add_argument("--kvmanager-address", default=DEFAULT_KVMANAGER_ADDRESS, help="kvmanager gRPC address")
    parser.add_argument("--executor-address", default=DEFAULT_EXECUTOR_ADDRESS,
                        help="executor gRPC addresses, comma-separated: host:port, or dns:///name:port for every "
                             "address the name resolves to, resolved again while serving (a Kubernetes headless "
                             "Service, compose replicas)")
    parser.add_argument("--executor-discovery-interval", dest="executor_discovery_interval_s", type=float,
                        default=5.0, help="seconds between resolutions of dns:/// executor names")
    parser.add_argument("--routing", choices=list(ROUTING_POLICIES), default="kv",
                        help="which executor a request goes to: kv (cached prefix and load, see docs/gateway.md), "
                             "least-loaded, round-robin")
    parser.add_argument("--model", type=Path, default=default_model_dir(),
                        help="model directory (tokenizer.json, chat template)")
    parser.add_argument("--served-model-name", default=None, help="model name in the APIs (default: "
                        "the model directory's name)")
    parser.add_argument("--max-num-seqs", type=int, default=64, help="most sequences running at once")
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048,
                        help="most tokens computed per step (prefill is chunked to fit)")
    parser.add_argument("--batching", choices=["continuous", "static"], default="continuous",
                        help="continuous (iteration-level) or static (batch runs to completion) batching")
    parser.add_argument("--speculative-decoding", choices=["off", "prompt-lookup"], default="prompt-lookup",
                        help="prompt-lookup: greedy requests send n-gram drafts from their own prompt and output, "
                             "verified by the executor in the step's forward (same tokens, fewer steps on text that "
                             "copies its input; docs/gateway.md); off: one token a step")
    parser.add_argument("--num-speculative-tokens", type=int, default=5,
                        help="most drafts a sequence sends per step (adapted per sequence to its acceptance)")
    parser.add_argument("--speculative-token-budget", type=int, default=16,
                        help="drafts go only into steps of at most this many tokens, drafts included: a large "
                             "batch is compute-bound, where verifying guesses costs more than it saves")
    parser.add_argument("--kv-allocation", choices=["paged", "reserve"], default="paged",
                        help="kvmanager pool policy: blocks on demand or max_model_len reserved at admission")
    parser.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                        default=True, help="reuse cached KV blocks of shared prompt prefixes")
    parser.add_argument("--responses-store", default="memory",
                        help="where the Responses API keeps stored responses (previous_response_id, GET "
                             "/v1/responses/{id}): memory (this gateway's), or a Redis URL (redis://host:port/db, "
                             "rediss://..., unix:///path.sock) shared by every gateway on it and kept across restarts")
    parser.add_argument("--responses-store-mib", type=int, default=DEFAULT_CAPACITY_BYTES >> 20,
                        help="memory store: MiB of stored responses (least recently used forgotten first; 0: none "
                             "stored)")
    parser.add_argument("--responses-store-ttl", type=int, default=DEFAULT_TTL_S,
                        help="Redis store: seconds a stored response is kept (default 30 days, as OpenAI's)")
    parser.add_argument("--max-queue-len", type=int, default=1024,
                        help="most requests waiting; more get HTTP 429 / RESOURCE_EXHAUSTED")
    parser.add_argument("--request-timeout", dest="request_timeout_s", type=float, default=None,
                        help="seconds a request may take from arrival to its last token; past it, it fails with "
                             "HTTP 504 / gRPC DEADLINE_EXCEEDED and its blocks are freed (default: no limit; a gRPC "
                             "client's own deadline is honoured either way)")
    parser.add_argument("--pool-id", default="", help="kvmanager pool name with one executor address; with "
                        "several, each executor's pool is <pool-id>@<address> (default: executor@<address>)")
    parser.add_argument("--session-ttl-ms", type=int, default=10_000, help="kvmanager session lease")
    parser.add_argument("--step-timeout", dest="step_timeout_s", type=float, default=None,
                        help="seconds an Execute may take before the executor counts as unreachable (stopped, hung) "
                             "and its requests move to another executor (or wait for this one); default: derived "
                             "per executor, 10x the expected time of the step from its last 64 steps, between 5 "
                             "and 120 s (120 s until it ran 8 steps)")
    parser.add_argument("--executor-step-socket", action=argparse.BooleanOptionalAction, default=True,
                        help="step an executor over the Unix socket its Describe offers when it is on this host "
                             "(no gRPC cost per step, docs/gateway.md); --no-executor-step-socket: always gRPC")
    parser.add_argument("--unavailable-timeout", dest="unavailable_timeout_s", type=float, default=30.0,
                        help="seconds requests wait (those in flight to be recomputed, new ones to start) while no "
                             "executor can serve (all unreachable, or kvmanager) before they fail with 503")
    parser.add_argument("--api-key", default=None, secret=True,
                        help="require 'Authorization: Bearer <key>' on the OpenAI API (/v1/*; 401 otherwise) and "
                             "'authorization: Bearer <key>' gRPC metadata on kvserve.v1.Gateway (UNAUTHENTICATED); "
                             "/health, /metrics, gRPC health and reflection stay open")
    parser.add_argument("--api-keys-file", default=None,
                        help="JSON object {\"<key>\": \"<tenant>\", ...}: each key is accepted like --api-key and "
                             "names the tenant of the requests it authenticates (its own cached KV, docs/gateway.md "
                             "Tenants); the X-Kvserve-Tenant header is then ignored. --api-key beside it is the "
                             "default tenant's key")
    parser.add_argument("--tenants", default=None,
                        help="comma-separated tenant names a request may pick with the 'X-Kvserve-Tenant' header "
                             "(gRPC metadata 'x-kvserve-tenant') when no --api-keys-file names tenants; without the "
                             "header a request is the default tenant's")
    parser.add_argument("--admin-key", default=None, secret=True,
                        help="enable the admin HTTP API (/admin/v1/*: tenant policies, pins) for 'Authorization: "
                             "Bearer <key>'; sent to kvmanager as 'kvserve-admin-key' metadata (start kvmanager "
                             "with the same --admin-key)")
    parser.add_argument("--service-token", default=None, secret=True,
                        help="sent as 'authorization: Bearer <token>' on every call to kvmanager and executor "
                             "(their --service-token)")
    parser.add_argument("--tls-ca-file", default=None,
                        help="PEM CA bundle: reach kvmanager and executor over TLS, trusting it")
    return parser


class _EmbeddedUvicorn(uvicorn.Server):
    """uvicorn inside our loop: the gateway, not uvicorn, handles SIGTERM."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


async def serve(args, parser: EnvArgumentParser) -> None:
    configure_logging(args.log_level)
    if not (args.model / "tokenizer.json").exists():
        raise StartupError(f"--model {args.model}: no tokenizer.json there")
    try:
        config = config_from_args(EngineConfig, args, scheduler=config_from_args(SchedulerConfig, args),
                                  channel_security=ChannelSecurity(args.service_token or None, args.tls_ca_file))
    except ValueError as exc:
        raise StartupError(parser.in_flag_terms(str(exc))) from exc
    tokenizer = ModelTokenizer(args.model)
    metrics = GatewayMetrics(args.served_model_name or args.model.name)
    engine = Engine(config, tokenizer, metrics)
    batching = {"batching": args.batching, "kv_allocation": args.kv_allocation,
                "enable_prefix_caching": args.enable_prefix_caching}
    grammars = GrammarCompiler.for_tokenizer(tokenizer)  # structured outputs, shared by both APIs
    if args.api_keys_file:
        api_key = load_api_keys(args.api_keys_file, args.api_key or None)
        if args.tenants:
            raise StartupError("--tenants: the keys of --api-keys-file name the tenants; give one or the other")
        tenants = TenantResolver(api_key)
    else:
        api_key = token_or_none(args.api_key)
        tenants = TenantResolver(None, parse_tenant_list(args.tenants))
    servicer = GatewayServicer(engine, tokenizer, batching, grammars, tenants)
    tls = TlsFiles.from_args(args)
    grpc_server = GrpcServer("gateway", args.host, args.port, [Service(
        gateway_pb2.DESCRIPTOR.services_by_name["Gateway"].full_name, servicer,
        gateway_pb2_grpc.add_GatewayServicer_to_server)], auth=api_key, auth_what="API key", tls=tls)
    try:
        responses = open_response_store(args.responses_store, args.responses_store_mib, args.responses_store_ttl)
    except ValueError as exc:
        raise StartupError(parser.in_flag_terms(str(exc))) from exc
    app = create_app(engine, tokenizer, api_key=api_key, grammars=grammars, tenants=tenants,
                     admin_key=args.admin_key or None, responses=responses)
    ssl = {"ssl_certfile": tls.cert_file, "ssl_keyfile": tls.key_file} if tls else {}
    http = _EmbeddedUvicorn(uvicorn.Config(app, host=args.host, port=args.http_port, log_level="warning",
                                           access_log=False, lifespan="off", timeout_graceful_shutdown=5,
                                           timeout_keep_alive=args.http_keep_alive_s, **ssl))
    problem = await responses.unreachable()
    if problem is not None:  # served all the same: the store is read per request, and may come back
        log.warning("responses_store_unreachable", error=problem)
    await engine.start()
    await grpc_server.start()
    http_task = asyncio.create_task(http.serve())
    while not http.started:
        if http_task.done():
            await engine.shutdown()
            await grpc_server.stop(0)
            raise StartupError(f"cannot listen on {args.host}:{args.http_port} (HTTP)")
        await asyncio.sleep(0.02)
    log.info("gateway_started", grpc=grpc_server.address, http=f"{args.host}:{args.http_port}",
             model=metrics.model_name, batching=args.batching, kv_allocation=args.kv_allocation,
             prefix_caching=args.enable_prefix_caching, api_key=api_key is not None, tls=tls is not None,
             tenants_by=("api key" if tenants.by_key else "header" if tenants.tenants else "none"),
             admin_api=bool(args.admin_key),
             service_token=bool(args.service_token), dependencies_tls=bool(args.tls_ca_file))
    signal_task = asyncio.create_task(wait_for_shutdown_signal())
    done, _ = await asyncio.wait({signal_task, http_task}, return_when=asyncio.FIRST_COMPLETED)
    log.info("gateway_stopping", signal=str(signal_task.result()) if signal_task in done else "http exited")
    await engine.shutdown(timeout=args.shutdown_grace)
    http.should_exit = True
    await grpc_server.stop(args.shutdown_grace)
    with contextlib.suppress(Exception):
        await wait_within(http_task, args.shutdown_grace + 1)
    await responses.close()
    signal_task.cancel()
    log.info("gateway_stopped")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    check_server_flags(parser, args)
    return run_service("gateway", lambda: serve(args, parser))


if __name__ == "__main__":
    sys.exit(main())
