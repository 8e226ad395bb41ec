"""``python -m kvmanager``: serve ``kvserve.v1.KVManager`` until SIGTERM/SIGINT."""
from __future__ import annotations

import asyncio
import contextlib
import json
import sys
from pathlib import Path

from kvmanager.allocate_socket import AllocateSocketListener
from kvmanager.events import DEFAULT_EVENT_BUFFER, DEFAULT_MEDIUM
from kvmanager.pool import SAVE_POLICIES
from kvmanager.manager import KVManager
from kvmanager.service import SERVICE_NAME, KVManagerService
from kvserve.auth import token_or_none
from kvserve.config import EnvArgumentParser, add_server_flags, add_service_token_flag, check_server_flags
from kvserve.errors import InvalidArgument
from kvserve.identity import new_instance_id
from kvserve.logs import configure_logging, get_logger
from kvserve.ports import DEFAULT_KVMANAGER_PORT
from kvserve.server import GrpcServer, Service, TlsFiles, run_service, wait_for_shutdown_signal
from kvserve.v1 import kvmanager_pb2_grpc

PROG = "kvmanager"
log = get_logger("kvmanager")


def build_parser() -> EnvArgumentParser:
    parser = EnvArgumentParser(
        prog=PROG,
        description="The kvserve KV cache manager: paged block pools with refcounts, "
        "copy-on-write, prefix caching and client leases, over gRPC.",
    )
    add_server_flags(parser, default_port=DEFAULT_KVMANAGER_PORT)
    add_service_token_flag(parser)
    parser.add_argument("--admin-key", default=None, secret=True,
                        help="enable the admin calls (SetTenantPolicy, PinPrefix, GetPin, UnpinPrefix): they must "
                             "carry 'kvserve-admin-key: <key>' metadata; the gateway's --admin-key must match")
    parser.add_argument("--tenants", default="", metavar="FILE",
                        help='tenant policies at start, a JSON file: {"tenants": {"NAME": {"weight": 1.0, '
                             '"quota_blocks": 0, "store_quota_blocks": 0}}} (0: no quota); "shared" names the '
                             "shared namespace; SetTenantPolicy changes them later")
    parser.add_argument("--default-session-ttl-ms", type=int, default=30_000,
                        help="lease length of a session opened with ttl_ms=0")
    parser.add_argument("--reap-interval-ms", type=int, default=250,
                        help="how often expired sessions are looked for and their sequences freed")
    parser.add_argument("--kv-store-save", default="all", choices=list(SAVE_POLICIES),
                        help="when published blocks are saved to a pool's KV store (the executor's --kv-store): "
                             "all: as soon as their KV is written (a restart, an eviction or a migration then "
                             "loads them); free: when their sequence ends or is preempted; off: never (loads only)")
    parser.add_argument("--allocate-socket", default="auto", metavar="auto|off|PATH",
                        help="a Unix socket that takes Allocate and Free without gRPC's cost per call, for a "
                             "gateway on this host (OpenSession names it; docs/kvmanager.md, 'The allocate "
                             "socket'): auto: in a fresh private directory under --allocate-socket-dir; off: none")
    parser.add_argument("--allocate-socket-dir", type=Path, default=None, metavar="DIR",
                        help="where --allocate-socket auto makes its directory (default: the temp directory); "
                             "a directory the gateway's host or container sees at the same path, such as a "
                             "volume both containers mount")
    parser.add_argument("--kv-events-buffer", type=int, default=DEFAULT_EVENT_BUFFER,
                        help="events each pool keeps so that a WatchEvents watcher can resume from an event id "
                        "(at least this many, whole batches; 0: no replay, only snapshots)")
    parser.add_argument("--kv-events-medium", default=DEFAULT_MEDIUM,
                        help="the medium KV events report for a pool registered without one")
    parser.add_argument("--kv-events-zmq", default="", metavar="ENDPOINT",
                        help="also publish every pool's KV events in vLLM's format on a ZeroMQ PUB socket bound "
                        "there, e.g. tcp://*:5557 ('>ENDPOINT' connects instead); needs pyzmq and msgspec "
                        "(pip install 'kvserve[kv-events]')")
    parser.add_argument("--kv-events-replay", default="", metavar="ENDPOINT",
                        help="with --kv-events-zmq: a ROUTER socket answering vLLM's replay requests, "
                        "e.g. tcp://*:5558")
    parser.add_argument("--kv-events-topic", default="kv-events",
                        help="with --kv-events-zmq: each message's topic is TOPIC/POOL_ID (POOL_ID when empty)")
    parser.add_argument("--kv-events-replay-buffer", type=int, default=10_000,
                        help="with --kv-events-replay: ZeroMQ messages (batches) kept for replay")
    parser.add_argument("--kv-events-data-parallel-rank", type=int, default=0,
                        help="with --kv-events-zmq: the data_parallel_rank field of every batch")
    parser.add_argument("--kv-events-pool", default="",
                        help="with --kv-events-zmq: publish only this pool's events (default: every pool's, on "
                        "one sequence-number stream)")
    return parser


