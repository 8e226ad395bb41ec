"""``python -m kvmanager``: serve ``kvserve.v1.KVManager`` until SIGTERM/SIGINT."""
from __future__ import annotations

import asyncio
import contextlib
import sys

from kvmanager.manager import KVManager
from kvmanager.service import SERVICE_NAME, KVManagerService
from kvserve.auth import token_or_none
from kvserve.config import EnvArgumentParser, add_server_flags, add_service_token_flag, check_server_flags
from kvserve.errors import InvalidArgument
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
    parser.add_argument("--default-session-ttl-ms", type=int, default=30_000,
                        help="lease length of a session opened with ttl_ms=0")
    parser.add_argument("--reap-interval-ms", type=int, default=250,
                        help="how often expired sessions are looked for and their sequences freed")
    return parser


async def reap_expired_sessions(manager: KVManager, interval_s: float) -> None:
    """Frees the sequences of sessions nobody renewed, even when no call comes in."""
    while True:
        await asyncio.sleep(interval_s)
        try:
            manager.reap_expired()
        except Exception as exc:  # noqa: BLE001 — the reaper must outlive one bad pass
            log.error("reap_failed", error=repr(exc))


async def serve(args, manager: KVManager) -> None:
    server = GrpcServer(PROG, args.host, args.port, [
        Service(SERVICE_NAME, KVManagerService(manager), kvmanager_pb2_grpc.add_KVManagerServicer_to_server),
    ], auth=token_or_none(args.service_token), auth_what="service token", tls=TlsFiles.from_args(args))
    await server.start()
    reaper = asyncio.create_task(reap_expired_sessions(manager, args.reap_interval_ms / 1000))
    signum = await wait_for_shutdown_signal()
    log.info("shutdown_requested", signal=signum.name)
    reaper.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await reaper
    await server.stop(args.shutdown_grace)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    check_server_flags(parser, args)
    try:  # KVManager validates the TTL; a bad one is a flag error (exit 2)
        manager = KVManager(default_session_ttl_ms=args.default_session_ttl_ms, freeze_gc=True)
    except InvalidArgument as exc:
        parser.error(parser.in_flag_terms(str(exc)))
    if args.reap_interval_ms <= 0:
        parser.error("--reap-interval-ms: must be > 0")
    configure_logging(args.log_level)
    return run_service(PROG, lambda: serve(args, manager))


if __name__ == "__main__":
    sys.exit(main())
