"""How a gspo RL step's time grows with completion length, group size and model width, and
the update phase's achieved matmul rate against this CPU's own.

    python benchmarks/scaling.py [--lengths 8,16,32,64] [--groups 2,4,8,16] [--widths 128,256,512]

Every point is a real `gspo.train` run (tiny Qwen3 built locally, no warm-up, no evaluation,
arithmetic prompts) whose per-step times come from its metrics.jsonl: rollout (sampling and
rewards), pi_old (the recompute pass) and update (4 AdamW minibatch steps and the weights' push
to the engine); the final checkpoint, written after the last step, is in none of them. The
first RL step is a warm-up and is left out; the table shows medians of the rest. Each sweep
varies one factor around the base point (--base-length, --base-group, --base-width) and is
fitted twice: t = a * x^b on log-log axes (b: the growth over the range), and
t = c0 + c1 x + c2 x^2 with non-negative coefficients, whose terms' shares at the largest x show
where a superlinear term comes in; the printed notes name the work behind each term.

Matmul rate (the issue's target: update phase >= 30% of the CPU's float32 GEMM rate, for a
model of hidden size >= 512): in the same invocation, `torch.mm` of two 1024 x 1024 float32
matrices gives the CPU's rate (best of repeated calls, measured before and after the runs,
the higher kept), and one extra run at --flops-width counts the update phase's FLOPs with
`torch.utils.flop_counter.FlopCounterMode`, which a gspo.Callback enters as the update phase
begins and leaves as it ends (every mm / addmm / bmm / attention kernel of the forward and
backward passes, 2 * M * N * K each) while a twin run with the same seed, hence the same
rollouts, minibatches and FLOPs, is timed without the counter. Achieved rate = counted
update FLOPs / update seconds. For a dense decoder these FLOPs are about
6 * (non-embedding params) * (positions the decoder computes) + 6 * H * V * (scored positions)
+ attention; they count what gspo computes, so a prompt shared by G rows counts once.
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", default="8,16,32,64", help="completion lengths (max_new_tokens)")
    p.add_argument("--groups", default="2,4,8,16", help="group sizes G")
    p.add_argument("--widths", default="128,256,512", help="hidden sizes (MLP 4x, head dim 32)")
    p.add_argument("--base-length", type=int, default=16)
    p.add_argument("--base-group", type=int, default=8)
    p.add_argument("--base-width", type=int, default=128)
    p.add_argument("--prompts", type=int, default=16, help="prompts per RL step")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--steps", type=int, default=3, help="RL steps per point (the first is a warm-up)")
    p.add_argument("--flops-width", type=int, default=512,
                   help="hidden size of the matmul-rate run (0 = skip it)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    p.add_argument("--json", help="also write the results here")
    return p.parse_args(argv)


def run_point(a, T: int, G: int, H: int, count_flops: bool = False) -> dict:
    """Median per-step times of one train() run (and, with count_flops, the update's FLOPs)."""
    from torch.utils.flop_counter import FlopCounterMode

    from gspo import load_config, read_metrics, train

    heads = max(1, H // 32)
    cfg = load_config(overrides=[
        f"model.hidden_size={H}", f"model.num_layers={a.layers}", f"model.num_heads={heads}",
        f"model.num_kv_heads={max(1, heads // 2)}", f"model.intermediate_size={4 * H}",
        "data.n_train=2000", "data.n_eval=8",
        f"rollout.group_size={G}", f"rollout.prompts_per_step={a.prompts}",
        f"rollout.max_new_tokens={T}", "warmup.steps=0", f"train.steps={a.steps}",
        "train.eval_every=0", f"train.save_every={10**9}", "train.progress=false",
        "train.tensorboard=false",
    ])
    counter = common.PhaseHook(lambda step, phase: FlopCounterMode(display=False)
                               if count_flops and phase == "update" else None)
    # the final checkpoint train() writes after the last step is in no figure: the times are
    # the metrics rows' phases
    with tempfile.TemporaryDirectory() as tmp:
        train(cfg, Path(tmp) / "run", callbacks=[counter])
        rows = [r for r in read_metrics(Path(tmp) / "run") if "time/update_s" in r]
    rows = rows[1:] if len(rows) > 1 else rows  # the first step warms up allocators and kernels
    med = lambda k: common.median([r[k] for r in rows])  # noqa: E731
    out = {"T": T, "G": G, "H": H, "rollout_s": med("time/rollout_s"),
           "old_s": med("time/old_logp_s"), "update_s": med("time/update_s"),
           "tokens": med("response/len_mean") * G * a.prompts,
           "update_s_each": [r["time/update_s"] for r in rows]}
    out["step_s"] = out["rollout_s"] + out["old_s"] + out["update_s"]
    if count_flops:
        flops = [float(fc.get_total_flops()) for _, fc in sorted(counter.results.items())]
        out["update_flops_each"] = flops[1:] if len(flops) > 1 else flops
    return out


def fit_power(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least squares of log y = log a + b log x; returns (a, b)."""
    lx, ly = [math.log(x) for x in xs], [math.log(y) for y in ys]
    mx, my = sum(lx) / len(lx), sum(ly) / len(ly)
    var = sum((x - mx) ** 2 for x in lx)
    b = sum((x - mx) * (y - my) for x, y in zip(lx, ly)) / var if var else 0.0
    return math.exp(my - b * mx), b


def fit_poly(xs: list[float], ys: list[float]) -> list[float]:
    """Non-negative least squares of y = c0 + c1 x + c2 x^2 (c2 only with 3+ points)."""
    import numpy as np
    from itertools import combinations

    x, y = np.asarray(xs, float), np.asarray(ys, float)
    basis = [np.ones_like(x), x, x**2][: 3 if len(x) >= 3 else 2]
    best, best_err = [0.0] * 3, float("inf")
    for k in range(1, len(basis) + 1):  # every subset of terms: small exact NNLS
        for cols in combinations(range(len(basis)), k):
            A = np.stack([basis[c] for c in cols], 1)
            coef, *_ = np.linalg.lstsq(A, y, rcond=None)
            if (coef < 0).any():
                continue
            err = float(((A @ coef - y) ** 2).sum())
            if err < best_err - 1e-15:
                best_err, best = err, [0.0] * 3
                for c, v in zip(cols, coef):
                    best[c] = float(v)
    return best


NOTES = {
    "T": "x = completion length. Linear: decode steps and update/pi_old positions. Quadratic: "
         "attention, each new position attending over the prompt and all earlier ones, in the "
         "decode loop and in the update. Constant: the prompt (prefill, its share of every "
         "forward/backward) and the per-step fixed costs (optimiser steps, Python).",
    "G": "x = group size (B = prompts x G). Linear: every response row. Constant: what is shared "
         "by a group: one prefill per prompt, one prompt pass per micro-batch (so the prompt "
         "part stops growing once a minibatch holds every prompt), the optimiser steps.",
    "H": "x = hidden size (MLP 4 H). Quadratic: the parameters and so the GEMM FLOPs, ~H^2. "
         "Linear: the elementwise work (norms, RoPE, residuals, softmax), ~H per position, and "
         "the GEMMs' fixed cost per call. Constant: Python and per-op dispatch.",
}


def main(argv=None) -> int:
    a = parse_args(argv)
    import torch

    if a.threads:
        torch.set_num_threads(a.threads)
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    sweeps = {"T": [(t, a.base_group, a.base_width) for t in ints(a.lengths)],
              "G": [(a.base_length, g, a.base_width) for g in ints(a.groups)],
              "H": [(a.base_length, a.base_group, h) for h in ints(a.widths)]}
    gemm_before = common.matmul_gflops(1024)
    cache: dict[tuple, dict] = {}
    results = {}
    for name, points in sweeps.items():
        rows = []
        for p in points:
            if p not in cache:
                cache[p] = run_point(a, *p)
                print(f"{name} T={p[0]} G={p[1]} H={p[2]}: {cache[p]['step_s']:.3f} s/step",
                      file=sys.stderr, flush=True)
            rows.append(cache[p])
        results[name] = rows
    flops_row = None
    if a.flops_width:
        p = (a.base_length, a.base_group, a.flops_width)
        counted = run_point(a, *p, count_flops=True)
        timed = cache.get(p) or run_point(a, *p)
        flops = common.median(counted["update_flops_each"])
        flops_row = {"H": a.flops_width, "update_gflop": flops / 1e9,
                     "update_s": timed["update_s"],
                     "achieved_gflops": flops / 1e9 / timed["update_s"]}
    gemm = max(gemm_before, common.matmul_gflops(1024))

    print(f"\nscaling: tiny Qwen3 x {a.layers} layers, {a.prompts} prompts per step, "
          f"{torch.get_num_threads()} threads; medians of {a.steps - 1} steps after a warm-up\n")
    cols = [("T", "T", "d"), ("G", "G", "d"), ("H", "H", "d"), ("rollout_s", "rollout s", ".3f"),
            ("old_s", "pi_old s", ".3f"), ("update_s", "update s", ".3f"),
            ("step_s", "step s", ".3f")]
    fits = {}
    for name, rows in results.items():
        print(common.table(rows, cols))
        xs = [r[name] for r in rows]
        if len(xs) < 2:
            continue
        ys = [r["step_s"] for r in rows]
        c = fit_poly(xs, ys)
        x_max = max(xs)
        parts = [c[0], c[1] * x_max, c[2] * x_max**2]
        total = sum(parts) or 1.0
        fits[name] = {"exponent": {part: fit_power(xs, [r[part] for r in rows])[1]
                                   for part in ("step_s", "rollout_s", "old_s", "update_s")},
                      "poly": c, "shares_at_max": [p / total for p in parts]}
        f = fits[name]["exponent"]
        print(f"\nfit over {name}: step time ~ {name}^{f['step_s']:.2f} on log-log axes (rollout "
              f"^{f['rollout_s']:.2f}, pi_old ^{f['old_s']:.2f}, update ^{f['update_s']:.2f});\n"
              f"  t = {c[0]:.4f} + {c[1]:.3g} {name} + {c[2]:.3g} {name}^2 s (non-negative least "
              f"squares); at {name} = {x_max}: constant {100 * parts[0] / total:.0f}%, linear "
              f"{100 * parts[1] / total:.0f}%, quadratic {100 * parts[2] / total:.0f}%\n"
              f"  {NOTES[name]}\n")
    if flops_row:
        flops_row["gemm_gflops"] = gemm
        flops_row["fraction"] = flops_row["achieved_gflops"] / gemm
        print(f"matmul rate: torch.mm 1024^3 float32 {gemm:.1f} GFLOP/s; update phase at H = "
              f"{flops_row['H']}: {flops_row['update_gflop']:.2f} GFLOP counted in "
              f"{flops_row['update_s']:.3f} s = {flops_row['achieved_gflops']:.1f} GFLOP/s = "
              f"{100 * flops_row['fraction']:.0f}% of the GEMM rate (target >= 30%)")
    common.write_json(a.json, {"args": vars(a), "sweeps": results, "fits": fits,
                               "gemm_gflops": gemm, "matmul": flops_row})
    return 0


if __name__ == "__main__":
    sys.exit(main())
