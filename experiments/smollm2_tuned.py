"""GSPO vs GRPO, each tuned, and the sampler's precision: SmolLM2-135M-Instruct, 2-digit
addition, one CPU thread.

    OMP_NUM_THREADS=1 .venv/bin/python experiments/smollm2_tuned.py [--steps 10]
        [--eval-every 5] [--until HH:MM] [--runs DIR] [--out docs/results] [--report-only]
        [--only NAME ...] [--model NAME_OR_DIR] [--extra KEY=VALUE ...]

Every run starts from the same pretrained weights with the recipe
examples/configs/smollm2_addition.yaml (8 prompts x G 8, <= 40 new tokens, 4 minibatches,
bf16-mixed training with a float32 sampler, old_logprobs=recompute, lr 5e-6) and changes one or
two things. Runs train in this order (most wanted first):

1. lr sweep, seed 0: GSPO and GRPO at 1.5e-5 and 3e-5 (lr 5e-6 is read from earlier runs,
   trained only where there are none);
2. seed 1 of each algorithm's best lr (highest held-out at the last step, then at the eval
   before it, then the training reward of the last 3 steps);
3. the sampler in float16 (GSPO, lr 5e-6): a 1-step probe first; if it samples more than
   3x slower per token than the float32 sampler, only 3 steps (for mismatch/*), else --steps;
   then two probes of mismatch/* alone (no evaluation): float16 on both sides
   (train.precision=fp16-mixed) and float32 on both sides, 1 step each;
4. off-policyness: algorithm.minibatches 8 then 1, GSPO and GRPO;
5. GSPO's clip range about 3x the paper's (1e-3 / 1.3e-3), then 10x (3e-3 / 4e-3);
6. minibatches 1 and 8 again, each algorithm at its best lr (seed 0);
7. seed 1 of GSPO at the 10x clip range, then of minibatches 1 and 8 at each best lr;
8. seed 1 of minibatches 1 and 8 at lr 5e-6.

Earlier runs of the same recipe are reused, not trained again (REUSED below: GSPO lr 5e-6 seeds
0 and 1 with the float32 sampler, seed 0 with the bf16 sampler; GRPO lr 5e-6 seed 0 from
async_staleness.json, whose evals are at steps 0 and 10 only, without mismatch/*). Nothing in a
run depends on train.steps, so their first --steps steps are the same runs. A run whose metrics
reach its steps is skipped (the script resumes where it stopped, from its run dirs or, when
they are gone, from the rows smollm2_tuned.json keeps; an unfinished run is trained again from
step 0), and no run starts that would not end by --until. After each run
smollm2_tuned.json and the tables in smollm2_tuned.md (between its table markers; the prose
around them is left alone) are rewritten from whatever has finished. `--model tiny-qwen3` with
`--extra` sizes runs the same plan on the built-in tiny model (the test suite's smoke run); the
earlier runs are SmolLM2's, so they are reused only for the default model.
"""

from __future__ import annotations

import argparse
import datetime as dt
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

