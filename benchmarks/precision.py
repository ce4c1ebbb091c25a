"""train.precision side by side: per-phase time of RL steps, and each phase's rate against the
bfloat16 GEMM rate of this machine, measured in the same run.

    .venv/bin/python benchmarks/precision.py --model smollm2-135m-instruct --threads 1
    .venv/bin/python benchmarks/precision.py --model smollm2-135m-instruct --direction

One run per mode (the recipe examples/configs/smollm2_addition.yaml on `--model`, or the tiny
Qwen3), all built up front and stepped in turn (fp32 step 0, bf16-mixed step 0, fp32 step 1,
...), so that every mode sees the same background load. Phases as the trainer times them and
shows them to a gspo.Callback: rollout (sampling, in rollout.dtype: with auto the mode's compute
dtype, and the rewards), pi_old (the recompute) and update (the AdamW minibatches and the
engine's weight refresh). Step 0 of each mode runs with torch's FlopCounterMode entered from
each phase's begin to its end and is not timed (it also warms the allocator up): its FLOPs per
phase (GEMMs and attention; per mode, since a bf16 sampler draws other responses of other
lengths) over the phase's median time over steps 1..--steps give the phase's rate.

--direction: one RL step at lr 1e-6 in every mode from the same weights and seed, every mode
sampling in float32 (rollout.dtype=float32), scored by a reward that hashes the completion (so
the advantages are not all 0 whatever the model's skill), and the fraction of the weights each
mode moves, and moves the way float32 moves them. The modes with float32 weights draw float32's
rollouts exactly (the column "float32's rollouts" checks it); bf16-true's weights are rounded
to bfloat16, so it may draw others, and then its columns compare updates of other batches.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
import zlib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch  # noqa: E402

from common import (PhaseHook, add_model_args, median, recipe_config,  # noqa: E402
                    resolve_model, table, write_json)

PHASES = {"rollout": "time/rollout_s", "pi_old": "time/old_logp_s", "update": "time/update_s"}
CALLBACK_PHASES = ("rollout", "old_logp", "update")
"""the same phases as gspo's callbacks name them (gspo.callbacks.PHASES)"""


def parse():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    p.add_argument("--model", help="a Hugging Face model directory or a `gspo fetch-model` name "
                                   "(e.g. smollm2-135m-instruct) in place of the tiny Qwen3")
    p.add_argument("--modes", nargs="+", default=["fp32", "bf16-mixed"])
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=40)
    p.add_argument("--steps", type=int, default=3,
                   help="timed RL steps per mode (after step 0, whose FLOPs are counted)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (0 = torch's default)")
    p.add_argument("--direction", action="store_true",
                   help="only the lr 1e-6 update-direction measurement")
    p.add_argument("--rate-seconds", type=float, default=1.0,
                   help="time each GEMM rate for at least this long (0: one call after a warm-up; "
                        "a bf16 one takes seconds on a CPU without bf16 instructions)")
    p.add_argument("--json", default=None)
    return p.parse_args()


def gemm_rates(min_seconds: float = 1.0) -> dict[str, float]:
    """GFLOP/s of a 1024^3 GEMM in float32 and bfloat16, and of SmolLM2's MLP-shaped F.linear
    (4096 x 576 -> 1536) in bfloat16: the rates a phase is measured against, each the best call
    of at least `min_seconds` of calls after three warm-up calls (0: one call after one)."""
    def best(fn, flop):
        for _ in range(3 if min_seconds > 0 else 1):  # the first call picks the kernel
            fn()
        t, start = float("inf"), time.perf_counter()
        while t == float("inf") or time.perf_counter() - start < min_seconds:
            t0 = time.perf_counter()
            fn()
            t = min(t, time.perf_counter() - t0)
        return flop / t / 1e9
    out = {}
    for name, dt in (("fp32_gemm", torch.float32), ("bf16_gemm", torch.bfloat16)):
        a, b = torch.randn(1024, 1024, dtype=dt), torch.randn(1024, 1024, dtype=dt)
        out[name] = best(lambda: a @ b, 2 * 1024 ** 3)
    x, w = torch.randn(4096, 576, dtype=torch.bfloat16), torch.randn(1536, 576, dtype=torch.bfloat16)
    out["bf16_linear"] = best(lambda: torch.nn.functional.linear(x, w), 2 * 4096 * 576 * 1536)
    return out


