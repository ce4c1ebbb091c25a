"""GSPO vs GRPO (with and without Routing Replay, and R3) on a tiny Qwen3-MoE with a real
train/inference mismatch: bf16 sampler, bf16-mixed trainer, pi_old from the sampler.

    .venv/bin/python experiments/moe_mismatch.py [--steps 200] [--seeds 0 1 2]
        [--sweep optim.lr=1e-3 ...] [--out docs/results] [--extra KEY=VALUE ...] [--name NAME]

The conditions the paper's MoE claim needs, at a size 2 CPU cores can run: 8 layers of 16
experts (top-2), a rollout engine holding its own bfloat16 copy of the weights while the trainer
keeps float32 master weights under bf16 autocast, pi_old taken from the engine
(`algorithm.old_logprobs=rollout`, no recompute), and 4 off-policy minibatches per step. Variants:

    gspo         GSPO, pi_old = the engine's log-probs
    grpo         GRPO, the same
    grpo+rr      GRPO + Routing Replay of the trainer's pi_old routing (pi_old recomputed)
    grpo+r3      GRPO + R3: the engine's own routing, recorded as it sampled, is replayed in
                 every training forward; pi_old = the engine's log-probs
    gspo+recompute   GSPO, pi_old recomputed by the trainer (the engine mismatch kept out of
                 the ratio: a control for the first row)
    gspo-eps3e-2     GSPO, pi_old = the engine's log-probs, clip range 3e-2 (above the mismatch)

Each seed warms one model up (supervised, shared by the variants so they start from the same
policy). `--sweep OVERRIDE` adds, per override, one run of each `--sweep-variants` (default: gspo
and grpo) for each `--sweep-seeds` (default: the first seed) with that override on top (one
axis, looking for a setting where the paper's effect shows; more seeds where it did).
`--extra` adds overrides to every RL run (not to the warm-ups, which `--warm-work` lets runs with
other extras share), e.g. vLLM as the sampler (run from .venv-vllm; vLLM's CPU backend cannot
record routing, so not grpo+r3):

    OMP_NUM_THREADS=1 PYTHONPATH=src .venv-vllm/bin/python experiments/moe_mismatch.py \
        --extra rollout.engine=vllm --name moe_mismatch_vllm --only gspo grpo grpo+rr \
        --work runs/moe_mismatch_vllm --warm-work runs/moe_mismatch

Writes NAME.{md,json} (NAME: moe_mismatch) and mm_*.png (NAME_*.png for another NAME); the text
after the ANALYSIS marker in an existing NAME.md is written by hand and kept. A run whose rows
NAME.json already holds (same settings, the variant's overrides included) is not trained again
and stays reported, so the grid can grow by a variant (`--only NAME`) and the sweep by a point
(`--sweep OVERRIDE`) after the run dirs are gone; a seed's warm-up is trained only when one of
its runs must be.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

from gspo import load_config, read_metrics, train  # noqa: E402
from moe_stability import _smooth, seed_band, series  # noqa: E402  (experiments/, beside this file)

VARIANTS = {
    "gspo": ["algorithm=gspo", "algorithm.old_logprobs=rollout"],
    "grpo": ["algorithm=grpo", "algorithm.old_logprobs=rollout"],
    "grpo+rr": ["algorithm=grpo", "algorithm.routing_replay=true",
                "algorithm.old_logprobs=recompute"],
    "grpo+r3": ["algorithm=grpo", "algorithm.routing_replay=true",
                "algorithm.old_logprobs=rollout"],
    # controls for GSPO's lag: the same bf16 sampler, the mismatch kept out of its ratio
    "gspo+recompute": ["algorithm=gspo", "algorithm.old_logprobs=recompute"],
    "gspo-eps3e-2": ["algorithm=gspo", "algorithm.old_logprobs=rollout",
                      "algorithm.eps_low=3e-2", "algorithm.eps_high=3e-2"],
}
MODEL = ["model.name_or_path=tiny-qwen3-moe", "model.num_layers=8", "model.num_experts=16",
         "model.num_experts_per_tok=2", "model.moe_intermediate_size=64"]
# the mismatch the paper's setting has: bf16 sampler, bf16-mixed trainer, 4 minibatches
COMMON = ["train.progress=false", "train.tensorboard=false", "train.precision=bf16-mixed",
          "rollout.dtype=bfloat16", "rollout.prompts_per_step=16", "rollout.group_size=8",
          "optim.lr=1e-4", "algorithm.minibatches=4"]
PLOTS = [("eval/accuracy", "held-out accuracy (avg@4)"), ("reward/mean", "reward"),
         ("clip/frac", "clip fraction (tokens)"), ("moe/volatility", "expert volatility"),
         ("kl/old", "KL(old || new) per token"),
         ("mismatch/token_abs_mean", "|trainer - engine| log-prob per token"),
         ("mismatch/seq_log_ratio_abs_max", "max |seq log-ratio| trainer vs engine")]
COLUMNS = ["clip/frac", "moe/volatility", "kl/old", "mismatch/token_abs_mean",
           "mismatch/seq_log_ratio_abs_max"]
ANALYSIS = "<!-- ANALYSIS: hand-written below; the script keeps it -->"


def warm_model(seed: int, out: Path, warmup: int) -> Path:
    """One supervised warm-up per seed: a run of no RL steps, whose checkpoint (a Hugging Face
    model directory) every variant starts from."""
    start = out / "checkpoints" / "step_000000"
    if (start / "config.json").is_file():
        return start
    cfg = load_config(overrides=MODEL + COMMON + [f"warmup.steps={warmup}", f"train.seed={seed}",
                                                  "train.steps=0", "train.eval_every=0"])
    shutil.rmtree(out, ignore_errors=True)  # a warm-up that did not finish: from scratch
    train(cfg, out)
    return start


def rl_run(run_dir: Path, overrides: list[str], steps: int, page_only: bool,
           earlier: list[dict] | None = None, warm=lambda: None) -> list[dict] | None:
    """Train unless run_dir holds a finished run (the step-0 eval row plus `steps` rows) or
    `earlier` (its rows in the last report) is one; page_only: train nothing, None for a run
    not finished. warm(): the warm-up the run starts from, called before it trains."""
    if (run_dir / "metrics.jsonl").is_file() and len(read_metrics(run_dir)) > steps:
        return read_metrics(run_dir)
    if earlier is not None and len(earlier) > steps:
        return earlier
    if page_only:
        return None
    warm()
    t0 = time.time()
    cfg = load_config(overrides=overrides)
    shutil.rmtree(run_dir, ignore_errors=True)  # rerun from scratch
    train(cfg, run_dir)
    print(f"{run_dir.name}: {time.time() - t0:.0f}s", file=sys.stderr, flush=True)
    return read_metrics(run_dir)


def rl_overrides(args, start: Path, seed: int) -> list[str]:
    return MODEL + COMMON + [
        f"model.name_or_path={start}", f"train.seed={seed}", f"train.steps={args.steps}",
        f"train.eval_every={args.eval_every}", "train.save_every=0", "train.keep_last=1",
        "warmup.steps=0", f"data.n_eval={args.n_eval}",
        f"algorithm.mismatch_every={args.mismatch_every}"] + args.extra


def check_configs(args) -> None:
    """Load every variant's config before spending time on any run (a typo fails here)."""
    for extra in list(VARIANTS.values()) + [[o] for o in args.sweep]:
        load_config(overrides=rl_overrides(args, Path("tiny-qwen3-moe"), 0) + extra)


