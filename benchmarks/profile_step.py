"""Where one gspo RL step spends its time: per phase, the share spent in GEMMs and their rate.

    .venv/bin/python benchmarks/profile_step.py --threads 1                  # vs_trl.py's settings
    .venv/bin/python benchmarks/profile_step.py --threads 1 --max-new-tokens 32
    .venv/bin/python benchmarks/profile_step.py --threads 1 --model smollm2-135m-instruct \
        --prompts 4 --max-new-tokens 128 --steps 2                              # the real model

Phases as the trainer times them and shows them to a gspo.Callback (rollout = sampling and
rewards, pi_old recompute, update = `minibatches` AdamW steps and the weights' push to the
engine), medians over `--steps` RL steps after `--warmup-steps`. Then `--profile-repeats` more
RL steps run with torch.profiler on from each phase's begin to its end, each step on its own
rollout batch: "GEMM" is the self time of aten::mm / addmm / bmm / baddbmm kernels over all
profiled steps of a phase, its rate their counted FLOPs over that time, GEMM GFLOP their FLOPs
per step; everything else (elementwise ops, attention, autograd and Python overhead) is
"other"; GEMM ms and other ms split the phase's median time by that share. A phase whose GEMMs
already run near the CPU's large-GEMM rate (printed) can only get faster by spending less time
in "other" or by doing fewer FLOPs.

`--model` takes a real model (a directory, or a `gspo fetch-model` name) on the task of the
recipe examples/configs/smollm2_addition.yaml in place of the tiny Qwen3 on generated sums.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch  # noqa: E402

from common import (PhaseHook, add_model_args, matmul_gflops, median,  # noqa: E402
                    recipe_config, table, write_json)

GEMMS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm")


def parse():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    p.add_argument("--model", help="a Hugging Face model directory or a `gspo fetch-model` name "
                                   "(e.g. smollm2-135m-instruct) in place of the tiny Qwen3")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=8)
    p.add_argument("--minibatches", type=int, default=4)
    p.add_argument("--steps", type=int, default=8, help="timed RL steps")
    p.add_argument("--warmup-steps", type=int, default=2, help="RL steps before the timed ones")
    p.add_argument("--profile-repeats", type=int, default=3,
                   help="RL steps profiled after the timed ones")
    p.add_argument("--threads", type=int, default=1, help="torch threads (0 = torch's default)")
    p.add_argument("--precision", default="fp32", help="train.precision (fp32, bf16-mixed, ...)")
    p.add_argument("--json", default=None)
    return p.parse_args()


PHASES = {"rollout": "rollout", "old_logp": "pi_old", "update": "update"}
"""gspo's phases of an RL step (gspo.callbacks.PHASES) and their rows in the table"""


def profiler():
    from torch.profiler import ProfilerActivity, profile
    return profile(activities=[ProfilerActivity.CPU], with_flops=True)


def gemm_split(profiles: list) -> dict:
    """GEMMs' share of the profiled self time, their rate and FLOPs per profile, over profiles
    of one phase (one per profiled step)."""
    gemm_us = gemm_flop = total_us = 0.0
    for prof in profiles:
        events = prof.key_averages()
        gemm_us += sum(e.self_cpu_time_total for e in events if e.key in GEMMS)
        gemm_flop += sum(e.flops for e in events if e.key in GEMMS)
        total_us += sum(e.self_cpu_time_total for e in events)
    return {"gemm_share": gemm_us / total_us if total_us else 0.0,
            "gemm_gflops": gemm_flop / max(gemm_us, 1) / 1e3,
            "gemm_gflop": gemm_flop / len(profiles) / 1e9}


def main() -> None:
    a = parse()
    if a.threads:
        torch.set_num_threads(a.threads)
    from gspo import close_run, load_config, prepare, rl_step

    step = [f"rollout.group_size={a.group_size}", f"rollout.prompts_per_step={a.prompts}",
            f"rollout.max_new_tokens={a.max_new_tokens}", "algorithm=gspo",
            f"algorithm.minibatches={a.minibatches}", "optim.lr=1e-5", "warmup.steps=0",
            "train.eval_every=0", "train.progress=false", "train.tensorboard=false",
            f"train.precision={a.precision}"]
    if a.model:
        cfg = recipe_config(a.model, step)  # load_model takes names
    else:
        cfg = load_config(overrides=[
            f"model.hidden_size={a.hidden_size}", f"model.num_layers={a.num_layers}",
            f"model.num_heads={a.num_heads}", f"model.num_kv_heads={a.num_kv_heads}",
            f"model.intermediate_size={a.intermediate_size}",
            "data.n_train=2000", "data.n_eval=8", "data.digits=2", "data.operations=+", *step])
    timed = a.warmup_steps + a.steps  # the steps after these run under torch.profiler
    profiled = PhaseHook(lambda i, phase: profiler() if i >= timed else None)
    run = prepare(cfg, Path(tempfile.mkdtemp()), resume=False, callbacks=[profiled])
    try:
        for i in range(timed + a.profile_repeats):
            rl_step(run, i)
    finally:
        close_run(run)
    ms = {name: 1e3 * median([profiled.seconds[i, phase] for i in range(a.warmup_steps, timed)])
          for phase, name in PHASES.items()}
    step_ms = sum(ms.values())

    peak = matmul_gflops()
    out = []
    for phase, name in PHASES.items():
        p = gemm_split([prof for (i, ph), prof in profiled.results.items() if ph == phase])
        gemm_ms = ms[name] * p["gemm_share"]
        out.append({"phase": name, "ms": ms[name], "share": ms[name] / step_ms,
                    "gemm_ms": gemm_ms, "other_ms": ms[name] - gemm_ms,
                    "gemm_share": p["gemm_share"], "gemm_gflop": p["gemm_gflop"],
                    "gemm_gflops": p["gemm_gflops"], "gemm_vs_peak": p["gemm_gflops"] / peak})
    out.append({"phase": "step", "ms": step_ms, "share": 1.0,
                "gemm_ms": sum(o["gemm_ms"] for o in out),
                "other_ms": sum(o["other_ms"] for o in out)})
    name = a.model or f"tiny Qwen3 hidden {a.hidden_size} x {a.num_layers} layers"
    print(f"\nprofile_step: {name}, "
          f"{a.prompts} prompts x G {a.group_size}, {a.max_new_tokens} new tokens, "
          f"{a.minibatches} minibatches, {a.threads or 'default'} thread(s); large-GEMM rate "
          f"(torch.mm 1024^3) {peak:.1f} GFLOP/s\n")
    print(table(out, [("phase", "phase", ""), ("ms", "ms / step", ".1f"),
                      ("share", "share of step", ".2f"), ("gemm_ms", "GEMM ms", ".1f"),
                      ("other_ms", "other ms", ".1f"), ("gemm_gflop", "GEMM GFLOP", ".2f"),
                      ("gemm_gflops", "GEMM GFLOP/s", ".1f"),
                      ("gemm_vs_peak", "GEMM rate / large-GEMM rate", ".2f")]))
    write_json(a.json, {"args": vars(a), "large_gemm_gflops": peak, "rows": out})


if __name__ == "__main__":
    main()
