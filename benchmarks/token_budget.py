"""Micro-batches packed by token count (train.max_tokens_per_micro) vs fixed-size micro-batches
(algorithm.micro_batch_size), the update's and pi_old's time side by side in one run.

    .venv/bin/python benchmarks/token_budget.py --config examples/configs/smollm2_addition.yaml \
        rollout.max_new_tokens=128 [--micro 4] [--budget N] [--steps 2] [--threads 1]

Both runs are built up front from the same config (same model, prompts, seeds) and stepped in
turn (fixed step 0, packed step 0, fixed step 1, ...), so both see the same background load.
The learning rate is 1e-50 unless overridden, so small that AdamW's step rounds to 0 in
float32: the updates do all their work but move no weight, and both runs sample the same
rollouts at every step (the two layouts round differently, so at a real learning rate, or even
at 1e-30, which moves weights that are 0, the samples part ways after the first update; the
table says whether they stayed the same). Step 0 warms up (allocator, AdamW state) and is not
timed. The budget defaults to
what a fixed micro-batch may hold at worst, --micro x (longest training prompt +
rollout.max_new_tokens), so both bound a forward's activations alike: the fixed micro-batches
pad --micro rows to their longest response, the packed ones put rows of like length together.
Phases are timed through gspo.Callback; the decoder positions each phase computes are counted
by a forward hook on the model's input embedding.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch  # noqa: E402

from common import table, write_json  # noqa: E402
from gspo import Callback, close_run, encode_prompts, load_config, prepare, rl_step  # noqa: E402

BASE = ["warmup.steps=0", "train.eval_every=0", "train.save_every=0", "train.progress=false",
        "train.tensorboard=false", "optim.lr=1e-50"]
PHASES = ("old_logp", "update")


class PhaseMeter(Callback):
    """Seconds and decoder positions of each timed step's pi_old and update phases."""

    def __init__(self):
        self.phase, self.rows, self.positions, self.hooked = None, [], 0, False

    def _count(self, module, args, out):
        if self.phase is not None:
            self.positions += args[0].numel()  # the ids this decoder call embeds

    def on_phase_begin(self, run, step, phase):
        if not self.hooked:
            run.model.get_input_embeddings().register_forward_hook(self._count)
            self.hooked = True
        self.phase, self.positions = phase if phase in PHASES else None, 0

    def on_phase_end(self, run, step, phase, seconds):
        if phase in PHASES:
            self.rows.append({"step": step, "phase": phase, "s": seconds,
                              "positions": self.positions})
        self.phase = None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="a YAML config (default: the tiny built-in model)")
    p.add_argument("--micro", type=int, default=4, help="rows per fixed-size micro-batch")
    p.add_argument("--budget", type=int, default=0,
                   help="tokens per packed micro-batch (0 = --micro x the longest sequence)")
    p.add_argument("--steps", type=int, default=2, help="timed RL steps, after one warm-up step")
    p.add_argument("--threads", type=int, default=1, help="torch threads (0 = torch's default)")
    p.add_argument("--json", default=None)
    p.add_argument("overrides", nargs="*")
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    cfg = load_config(a.config, BASE + a.overrides + [f"algorithm.micro_batch_size={a.micro}"])
    runs, meters = {}, {"fixed": PhaseMeter(), "packed": PhaseMeter()}
    try:
        runs["fixed"] = prepare(cfg, Path(tempfile.mkdtemp()), resume=False,
                                callbacks=[meters["fixed"]])
        budget = a.budget or a.micro * (cfg.rollout.max_new_tokens + max(map(len, encode_prompts(
            runs["fixed"].tokenizer, runs["fixed"].train_rows, cfg.data.system_prompt or None))))
        packed = load_config(a.config, BASE + a.overrides + [f"train.max_tokens_per_micro={budget}"])
        runs["packed"] = prepare(packed, Path(tempfile.mkdtemp()), resume=False,
                                 callbacks=[meters["packed"]])
        names = {"fixed": f"{a.micro} rows each", "packed": f"<= {budget:,} tokens each"}
        rows = {k: [] for k in runs}
        for step in range(a.steps + 1):
            for k, run in runs.items():
                rows[k].append(rl_step(run, step))
                print(f"{k:<6} step {step}: " + "  ".join(
                    f"{r['phase']} {r['s']:.2f}s" for r in meters[k].rows[-2:]), flush=True)
    finally:
        for run in runs.values():
            close_run(run)
    out = []
    for k in runs:
        timed = [r for r in meters[k].rows if r["step"] >= 1]
        row = {"system": names[k]}
        for phase in PHASES:
            mine = [r for r in timed if r["phase"] == phase]
            row[f"{phase}_s"] = statistics.median(r["s"] for r in mine)
            row[f"{phase}_positions"] = statistics.fmean(r["positions"] for r in mine)
        steps = rows[k][1:]
        row["response_len"] = statistics.fmean(r["response/len_mean"] for r in steps)
        row["truncated"] = statistics.fmean(r["response/truncated_frac"] for r in steps)
        out.append(row)
    fixed, packed = out
    same = all(f[k] == p[k] for f, p in zip(rows["fixed"], rows["packed"])
               for k in ("reward/mean", "response/len_mean"))
    for o in out:
        o["update_speedup"] = fixed["update_s"] / o["update_s"]
        o["old_logp_speedup"] = fixed["old_logp_s"] / o["old_logp_s"]
    print(f"\ntoken_budget: {cfg.model.name_or_path}, {cfg.rollout.prompts_per_step} prompts x G "
          f"{cfg.rollout.group_size}, <= {cfg.rollout.max_new_tokens} new tokens, "
          f"{cfg.algorithm.minibatches} minibatches, {a.threads or 'default'} thread(s); "
          f"medians of {a.steps} step(s) after a warm-up; the same rollouts in both: "
          f"{'yes' if same else 'no'}\n")
    print(table(out, [("system", "micro-batches", ""), ("update_s", "update s", ".2f"),
                      ("update_speedup", "vs fixed", ".2f"),
                      ("update_positions", "update positions", ",.0f"),
                      ("old_logp_s", "pi_old s", ".2f"), ("old_logp_speedup", "vs fixed", ".2f"),
                      ("old_logp_positions", "pi_old positions", ",.0f"),
                      ("response_len", "response len", ".1f"),
                      ("truncated", "truncated", ".2f")]))
    print(f"\nupdate fixed / packed: {packed['update_speedup']:.2f}x; pi_old: "
          f"{packed['old_logp_speedup']:.2f}x")
    write_json(a.json, {"args": vars(a), "budget": budget, "rows": out, "same_rollouts": same,
                        "steps": {k: meters[k].rows for k in runs}})
    return 0


if __name__ == "__main__":
    sys.exit(main())