def settings(args, seeds) -> dict:
    """What a report's runs depend on (`extra` only where given: reports written before it
    existed stay readable)."""
    extra = {"extra": args.extra} if args.extra else {}
    return {"model": MODEL, "common": COMMON, "variants": VARIANTS, "steps": args.steps,
            "warmup": args.warmup, "seeds": seeds, "mismatch_every": args.mismatch_every,
            "n_eval": args.n_eval, **extra}


def earlier_report(args) -> dict:
    """The last report's runs ({"grid": variant -> seed -> rows, "sweep": override -> variant
    -> seed -> rows}, seeds as strings) whose settings are this invocation's: the common ones
    (seeds and variants aside) or none, then per variant its overrides. Reports written before
    sweeps had seeds hold one run per sweep point, of their first seed."""
    path = args.out / f"{args.name}.json"
    if not path.is_file():
        return {"grid": {}, "sweep": {}}
    old = json.loads(path.read_text())
    now, then = settings(args, []), old["settings"]
    if any(then.get(k) != now.get(k) for k in {**now, **then} if k not in ("seeds", "variants")):
        return {"grid": {}, "sweep": {}}
    same = {n for n, extra in VARIANTS.items() if then["variants"].get(n) == extra}
    first = str(then["seeds"][0]) if then["seeds"] else None
    sweep = {o: {n: ({first: r} if isinstance(r, list) else r)  # the one-seed format
                 for n, r in by_var.items() if n in same}
             for o, by_var in old["sweep"].items()}
    return {"grid": {n: r for n, r in old["grid"].items() if n in same}, "sweep": sweep}


