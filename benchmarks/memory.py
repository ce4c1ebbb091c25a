"""Where an RL step's memory goes: peak resident memory per phase against what each part needs.

    .venv/bin/python benchmarks/memory.py                               # SmolLM2-135M, the recipe
    .venv/bin/python benchmarks/memory.py model.logprob_chunk_size=256
    .venv/bin/python benchmarks/memory.py model.lora_rank=16

Builds the run of examples/configs/smollm2_addition.yaml (evaluation off), takes one full RL
step (so that AdamW's state exists, as in every later step), then runs the phases of a second
step one by one - rollout, pi_old recompute, minibatch updates - while a thread samples this
process's resident set every 2 ms. Printed: the resident memory before each phase and its peak
during it, beside the sizes the parts need by arithmetic: weights, gradients, AdamW's two
moments (of the trainable parameters), the KV cache of the rollout batch, and one log-prob
chunk's (chunk, V) float32 logits.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RECIPE, current_rss_mb, recipe_config, table, write_json  # noqa: E402

MB = 2 ** 20


class PeakRSS:
    """The highest resident set seen while the block runs, sampled every `every` seconds."""

    def __init__(self, every: float = 0.002):
        self.every, self.peak, self._stop = every, 0.0, threading.Event()

    def __enter__(self):
        self.before = self.peak = current_rss_mb()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, current_rss_mb())
            time.sleep(self.every)

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, current_rss_mb())


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct", help="model.name_or_path")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    p.add_argument("--json", default=None)
    p.add_argument("overrides", nargs="*", help="config overrides, e.g. model.lora_rank=16")
    return p.parse_args(argv)


def needs(run, rollouts) -> dict[str, float]:
    """MB each part needs by arithmetic (float32 = 4 bytes an element)."""
    model, cfg = run.model, run.model.config
    params = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    B, L = rollouts.input_ids.shape
    kv = B * L * cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * head_dim
    chunk = min(run.cfg.model.logprob_chunk_size, run.micro * rollouts.response_ids.shape[1])
    return {"weights": 4 * params / MB, "gradients": 4 * trainable / MB,
            "AdamW moments": 8 * trainable / MB, f"KV cache ({B} x {L} positions)": 4 * kv / MB,
            f"one logits chunk ({chunk} x {cfg.vocab_size})": 4 * chunk * cfg.vocab_size / MB}


def main(argv=None) -> int:
    a = parse(argv)
    import torch

    from gspo.trainer import generate, old_policy, prepare, rl_step, step_prompts, update

    if a.threads:
        torch.set_num_threads(a.threads)
    cfg = recipe_config(a.model, a.overrides)
    phases = []
    with tempfile.TemporaryDirectory() as d:
        with PeakRSS() as m:
            run = prepare(cfg, Path(d) / "run", resume=False)
        phases.append(("build the run (model, engine, optimiser)", m))
        with PeakRSS() as m:
            rl_step(run, 0)
        phases.append(("first RL step (allocates AdamW state)", m))
        rows = step_prompts(run.train_rows, 1, cfg.rollout.prompts_per_step, cfg.train.seed)
        with PeakRSS() as m:
            r = generate(run, rows, 1)
        phases.append(("step 2: rollout", m))
        with PeakRSS() as m:
            old_logp, _, _ = old_policy(run, r, 1)
        phases.append(("step 2: pi_old recompute", m))
        adv = torch.randn(r.response_ids.shape[0])  # the memory does not depend on the values
        with PeakRSS() as m:
            update(run, r, old_logp, None, adv)
        phases.append(("step 2: minibatch updates", m))
        parts = needs(run, r)
        run.engine.close()
    rows = [{"phase": name, "before": m.before, "peak": m.peak, "rise": m.peak - m.before}
            for name, m in phases]
    print(f"{a.model}, recipe {RECIPE.name}, overrides {' '.join(a.overrides) or '-'}")
    print(table(rows, [("phase", "phase", ""), ("before", "resident before (MB)", ".0f"),
                       ("peak", "peak during (MB)", ".0f"), ("rise", "rise (MB)", ".0f")]))
    print()
    print(table([{"part": k, "mb": v} for k, v in parts.items()],
                [("part", "part", ""), ("mb", "needs (MB)", ".0f")]))
    write_json(a.json, {"args": vars(a), "phases": rows, "needs": parts})
    return 0


if __name__ == "__main__":
    sys.exit(main())
