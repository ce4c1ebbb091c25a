"""GSPO and GRPO on SmolLM2 with pi_old taken from a bf16 sampler (algorithm.old_logprobs=rollout).

    OMP_NUM_THREADS=1 .venv/bin/python experiments/engine_likelihoods.py [--steps 10]
        [--seeds 0] [--variants NAME@key=value,... ...] [--runs DIR] [--out docs/results]
        [--report-only] [--model NAME_OR_DIR] [--extra KEY=VALUE ...] [--name NAME]

The paper's claim under test: GSPO can use the inference engine's likelihoods as pi_old
directly (its sequence-level ratio tolerates the engine's precision), skipping the recompute.
Every run is the SmolLM2 recipe (examples/configs/smollm2_addition.yaml: bf16-mixed trainer,
8 prompts x G 8, <= 40 new tokens, 4 minibatches) for `--steps` RL steps with held-out
evaluations every 5, on one thread; the variants change the sampler's dtype and where pi_old
comes from. A finished run directory is reused. Writes engine_likelihoods.{json,md} (the
table; the analysis lives in docs/results/paper_claims.md) and engine_likelihoods.png.
`--model tiny-qwen3` with `--extra` sizes runs the same variants on the built-in tiny model (the
test suite's smoke run). With vLLM as the sampler (run it from .venv-vllm):

    OMP_NUM_THREADS=1 PYTHONPATH=src .venv-vllm/bin/python experiments/engine_likelihoods.py \
        --name engine_likelihoods_vllm --runs runs/engine-likelihoods-vllm \
        --extra rollout.engine=vllm
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
import torch  # noqa: E402

from gspo import PRETRAINED, fetch_model, load_config, read_metrics, train  # noqa: E402

RECIPE = Path(__file__).resolve().parent.parent / "examples" / "configs" / "smollm2_addition.yaml"
BF16_ROLLOUT = "rollout.dtype=bfloat16,algorithm.old_logprobs=rollout,algorithm.mismatch_every=5"
WIDE = "algorithm.eps_low=0.03,algorithm.eps_high=0.03"  # beyond the ~1e-2 sequence mismatch
VARIANTS = [f"gspo@{BF16_ROLLOUT}", f"grpo@{BF16_ROLLOUT}", f"gspo@{BF16_ROLLOUT},{WIDE}",
            f"gspo@rollout.dtype=bfloat16,{WIDE}"]  # the wide clip range with pi_old recomputed


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--variants", nargs="+", default=VARIANTS,
                   help="each ALGORITHM@key=value,key=value (overrides of the recipe)")
    p.add_argument("--runs", default="runs/engine-likelihoods", help="where run dirs go")
    p.add_argument("--out", default="docs/results")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--report-only", action="store_true",
                   help="train nothing: the table of the variants' finished runs")
    p.add_argument("--model", default="smollm2-135m-instruct",
                   help="a gspo.PRETRAINED name, a model directory, or tiny-qwen3 (smoke runs)")
    p.add_argument("--extra", nargs="*", default=[], metavar="KEY=VALUE",
                   help="further config overrides for every run (e.g. for a quick smoke run); "
                        "give a run dir (--runs) of its own to runs with other --extra")
    p.add_argument("--name", default="engine_likelihoods",
                   help="the report's file names: NAME.{json,md,png} in --out")
    return p.parse_args(argv)


def run_name(variant: str, seed: int) -> str:
    algo, _, extra = variant.partition("@")
    short = "-".join(kv.split("=")[-1] for kv in extra.split(",") if kv)
    return f"{algo}-{short}-s{seed}" if short else f"{algo}-s{seed}"


def finished(path: Path, steps: int) -> bool:
    try:
        return any(r["step"] >= steps and "eval/accuracy" in r
                   for r in read_metrics(path / "metrics.jsonl"))
    except (OSError, ValueError):
        return False


def summarise(rows: list[dict]) -> dict:
    rl = [r for r in rows if "loss" in r]
    mismatch = [r for r in rl if "mismatch/token_abs_mean" in r]
    return {
        "evals": {r["step"]: r["eval/accuracy"] for r in rows if "eval/accuracy" in r},
        "clip_frac": statistics.mean(r["clip/frac"] for r in rl),
        "reward_last3": statistics.mean(r["reward/mean"] for r in rl[-3:]),
        "mismatch_token_abs_mean": (statistics.mean(r["mismatch/token_abs_mean"] for r in mismatch)
                                    if mismatch else None),
        "mismatch_seq_abs_max": (max(r["mismatch/seq_log_ratio_abs_max"] for r in mismatch)
                                 if mismatch else None),
        "s_per_step": statistics.mean(r["time/rollout_s"] + r["time/old_logp_s"]
                                      + r["time/update_s"] for r in rl),
    }


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    a = parse_args(argv)
    torch.set_num_threads(a.threads)
    model = fetch_model(a.model) if a.model in PRETRAINED else a.model
    results = {}
    for variant in a.variants:
        algo, _, extra = variant.partition("@")
        for seed in a.seeds:
            path = Path(a.runs) / run_name(variant, seed)
            if not finished(path, a.steps):
                if a.report_only:
                    continue
                cfg = load_config(RECIPE, [f"model.name_or_path={json.dumps(str(model))}",
                                           f"algorithm={algo}", f"train.seed={seed}",
                                           f"train.steps={a.steps}", "train.eval_every=5",
                                           "train.progress=false", "train.save_every=0",
                                           *filter(None, extra.split(",")), *a.extra])
                print(f"training {variant} seed {seed} -> {path}", flush=True)
                train(cfg, path)
            results[(variant, seed)] = read_metrics(path / "metrics.jsonl")
    write_report(a, argv, results)
    return 0


def write_report(a, argv: list[str], results: dict) -> None:
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    sums = {k: summarise(rows) for k, rows in results.items()}
    steps = sorted({s for v in sums.values() for s in v["evals"]})
    head = ("| variant | seed | " + " | ".join(f"acc @ {s}" for s in steps)
            + " | clip frac | reward (last 3) | mismatch: mean abs dlogp per token"
            " | max abs seq log-ratio | s / step |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for (variant, seed), v in sums.items():
        accs = " | ".join(f"{100 * v['evals'][s]:.1f}%" if s in v["evals"] else "-"
                          for s in steps)
        fmt = lambda x: "-" if x is None else f"{x:.4f}"  # noqa: E731
        lines.append(f"| {variant} | {seed} | {accs} | {v['clip_frac']:.3f} | "
                     f"{v['reward_last3']:.3f} | {fmt(v['mismatch_token_abs_mean'])} | "
                     f"{fmt(v['mismatch_seq_abs_max'])} | {v['s_per_step']:.1f} |")
    table = "\n".join(lines)
    (out / f"{a.name}.json").write_text(json.dumps(
        {f"{vr}|s{sd}": v for (vr, sd), v in sums.items()}, indent=1))
    (out / f"{a.name}.md").write_text(
        "# SmolLM2: pi_old from a bf16 sampler"
        + (f" (`{' '.join(a.extra)}`)" if a.extra else "") +
        "\n\nMade by `experiments/engine_likelihoods.py "
        + " ".join(argv) + "`; analysis in `paper_claims.md`.\n\n" + table + "\n")
    print(table)
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for i, ((variant, seed), rows) in enumerate(results.items()):
        ax.plot(*zip(*[(r["step"], r["reward/mean"]) for r in rows if "reward/mean" in r]),
                color=f"C{i}", label=f"{variant.split('@')[0]} seed {seed}")
    ax.set(xlabel="RL step", title="reward, pi_old from the bf16 sampler")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / f"{a.name}.png", dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