def run_all(args) -> tuple[dict, dict]:
    """grid: variant -> seed -> metrics rows; sweep: override -> variant -> seed -> rows."""
    grid: dict[str, dict[int, list[dict]]] = {v: {} for v in VARIANTS}
    sweep: dict[str, dict[str, dict[int, list[dict]]]] = {o: {} for o in args.sweep}
    old = earlier_report(args)

    def start_of(seed: int) -> tuple[Path, object]:
        """The seed's warm-up checkpoint, and what trains it when a run needs it."""
        warm = args.warm_work or args.work
        return (warm / f"warm-seed{seed}" / "checkpoints" / "step_000000",
                lambda: warm_model(seed, warm / f"warm-seed{seed}", args.warmup))

    for seed in args.seeds:  # seed by seed, so a cut-short grid holds whole seeds
        start, warm = start_of(seed)
        for name, extra in VARIANTS.items():
            if args.only and name not in args.only and str(seed) not in old["grid"].get(name, {}):
                continue
            rows = rl_run(args.work / f"{name}-seed{seed}",
                          rl_overrides(args, start, seed) + extra, args.steps, args.page_only,
                          old["grid"].get(name, {}).get(str(seed)), warm)
            if rows is not None:
                grid[name][seed] = rows
    for seed in args.sweep_seeds or args.seeds[:1]:
        start, warm = start_of(seed)
        for o in args.sweep:
            for name in args.sweep_variants:
                rows = rl_run(args.work / f"sweep-{o}-{name}-seed{seed}",
                              rl_overrides(args, start, seed) + VARIANTS[name] + [o],
                              args.steps, args.page_only,
                              old["sweep"].get(o, {}).get(name, {}).get(str(seed)), warm)
                if rows is not None:
                    sweep[o].setdefault(name, {})[seed] = rows
    for o, by_var in old["sweep"].items():  # sweep runs of earlier invocations stay reported
        for name, by_seed in by_var.items():
            for seed, rows in by_seed.items():
                sweep.setdefault(o, {}).setdefault(name, {}).setdefault(int(seed), rows)
    return grid, sweep


def plot(curves_by_label: dict[str, list[list[dict]]], out: Path, prefix: str) -> list[str]:
    """One PNG per metric of PLOTS: mean +- std over the runs of each label."""
    names = []
    for key, title in PLOTS:
        fig, ax = plt.subplots(figsize=(6, 4))
        for label, runs in curves_by_label.items():
            band = seed_band(runs, key)
            if band is None:
                continue
            steps, mean, std = band
            if key != "eval/accuracy" and len(steps) > 1:  # noisy per-step metrics: a 10-step moving mean
                w = max(1, round(10 / (steps[1] - steps[0])))  # some are logged every 5 steps
                mean, std = _smooth(mean, w), _smooth(std, w)
            ax.plot(steps, mean, label=label)
            ax.fill_between(steps, [m - s for m, s in zip(mean, std)],
                            [m + s for m, s in zip(mean, std)], alpha=0.2)
        ax.set_xlabel("RL step")
        ax.set_title(title)
        if key in ("clip/frac", "moe/volatility", "kl/old") or key.startswith("mismatch/"):
            ax.set_yscale("log")
        ax.legend()
        fig.tight_layout()
        name = f"{prefix}_{key.replace('/', '_')}.png"
        fig.savefig(out / name, dpi=100)
        plt.close(fig)
        names.append(name)
    return names


def run_mean(rows: list[dict], key: str) -> float:
    vals = series(rows, key)[1]
    return statistics.fmean(vals) if vals else float("nan")


def _ms(xs: list[float], fmt: str) -> str:
    sd = statistics.stdev(xs) if len(xs) > 1 else 0.0
    return f"{statistics.fmean(xs):{fmt}} +- {sd:{fmt.lstrip('+')}}"


