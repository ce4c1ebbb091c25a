"""The optimiser and its schedule, shared by the warm-up and the RL steps."""

from __future__ import annotations

import torch

from gspo.config import Config


def build_optimizer(model, lr: float, cfg: Config):
    o = cfg.optim
    # fused: one kernel for the whole step (CPU and CUDA); halves the optimiser's time here
    fused = all(p.device.type in ("cpu", "cuda") for p in model.parameters())
    params = [p for p in model.parameters() if p.requires_grad]  # LoRA: the adapters alone
    opt = torch.optim.AdamW(params, lr=lr, betas=tuple(o.betas),
                            weight_decay=o.weight_decay, fused=fused)
    warm = max(1, o.warmup_steps)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warm))
    return opt, sched
