"""A long prompt's prefill: kvserve's executor and OpenVINO GenAI taking turns, in one run.

    python -m bench.prefill_vs_openvino [--quantization int8] [--tokens 551] [--cached 128]
                                        [--rounds 12] [--threads 1] [--out FILE] [--log-dir DIR]

At one stream a served row's TTFT P99 (``python -m bench --concurrency 1``) is the prefill of its
longest prompt: one measurement, taken minutes apart from the peer's row. On a shared host the
speed of the matrix unit (AMX) changes from one second to the next (on the 2-vCPU KVM Xeon of
docs/benchmarks.md the same bf16 matmul, best of 5, took 1.8 or 4.5 ms), so two such rows may
compare the hours more than the systems. Here both systems stay loaded, each in its own process
on ``--threads`` compute threads, and take turns on the same token ids: ``--cached`` tokens of
a shared prefix (sent once before, a prefix-cache hit for both, as the served workload's
system prompt), then ``--tokens`` new ones, prefilled and the first token picked (greedy).

Every round: the matrix-unit probe (a 512 x 576 x 3072 matmul, best of 5, in kvserve's worker; bf16
where the CPU has it natively, else float32), both prefills in alternating order, the probe again. A round is "contended" when a probe
took more than 1.5x the run's fastest. It prints each round, then the medians and in how many
rounds kvserve was faster, over all rounds and split by the probe. The OpenVINO side is the
served peer's set-up (bench/peers/openvino_peer.py: its venv and IR export, cached under
``~/.cache/kvserve/peers/``); kvserve's is the executor's ``ModelRunner`` in process (no gRPC:
an in-process peer against an in-process runner).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import select
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from bench.peers.common import PeerUnavailable, exit_status, lscpu_text
from kvserve.paths import default_model_dir

# --quantization of kvserve → the OpenVINO IR with the same weight precision (bench/peers).
OPENVINO_WEIGHTS = {"none": "fp16", "int8": "int8", "int4": "int4"}
OPENVINO_WORKER = Path(__file__).with_name("peers") / "openvino_prefill_worker.py"
CONTENDED_FACTOR = 1.5
BLOCK_SIZE = 16
READY_TIMEOUT_S = 900.0  # a worker's start: model load, kernel build, OpenVINO's compile
ANSWER_TIMEOUT_S = 300.0  # one prefill or probe
LOG_DIR_NAME = "prefill-vs-openvino-logs"
RESULTS_DIR = Path(__file__).resolve().parent / "results"  # bench/results/ (git-ignored)


@dataclass
class Round:
    kvserve_ms: float
    openvino_ms: float
    probe_ms: tuple[float, float]  # before, after
    kvserve_first: bool


def contended(rounds: list[Round]) -> list[bool]:
    """Per round: whether a probe took more than CONTENDED_FACTOR x the run's fastest probe."""
    fastest = min(min(r.probe_ms) for r in rounds)
    return [max(r.probe_ms) > CONTENDED_FACTOR * fastest for r in rounds]


def summarize_rounds(rounds: list[Round]) -> dict[str, dict]:
    """Medians and wins over all rounds and over the quiet and the contended ones."""
    flags = contended(rounds)
    groups = {"all": rounds, "quiet": [r for r, c in zip(rounds, flags) if not c],
              "contended": [r for r, c in zip(rounds, flags) if c]}
    summary = {}
    for name, group in groups.items():
        if not group:
            continue
        kvserve = statistics.median(r.kvserve_ms for r in group)
        openvino = statistics.median(r.openvino_ms for r in group)
        summary[name] = {"rounds": len(group), "kvserve_ms": kvserve, "openvino_ms": openvino,
                         "ratio": kvserve / openvino,
                         "kvserve_faster": sum(r.kvserve_ms < r.openvino_ms for r in group)}
    return summary