def config(a, mode: str, extra: list[str]):
    from gspo import load_config
    step = [f"rollout.group_size={a.group_size}", f"rollout.prompts_per_step={a.prompts}",
            f"rollout.max_new_tokens={a.max_new_tokens}", "warmup.steps=0",
            "train.eval_every=0", "train.progress=false", f"train.precision={mode}", *extra]
    if a.model:
        return recipe_config(resolve_model(a.model), step)
    return load_config(overrides=[
        f"model.hidden_size={a.hidden_size}", f"model.num_layers={a.num_layers}",
        f"model.num_heads={a.num_heads}", f"model.num_kv_heads={a.num_kv_heads}",
        f"model.intermediate_size={a.intermediate_size}", "data.n_train=2000", "data.n_eval=8",
        *step])


def cpu() -> str:
    """The CPU's model name and whether it has AMX tiles (bf16 GEMMs ~8x float32's) or only
    AVX512-BF16 (~2x)."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "unknown"
    name = next((line.split(":", 1)[1].strip() for line in info.splitlines()
                 if line.startswith("model name")), "unknown")
    flags = " ".join(line for line in info.splitlines() if line.startswith("flags"))
    return f"{name}, {'AMX' if 'amx_bf16' in flags else 'no AMX'}, " \
           f"{'AVX512-BF16' if 'avx512_bf16' in flags else 'no AVX512-BF16'}"


def speed(a) -> dict:
    from torch.utils.flop_counter import FlopCounterMode

    from gspo import close_run, prepare, rl_step
    # the GEMM rates before and after: the higher of the two, the quieter machine
    before = gemm_rates(a.rate_seconds)
    # step 0 of each mode runs under the FLOP counter, phase by phase, and is not timed
    counters = {m: PhaseHook(lambda step, phase: FlopCounterMode(display=False)
                             if step == 0 else None) for m in a.modes}
    runs = {m: prepare(config(a, m, []), Path(tempfile.mkdtemp()), resume=False,
                       callbacks=[counters[m]]) for m in a.modes}
    rows = {m: [] for m in a.modes}
    try:
        for step in range(a.steps + 1):
            for mode, run in runs.items():
                row = rl_step(run, step)
                if step > 0:
                    rows[mode].append(row)
                print(f"{mode:<11} step {step}: " + "  ".join(
                    f"{p} {row[k]:.2f}s" for p, k in PHASES.items())
                    + ("  (FLOPs counted, not timed)" if step == 0 else ""), flush=True)
    finally:
        for run in runs.values():
            close_run(run)
    flops = {m: {name: float(counters[m].results[0, phase].get_total_flops())
                 for name, phase in zip(PHASES, CALLBACK_PHASES)} for m in a.modes}
    rates = {k: max(v, before[k]) for k, v in gemm_rates(a.rate_seconds).items()}
    out = []
    for mode in a.modes:
        for phase, key in {**PHASES, "step": None}.items():
            if key is None:
                s = sum(median([r[k] for r in rows[mode]]) for k in PHASES.values())
                f = sum(flops[mode].values())
            else:
                s, f = median([r[key] for r in rows[mode]]), flops[mode][phase]
            out.append({"mode": mode, "phase": phase, "s": s, "gflop": f / 1e9,
                        "gflops": f / s / 1e9, "vs_bf16": f / s / 1e9 / rates["bf16_gemm"],
                        "speedup": None})
    base = {o["phase"]: o["s"] for o in out if o["mode"] == a.modes[0]}
    for o in out:
        o["speedup"] = base[o["phase"]] / o["s"]
    return {"cpu": cpu(), "rates": rates, "rows": out,
            "reward": {m: [r["reward/mean"] for r in rows[m]] for m in a.modes}}


class HashReward:
    """A reward the model's skill does not decide, so that advantages are not all 0: the
    completion's CRC32 in [0, 1). Keeps every completion it scores, to compare the modes'
    rollouts."""
    __name__ = "crc32"

    def __init__(self):
        self.completions = []

    def __call__(self, completion: str, **fields) -> float:
        self.completions.append(completion)
        return zlib.crc32(completion.encode()) / 2 ** 32


def direction(a) -> dict:
    """One RL step at lr 1e-6 per mode, from the same weights and seed, all sampling in float32
    (so the modes whose weights are float32 draw the same rollouts); the weights' move."""
    from gspo import close_run, prepare, rl_step
    extra = ["optim.lr=1e-6", "optim.grad_clip=0", "rollout.dtype=float32"]
    deltas, completions = {}, {}
    for mode in ["fp32", *[m for m in a.modes if m != "fp32"]]:
        reward = HashReward()
        run = prepare(config(a, mode, extra), Path(tempfile.mkdtemp()), resume=False,
                      reward_fn=reward)
        try:
            before = {k: v.float().clone() for k, v in run.model.state_dict().items()}
            row = rl_step(run, 0)
            deltas[mode] = (torch.cat([(v.float() - before[k]).flatten()
                                       for k, v in run.model.state_dict().items()]),
                            row["time/update_s"])
            completions[mode] = sorted(reward.completions)
        finally:
            close_run(run)
    ref = deltas["fp32"][0]
    nz = ref != 0
    big = ref.abs() > ref[nz].abs().median()
    out = []
    for mode, (d, seconds) in deltas.items():
        d64, r64 = d.double(), ref.double()
        out.append({"mode": mode, "moved": float((d != 0).double().mean()),
                    "same_direction": float((d[nz].sign() == ref[nz].sign()).double().mean()),
                    # several minibatches: a weight whose steps nearly cancel has a total move
                    # near 0 whose sign any rounding decides; the larger half does not
                    "same_direction_big": float((d[big].sign() == ref[big].sign()).double().mean()),
                    "cosine": float(d64 @ r64 / (d64.norm() * r64.norm() + 1e-300)),
                    "same_rollouts": "yes" if completions[mode] == completions["fp32"] else "no",
                    "update_s": seconds})
    return {"rows": out}


