"""Helpers the benchmark scripts share: the tiny model on disk, timers, memory, the matmul rate,
and a callback that measures each phase of an RL step.

Benchmarks are scripts, not tests: each prints a table and, with `--json PATH`, writes its rows.
They pin nothing about the machine; every comparison is a ratio of two systems measured in the
same invocation, alternating, so that both see the same background load.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

from gspo import Callback

RESULT_PREFIX = "BENCH-RESULT "
ROOT = Path(__file__).resolve().parent.parent
RECIPE = ROOT / "examples" / "configs" / "smollm2_addition.yaml"
"""The real-model recipe: SmolLM2-135M-Instruct, 2-digit sums asked in \\boxed{}, math-verify."""


def add_model_args(p) -> None:
    """The tiny Qwen3's shape, the same flags in every benchmark (defaults: gspo's default model)."""
    p.add_argument("--hidden-size", type=int, default=128)
    p.add_argument("--num-layers", type=int, default=2)
    p.add_argument("--num-heads", type=int, default=4)
    p.add_argument("--num-kv-heads", type=int, default=2)
    p.add_argument("--intermediate-size", type=int, default=512)


def resolve_model(name_or_dir: str) -> str:
    """A `gspo fetch-model` name (e.g. smollm2-135m-instruct) as its converted directory, made
    once and cached; a directory or hub id as it is."""
    from gspo import PRETRAINED, fetch_model

    return str(fetch_model(name_or_dir)) if name_or_dir in PRETRAINED else name_or_dir


def recipe_config(model: str, overrides: list[str]):
    """The Config of RECIPE on `model`, its data files found from any working directory,
    evaluation, checkpoints and progress bars off, then `overrides`."""
    from gspo.config import load_config

    data = ROOT / "examples" / "data"
    return load_config(RECIPE, [
        f"model.name_or_path={model}", f"data.path={data / 'addition_train.jsonl'}",
        f"data.eval_path={data / 'addition_heldout.jsonl'}", "train.eval_every=0",
        f"train.save_every={10**9}", "train.progress=false", "train.tensorboard=false",
        *overrides])


def peak_rss_mb() -> float:
    """Peak resident set size of this process so far (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def current_rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def save_tiny_model(path: Path, hidden_size: int, num_layers: int, num_heads: int,
                    num_kv_heads: int, intermediate_size: int, seed: int = 0) -> Path:
    """Build the character tokenizer and a tiny Qwen3 over it, save both in HF format."""
    from gspo.models import build_tiny_qwen3, build_tokenizer

    tokenizer = build_tokenizer()
    model = build_tiny_qwen3(tokenizer, hidden_size=hidden_size, num_layers=num_layers,
                             num_heads=num_heads, num_kv_heads=num_kv_heads,
                             intermediate_size=intermediate_size, seed=seed)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def matmul_gflops(n: int = 1024, min_seconds: float = 1.0) -> float:
    """float32 GEMM rate of this CPU now: best of repeated (n, n) @ (n, n), in GFLOP/s."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    out = torch.empty(n, n)
    for _ in range(3):
        torch.mm(a, b, out=out)
    best, start = float("inf"), time.perf_counter()
    while time.perf_counter() - start < min_seconds:
        t0 = time.perf_counter()
        torch.mm(a, b, out=out)
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best / 1e9


def run_worker(script: str, args: list[str], timeout: float = 1800) -> dict:
    """Run `python script args` in a fresh process; return the dict it printed after RESULT_PREFIX."""
    proc = subprocess.run([sys.executable, script, *args], capture_output=True, text=True,
                          timeout=timeout)
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(RESULT_PREFIX):
            return json.loads(line[len(RESULT_PREFIX):])
    raise RuntimeError(f"worker {script} {' '.join(args)} failed (exit {proc.returncode}):\n"
                       f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")


def emit(result: dict) -> None:
    """A worker's last line: the result for the parent process."""
    print(RESULT_PREFIX + json.dumps(result), flush=True)


def table(rows: list[dict], columns: list[tuple[str, str, str]]) -> str:
    """A Markdown table; columns are (key, header, format spec)."""
    head = "| " + " | ".join(h for _, h, _ in columns) + " |"
    rule = "|" + "|".join("---:" if f else "---" for _, _, f in columns) + "|"
    body = []
    for r in rows:
        cells = []
        for key, _, f in columns:
            v = r.get(key, "")
            cells.append(format(v, f) if f and isinstance(v, (int, float)) else str(v))
        body.append("| " + " | ".join(cells) + " |")
    return "\n".join([head, rule, *body])


def write_json(path: str | None, payload: dict) -> None:
    if path:
        Path(path).write_text(json.dumps(payload, indent=2))


def median(xs: list[float]) -> float:
    s = sorted(xs)
    n = len(s)
    return s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])


class PhaseHook(Callback):
    """Holds a context manager open for the length of a phase of the run's RL steps (gspo's
    phases: "rollout", "old_logp", "update"): `enter(step, phase)` returns one, or None to leave
    that phase alone. What entering it gave (a FlopCounterMode, a torch.profiler, a PeakRSS) is
    kept in `results[step, phase]` once the phase ends, and every phase's wall time in
    `seconds[step, phase]`. A benchmark measures a phase inside a normal `rl_step` this way:

        hook = PhaseHook(lambda step, phase: FlopCounterMode() if phase == "update" else None)
        run = prepare(cfg, run_dir, resume=False, callbacks=[hook])
    """

    def __init__(self, enter):
        self.enter, self.results, self.seconds, self._open = enter, {}, {}, None

    def on_phase_begin(self, run, step, phase):
        cm = self.enter(step, phase)
        if cm is not None:
            self._open = cm, cm.__enter__()

    def on_phase_end(self, run, step, phase, seconds):
        self.seconds[step, phase] = seconds
        if self._open is not None:
            cm, value = self._open
            self._open = None
            cm.__exit__(None, None, None)
            self.results[step, phase] = value
