"""Steps per hour with asynchronous rollouts (rollout.max_staleness=k) vs the synchronous step,
side by side in one process.

    .venv/bin/python benchmarks/async_rollouts.py [--steps 6] [--repeats 1] [--staleness 1]
        [--config FILE] [key.sub=value ...] [--modes sync shared trainer-recomputes fixed]

The modes run the same config (same model, prompts, seeds), in turn, so all see the same
machine load; the first step of each is a warm-up and is not timed. The synchronous step
computes with all of torch's threads; the asynchronous ones give half to the sampler's thread
and half to the trainer's, either lending a waiting thread's half to the other
(rollout.share_cores=true, the default: 'shared', and 'trainer-recomputes' with
rollout.sampler_recomputes=false, pi_old's forward in the trainer's thread) or not
('fixed': fixed shares). The overrides go before --modes. Prints seconds per step (and each
repeat's: their spread is the noise), steps per hour, the ratios, and each asynchronous mode's
bound: max(sampling, the trainer's own work) per step, from its rows (time/sample_s; the
step's time less its wait for the batch).
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
        "train.tensorboard=false"]


def time_mode(staleness: int, steps: int, config: str | None, overrides: list[str]) -> dict:
    cfg = load_config(config, BASE + overrides + [f"rollout.max_staleness={staleness}"])
    with tempfile.TemporaryDirectory() as d:
        run = prepare(cfg, Path(d), resume=False)
        try:
            rl_step(run, 0)  # warm-up step: allocator, thread pools, the sampler's first batch
            rows, t0 = [], time.perf_counter()
            for step in range(1, steps + 1):
                rows.append(rl_step(run, step))
            wall = (time.perf_counter() - t0) / steps
        finally:
            close_run(run)
    mean = lambda key: statistics.fmean(r.get(key, 0.0) for r in rows)  # noqa: E731
    own = statistics.fmean(r["time/old_logp_s"] + r["time/update_s"] for r in rows)
    return {"s_per_step": wall, "sample_s": mean("time/sample_s") or mean("time/rollout_s"),
            "wait_s": mean("time/rollout_s"), "trainer_s": own, "reward": mean("reward/mean")}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--staleness", type=int, default=1)
    p.add_argument("--config")
    p.add_argument("--modes", nargs="+", choices=("sync", "shared", "trainer-recomputes",
                                                  "fixed"),
                   default=["sync", "shared", "trainer-recomputes", "fixed"])
    p.add_argument("overrides", nargs="*")
    args = p.parse_args(argv)
    k = args.staleness
    modes = {"sync": (0, []), f"async k={k}": (k, []),
             f"async k={k} trainer pi_old": (k, ["rollout.sampler_recomputes=false"]),
             f"async k={k} fixed": (k, ["rollout.share_cores=false"])}
    modes = {name: mode for (name, mode), key in zip(modes.items(), (
        "sync", "shared", "trainer-recomputes", "fixed")) if key in args.modes or key == "sync"}
    runs: dict[str, list[dict]] = {m: [] for m in modes}
    for _ in range(args.repeats):
        for name, (staleness, extra) in modes.items():
            runs[name].append(time_mode(staleness, args.steps, args.config,
                                        args.overrides + extra))
    print(f"{'mode':<28} {'s/step':>8} {'steps/h':>8} {'sample s':>9} {'trainer s':>10} "
          f"{'wait s':>7}")
    mean = {}
    for name, rs in runs.items():
        m = {key: statistics.fmean(r[key] for r in rs) for key in rs[0]}
        mean[name] = m
        each = " / ".join(f"{r['s_per_step']:.2f}" for r in rs) if len(rs) > 1 else ""
        print(f"{name:<28} {m['s_per_step']:8.2f} {3600 / m['s_per_step']:8.0f} "
              f"{m['sample_s']:9.2f} {m['trainer_s']:10.2f} {m['wait_s']:7.2f}  {each}")
    sync = mean["sync"]
    for name in list(modes)[1:]:
        asyn = mean[name]
        bound = max(asyn["sample_s"], asyn["s_per_step"] - asyn["wait_s"])
        print(f"steps/hour {name} / sync: {sync['s_per_step'] / asyn['s_per_step']:.3f}x; "
              f"its step {asyn['s_per_step']:.2f} s vs its bound max(sampling, trainer) "
              f"{bound:.2f} s ({asyn['s_per_step'] / bound:.2f}x the bound)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