ROOT = Path(__file__).resolve().parent.parent
MODEL = "smollm2-135m-instruct"
RECIPE = ROOT / "examples" / "configs" / "smollm2_addition.yaml"
RESULTS = ROOT / "docs" / "results"
REUSED = {  # run name -> earlier metrics of exactly that run (MODEL, same recipe, seed, overrides)
    "gspo-lr5e-06-s0": RESULTS / "smollm2_addition_bf16_mixed_fp32_sampler_s0_metrics.jsonl",
    "gspo-lr5e-06-s1": RESULTS / "smollm2_addition_bf16_mixed_fp32_sampler_s1_metrics.jsonl",
    "gspo-lr5e-06-bfloat16-s0": RESULTS / "smollm2_addition_bf16_mixed_s0_metrics.jsonl",
    "grpo-lr5e-06-s0": RESULTS / "async_staleness.json",  # its sweep's grpo-k0-s0
}
SWEEP_LRS = (5e-6, 1.5e-5, 3e-5)
TABLE_START, TABLE_END = "<!-- tables: written by experiments/smollm2_tuned.py -->", "<!-- /tables -->"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--eval-every", type=int, default=5)
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    p.add_argument("--until", default=None, metavar="HH:MM",
                   help="UTC time (its next occurrence) by which training must end: a run "
                        "that would not finish by then (at --est-step-s per step, 30 s per "
                        "eval) is not started")
    p.add_argument("--est-step-s", type=float, default=45.0)
    p.add_argument("--runs", default="runs/smollm2-tuned", help="where run dirs go")
    p.add_argument("--out", default=str(RESULTS))
    p.add_argument("--report-only", action="store_true", help="train nothing, only report")
    p.add_argument("--skip", nargs="*", default=[], metavar="NAME",
                   help="runs not to train (e.g. one too slow for the time left)")
    p.add_argument("--only", nargs="*", default=None, metavar="NAME",
                   help="train only these runs (names as in the JSON, e.g. gspo-lr1.5e-05-s0)")
    p.add_argument("--model", default=MODEL,
                   help="a gspo.PRETRAINED name, a model directory, or tiny-qwen3 (smoke runs)")
    p.add_argument("--extra", nargs="*", default=[], metavar="KEY=VALUE",
                   help="further config overrides for every run (e.g. for a quick smoke run)")
    return p.parse_args(argv)


# ---------------------------------------------------------------- the runs


def spec(algo: str, seed: int, steps: int, lr: float = 5e-6, eps: tuple | None = None,
         minibatches: int = 4, dtype: str = "float32", precision: str = "bf16-mixed",
         probe: bool = False) -> dict:
    """One run: its name (which says what differs from the recipe) and its config overrides.
    A probe measures speed and mismatch/* only: no held-out evaluation."""
    name = f"{algo}-lr{lr:g}" + (f"-eps{eps[0]:g}-{eps[1]:g}" if eps else "") + \
        (f"-mb{minibatches}" if minibatches != 4 else "") + \
        (f"-{dtype}" if dtype != "float32" else "") + \
        (f"-train-{precision}" if precision != "bf16-mixed" else "") + \
        ("-probe" if probe else "") + f"-s{seed}"
    over = [f"algorithm={algo}", f"train.seed={seed}", f"train.steps={steps}",
            f"optim.lr={lr}", f"algorithm.minibatches={minibatches}", f"rollout.dtype={dtype}",
            f"train.precision={precision}"]
    if eps:
        over += [f"algorithm.eps_low={eps[0]}", f"algorithm.eps_high={eps[1]}"]
    return {"name": name, "algo": algo, "seed": seed, "steps": steps, "overrides": over,
            "probe": probe}


def config(a, model: Path, s: dict):
    """The resolved config of a run: load_config validates every override before any training."""
    return load_config(RECIPE, [f"model.name_or_path={json.dumps(str(model))}", *s["overrides"],
                                f"train.eval_every={0 if s['probe'] else a.eval_every}",
                                "train.save_every=0", "train.keep_last=1", "train.progress=false",
                                *a.extra])


def finished(rows: list[dict] | None, steps: int) -> bool:
    return bool(rows) and any(r["step"] >= steps and "loss" in r for r in rows)


def reused(a) -> dict[str, Path]:
    """The earlier runs this invocation may stand on: SmolLM2's, so none for another model."""
    return REUSED if a.model == MODEL else {}


