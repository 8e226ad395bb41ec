"""Parsed flags become the services' config objects by field name, and domain errors
that name a field are told in flag terms on the command line."""
from __future__ import annotations

from dataclasses import dataclass, fields

import pytest

from kvserve.config import EnvArgumentParser, config_from_args
from kvserve.errors import InvalidArgument


@dataclass(frozen=True)
class Inner:
    size: int = 1


@dataclass(frozen=True)
class Outer:
    name: str = "x"
    limit: int = 2
    inner: Inner = Inner()


def _parser() -> EnvArgumentParser:
    parser = EnvArgumentParser(prog="t", environ={})
    parser.add_argument("--name", default="n")
    parser.add_argument("--max-limit", dest="limit", type=int, default=5)
    parser.add_argument("--size", type=int, default=3)
    parser.add_argument("--not-a-field", default="ignored")
    return parser


def test_config_from_args_takes_the_flags_whose_dest_is_a_field():
    args = _parser().parse_args(["--max-limit", "7"])
    assert config_from_args(Outer, args) == Outer(name="n", limit=7)
    assert config_from_args(Outer, args, inner=config_from_args(Inner, args)) == Outer("n", 7, Inner(3))
    assert config_from_args(Outer, args, name="given") == Outer("given", 7)


def test_a_field_error_names_the_flag():
    parser = _parser()
    assert parser.in_flag_terms("limit: must be > 0") == "--max-limit: must be > 0"
    assert parser.in_flag_terms("size: must be > 0") == "--size: must be > 0"
    for unchanged in ("other: must be > 0", "limit must be > 0", "model directory /x: missing"):
        assert parser.in_flag_terms(unchanged) == unchanged


def _dests(parser) -> set[str]:
    return {action.dest for action in parser._actions}


# The fields __main__ once copied one by one: each must still have a flag of that dest.
ENGINE_FLAG_FIELDS = {"kvmanager_address", "executor_address", "pool_id", "kv_allocation", "enable_prefix_caching",
                      "session_ttl_ms", "max_queue_len"}
RUNNER_FLAG_FIELDS = {"model_dir", "dtype", "device", "attention_backend", "block_size", "num_blocks",
                      "kv_cache_memory", "gpu_memory_utilization", "max_model_len", "served_model_name", "seed",
                      "quantization", "kv_cache_dtype"}


def test_the_gateway_flags_set_engine_and_scheduler_config():
    from gateway.__main__ import build_parser
    from gateway.engine import EngineConfig
    from gateway.scheduler import SchedulerConfig

    dests = _dests(build_parser())
    assert ENGINE_FLAG_FIELDS <= {f.name for f in fields(EngineConfig)} & dests
    assert {f.name for f in fields(SchedulerConfig)} <= dests


def test_the_executor_flags_set_runner_options():
    from executor.__main__ import build_parser
    from executor.runner import RunnerOptions

    assert RUNNER_FLAG_FIELDS <= {f.name for f in fields(RunnerOptions)} & _dests(build_parser())


def test_check_model_name():
    from gateway.model_name import check_model_name

    check_model_name(None, "m")
    check_model_name("", "m")
    check_model_name("m", "m")
    with pytest.raises(InvalidArgument, match=r"^model: 'other' does not exist; this server serves 'm'$"):
        check_model_name("other", "m")
