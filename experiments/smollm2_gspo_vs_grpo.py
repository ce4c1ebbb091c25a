"""GSPO vs GRPO on a real pretrained model: SmolLM2-135M-Instruct, 2-digit addition, CPU.

    .venv/bin/python experiments/smollm2_gspo_vs_grpo.py [--steps 20] [--seeds 0 1]
        [--runs DIR] [--out docs/results] [--reuse gspo:0:RUN_DIR ...]
        [--model NAME_OR_DIR] [--extra KEY=VALUE ...]

Each (algorithm, seed) trains from the same pretrained weights with the recipe
examples/configs/smollm2_addition.yaml (8 prompts x G 8, <= 40 new tokens, lr 5e-6, 4
minibatches) for the same number of steps, so both see the same compute (samples and
optimiser steps); only the objective and its paper clip range differ (GSPO 3e-4 / 4e-4 on
sequence ratios, GRPO 0.2 / 0.27 on token ratios). The seed moves sampling and minibatch order.
A finished run directory is reused, not trained again (`--reuse` names one made elsewhere, e.g.
the recipe's own run, whose first `--steps` steps are the same run). Writes
smollm2_gspo_vs_grpo.md (a table per run and per algorithm) and PNG curves beside it.
`--model tiny-qwen3` with `--extra` sizes runs the same comparison on the built-in tiny model
(the test suite's smoke run).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from gspo import PRETRAINED, fetch_model, load_config, read_metrics, train  # noqa: E402

RECIPE = Path(__file__).resolve().parent.parent / "examples" / "configs" / "smollm2_addition.yaml"
PLOTS = [("eval/accuracy", "held-out accuracy (avg@2, 64 problems)"), ("reward/mean", "reward"),
         ("clip/frac", "clipped fraction of tokens"), ("response/len_mean", "response length")]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--algorithms", nargs="+", default=["gspo", "grpo"],
                   help="each NAME or NAME@key=value,key=value (a variant with overrides, e.g. "
                        "gspo@optim.lr=1.5e-5)")
    p.add_argument("--runs", default="runs/smollm2-gspo-vs-grpo", help="where run dirs go")
    p.add_argument("--out", default="docs/results")
    p.add_argument("--reuse", nargs="*", default=[], metavar="ALGO:SEED:DIR")
    p.add_argument("--model", default="smollm2-135m-instruct",
                   help="a gspo.PRETRAINED name, a model directory, or tiny-qwen3 (smoke runs)")
    p.add_argument("--extra", nargs="*", default=[], metavar="KEY=VALUE",
                   help="further config overrides for every run (e.g. for a quick smoke run)")
    return p.parse_args(argv)


def run_dir(a, algo: str, seed: int) -> Path:
    for spec in a.reuse:
        r_algo, r_seed, path = spec.split(":", 2)
        if (r_algo, int(r_seed)) == (algo, seed):
            return Path(path)
    return Path(a.runs) / f"{algo.replace('@', '-').replace('=', '').replace(',', '-')}-s{seed}"


def finished(path: Path, steps: int) -> bool:
    try:
        return any(r["step"] >= steps for r in read_metrics(path / "metrics.jsonl"))
    except (OSError, ValueError):
        return False


def summarise(rows: list[dict], steps: int) -> dict:
    evals = {r["step"]: r["eval/accuracy"] for r in rows if "eval/accuracy" in r and r["step"] <= steps}
    rl = [r for r in rows if "loss" in r and r["step"] <= steps]
    step_s = [r["time/rollout_s"] + r["time/old_logp_s"] + r["time/update_s"] for r in rl]
    return {"evals": evals, "clip_frac": statistics.mean(r["clip/frac"] for r in rl),
            "reward_last5": statistics.mean(r["reward/mean"] for r in rl[-5:]),
            "len_mean": statistics.mean(r["response/len_mean"] for r in rl),
            "s_per_step": statistics.mean(step_s)}


def main(argv=None) -> int:
    a = parse_args(argv)
    model = fetch_model(a.model) if a.model in PRETRAINED else a.model
    results = {}
    for algo in a.algorithms:
        for seed in a.seeds:
            path = run_dir(a, algo, seed)
            if not finished(path, a.steps):
                name, _, extra = algo.partition("@")
                cfg = load_config(RECIPE, [f"model.name_or_path={json.dumps(str(model))}",
                                           f"algorithm={name}", f"train.seed={seed}",
                                           f"train.steps={a.steps}", "train.progress=false",
                                           "train.save_every=0", *filter(None, extra.split(",")),
                                           *a.extra])
                print(f"training {algo} seed {seed} -> {path}", flush=True)
                train(cfg, path)
            results[(algo, seed)] = (path, read_metrics(path / "metrics.jsonl"))
    write_report(a, results)
    return 0


def write_report(a, results) -> None:
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    sums = {k: summarise(rows, a.steps) for k, (_, rows) in results.items()}
    steps = sorted({s for v in sums.values() for s in v["evals"]})
    head = "| algorithm | seed | " + " | ".join(f"acc @ {s}" for s in steps) + \
           " | clip frac | reward (last 5 steps) | response tokens | s / step |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for (algo, seed), v in sums.items():
        accs = " | ".join(f"{100 * v['evals'][s]:.1f}%" if s in v["evals"] else "-" for s in steps)
        lines.append(f"| {algo} | {seed} | {accs} | {v['clip_frac']:.3f} | "
                     f"{v['reward_last5']:.3f} | {v['len_mean']:.1f} | {v['s_per_step']:.1f} |")
    for algo in a.algorithms:
        vs = [v for (al, _), v in sums.items() if al == algo]
        accs = " | ".join(f"{100 * statistics.mean(v['evals'][s] for v in vs):.1f}%"
                          if all(s in v["evals"] for v in vs) else "-" for s in steps)
        lines.append(f"| **{algo} mean** | {len(vs)} seeds | {accs} | "
                     f"{statistics.mean(v['clip_frac'] for v in vs):.3f} | "
                     f"{statistics.mean(v['reward_last5'] for v in vs):.3f} | "
                     f"{statistics.mean(v['len_mean'] for v in vs):.1f} | "
                     f"{statistics.mean(v['s_per_step'] for v in vs):.1f} |")
    (out / "smollm2_gspo_vs_grpo.json").write_text(json.dumps(
        {f"{al}-s{sd}": {**v, "run": str(results[(al, sd)][0])} for (al, sd), v in sums.items()},
        indent=1, default=str))
    table = "\n".join(lines)
    (out / "smollm2_gspo_vs_grpo_table.md").write_text(table + "\n")
    print(table)
    for key, title in PLOTS:
        fig, ax = plt.subplots(figsize=(6, 3.5))
        for (algo, seed), (_, rows) in results.items():
            pts = [(r["step"], r[key]) for r in rows if r.get(key) is not None and r["step"] <= a.steps]
            ax.plot(*zip(*pts), marker="o" if key == "eval/accuracy" else None,
                    color=f"C{a.algorithms.index(algo)}", alpha=0.5 + 0.5 * (seed == 0),
                    label=f"{algo} seed {seed}")
        ax.set_xlabel("RL step")
        ax.set_title(title)
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / f"smollm2_{key.replace('/', '_')}.png", dpi=100)
        plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
