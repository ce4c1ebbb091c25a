"""Run by tests/test_distributed.py, under torchrun (N ranks) or alone (1 process): one
optimiser step of gspo.step.update on a fixed global batch; rank 0 saves the parameters.

    python tests/dist_update_worker.py OUT.pt key.sub=value ...
"""

import os
import sys
import tempfile
import time
from pathlib import Path

import torch

from gspo.config import load_config
from gspo.distributed import as_local, full_weights, shutdown
from gspo.engines import Rollouts
from gspo.step import update
from gspo.trainer import prepare


def digit_fraction(completion: str, **_) -> float:
    """A dense reward a random tiny model earns (data.reward=tests/dist_update_worker.py:digit_fraction),
    so that RL steps under torchrun really move the weights."""
    return sum(c.isdigit() for c in completion) / max(1, len(completion))


def stalls_on_rank_1(completion: str, **_) -> float:
    """A reward that never returns on rank 1 (a hung user function, a dead NFS mount)."""
    if os.environ.get("RANK") == "1":
        time.sleep(3600)
    return 0.0


def fixed_batch(B: int, vocab: int, Lp: int = 5, T: int = 6) -> tuple[Rollouts, torch.Tensor]:
    g = torch.Generator().manual_seed(123)
    prompt_ids = torch.randint(4, vocab, (B, Lp), generator=g)
    prompt_mask = torch.ones(B, Lp, dtype=torch.long)
    prompt_mask[::3, :2] = 0  # some left padding
    response_ids = torch.randint(4, vocab, (B, T), generator=g)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    lengths[: B // 2] = lengths[: B // 2].clamp(max=T - 2)  # the first rank's rows are shorter
    response_mask = (torch.arange(T)[None] < lengths[:, None]).float()
    adv = torch.randn(B, generator=g)
    return Rollouts(prompt_ids, prompt_mask, response_ids, response_mask, torch.zeros(B, T)), adv


def main(out: str, overrides: list[str]) -> None:
    if "seed_per_rank=1" in overrides:  # every rank builds a different initial model
        overrides = [o for o in overrides if o != "seed_per_rank=1"]
        overrides.append(f"train.seed={int(os.environ.get('RANK', '0'))}")
    warmup_only = "warmup_only=1" in overrides  # save the state right after the warm-up
    overrides = [o for o in overrides if o != "warmup_only=1"]
    cfg = load_config(overrides=overrides)
    with tempfile.TemporaryDirectory() as d:
        run = prepare(cfg, Path(d), resume=False)
        if warmup_only:
            save(run, out, {})
            shutdown()
            return
        B = cfg.rollout.prompts_per_step * cfg.rollout.group_size
        full, adv = fixed_batch(B, len(run.tokenizer))
        rows = slice(run.dist.rank * B // run.dist.world, (run.dist.rank + 1) * B // run.dist.world)
        # as an engine returns them: no columns past this rank's longest response, so ranks
        # hold rollouts of different widths
        w = int(full.response_mask[rows].sum(-1).max())
        r = Rollouts(full.prompt_ids[rows], full.prompt_mask[rows], full.response_ids[rows, :w],
                     full.response_mask[rows, :w], full.logp[rows, :w])
        r, device = r.to(run.dist.device), run.dist.device
        # pi_old slightly off the current policy, so that ratios differ from 1
        noise = 0.01 * torch.randn(full.response_ids.shape, generator=torch.Generator().manual_seed(7))
        noise, adv = noise.to(device), adv.to(device)
        with torch.no_grad():
            old_logp = run.policy(r.input_ids, r.attention_mask, r.response_ids.shape[1], 1.0,
                                  1024) + noise[rows, :w]
        grads = {}  # what the last optimiser step used (update frees .grad after its steps)

        def capture(optimizer, args, kwargs):
            # sharded under FSDP, so gathered (a collective) on every rank, which all step
            grads.update({k: as_local(p.grad).clone() for k, p in run.model.named_parameters()})

        run.optimizer.register_step_pre_hook(capture)
        metrics = update(run, r, old_logp, None, adv[rows])
        save(run, out, metrics, grads)
        shutdown()


def save(run, out: str, metrics: dict, grads: dict | None = None) -> None:
    if grads is None:  # after the warm-up, .grad holds its last step's (reduced) gradient
        grads = {k: as_local(p.grad).clone() for k, p in run.model.named_parameters()}
    params = {k: v.detach().clone() for k, v in full_weights(run.policy, run.model).items()}
    # how far the rollout engine's and pi_ref's copies are from the trained weights
    copies = {"engine": run.engine.model.state_dict(),
              "ref": run.ref_policy.model.state_dict() if run.ref_policy else params}
    diffs = {name: max(float((sd[k] - v).abs().max()) for k, v in params.items())
             for name, sd in copies.items()}
    if run.dist.is_main:
        torch.save({"params": params, "grads": grads, "metrics": metrics, "copy_diffs": diffs,
                    "sharded": type(run.model.lm_head.weight).__name__ == "DTensor"}, out)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
