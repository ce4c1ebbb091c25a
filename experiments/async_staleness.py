"""Asynchronous rollouts at equal steps: does rollout.max_staleness=k cost held-out accuracy, and
do GSPO and GRPO tolerate staleness alike? SmolLM2-135M-Instruct, 2-digit addition, CPU.

    OMP_NUM_THREADS=1 .venv/bin/python experiments/async_staleness.py [--threads 1]
        [--main-steps 20] [--sweep-steps 10] [--seeds 0 1] [--sweep-seeds 0] [--staleness 0 1 2 4]
        [--runs DIR] [--out docs/results] [--only NAME ...] [--report-only]
        [--model NAME_OR_DIR] [--extra KEY=VALUE ...] [--gspo-extra KEY=VALUE ...]
        [--name async_staleness]

Two questions, one grid of runs, each from the same pretrained weights with the recipe
examples/configs/smollm2_addition.yaml (8 prompts x G 8, <= 40 new tokens, lr 5e-6, 4
minibatches, bf16-mixed with a float32 sampler, old_logprobs=recompute) and only
rollout.max_staleness, algorithm.name and train.seed changed:

- main: GSPO synchronous (k = 0) vs k = 1, for --main-steps steps, each seed;
- sweep: GSPO vs GRPO (each with its paper clip range, both at the recipe's lr) at each k of
  --staleness, each of --sweep-seeds (default 0), for --sweep-steps steps. A sweep point that
  is also a main run (GSPO, k 0 or 1, a main seed) is read from the main run's first
  --sweep-steps steps: nothing in a run depends on train.steps (no lr schedule; step m's
  prompts, sampling seed and weights version do not look ahead), so it is the same run.

Runs go in the order of RUNS below (most wanted first) and a run whose metrics reach its steps
is skipped (read from its run dir or, when that is gone, from the rows async_staleness.json
keeps), so the script resumes where it was stopped; an unfinished run directory is deleted
and trained again from step 0 (an asynchronous run resumed from a checkpoint samples its first
step at staleness 0, so it would not be the same run). The final checkpoint's weights are
deleted once a run finishes (only metrics.jsonl and config.yaml are read). After each run,
async_staleness.json (every run's per-step numbers and summaries) and async_staleness_table.md
are rewritten from whatever has finished, so a stopped grid still reports what it has.
`--model tiny-qwen3` with `--extra` sizes runs the same grid on the built-in tiny model (the
test suite's smoke run). `--extra` changes every run and `--gspo-extra` the GSPO runs only; with
`--name` the grid writes NAME.json, NAME_table.md and NAME.png, e.g. the paper's setting, pi_old
from the sampler, with GSPO's clip range above the sampler/trainer mismatch:

    experiments/async_staleness.py --name async_staleness_rollout --seeds 0 --main-steps 10 \
        --staleness 0 1 4 --extra algorithm.old_logprobs=rollout \
        --gspo-extra algorithm.eps_low=3e-2 algorithm.eps_high=3e-2
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
import torch  # noqa: E402

from gspo import PRETRAINED, fetch_model, load_config, read_metrics, train  # noqa: E402

RECIPE = Path(__file__).resolve().parent.parent / "examples" / "configs" / "smollm2_addition.yaml"
STEP_KEYS = ("reward/mean", "clip/frac", "rollout/staleness", "response/len_mean", "kl/old",
             "time/rollout_s", "time/old_logp_s", "time/update_s", "time/sample_s")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--main-steps", type=int, default=20)
    p.add_argument("--sweep-steps", type=int, default=10)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1], help="seeds of the main runs")
    p.add_argument("--sweep-seeds", type=int, nargs="+", default=[0],
                   help="seeds of the GSPO vs GRPO staleness sweep")
    p.add_argument("--staleness", type=int, nargs="+", default=[0, 1, 2, 4],
                   help="max_staleness values of the sweep")
    p.add_argument("--eval-every", type=int, default=10)
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads of the trainer (an asynchronous run's sampler thread "
                        "gets as many again: rollout.sampler_threads is left at its default)")
    p.add_argument("--runs", default="runs/async-staleness", help="where run dirs go")
    p.add_argument("--out", default="docs/results")
    p.add_argument("--only", nargs="*", default=None, metavar="NAME",
                   help="train only these runs (names as in the JSON, e.g. gspo-k4-s0)")
    p.add_argument("--report-only", action="store_true", help="train nothing, only report")
    p.add_argument("--extra", nargs="*", default=[], metavar="KEY=VALUE",
                   help="further config overrides for every run (e.g. for a quick smoke run)")
    p.add_argument("--gspo-extra", nargs="*", default=[], metavar="KEY=VALUE",
                   help="further config overrides for the GSPO runs (e.g. a clip range)")
    p.add_argument("--name", default="async_staleness",
                   help="the report's file names: NAME.json, NAME_table.md, NAME.png")
    p.add_argument("--model", default="smollm2-135m-instruct",
                   help="a gspo.PRETRAINED name, a model directory, or tiny-qwen3 (smoke runs)")
    return p.parse_args(argv)


def name(algo: str, k: int, seed: int) -> str:
    return f"{algo}-k{k}-s{seed}"


def plan(a) -> dict[str, dict]:
    """name -> {algo, k, seed, steps}, in the order the runs should train (most wanted first):
    main seed 0 (sync, async), the first sweep seed's k 0 and the largest k, the other ks from
    the largest down, then the other main seeds, then the other sweep seeds likewise."""
    runs: dict[str, dict] = {}

    def add(algo, k, seed, steps):
        key = name(algo, k, seed)
        runs[key] = {"algo": algo, "k": k, "seed": seed,
                     "steps": max(steps, runs.get(key, {}).get("steps", 0))}

    seeds = sorted(a.seeds, key=lambda s: s != 0)
    ks = sorted(a.staleness)
    for k in (0, 1):
        add("gspo", k, seeds[0], a.main_steps)
    sweep_seeds = sorted(a.sweep_seeds, key=lambda s: s != 0)

    def add_sweep(seed):
        for k in [ks[0], ks[-1], *sorted(ks[1:-1], reverse=True)]:
            for algo in ("gspo", "grpo"):
                add(algo, k, seed, a.sweep_steps)

    add_sweep(sweep_seeds[0])
    for seed in seeds[1:]:
        for k in (0, 1):
            add("gspo", k, seed, a.main_steps)
    for seed in sweep_seeds[1:]:
        add_sweep(seed)
    return runs


def finished(rows: list[dict] | None, steps: int) -> bool:
    return bool(rows) and any(r["step"] >= steps and "loss" in r for r in rows)


def load_run(a, key: str) -> tuple[list[dict], dict | None] | None:
    """A run's metrics rows and wall time: from its run dir, else from the rows the report's
    JSON keeps (a run reported earlier, its run dir gone: the longest entry, main or sweep)."""
    path = Path(a.runs) / key
    try:
        rows = read_metrics(path / "metrics.jsonl")
        wall = path / "wall_s.json"
        return rows, json.loads(wall.read_text()) if wall.is_file() else None
    except (OSError, ValueError):
        pass
    report = Path(a.out) / f"{a.name}.json"
    if not report.is_file():
        return None
    old = json.loads(report.read_text())
    # the same run only if of the same model and extra overrides (a report from before they
    # were recorded was SmolLM2's, without extras)
    if (old.get("model", "smollm2-135m-instruct"), old.get("extra", []),
            old.get("gspo_extra", [])) != (a.model, a.extra, a.gspo_extra):
        return None
    entries = [old[part][key] for part in ("main", "sweep") if key in old.get(part, {})]
    if not entries:
        return None
    v = max(entries, key=lambda e: len(e["per_step"]["reward/mean"]))
    steps = len(v["per_step"]["reward/mean"])
    rows = [{"step": int(s), "eval/accuracy": acc} for s, acc in v["evals"].items()]
    rows += [{"step": i + 1, "loss": None,
              **{k: xs[i] for k, xs in v["per_step"].items() if xs[i] is not None}}
             for i in range(steps)]
    return rows, v.get("wall")


def run_one(a, model: Path, spec: dict, path: Path) -> None:
    if path.exists():
        print(f"{path}: unfinished, deleted and trained again", flush=True)
        shutil.rmtree(path)
    cfg = load_config(RECIPE, [f"model.name_or_path={json.dumps(str(model))}",
                               f"algorithm={spec['algo']}", f"train.seed={spec['seed']}",
                               f"rollout.max_staleness={spec['k']}",
                               f"train.steps={spec['steps']}",
                               f"train.eval_every={a.eval_every}", "train.progress=false",
                               "train.save_every=0", "train.keep_last=1", *a.extra,
                               *(a.gspo_extra if spec["algo"] == "gspo" else [])])
    print(f"training {path.name} ({spec['steps']} steps) -> {path}", flush=True)
    t0 = time.perf_counter()
    train(cfg, path)
    (path / "wall_s.json").write_text(json.dumps({"wall_s": time.perf_counter() - t0,
                                                  "threads": a.threads}))
    for ckpt in (path / "checkpoints").glob("step_*"):  # ~2 GB each; the metrics are the result
        for f in ("model.safetensors", "trainer_state.pt"):
            (ckpt / f).unlink(missing_ok=True)


def summarise(rows: list[dict], steps: int) -> dict:
    """The first `steps` steps of a run: held-out accuracy, per-step numbers and means."""
    evals = {r["step"]: r["eval/accuracy"] for r in rows
             if "eval/accuracy" in r and r["step"] <= steps}
    rl = [r for r in rows if "loss" in r and r["step"] <= steps]
    # the trainer's wall time of a step (rollout_s is its wait for the sampler when async);
    # held-out evaluation is not in it
    step_s = [r["time/rollout_s"] + r["time/old_logp_s"] + r["time/update_s"] for r in rl]
    return {"evals": evals,
            "per_step": {k: [r.get(k) for r in rl] for k in STEP_KEYS},
            "reward_last3": statistics.mean(r["reward/mean"] for r in rl[-3:]),
            "reward_mean": statistics.mean(r["reward/mean"] for r in rl),
            "clip_frac": statistics.mean(r["clip/frac"] for r in rl),
            "staleness_mean": statistics.mean(r.get("rollout/staleness", 0) for r in rl),
            "len_mean": statistics.mean(r["response/len_mean"] for r in rl),
            "s_per_step": statistics.mean(step_s)}


def main(argv=None) -> int:
    a = parse_args(argv)
    torch.set_num_threads(a.threads)
    model = fetch_model(a.model) if a.model in PRETRAINED else a.model
    runs = plan(a)
    for key, spec in runs.items():
        got = load_run(a, key)
        if a.report_only or finished(got and got[0], spec["steps"]) or (
                a.only is not None and key not in a.only):
            continue
        run_one(a, model, spec, Path(a.runs) / key)
        write_report(a, runs)
    write_report(a, runs)
    return 0


def write_report(a, runs: dict[str, dict]) -> None:
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    done = {}
    for key, spec in runs.items():
        got = load_run(a, key)
        if got and finished(got[0], spec["steps"]):
            done[key] = {**spec, "rows": got[0], "wall": got[1]}
    main_rows = {(r["seed"], r["k"]): {**summarise(r["rows"], a.main_steps), "wall": r["wall"]}
                 for key, r in done.items()
                 if r["algo"] == "gspo" and r["k"] in (0, 1) and r["seed"] in a.seeds
                 and r["steps"] >= a.main_steps}
    sweep_rows = {(r["algo"], r["k"], r["seed"]): summarise(r["rows"], a.sweep_steps)
                  for r in done.values() if r["seed"] in a.sweep_seeds and r["k"] in a.staleness}
    (out / f"{a.name}.json").write_text(json.dumps({
        "recipe": str(RECIPE.relative_to(RECIPE.parents[2])), "model": a.model, "extra": a.extra,
        "gspo_extra": a.gspo_extra,
        "threads": a.threads,
        "main": {f"gspo-k{k}-s{seed}": v for (seed, k), v in sorted(main_rows.items())},
        "sweep": {f"{algo}-k{k}-s{seed}": v for (algo, k, seed), v in sorted(sweep_rows.items())},
    }, indent=1, default=str))
    table = main_table(a, main_rows) + "\n\n" + sweep_table(a, sweep_rows)
    (out / f"{a.name}_table.md").write_text(table + "\n")
    print(table, flush=True)
    plot(a, out, done)


def _acc(v: dict, s: int) -> str:
    return f"{100 * v['evals'][s]:.1f}%" if s in v["evals"] else "-"


def main_table(a, rows: dict) -> str:
    steps = sorted({s for v in rows.values() for s in v["evals"]})
    head = ("| max_staleness | seed | " + " | ".join(f"acc @ {s}" for s in steps) +
            " | reward (mean, last 3) | staleness (mean) | clip frac | response tokens |"
            " s / step (trainer) | sample s / step |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for (seed, k), v in sorted(rows.items(), key=lambda kv: (kv[0][0], kv[0][1])):
        sample = [x for x in v["per_step"]["time/sample_s"] if x is not None]
        lines.append(f"| {k} | {seed} | " + " | ".join(_acc(v, s) for s in steps) +
                     f" | {v['reward_mean']:.3f}, {v['reward_last3']:.3f} | "
                     f"{v['staleness_mean']:.2f} | {v['clip_frac']:.3f} | {v['len_mean']:.1f} | "
                     f"{v['s_per_step']:.1f} | "
                     f"{statistics.mean(sample) if sample else float('nan'):.1f} |")
    for k in (0, 1):
        vs = [v for (_, kk), v in rows.items() if kk == k]
        if len(vs) > 1:
            accs = " | ".join(f"{100 * statistics.mean(v['evals'][s] for v in vs):.1f}%"
                              if all(s in v["evals"] for v in vs) else "-" for s in steps)
            lines.append(f"| **{k} mean** | {len(vs)} seeds | {accs} | "
                         f"{statistics.mean(v['reward_mean'] for v in vs):.3f}, "
                         f"{statistics.mean(v['reward_last3'] for v in vs):.3f} | "
                         f"{statistics.mean(v['staleness_mean'] for v in vs):.2f} | "
                         f"{statistics.mean(v['clip_frac'] for v in vs):.3f} | "
                         f"{statistics.mean(v['len_mean'] for v in vs):.1f} | "
                         f"{statistics.mean(v['s_per_step'] for v in vs):.1f} | |")
    return "\n".join(lines)


def sweep_table(a, rows: dict) -> str:
    """One row per sweep run, then per (algorithm, k) run on several seeds their mean held-out
    accuracy at the last step and the share of the synchronous gain it kept (mean over the
    seeds that have k = 0)."""
    head = (f"| algorithm | max_staleness | seed | acc @ 0 | acc @ {a.sweep_steps} | "
            "reward (last 3 steps) | clip frac | staleness (mean) | response tokens | s / step |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for (algo, k, seed), v in sorted(rows.items()):
        lines.append(f"| {algo} | {k} | {seed} | {_acc(v, 0)} | {_acc(v, a.sweep_steps)} | "
                     f"{v['reward_last3']:.3f} | {v['clip_frac']:.3f} | "
                     f"{v['staleness_mean']:.2f} | {v['len_mean']:.1f} | {v['s_per_step']:.1f} |")
    means = sweep_means(a, rows)
    if any(n > 1 for _, _, n, _ in means.values()):
        lines += ["", f"| algorithm | max_staleness | seeds | acc @ {a.sweep_steps} (mean) | "
                      "gain kept vs k = 0 (mean) |", "|---|---|---|---|---|"]
        for (algo, k), (acc, kept, n, seeds) in sorted(means.items()):
            lines.append(f"| {algo} | {k} | {n} ({', '.join(map(str, seeds))}) | "
                         f"{100 * acc:.1f}% | " + ("-" if kept is None else f"{100 * kept:.0f}%")
                         + " |")
    return "\n".join(lines)


def sweep_means(a, rows: dict) -> dict:
    """(algo, k) -> (mean held-out accuracy at the sweep's last step, mean share of the k = 0
    run's gain kept (same seed; None without one), seed count, seeds)."""
    out = {}
    for algo, k in sorted({(algo, k) for algo, k, _ in rows}):
        by_seed = {seed: v["evals"][a.sweep_steps] for (al, kk, seed), v in rows.items()
                   if (al, kk) == (algo, k) and a.sweep_steps in v["evals"]}
        if not by_seed:
            continue
        kept = []
        for seed, acc in by_seed.items():
            sync = rows.get((algo, 0, seed))
            if sync and a.sweep_steps in sync["evals"] and 0 in sync["evals"]:
                gain = sync["evals"][a.sweep_steps] - sync["evals"][0]
                if gain > 0:
                    kept.append((acc - sync["evals"][0]) / gain)
        out[(algo, k)] = (statistics.mean(by_seed.values()),
                          statistics.mean(kept) if kept else None, len(by_seed), sorted(by_seed))
    return out


def plot(a, out: Path, done: dict) -> None:
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 3.5))
    for key, r in done.items():
        if r["algo"] != "gspo" or r["k"] not in (0, 1) or r["steps"] < a.main_steps:
            continue
        pts = [(x["step"], x["reward/mean"]) for x in r["rows"] if "loss" in x]
        ax1.plot(*zip(*pts), color=f"C{r['k']}", ls="-" if r["seed"] == 0 else "--",
                 label=f"gspo max_staleness={r['k']} seed {r['seed']}")
    ax1.set_xlabel("RL step")
    ax1.set_title("reward (GSPO, sync vs async)")
    ax1.legend(fontsize=7)
    for i, algo in enumerate(("gspo", "grpo")):
        for seed in sorted(a.sweep_seeds):
            pts = sorted((r["k"], r["rows"]) for r in done.values()
                         if r["algo"] == algo and r["seed"] == seed and r["k"] in a.staleness)
            accs = [(k, summarise(rows, a.sweep_steps)["evals"].get(a.sweep_steps))
                    for k, rows in pts]
            accs = [(k, v) for k, v in accs if v is not None]
            if accs:
                ax2.plot(*zip(*accs), marker="o", color=f"C{i + 2}",
                         ls="-" if seed == min(a.sweep_seeds) else "--",
                         label=f"{algo} seed {seed}")
    ax2.set_xlabel("rollout.max_staleness")
    ax2.set_title(f"held-out accuracy at step {a.sweep_steps}")
    ax2.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / f"{a.name}.png", dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