def main() -> None:
    a = parse()
    if a.threads:
        torch.set_num_threads(a.threads)
    name = a.model or f"tiny Qwen3 hidden {a.hidden_size} x {a.num_layers} layers"
    shape = (f"{a.prompts} prompts x G {a.group_size}, <= {a.max_new_tokens} new tokens, "
             f"{a.threads or 'default'} thread(s)")
    if a.direction:
        res = direction(a)
        print(f"\nprecision --direction: {name}, {shape}: one RL step at lr 1e-6\n")
        print(table(res["rows"], [("mode", "train.precision", ""),
                                  ("moved", "weights moved", ".4f"),
                                  ("same_direction", "moved as float32 moves them", ".4f"),
                                  ("same_direction_big", "... of float32's larger half", ".4f"),
                                  ("cosine", "cosine to float32's move", ".4f"),
                                  ("same_rollouts", "float32's rollouts", ""),
                                  ("update_s", "update s", ".1f")]))
    else:
        res = speed(a)
        r = res["rates"]
        print(f"\nprecision: {name}, {shape}; CPU {res['cpu']}; GEMM rates (1 thread): "
              f"float32 {r['fp32_gemm']:.0f}, "
              f"bfloat16 {r['bf16_gemm']:.0f} GFLOP/s (1024^3), bf16 F.linear 4096x576->1536 "
              f"{r['bf16_linear']:.0f} GFLOP/s\n")
        print(table(res["rows"], [("mode", "train.precision", ""), ("phase", "phase", ""),
                                  ("s", "s (median)", ".2f"), ("speedup", f"vs {a.modes[0]}", ".2f"),
                                  ("gflop", "GFLOP", ".1f"), ("gflops", "GFLOP/s", ".0f"),
                                  ("vs_bf16", "/ bf16 GEMM rate", ".2f")]))
    write_json(a.json, {"args": vars(a), **res})


if __name__ == "__main__":
    main()
