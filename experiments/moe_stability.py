"""GSPO vs GRPO vs GRPO + Routing Replay on a tiny Qwen3-MoE, equal compute, several seeds.

    .venv/bin/python experiments/moe_stability.py [--steps 120] [--seeds 0 1 2] [--out docs/results]

Each seed warms one tiny MoE up (supervised, shared by the three variants so they start from the
same policy), then runs the same number of RL steps with the same batch for each variant.
Writes moe_stability.md with a table of final held-out accuracy (mean +- std over seeds) and
PNG plots (accuracy, reward, clip fraction, moe/volatility, kl/old vs step) beside it.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from gspo import load_config, read_metrics, train  # noqa: E402

VARIANTS = {
    "gspo": ["algorithm=gspo"],
    "grpo": ["algorithm=grpo"],
    "grpo+replay": ["algorithm=grpo", "algorithm.routing_replay=true"],
}
MODEL = ["model.name_or_path=tiny-qwen3-moe", "model.num_layers=4", "model.num_experts=8",
         "model.num_experts_per_tok=2", "model.moe_intermediate_size=96"]
PLOTS = [("eval/accuracy", "held-out accuracy (avg@4)"), ("reward/mean", "reward"),
         ("clip/frac", "clip fraction (tokens)"), ("moe/volatility", "expert volatility"),
         ("kl/old", "KL(old || new) per token")]


def warm_model(seed: int, out: Path, common: list[str]) -> Path:
    """One supervised warm-up per seed: a run of no RL steps, whose checkpoint (a Hugging Face
    model directory) every variant starts from."""
    start = out / "checkpoints" / "step_000000"
    if (start / "config.json").is_file():
        return start
    cfg = load_config(overrides=MODEL + common + [f"train.seed={seed}", "train.steps=0",
                                                  "train.eval_every=0"])
    shutil.rmtree(out, ignore_errors=True)  # a warm-up that did not finish: from scratch
    train(cfg, out)
    return start


def run_all(args) -> dict[str, dict[int, list[dict]]]:
    common = ["train.progress=false", "train.tensorboard=false", f"warmup.steps={args.warmup}",
              "rollout.prompts_per_step=16", "rollout.group_size=8", "optim.lr=1e-4"]
    rl = [f"train.steps={args.steps}", f"train.eval_every={args.eval_every}", "train.save_every=0",
          "train.keep_last=1", "warmup.steps=0", f"data.n_eval={args.n_eval}"]
    results: dict[str, dict[int, list[dict]]] = {v: {} for v in VARIANTS}
    for seed in args.seeds:
        start = warm_model(seed, args.work / f"warm-seed{seed}", common)
        for name, extra in VARIANTS.items():
            run_dir = args.work / f"{name}-seed{seed}"
            if not (run_dir / "metrics.jsonl").is_file() or len(read_metrics(run_dir)) <= args.steps:
                t0 = time.time()
                cfg = load_config(overrides=MODEL + common + rl + extra + [
                    f"model.name_or_path={start}", f"train.seed={seed}"])
                shutil.rmtree(run_dir, ignore_errors=True)  # rerun from scratch
                train(cfg, run_dir)
                print(f"{name} seed {seed}: {time.time() - t0:.0f}s", file=sys.stderr)
            results[name][seed] = read_metrics(run_dir)
    return results


def series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    pts = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
    return [p[0] for p in pts], [p[1] for p in pts]


def seed_band(runs, key: str) -> tuple[list[int], list[float], list[float]] | None:
    """(steps, mean, std) of `key` over the runs (each a metrics row list), on the steps all of
    them reached; None when no run logged it. Shared with moe_mismatch.py."""
    curves = [c for c in (series(rows, key) for rows in runs) if c[0]]
    if not curves:
        return None
    n = min(len(c[0]) for c in curves)
    vals = [[c[1][i] for c in curves] for i in range(n)]
    return (curves[0][0][:n], [statistics.fmean(v) for v in vals],
            [statistics.pstdev(v) for v in vals])


def plot(results, out: Path) -> list[Path]:
    paths = []
    for key, title in PLOTS:
        fig, ax = plt.subplots(figsize=(6, 4))
        for name, by_seed in results.items():
            band = seed_band(by_seed.values(), key)
            if band is None:
                continue
            steps, mean, std = band
            if key != "eval/accuracy":  # per-step metrics are noisy: a 10-step moving mean
                mean, std = _smooth(mean), _smooth(std)
            ax.plot(steps, mean, label=name)
            ax.fill_between(steps, [m - s for m, s in zip(mean, std)],
                            [m + s for m, s in zip(mean, std)], alpha=0.2)
        ax.set_xlabel("RL step")
        ax.set_title(title)
        if key in ("clip/frac", "moe/volatility"):
            ax.set_yscale("log")
        ax.legend()
        fig.tight_layout()
        path = out / f"moe_{key.replace('/', '_')}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        paths.append(path)
    return paths


def _smooth(xs: list[float], w: int = 10) -> list[float]:
    return [statistics.fmean(xs[max(0, i - w + 1):i + 1]) for i in range(len(xs))]


def summarise(results, args) -> str:
    lines = ["| variant | start acc | final acc (mean +- std) | clip frac | volatility | "
             "kl/old |", "|---|---|---|---|---|---|"]
    for name, by_seed in results.items():
        start = [rows[0]["eval/accuracy"] for rows in by_seed.values()]
        final = [series(rows, "eval/accuracy")[1][-1] for rows in by_seed.values()]

        def avg(key):
            vals = [v for rows in by_seed.values() for v in series(rows, key)[1]]
            return statistics.fmean(vals) if vals else float("nan")

        sd = statistics.stdev(final) if len(final) > 1 else 0.0
        lines.append(f"| {name} | {statistics.fmean(start):.3f} | {statistics.fmean(final):.3f} "
                     f"+- {sd:.3f} | {avg('clip/frac'):.4f} | {avg('moe/volatility'):.4f} | "
                     f"{avg('kl/old'):.2e} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--warmup", type=int, default=300)
    p.add_argument("--eval-every", type=int, default=20)
    p.add_argument("--n-eval", type=int, default=200)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--work", type=Path, default=Path("runs/moe_stability"))
    p.add_argument("--out", type=Path, default=Path("docs/results"))
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    results = run_all(args)
    plot(results, args.out)
    table = summarise(results, args)
    (args.out / "moe_stability.json").write_text(json.dumps(
        {n: {str(s): rows for s, rows in r.items()} for n, r in results.items()}))
    settings = (f"16 prompts x 8 responses per step, lr 1e-4, tiny Qwen3-MoE ({' '.join(MODEL[1:])}), warm-up {args.warmup} steps, "
                f"{args.steps} RL steps, seeds {args.seeds}, held-out n={args.n_eval} x 4 samples")
    images = "\n".join(f"![{title}](moe_{key.replace('/', '_')}.png)" for key, title in PLOTS)
    (args.out / "moe_stability.md").write_text(
        f"# MoE stability: GSPO vs GRPO vs GRPO + Routing Replay\n\n"
        f"Generated by `.venv/bin/python experiments/moe_stability.py "
        f"{' '.join(argv or sys.argv[1:])}`.\n\nSettings: {settings}. Means over the whole run "
        f"for clip fraction, volatility and KL.\n\n{table}\n\n{images}\n")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
