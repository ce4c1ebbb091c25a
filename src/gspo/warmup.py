"""The supervised warm-up: cross-entropy on worked answers before RL, so that a model that
cannot yet answer (the tiny default) starts RL with rewards to learn from. The run's side of
it (when it runs, its checkpoint, a stop part-way) is gspo.trainer.run_warmup."""

from __future__ import annotations

import math
import random
from typing import Callable

import torch

from gspo import precision
from gspo.config import Config
from gspo.data import encode_prompts
from gspo.distributed import Dist, load_optimizer_state
from gspo.engines import left_pad, right_pad
from gspo.errors import TrainingError
from gspo.logger import progress
from gspo.optim import build_optimizer
from gspo.signals import StopRequest


def warmup(policy, model, tokenizer, rows: list[dict], solution, cfg: Config, d: Dist,
           stop: StopRequest | None = None, on_stop: Callable | None = None, start: int = 0,
           optimizer_state: dict | None = None) -> float:
    """Cross-entropy on worked answers (prompt tokens unscored); returns the last loss.

    Runs through `policy` (DDP or FSDP2 on several ranks): every rank draws the same batch and
    scores its own share of it; the loss is normalised by the batch's GLOBAL token count and
    scaled by the world size, so the averaged gradient is the whole batch's.

    stop: checked before every step; when requested, on_stop(steps done, optimiser) is called
    (it saves and raises). start, optimizer_state: continue a warm-up stopped after `start`
    steps, exactly as if it had not stopped."""
    w = cfg.warmup
    opt, _ = build_optimizer(model, w.lr, cfg)
    scaler = precision.get(cfg.train.precision).grad_scaler(d.device)  # fp16-mixed only
    if optimizer_state is not None:
        load_optimizer_state(policy, opt, optimizer_state)
    rng = random.Random(cfg.train.seed)
    for _ in range(start):  # the batches already trained on, drawn again so the rest match
        rng.sample(rows, min(w.batch_size, len(rows)))
    eos = tokenizer.eos_token_id
    loss = torch.tensor(float("nan"))
    model.train()
    for step in progress(range(start, w.steps), "warm-up", cfg.train.progress and d.is_main):
        if stop is not None and stop.requested(d):
            on_stop(step, opt)
        batch = rng.sample(rows, min(w.batch_size, len(rows)))[d.rank::d.world]
        prompt_ids, prompt_mask = left_pad(encode_prompts(tokenizer, batch,
                                                          cfg.data.system_prompt or None),
                                           tokenizer.pad_token_id)
        answers = [tokenizer.encode(solution(r), add_special_tokens=False) + [eos] for r in batch]
        resp_ids, resp_mask = right_pad(answers, tokenizer.pad_token_id)
        input_ids = torch.cat([prompt_ids, resp_ids], 1).to(d.device)
        attn = torch.cat([prompt_mask, resp_mask.long()], 1).to(d.device)
        resp_mask = resp_mask.to(d.device)
        logp = policy(input_ids, attn, resp_ids.shape[1], 1.0, cfg.model.logprob_chunk_size)  # (B, T)
        n_tokens = d.sum([float(resp_mask.sum())])[0]
        loss = -(logp * resp_mask).sum() / n_tokens * d.world
        opt.zero_grad(set_to_none=True)
        precision.backward(loss, scaler)
        precision.step(opt, model.parameters(), cfg.optim.grad_clip, scaler)
    final = d.sum([float(loss.detach()) / d.world])[0]
    if w.steps > start and not math.isfinite(final):
        raise TrainingError(f"the warm-up's loss is {final} after {w.steps} steps: its updates "
                            f"broke the weights; lower warmup.lr (now {w.lr:g})")
    return final