def load_rows(a, name: str) -> list[dict] | None:
    """A run's metrics rows: from this script's run dir, else from the report's JSON (a run
    reported earlier, its run dir gone), else from an earlier experiment (REUSED)."""
    path = Path(a.runs) / name / "metrics.jsonl"
    if path.exists():
        return read_metrics(path)
    report = Path(a.out) / "smollm2_tuned.json"  # every row of each run reported so far
    if report.exists():
        old = json.loads(report.read_text())
        earlier = old["runs"].get(name)
        # the same run only if of the same model and extra overrides (a report from before
        # they were recorded was SmolLM2's, without extras)
        if earlier is not None and (old.get("model", MODEL), old.get("extra", [])) == \
                (a.model, a.extra):
            return earlier["per_step"]
    src = reused(a).get(name)
    if src is None:
        return None
    if src.suffix == ".jsonl":
        return read_metrics(src)
    run = json.loads(src.read_text())["sweep"]["grpo-k0-s0"]  # per-step lists, evals by step
    steps = len(run["per_step"]["reward/mean"])
    rows = [{"step": i + 1, "loss": None, **{k: v[i] for k, v in run["per_step"].items()}}
            for i in range(steps)]
    return [{"step": int(s), "eval/accuracy": acc} for s, acc in run["evals"].items()] + rows


def run_one(a, model: Path, s: dict) -> None:
    path = Path(a.runs) / s["name"]
    if path.exists():
        print(f"{path}: unfinished, deleted and trained again", flush=True)
        shutil.rmtree(path)
    cfg = config(a, model, s)
    print(f"{dt.datetime.now(dt.timezone.utc):%H:%M} training {s['name']} ({s['steps']} steps): "
          f"{' '.join(s['overrides'])}", flush=True)
    t0 = time.perf_counter()
    train(cfg, path)
    (path / "wall_s.json").write_text(json.dumps({"wall_s": time.perf_counter() - t0,
                                                  "threads": a.threads}))
    for ckpt in (path / "checkpoints").glob("step_*"):  # weights + AdamW state: GBs, not results
        for f in ("model.safetensors", "trainer_state.pt"):
            (ckpt / f).unlink(missing_ok=True)


def deadline(until: str | None, now: dt.datetime) -> dt.datetime | None:
    """--until's next occurrence after `now` (at 22:50, 01:00 is tomorrow's), fixed once per
    invocation so that a deadline passed during the runs stays passed."""
    if until is None:
        return None
    hh, mm = map(int, until.split(":"))
    at = now.replace(hour=hh, minute=mm, second=0, microsecond=0)
    return at if at > now else at + dt.timedelta(days=1)


def fits(a, s: dict) -> bool:
    if a.deadline is None:
        return True
    now = dt.datetime.now(dt.timezone.utc)
    evals = 0 if s["probe"] else 1 + s["steps"] // a.eval_every
    need = dt.timedelta(seconds=30 + s["steps"] * a.est_step_s + 30 * evals)
    if now + need <= a.deadline:
        return True
    print(f"{now:%H:%M} not started, would end after {a.until}: {s['name']}", flush=True)
    return False


def best_lr(a, algo: str) -> float | None:
    """The seed-0 lr of the sweep with the highest held-out at the last step, then at the eval
    before it, then the training reward of the last 3 steps; None until all have finished."""
    keys = []
    for lr in SWEEP_LRS:
        rows = load_rows(a, spec(algo, 0, a.steps, lr)["name"])
        if not finished(rows, a.steps):
            return None
        v = summarise(rows, a.steps)
        keys.append(((v["evals"].get(a.steps, 0), v["evals"].get(a.steps - a.eval_every, 0),
                      v["reward_last3"]), lr))
    return max(keys)[1]


def fp16_steps(a) -> int | None:
    """--steps if the float16 sampler's 1-step probe sampled at most 3x slower per token than
    the float32 sampler's step 1 (same weights, same prompts), else 3; None before the probe."""
    probe = load_rows(a, spec("gspo", 0, 1, dtype="float16", probe=True)["name"])
    if not finished(probe, 1):
        return None
    ref = load_rows(a, spec("gspo", 0, a.steps, 1.5e-5)["name"])  # step 1: pretrained weights
    ref = ref if finished(ref, 1) else load_rows(a, "gspo-lr5e-06-s0")
    s16, s32 = (next(r for r in rows if r["step"] == 1 and "loss" in r) for rows in (probe, ref))
    slowdown = (s16["time/rollout_s"] / s16["response/len_mean"]) / \
        (s32["time/rollout_s"] / s32["response/len_mean"])
    print(f"float16 sampler: {slowdown:.2f}x the float32 sampler's time per token", flush=True)
    return a.steps if slowdown <= 3 else 3


