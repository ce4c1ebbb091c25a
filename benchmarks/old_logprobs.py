"""Step time with pi_old from the rollout engine vs recomputed by the trainer, side by side.

    .venv/bin/python benchmarks/old_logprobs.py [--steps 20] [--repeats 2] [key.sub=value ...]

Both modes run the same config (same model, prompts, seeds) in this process, alternating
recompute / rollout / recompute / rollout..., so both see the same machine load. Prints the mean
wall time per RL step of each mode, the time of the pi_old phase, and the ratio rollout/recompute.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

from gspo import close_run, load_config, prepare, rl_step

BASE = ["warmup.steps=0", "train.eval_every=0", "train.save_every=0", "train.progress=false",
        "train.tensorboard=false", "rollout.max_new_tokens=16", "algorithm.mismatch_every=0",
        "model.hidden_size=256", "model.num_layers=4", "model.intermediate_size=1024"]


def time_mode(mode: str, steps: int, overrides: list[str]) -> tuple[float, float]:
    cfg = load_config(overrides=BASE + overrides + [f"algorithm.old_logprobs={mode}"])
    with tempfile.TemporaryDirectory() as d:
        run = prepare(cfg, Path(d), resume=False)
        try:
            rl_step(run, 0)  # warm-up step: allocator, thread pools
            t0, old = time.perf_counter(), 0.0
            for step in range(1, steps + 1):
                old += rl_step(run, step)["time/old_logp_s"]
            return (time.perf_counter() - t0) / steps, old / steps
        finally:
            close_run(run)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("overrides", nargs="*")
    args = p.parse_args(argv)
    times: dict[str, list[tuple[float, float]]] = {"recompute": [], "rollout": []}
    for _ in range(args.repeats):
        for mode in times:
            times[mode].append(time_mode(mode, args.steps, args.overrides))
    print(f"{'mode':<10} {'s/step':>8} {'pi_old s/step':>14}")
    mean = {}
    for mode, runs in times.items():
        mean[mode] = statistics.fmean(t for t, _ in runs)
        print(f"{mode:<10} {mean[mode]:8.3f} {statistics.fmean(o for _, o in runs):14.4f}")
    print(f"ratio rollout/recompute step time: {mean['rollout'] / mean['recompute']:.3f} "
          f"({100 * (1 - mean['rollout'] / mean['recompute']):.1f}% saved)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