def grid_table(grid: dict) -> str:
    head = ["variant", "start acc", "final acc", "last 3 evals", "gain"] + COLUMNS
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, by_seed in grid.items():
        runs = list(by_seed.values())
        if not runs:
            continue
        start = [rows[0]["eval/accuracy"] for rows in runs]
        final = [series(rows, "eval/accuracy")[1][-1] for rows in runs]
        last3 = [statistics.fmean(series(rows, "eval/accuracy")[1][-3:]) for rows in runs]
        cells = [f"{name} (n={len(runs)})", _ms(start, ".3f"), _ms(final, ".3f"), _ms(last3, ".3f"),
                 _ms([f - s for f, s in zip(final, start)], "+.3f")]
        cells += [_ms([run_mean(rows, k) for rows in runs], ".1e") for k in COLUMNS]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def gain_table(grid: dict) -> str:
    grid = {name: by_seed for name, by_seed in grid.items() if by_seed}  # variants that ran
    seeds = sorted({s for by_seed in grid.values() for s in by_seed})
    lines = ["| seed | start | " + " | ".join(grid) + " |", "|" + "---|" * (len(grid) + 2)]
    for s in seeds:
        start = next(by_seed[s][0]["eval/accuracy"] for by_seed in grid.values() if s in by_seed)
        cells = [f"{series(by_seed[s], 'eval/accuracy')[1][-1] - start:+.3f}"
                 if s in by_seed else "-" for by_seed in grid.values()]
        lines.append(f"| {s} | {start:.3f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def sweep_table(sweep: dict) -> str:
    """One row per run (override, variant, seed), then, for a point run with several seeds,
    the mean gain over them."""
    lines = ["| override | variant | seed | start acc | final acc | max acc | gain | clip frac "
             "| volatility | kl/old | mismatch tok | reward last 20 |", "|" + "---|" * 12]
    for o, by_var in sweep.items():
        for name, by_seed in by_var.items():
            gains = []
            for seed, rows in sorted(by_seed.items()):
                acc = series(rows, "eval/accuracy")[1]
                gains.append(acc[-1] - acc[0])
                last = statistics.fmean(series(rows, "reward/mean")[1][-20:])
                lines.append(
                    f"| `{o}` | {name} | {seed} | {acc[0]:.3f} | {acc[-1]:.3f} | {max(acc):.3f} "
                    f"| {gains[-1]:+.3f} | {run_mean(rows, 'clip/frac'):.2e} | "
                    f"{run_mean(rows, 'moe/volatility'):.2e} | {run_mean(rows, 'kl/old'):.2e}"
                    f" | {run_mean(rows, 'mismatch/token_abs_mean'):.2e} | {last:.3f} |")
            if len(gains) > 1:
                lines.append(f"| `{o}` | {name} | mean of {len(gains)} | | | | "
                             f"{_ms(gains, '+.3f')} | | | | | |")
    return "\n".join(lines)


def write_page(args, argv: list[str], grid: dict, sweep: dict) -> None:
    prefix = "mm" if args.name == "moe_mismatch" else args.name
    images = plot({n: list(s.values()) for n, s in grid.items()}, args.out, prefix)
    page = args.out / f"{args.name}.md"
    kept = ""
    if page.is_file() and ANALYSIS in page.read_text():
        kept = page.read_text().split(ANALYSIS, 1)[1]
    seeds = sorted({s for by_seed in grid.values() for s in by_seed})
    shown = [a for a in argv if a not in ("--runs-only", "--page-only")]
    python = os.path.relpath(sys.executable)  # .venv-vllm's for vLLM runs
    python = sys.executable if python.startswith("..") else python
    text = [
        "# MoE with a train/inference mismatch: GSPO vs GRPO, Routing Replay, R3"
        + (f" (`{' '.join(args.extra)}`)" if args.extra else "") + "\n",
        f"Generated by `OMP_NUM_THREADS=1 PYTHONPATH=src {python} "
        f"{' '.join(['experiments/moe_mismatch.py'] + shown)}` (1 CPU thread). The grid and "
        f"the sweep can grow over several invocations (`--only VARIANT`, `--sweep OVERRIDE`): "
        f"each keeps the finished runs' rows of {args.name}.json (same settings), so this "
        f"command rebuilds the page without training. The script writes the tables and plots; "
        f"the analysis is written by hand.\n",
        f"Settings: tiny Qwen3-MoE (`{' '.join(MODEL[1:])}`, hidden 128), `{' '.join(COMMON[2:])}`"
        f", `algorithm.mismatch_every={args.mismatch_every}`"
        + (f", on every RL run `{' '.join(args.extra)}`" if args.extra else "") +
        f"; warm-up {args.warmup} supervised "
        f"steps per seed, {args.steps} RL steps, seeds {seeds}, held-out n={args.n_eval} x 4 "
        f"samples every {args.eval_every} steps. Metric columns are means over each run's steps "
        f"(moe/volatility and mismatch/* exist only on the steps that log them), then mean +- "
        f"std over seeds.\n",
        grid_table(grid),
        "\nPer-seed gain (final - start held-out accuracy; a seed's variants share a warm-up):\n",
        gain_table(grid), "",
        "\n".join(f"![{t}]({n})" for n, (_, t) in zip(images, PLOTS)),
    ]
    if any(sweep.values()):
        sweep_imgs = plot({f"{name} {o}": list(by_seed.values()) for o, by_var in sweep.items()
                           for name, by_seed in by_var.items()}, args.out, f"{prefix}_sweep")
        text += ["\n## Sweep (each variant as in the grid, one override on top; the plots "
                 "show mean +- std over a point's seeds)\n",
                 sweep_table(sweep), "",
                 "\n".join(f"![sweep: {t}]({n})" for n, (_, t) in zip(sweep_imgs, PLOTS))]
    text += ["", ANALYSIS + kept.rstrip("\n") if kept else ANALYSIS]
    page.write_text("\n".join(text) + "\n")
    (args.out / f"{args.name}.json").write_text(json.dumps(
        {"settings": settings(args, seeds),
         "grid": {n: {str(s): rows for s, rows in r.items()} for n, r in grid.items()},
         "sweep": {o: {n: {str(s): rows for s, rows in by_seed.items()}
                       for n, by_seed in by_var.items()} for o, by_var in sweep.items()}}))


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--warmup", type=int, default=600)
    p.add_argument("--eval-every", type=int, default=20)
    p.add_argument("--n-eval", type=int, default=200)
    p.add_argument("--mismatch-every", type=int, default=5)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--sweep", nargs="*", default=[], help="config overrides, one sweep point "
                   "each (the --sweep-variants, the --sweep-seeds)")
    p.add_argument("--sweep-seeds", type=int, nargs="+", default=[], metavar="SEED",
                   help="the seeds each sweep point runs (default: the first of --seeds)")
    p.add_argument("--sweep-variants", nargs="+", default=["gspo", "grpo"], metavar="VARIANT",
                   choices=list(VARIANTS), help="the variants each sweep point runs")
    p.add_argument("--only", nargs="*", default=[], metavar="VARIANT", choices=list(VARIANTS),
                   help="train only these grid variants (the others' rows are kept from the "
                        "last report where it has them)")
    p.add_argument("--runs-only", action="store_true", help="train, write no page")
    p.add_argument("--page-only", action="store_true", help="train nothing: the page from the "
                   "runs that finished (a grid cut short says so in its seed counts)")
    p.add_argument("--work", type=Path, default=Path("runs/moe_mismatch"))
    p.add_argument("--warm-work", type=Path, default=None, metavar="DIR",
                   help="where the seeds' warm-ups are (default: --work)")
    p.add_argument("--extra", nargs="*", default=[], metavar="KEY=VALUE",
                   help="overrides for every RL run (not the warm-ups), e.g. rollout.engine=vllm")
    p.add_argument("--name", default="moe_mismatch", help="the report: NAME.{md,json} in --out")
    p.add_argument("--out", type=Path, default=Path("docs/results"))
    args = p.parse_args(argv)
    torch.set_num_threads(1)  # the machine is shared; one thread, as OMP_NUM_THREADS says
    check_configs(args)
    grid, sweep = run_all(args)
    if not args.runs_only:
        args.out.mkdir(parents=True, exist_ok=True)
        write_page(args, argv, grid, sweep)
        print(grid_table(grid))
    return 0


if __name__ == "__main__":
    sys.exit(main())