def plan(a):
    """Yield the runs in priority order; later entries may depend on earlier results."""
    for algo in ("gspo", "grpo"):
        for lr in SWEEP_LRS:  # lr 5e-6 is finished already where REUSED has it
            yield spec(algo, 0, a.steps, lr)
    for algo in ("gspo", "grpo"):
        lr = best_lr(a, algo)
        if lr is not None:
            yield spec(algo, 1, a.steps, lr)
    yield spec("gspo", 0, 1, dtype="float16", probe=True)
    n = fp16_steps(a)
    if n is not None:
        yield spec("gspo", 0, n, dtype="float16")
    # the mismatch with no bf16 anywhere: float16 on both sides (the FP16 paper's setting), and
    # float32 on both sides (what is left when no rounding differs: kernels, batching, KV cache)
    yield spec("gspo", 0, 1, dtype="float16", precision="fp16-mixed", probe=True)
    yield spec("gspo", 0, 1, precision="fp32", probe=True)
    for mb in (8, 1):
        for algo in ("gspo", "grpo"):
            yield spec(algo, 0, a.steps, minibatches=mb)
    for eps in ((1e-3, 1.3e-3), (3e-3, 4e-3)):
        yield spec("gspo", 0, a.steps, eps=eps)
    # the off-policy axis again, each algorithm at its own best lr (at 5e-6 GSPO is handicapped)
    best = {algo: lr for algo in ("gspo", "grpo") if (lr := best_lr(a, algo)) is not None}
    for algo, lr in best.items():
        for mb in (1, 8):
            yield spec(algo, 0, a.steps, lr, minibatches=mb)
    yield spec("gspo", 1, a.steps, eps=(3e-3, 4e-3))  # the wider clip range's second seed
    for algo, lr in best.items():  # seed 1 of the on-policy contrast at the best lrs
        yield spec(algo, 1, a.steps, lr, minibatches=1)
    for algo, lr in best.items():  # ... and of its 8-minibatch end: seed 1 has the whole axis
        yield spec(algo, 1, a.steps, lr, minibatches=8)
    for mb in (1, 8):  # seed 1 of the off-policy axis at lr 5e-6 (GSPO handicapped there)
        for algo in ("gspo", "grpo"):
            yield spec(algo, 1, a.steps, minibatches=mb)


def reported(a, model: Path) -> list[dict]:
    """Every run to report, the reused ones first, each with its resolved config."""
    runs = [spec("gspo", 0, a.steps, lr) for lr in SWEEP_LRS] + \
        [spec("grpo", 0, a.steps, lr) for lr in SWEEP_LRS] + \
        [spec("gspo", 1, a.steps), spec("gspo", 0, a.steps, dtype="bfloat16")] + \
        list(plan(a))
    seen, out = set(), []
    for s in runs:
        if s["name"] not in seen:
            seen.add(s["name"])
            out.append({**s, "cfg": config(a, model, s)})
    return out


# ---------------------------------------------------------------- the report


def summarise(rows: list[dict], steps: int) -> dict:
    evals = {r["step"]: r["eval/accuracy"] for r in rows
             if "eval/accuracy" in r and r["step"] <= steps}
    rl = [r for r in rows if "loss" in r and r["step"] <= steps]
    step_s = [r["time/rollout_s"] + r["time/old_logp_s"] + r["time/update_s"] for r in rl]
    mismatch = [r["mismatch/token_abs_mean"] for r in rl if "mismatch/token_abs_mean" in r]
    return {"steps": len(rl), "evals": evals,
            "eval_80": next((s for s in sorted(evals) if evals[s] >= 0.8), None),
            "reward_80": next((r["step"] for r in rl if r["reward/mean"] >= 0.8), None),
            "reward_last3": statistics.mean(r["reward/mean"] for r in rl[-3:]),
            "clip_frac": statistics.mean(r["clip/frac"] for r in rl),
            "clip_frac_steps": [r["clip/frac"] for r in rl],
            "mismatch": statistics.mean(mismatch) if mismatch else None,
            "mismatch_seq": statistics.mean(abs(r["mismatch/seq_log_ratio_mean"]) for r in rl)
            if mismatch else None,
            "len_mean": statistics.mean(r["response/len_mean"] for r in rl),
            "s_per_step": statistics.mean(step_s)}