# ---- kvserve's side: the executor's runner, in a worker process of its own ----------------------
class KvserveWorker:
    """Prefills on an executor ``ModelRunner``: ``prefix`` once (blocks from 1), then every
    ``prefill`` reads it from those blocks and writes its own after them, as a prefix-cache hit."""

    def __init__(self, model_dir: Path, quantization: str, kv_cache_dtype: str, max_model_len: int):
        from executor.runner import ModelRunner, RunnerOptions

        self.runner = ModelRunner(RunnerOptions(
            model_dir=model_dir, quantization=quantization, kv_cache_dtype=kv_cache_dtype,
            num_blocks=1 + 2 * -(-max_model_len // BLOCK_SIZE), max_model_len=max_model_len))
        self.prefix_len = 0
        self.calls = 0
        self._probe_inputs = None

    def _sequence(self, token_ids: list[int], start: int):
        from executor.runner import SequenceInput

        self.calls += 1
        blocks = list(range(1, 1 + -(-(start + len(token_ids)) // BLOCK_SIZE)))
        return SequenceInput(self.calls, token_ids, start, blocks, sample=True)

    def prefix(self, token_ids: list[int]) -> dict:
        if len(token_ids) % BLOCK_SIZE:
            raise ValueError(f"the prefix must fill whole blocks of {BLOCK_SIZE} tokens; got {len(token_ids)}")
        self.prefix_len = 0
        answer = self.prefill(token_ids)
        self.prefix_len = len(token_ids)
        return answer

    def prefill(self, token_ids: list[int]) -> dict:
        sequence = self._sequence(token_ids, self.prefix_len)
        started = time.perf_counter()
        out = self.runner.execute([sequence])
        return {"ms": (time.perf_counter() - started) * 1e3, "first_token": out.sampled_token_ids[0]}

    def probe(self) -> dict:
        """Best of 5 of one matmul on the CPU's matrix unit: bf16 where the CPU runs it natively
        (oneDNN takes AMX where there is one), else float32 (emulated bf16 takes seconds a call)."""
        import torch

        from executor.model import cpu_packs_bf16

        if self._probe_inputs is None:
            generator = torch.Generator().manual_seed(0)
            dtype = torch.bfloat16 if cpu_packs_bf16() else torch.float32
            self._probe_inputs = (torch.randn(512, 576, generator=generator).to(dtype),
                                  torch.randn(576, 3072, generator=generator).to(dtype))
        best = float("inf")
        for _ in range(5):
            started = time.perf_counter()
            torch.mm(*self._probe_inputs)
            best = min(best, time.perf_counter() - started)
        return {"probe_ms": best * 1e3}

    def answer(self, request: dict) -> dict:
        if "prefix" in request:
            return self.prefix(request["prefix"])
        if "prompt" in request:
            return self.prefill(request["prompt"])
        return self.probe()


def serve_worker(args) -> int:
    # The answers own stdout; whatever the runner logs or prints goes to stderr (the worker's log).
    answers = os.fdopen(os.dup(sys.stdout.fileno()), "w", buffering=1)
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    sys.stdout = sys.stderr

    import torch

    from executor.devices import back_large_allocations_with_huge_pages, tune_host_allocator

    tune_host_allocator()  # as the executor's entry point does, and its huge pages below
    torch.set_num_threads(args.threads)
    worker = KvserveWorker(args.model_dir, args.quantization, args.kv_cache_dtype,
                           args.cached + args.tokens + BLOCK_SIZE)
    huge_pages = back_large_allocations_with_huge_pages() if worker.runner.device.type == "cpu" else 0
    print(json.dumps({"ready": True, "torch_threads": torch.get_num_threads(), "huge_page_mib": huge_pages >> 20}),
          file=answers)
    with torch.inference_mode():
        for line in sys.stdin:
            print(json.dumps(worker.answer(json.loads(line))), file=answers)
    return 0


# ---- the driver ----------------------------------------------------------------------------------
class WorkerExited(RuntimeError):
    def __init__(self, message: str, code: int):
        super().__init__(message)
        self.code = code


class LineWorker:
    """A worker process spoken to in JSON lines (one request, one answer)."""

    def __init__(self, name: str, cmd: list[str], log_path: Path, env: dict | None = None):
        self.name = name
        self._log = log_path.open("ab")
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log,
                                     text=True, env=env)
        self.log_path = log_path

    def read(self, timeout: float = ANSWER_TIMEOUT_S) -> dict:
        # The worker writes one line per request and then waits, so nothing is left buffered
        # between lines and the pipe's readiness is the answer's.
        if not select.select([self.proc.stdout], [], [], timeout)[0]:
            self.proc.kill()
            self.proc.wait()
            raise WorkerExited(f"{self.name} worker gave no answer within {timeout:g} s (log: {self.log_path})",
                               self.proc.returncode)
        line = self.proc.stdout.readline()
        if not line:
            code = self.proc.wait()
            tail = " | ".join(self.log_path.read_text(errors="replace").strip().splitlines()[-4:])
            raise WorkerExited(f"{self.name} worker exited with {exit_status(code)} (log: {self.log_path}): "
                               f"{tail[-600:]}", code)
        return json.loads(line)

    def ready(self) -> dict:
        """The worker's first line, once it has loaded (a model load, an OpenVINO compile)."""
        return self.read(READY_TIMEOUT_S)

    def ask(self, request) -> dict:
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        return self.read()

    def close(self) -> None:
        try:
            self.proc.stdin.close()
            self.proc.wait(timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()
        self._log.close()


def start_workers(args, log_dir: Path) -> tuple[LineWorker, LineWorker, dict]:
    from bench.peers import openvino_peer

    python, _ = openvino_peer.setup_venv(log=print)
    ir_dir, _ = openvino_peer.export(python, args.model_dir, OPENVINO_WEIGHTS[args.quantization], log=print)
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    kv_blocks = 2 * -(-(args.cached + args.tokens) // 32) + 2  # the CPU plugin's blocks hold 32 tokens
    kvserve = LineWorker("kvserve", [sys.executable, "-m", "bench.prefill_vs_openvino", "--worker", "kvserve",
                                     "--model", str(args.model_dir), "--quantization", args.quantization,
                                     "--kv-cache-dtype", args.kv_cache_dtype, "--threads", str(args.threads),
                                     "--tokens", str(args.tokens), "--cached", str(args.cached)],
                         log_dir / "kvserve-worker.log", env=env)
    facts = {"kvserve": kvserve.ready(), "openvino_ir": str(ir_dir)}

    def start_openvino(precision: str) -> LineWorker:
        worker = LineWorker("openvino", [str(python), str(OPENVINO_WORKER), str(ir_dir), str(args.threads),
                                         str(kv_blocks), precision], log_dir / "openvino-worker.log", env=env)
        facts["openvino"] = worker.ready()
        return worker

    try:
        try:
            openvino = start_openvino(args.openvino_precision)
        except WorkerExited as exc:
            # As the served peer (bench/peers/openvino_peer.py): OpenVINO 2026.4 dies with SIGFPE compiling
            # an fp16 IR in bf16 on some AMX Xeons; in f32 it runs, and the report says so.
            if args.openvino_precision or exc.code != -signal.SIGFPE:
                raise
            print("   OpenVINO died with SIGFPE in its default precision: running it in f32", flush=True)
            openvino = start_openvino("f32")
            facts["openvino_note"] = "run in f32: in the CPU plugin's default precision it died with SIGFPE"
    except BaseException:
        kvserve.close()
        raise
    return kvserve, openvino, facts


def run_rounds(kvserve: LineWorker, openvino: LineWorker, args) -> list[Round]:
    from executor.model import ModelConfig

    rng = random.Random(args.seed)
    vocab = range(100, ModelConfig.from_dir(args.model_dir).vocab_size)  # past the special tokens
    prefix = [rng.choice(vocab) for _ in range(args.cached)]
    if prefix:
        kvserve.ask({"prefix": prefix})
        openvino.ask(prefix)
    rounds = []
    for index in range(args.warmup + args.rounds):
        prompt = [rng.choice(vocab) for _ in range(args.tokens)]
        kvserve_first = index % 2 == 0
        before = kvserve.ask({"probe": True})["probe_ms"]
        order = ("kvserve", "openvino") if kvserve_first else ("openvino", "kvserve")
        times = {}
        for name in order:
            times[name] = (kvserve.ask({"prompt": prompt}) if name == "kvserve" else openvino.ask(prefix + prompt))["ms"]
        after = kvserve.ask({"probe": True})["probe_ms"]
        if index < args.warmup:
            continue
        rounds.append(Round(times["kvserve"], times["openvino"], (before, after), kvserve_first))
        print(f"round {len(rounds):2d}  probe {before:4.2f} / {after:4.2f} ms   kvserve {times['kvserve']:6.1f} ms   "
              f"OpenVINO {times['openvino']:6.1f} ms   ratio {times['kvserve'] / times['openvino']:.2f}"
              f"{'   (kvserve first)' if kvserve_first else ''}", flush=True)
    return rounds


def print_summary(summary: dict[str, dict]) -> None:
    print("\n| rounds | n | kvserve median | OpenVINO median | ratio of medians | kvserve faster |")
    print("|---|---:|---:|---:|---:|---:|")
    labels = {"all": "all", "quiet": "probe quiet", "contended": f"probe > {CONTENDED_FACTOR}x its fastest"}
    for name, s in summary.items():
        print(f"| {labels[name]} | {s['rounds']} | {s['kvserve_ms']:.1f} ms | {s['openvino_ms']:.1f} ms | "
              f"{s['ratio']:.2f} | {s['kvserve_faster']} of {s['rounds']} |")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", dest="model_dir", type=Path, default=None,
                        help="kvserve's model directory (default: the embedded SmolLM2-135M)")
    parser.add_argument("--quantization", choices=sorted(OPENVINO_WEIGHTS), default="int8",
                        help="kvserve's weights; OpenVINO gets the IR of the same precision (none: FP16)")
    parser.add_argument("--kv-cache-dtype", choices=("auto", "int8"), default="int8",
                        help="kvserve's K/V cache (default int8, as the served bench's rows)")
    parser.add_argument("--openvino-precision", default="",
                        help="the CPU plugin's INFERENCE_PRECISION_HINT (default: its own; f32 where its bf16 fails)")
    parser.add_argument("--tokens", type=int, default=551, help="new prompt tokens a prefill")
    parser.add_argument("--cached", type=int, default=128,
                        help=f"tokens of the shared prefix cached before (a multiple of {BLOCK_SIZE})")
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="compute threads of each system")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None, help="write the rounds and the summary as JSON here")
    parser.add_argument("--log-dir", type=Path, default=None,
                        help=f"the workers' logs (default: {LOG_DIR_NAME}/ beside --out, "
                             f"else bench/results/{LOG_DIR_NAME}/)")
    parser.add_argument("--worker", choices=("kvserve",), default=None, help=argparse.SUPPRESS)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.cached < 0 or args.cached % BLOCK_SIZE:
        parser.error(f"--cached must be a non-negative multiple of {BLOCK_SIZE}, got {args.cached}")
    if args.tokens < 1 or args.rounds < 1 or args.threads < 1 or args.warmup < 0:
        parser.error("--tokens, --rounds and --threads must be at least 1, --warmup at least 0")
    args.model_dir = args.model_dir or default_model_dir()
    if args.worker:
        return serve_worker(args)

    log_dir = args.log_dir or (args.out.parent if args.out else RESULTS_DIR) / LOG_DIR_NAME
    log_dir.mkdir(parents=True, exist_ok=True)
    print(f"prefill of {args.tokens} tokens after {args.cached} cached, kvserve --quantization {args.quantization} "
          f"(K/V {args.kv_cache_dtype}) vs OpenVINO GenAI {OPENVINO_WEIGHTS[args.quantization].upper()} IR, "
          f"{args.threads} thread(s) each, {args.rounds} rounds after {args.warmup} warm-up", flush=True)
    try:
        kvserve, openvino, facts = start_workers(args, log_dir)
    except (PeerUnavailable, RuntimeError, OSError) as exc:
        print(f"cannot run: {exc}", file=sys.stderr)
        return 1
    try:
        rounds = run_rounds(kvserve, openvino, args)
    except RuntimeError as exc:
        print(f"stopped: {exc}", file=sys.stderr)
        return 1
    finally:
        kvserve.close()
        openvino.close()
    summary = summarize_rounds(rounds)
    print_summary(summary)
    print(f"(OpenVINO: {facts['openvino']}{'; ' + facts['openvino_note'] if 'openvino_note' in facts else ''}; "
          f"kvserve: {facts['kvserve']})")
    if args.out:
        args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "facts": facts,
                                        "lscpu": lscpu_text(), "rounds": [asdict(r) for r in rounds],
                                        "summary": summary}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
