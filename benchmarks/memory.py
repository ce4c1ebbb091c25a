"""Where an RL step's memory goes: peak resident memory per phase against what each part needs.

    .venv/bin/python benchmarks/memory.py                               # SmolLM2-135M, the recipe
    .venv/bin/python benchmarks/memory.py model.logprob_chunk_size=256
    .venv/bin/python benchmarks/memory.py model.lora_rank=16

Builds the run of examples/configs/smollm2_addition.yaml (evaluation off), takes one full RL
step (so that AdamW's state exists, as in every later step), then a second, whose phases a
gspo.Callback watches from each phase's begin to its end while a thread samples this process's
resident set every 2 ms: rollout (sampling and the rewards), pi_old recompute (and pi_ref's
pass with a KL penalty), minibatch updates (and the weights' push to the engine). Printed: the
resident memory before each phase and its peak during it, beside the sizes the parts need by
arithmetic: weights, gradients, AdamW's two moments (of the trainable parameters), the KV cache
of a rollout batch at its largest (every row as long as the longest training prompt plus
rollout.max_new_tokens), and one log-prob chunk's (chunk, V) float32 logits.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (RECIPE, PhaseHook, current_rss_mb, recipe_config, table,  # noqa: E402
                    write_json)

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


PHASES = {"rollout": "step 2: rollout", "old_logp": "step 2: pi_old recompute",
          "update": "step 2: minibatch updates"}
"""gspo's phases of an RL step (gspo.callbacks.PHASES) and their rows in the table"""


def needs(run) -> dict[str, float]:
    """MB each part needs by arithmetic (float32 = 4 bytes an element); the rollout's shapes at
    their largest: the step's B rows of the longest training prompt + max_new_tokens."""
    from gspo import encode_prompts

    model, cfg, r = run.model, run.model.config, run.cfg.rollout
    params = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    prompt = max(map(len, encode_prompts(run.tokenizer, run.train_rows,
                                         run.cfg.data.system_prompt or None)))
    B, L = r.prompts_per_step * r.group_size, prompt + r.max_new_tokens
    kv = B * L * cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * head_dim
    chunk = min(run.cfg.model.logprob_chunk_size, run.micro * r.max_new_tokens)
    return {"weights": 4 * params / MB, "gradients": 4 * trainable / MB,
            "AdamW moments": 8 * trainable / MB,
            f"KV cache ({B} x {L} positions, at most)": 4 * kv / MB,
            f"one logits chunk ({chunk} x {cfg.vocab_size})": 4 * chunk * cfg.vocab_size / MB}


def main(argv=None) -> int:
    a = parse(argv)
    import torch

    from gspo import close_run, prepare, rl_step

    if a.threads:
        torch.set_num_threads(a.threads)
    cfg = recipe_config(a.model, a.overrides)
    # each phase of the second step (step 1), watched from its begin to its end
    watch = PhaseHook(lambda step, phase: PeakRSS() if step == 1 else None)
    phases = []
    with tempfile.TemporaryDirectory() as d:
        with PeakRSS() as m:
            run = prepare(cfg, Path(d) / "run", resume=False, callbacks=[watch])
        phases.append(("build the run (model, engine, optimiser)", m))
        try:
            with PeakRSS() as m:
                rl_step(run, 0)
            phases.append(("first RL step (allocates AdamW state)", m))
            rl_step(run, 1)
            phases += [(name, watch.results[1, phase]) for phase, name in PHASES.items()]
            parts = needs(run)
        finally:
            close_run(run)
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