def describe(a, s: dict) -> dict:
    c = s["cfg"]
    return {"algorithm": c.algorithm.name, "lr": c.optim.lr, "eps_low": c.algorithm.eps_low,
            "eps_high": c.algorithm.eps_high, "minibatches": c.algorithm.minibatches,
            "sampler": c.rollout.dtype, "precision": c.train.precision, "seed": c.train.seed,
            "source": str(reused(a)[s["name"]].relative_to(ROOT)) if s["name"] in reused(a)
            else "this script"}


def run_table(a, done: dict) -> str:
    evals = sorted({e for v in done.values() for e in v["evals"] if e <= a.steps})
    head = ("| run | algorithm | lr | clip range | minibatches | sampler | seed | " +
            " | ".join(f"acc @ {e}" for e in evals) + " | held-out >= 80% at | reward >= 0.8 at "
            "| reward (last 3) | clip frac | mismatch token_abs_mean | response tokens | s / step |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for name, v in done.items():
        d = v["run"]
        accs = " | ".join(f"{100 * v['evals'][e]:.1f}%" if e in v["evals"] else "-" for e in evals)
        mark = ("*" if d["source"] != "this script" else "") + \
            ("" if v["steps"] == a.steps else f" ({v['steps']} steps)")
        lines.append(
            f"| {name}{mark} | {d['algorithm']} | {d['lr']:g} | {d['eps_low']:g} / "
            f"{d['eps_high']:g} | {d['minibatches']} | {d['sampler']}"
            + ("" if d["precision"] == "bf16-mixed" else f" (train {d['precision']})") +
            f" | {d['seed']} | {accs} | "
            f"{v['eval_80'] or '-'} | {v['reward_80'] or '-'} | {v['reward_last3']:.3f} | "
            f"{v['clip_frac']:.3f} | "
            + (f"{v['mismatch']:.2g}" if v["mismatch"] is not None else "-") +
            f" | {v['len_mean']:.1f} | {v['s_per_step']:.1f} |")
    return "\n".join(lines)


def best_table(a, done: dict) -> str:
    """Each algorithm's best lr, both seeds: the mean of what each seed reached."""
    lines = ["| algorithm | best lr | seeds | " + " | ".join(
        f"acc @ {e}" for e in range(a.eval_every, a.steps + 1, a.eval_every)) +
        " | reward >= 0.8 at (per seed) | reward (last 3) | clip frac |", None]
    for algo in ("gspo", "grpo"):
        lr = best_lr(a, algo)
        if lr is None:
            continue
        vs = [done[n] for n in (spec(algo, s, a.steps, lr)["name"] for s in (0, 1)) if n in done]
        accs = " | ".join(f"{100 * statistics.mean(v['evals'][e] for v in vs):.1f}%"
                          if all(e in v["evals"] for v in vs) else "-"
                          for e in range(a.eval_every, a.steps + 1, a.eval_every))
        lines.append(f"| {algo} | {lr:g} | {len(vs)} | {accs} | "
                     f"{', '.join(str(v['reward_80'] or '-') for v in vs)} | "
                     f"{statistics.mean(v['reward_last3'] for v in vs):.3f} | "
                     f"{statistics.mean(v['clip_frac'] for v in vs):.3f} |")
    lines[1] = "|" + "---|" * (lines[0].count("|") - 1)
    return "\n".join(lines)


def write_report(a, runs: list[dict]) -> None:
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    done = {}
    for s in runs:
        rows = load_rows(a, s["name"])
        if rows and any("loss" in r for r in rows):
            done[s["name"]] = {**summarise(rows, s["steps"]), "run": describe(a, s),
                               "per_step": [r for r in rows if r["step"] <= s["steps"]]}
    (out / "smollm2_tuned.json").write_text(json.dumps(
        {"recipe": str(RECIPE.relative_to(ROOT)), "model": a.model, "extra": a.extra,
         "threads": a.threads,
         "runs": done},
        indent=1, default=str))
    tables = f"{TABLE_START}\n\n{run_table(a, done)}\n\n{best_table(a, done)}\n\n{TABLE_END}"
    md = out / "smollm2_tuned.md"
    text = md.read_text() if md.exists() else f"# smollm2_tuned\n\n{TABLE_START}\n{TABLE_END}\n"
    head, _, rest = text.partition(TABLE_START)
    md.write_text(head + tables + rest.partition(TABLE_END)[2])
    print(run_table(a, done), flush=True)
    plot(out, done, {algo: best_lr(a, algo) for algo in ("gspo", "grpo")})


def plot(out: Path, done: dict, best: dict) -> None:
    """One figure per question, reward per step and held-out accuracy side by side; `best`
    maps an algorithm to its best lr."""
    groups = {
        "lr": lambda d: d["minibatches"] == 4 and d["sampler"] == "float32"
        and d["precision"] == "bf16-mixed" and d["eps_low"] in (3e-4, 0.2),
        "precision": lambda d: d["algorithm"] == "gspo" and d["lr"] == 5e-6 and d["seed"] == 0
        and d["minibatches"] == 4 and d["eps_low"] == 3e-4,
        "clip_minibatches": lambda d: d["lr"] == 5e-6 and d["seed"] == 0
        and d["sampler"] == "float32" and d["precision"] == "bf16-mixed",
        "minibatches_best_lr": lambda d: d["lr"] == best.get(d["algorithm"]) and d["seed"] == 0
        and d["eps_low"] in (3e-4, 0.2) and d["sampler"] == "float32"
        and d["precision"] == "bf16-mixed",
    }
    for group, keep in groups.items():
        sel = {n: v for n, v in done.items() if keep(v["run"])}
        keys = ["reward/mean", "eval/accuracy", "clip/frac"] + \
            (["mismatch/token_abs_mean"] if group == "precision" else [])
        fig, axes = plt.subplots(1, len(keys), figsize=(4.2 * len(keys), 3.6))
        configs = list(dict.fromkeys(n.rsplit("-s", 1)[0] for n in sel))  # seeds share a colour
        for name, v in sel.items():
            i = configs.index(name.rsplit("-s", 1)[0])
            for ax, key in zip(axes, keys):
                pts = [(r["step"], r[key]) for r in v["per_step"] if r.get(key) is not None]
                if pts:
                    ax.plot(*zip(*pts), marker="o" if key == "eval/accuracy" else ".",
                            color=f"C{i % 10}", ls="-" if v["run"]["seed"] == 0 else "--",
                            label=name)
        for ax, key in zip(axes, keys):
            ax.set_title(key)
            ax.set_xlabel("RL step")
        axes[0].legend(fontsize=6)
        fig.tight_layout()
        fig.savefig(out / f"smollm2_tuned_{group}.png", dpi=90)
        plt.close(fig)


def main(argv=None) -> int:
    a = parse_args(argv)
    a.deadline = deadline(a.until, dt.datetime.now(dt.timezone.utc))
    torch.set_num_threads(a.threads)
    model = fetch_model(a.model) if a.model in PRETRAINED else a.model
    if not a.report_only:
        for s in plan(a):  # a generator: each run's place in it may depend on the ones before
            config(a, model, s)  # check the overrides before anything trains
            if s["name"] in a.skip or (a.only is not None and s["name"] not in a.only) \
                    or finished(load_rows(a, s["name"]), s["steps"]) or not fits(a, s):
                continue
            run_one(a, model, s)
            write_report(a, reported(a, model))
    write_report(a, reported(a, model))
    return 0


if __name__ == "__main__":
    sys.exit(main())