def start_zmq_publisher(parser: EnvArgumentParser, args, manager: KVManager):
    """The ZeroMQ publisher the flags ask for (None without --kv-events-zmq); a flag error
    (exit 2) when pyzmq or msgspec is missing or an endpoint cannot be bound."""
    if not args.kv_events_zmq:
        if args.kv_events_replay:
            parser.error("--kv-events-replay: needs --kv-events-zmq")
        return None
    try:
        from kvmanager.zmq_events import ZmqEventPublisher
    except ImportError as exc:
        parser.error(f"--kv-events-zmq: needs the packages pyzmq and msgspec ({exc}); "
                     "install them with pip install 'kvserve[kv-events]'")
    import zmq

    try:
        publisher = ZmqEventPublisher(args.kv_events_zmq, args.kv_events_replay or None, args.kv_events_topic,
                                      args.kv_events_replay_buffer, args.kv_events_data_parallel_rank,
                                      args.kv_events_pool or None)
    except zmq.ZMQError as exc:
        parser.error(f"--kv-events-zmq/--kv-events-replay: {exc}")
    manager.event_sinks.append(publisher)
    log.info("kv_events_zmq", endpoint=publisher.endpoint, replay=publisher.replay_endpoint,
             topic=args.kv_events_topic, pool=args.kv_events_pool or "*")
    return publisher


async def reap_expired_sessions(manager: KVManager, interval_s: float) -> None:
    """Frees the sequences of sessions nobody renewed, even when no call comes in."""
    while True:
        await asyncio.sleep(interval_s)
        try:
            manager.reap_expired()
        except Exception as exc:  # noqa: BLE001 — the reaper must outlive one bad pass
            log.error("reap_failed", error=repr(exc))


async def serve(args, manager: KVManager) -> None:
    servicer = KVManagerService(manager, token_or_none(args.admin_key))
    allocate_socket = AllocateSocketListener.create(args.allocate_socket, new_instance_id(), servicer,
                                                    token_or_none(args.service_token), args.allocate_socket_dir)
    server = GrpcServer(PROG, args.host, args.port, [
        Service(SERVICE_NAME, servicer, kvmanager_pb2_grpc.add_KVManagerServicer_to_server),
    ], auth=token_or_none(args.service_token), auth_what="service token", tls=TlsFiles.from_args(args))
    try:
        if allocate_socket is not None:
            await allocate_socket.start()
            servicer.offer_allocate_socket(str(allocate_socket.path), allocate_socket.instance_id)
        await server.start()
        reaper = asyncio.create_task(reap_expired_sessions(manager, args.reap_interval_ms / 1000))
        signum = await wait_for_shutdown_signal()
        log.info("shutdown_requested", signal=signum.name)
        reaper.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await reaper
        await server.stop(args.shutdown_grace)
    finally:
        if allocate_socket is not None:
            await allocate_socket.stop()


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    check_server_flags(parser, args)
    try:  # KVManager validates the TTL; a bad one is a flag error (exit 2)
        manager = KVManager(default_session_ttl_ms=args.default_session_ttl_ms, freeze_gc=True,
                            event_buffer_size=args.kv_events_buffer, default_medium=args.kv_events_medium,
                            store_save_policy=args.kv_store_save)
    except InvalidArgument as exc:
        parser.error(parser.in_flag_terms(str(exc).replace("event_buffer_size", "kv_events_buffer")))
    if args.tenants:
        try:
            manager.tenant_policies.load(json.loads(Path(args.tenants).read_text()))
        except (OSError, ValueError, InvalidArgument) as exc:
            parser.error(f"--tenants: {exc}")
    if args.reap_interval_ms <= 0:
        parser.error("--reap-interval-ms: must be > 0")
    if args.kv_events_replay_buffer < 0:
        parser.error("--kv-events-replay-buffer: must be >= 0")
    configure_logging(args.log_level)
    publisher = start_zmq_publisher(parser, args, manager)
    try:
        return run_service(PROG, lambda: serve(args, manager))
    finally:
        if publisher is not None:
            publisher.close()


if __name__ == "__main__":
    sys.exit(main())
