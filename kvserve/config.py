"""Command-line flags that can also come from ``KVSERVE_<FLAG>`` environment variables."""
from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping
from dataclasses import fields
from typing import Any, NoReturn, TypeVar

from kvserve.ports import DEFAULT_HOST

T = TypeVar("T")
ENV_PREFIX = "KVSERVE_"
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def without_flag_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """A copy of ``environ`` (default: this process's) without ``KVSERVE_*`` variables, so a service
    started with it takes only the flags it is given; ``KVSERVE_CACHE_DIR`` (where the models and
    caches live, not a flag) stays."""
    environ = os.environ if environ is None else environ
    return {k: v for k, v in environ.items() if not k.startswith(ENV_PREFIX) or k == "KVSERVE_CACHE_DIR"}


def env_name(flag: str) -> str:
    """``--max-num-seqs`` → ``KVSERVE_MAX_NUM_SEQS``."""
    return ENV_PREFIX + flag.lstrip("-").replace("-", "_").upper()


def parse_bool(text: str) -> bool:
    value = text.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"not a boolean: {text!r}")


class EnvArgumentParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose long flags default to ``KVSERVE_<FLAG>`` when set.

    Command line beats environment beats the coded default. Errors print one
    line (``prog: error: reason``) and exit 2, without the usage block.
    """

    def __init__(self, *args: Any, environ: dict[str, str] | None = None, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", argparse.ArgumentDefaultsHelpFormatter)
        self._environ = os.environ if environ is None else environ
        self._flags: dict[str, str] = {}  # dest → its long flag
        super().__init__(*args, **kwargs)

    def add_argument(self, *names: str, secret: bool = False, **kwargs: Any) -> argparse.Action:
        """``secret=True``: ``--help`` never shows the value (from the environment or not)."""
        long_flags = [n for n in names if n.startswith("--")]
        if not long_flags or kwargs.get("action") in ("help", "version"):
            return super().add_argument(*names, **kwargs)
        var = env_name(long_flags[0])
        kwargs["help"] = f"{kwargs.get('help', '')} [env: {var}]".strip()
        if secret:  # "%(default)" in the help keeps the formatter from appending the value
            kwargs["help"] += "%(default).0s"
        raw = self._environ.get(var)
        if raw is not None:
            kwargs["default"] = self._convert_env(var, raw, kwargs)
            kwargs.pop("required", None)
        action = super().add_argument(*names, **kwargs)
        self._flags[action.dest] = long_flags[0]
        return action

    def in_flag_terms(self, message: str) -> str:
        """A domain error names a field (``block_size: must be ...``); on the command line,
        the flag whose ``dest`` it is names it (``--block-size: must be ...``)."""
        field, sep, rest = message.partition(": ")
        flag = self._flags.get(field) if sep else None
        return f"{flag}: {rest}" if flag else message

    def _convert_env(self, var: str, raw: str, kwargs: dict[str, Any]) -> Any:
        action = kwargs.get("action")
        try:
            if action in ("store_true", "store_false") or action is argparse.BooleanOptionalAction:
                return parse_bool(raw)
            value = kwargs.get("type", str)(raw)
        except (TypeError, ValueError) as exc:
            self.error(f"{var}={raw!r}: {exc}")
        choices = kwargs.get("choices")
        if choices is not None and value not in choices:
            self.error(f"{var}={raw!r}: choose from {', '.join(map(str, choices))}")
        return value

    def error(self, message: str) -> NoReturn:
        sys.stderr.write(f"{self.prog}: error: {message}\n")
        sys.exit(2)


def config_from_args(cls: type[T], args: argparse.Namespace, **given: Any) -> T:
    """The dataclass ``cls`` from the parsed flags whose ``dest`` names one of its fields,
    and ``given`` (e.g. a nested config); a field no flag sets keeps its default."""
    values = {f.name: getattr(args, f.name) for f in fields(cls) if f.init and hasattr(args, f.name)}
    return cls(**{**values, **given})


def add_server_flags(parser: EnvArgumentParser, *, default_port: int) -> None:
    """The flags every gRPC service has."""
    parser.add_argument("--host", default=DEFAULT_HOST, help="address to listen on (0.0.0.0 for all)")
    parser.add_argument("--port", type=int, default=default_port, help="gRPC port")
    parser.add_argument(
        "--log-level", default="info", choices=["debug", "info", "warning", "error"], help="log level"
    )
    parser.add_argument(
        "--shutdown-grace", type=float, default=5.0, help="seconds in-flight RPCs get on SIGTERM"
    )
    parser.add_argument("--tls-cert-file", default=None,
                        help="PEM certificate (chain): serve TLS instead of plaintext (with --tls-key-file)")
    parser.add_argument("--tls-key-file", default=None, help="PEM private key of --tls-cert-file")


def add_service_token_flag(parser: EnvArgumentParser) -> None:
    """kvmanager's and executor's ``--service-token``: the secret their clients must send."""
    parser.add_argument(
        "--service-token", default=None, secret=True,
        help="require gRPC metadata 'authorization: Bearer <token>' on every RPC but health and "
             "reflection (UNAUTHENTICATED otherwise); the gateway's --service-token must match")


def check_server_flags(parser: EnvArgumentParser, args: argparse.Namespace) -> None:
    """Flag combinations ``add_server_flags`` cannot express: a one-line error, exit 2."""
    from kvserve.auth import check_tls_flags

    problem = check_tls_flags(args.tls_cert_file, args.tls_key_file)
    if problem:
        parser.error(problem)
    for flag in ("--tls-cert-file", "--tls-key-file", "--tls-ca-file"):
        path = getattr(args, flag[2:].replace("-", "_"), None)
        if path and not os.access(path, os.R_OK):  # before a model load, not after it
            parser.error(f"{flag} {path}: not a readable file")
