"""Numerical precision of training: which dtype the weights live in and which the matmuls run in.

    train.precision   master weights + AdamW   matmuls    log-softmax, log-probs, losses
    fp32              float32                  float32    float32
    bf16-mixed        float32                  bfloat16   float32
    fp16-mixed        float32                  float16    float32 (+ a dynamic loss scale)
    bf16-true         bfloat16                 bfloat16   float32

The mixed modes are what TRL (`bf16=True`), verl (FSDP `mixed_precision`) and Lightning
(`precision="bf16-mixed"`) do. One process and DDP run each forward under `torch.autocast`
(the weights are cast to the low precision once per forward, the AdamW update stays float32);
FSDP2 does it with a `MixedPrecisionPolicy` (parameters gathered in the low precision, gradients
reduced in float32). Either way the log-prob kernel (gspo.logprobs) applies the output
embedding in the low precision and takes every logit to float32 before the log-softmax, and the
objectives, advantages and reductions see float32 only.

Why that matters for GSPO: its ratio s_i = exp(mean_t (logp - old_logp)) is clipped at
1 - 3e-4 / 1 + 4e-4, so the length-normalised log-ratio must be resolved to ~1e-5. A bfloat16
log-prob carries ~8 significant bits (an error of ~0.03 at logp = -5); float32 carries ~24
(~5e-7). So logits may come out of a bf16 GEMM (each logit has a relative error ~4e-3, shared by
pi_old's recompute and the update, which take the same path: their ratio is exactly 1 at
theta = theta_old), but the log-softmax and everything after it must be float32.

bf16-true trains the weights themselves in bfloat16 (AdamW moments too): half the memory, but a
weight w only moves when its update exceeds half a bf16 step, |w| * 2**-9. At the lr of RL
fine-tuning (1e-6) almost nothing moves; the run says so once (:func:`warn_vanishing_updates`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Precision:
    """One train.precision mode."""

    name: str
    param_dtype: torch.dtype
    """the dtype of the weights the optimiser updates (the checkpoint's)"""
    compute_dtype: torch.dtype
    """the dtype the matmuls run in"""

    @property
    def mixed(self) -> bool:
        return self.compute_dtype != self.param_dtype

    @property
    def scaled(self) -> bool:
        """Whether gradients need a dynamic loss scale (float16's 5-bit exponent underflows)."""
        return self.compute_dtype == torch.float16

    def grad_scaler(self, device: torch.device | str) -> torch.amp.GradScaler | None:
        """torch's dynamic loss scaler for fp16-mixed (None in the other modes)."""
        if not self.scaled:
            return None
        return torch.amp.GradScaler(torch.device(device).type)


MODES: dict[str, Precision] = {
    "fp32": Precision("fp32", torch.float32, torch.float32),
    "bf16-mixed": Precision("bf16-mixed", torch.float32, torch.bfloat16),
    "fp16-mixed": Precision("fp16-mixed", torch.float32, torch.float16),
    "bf16-true": Precision("bf16-true", torch.bfloat16, torch.bfloat16),
}
"""train.precision -> Precision."""

def get(name: str) -> Precision:
    return MODES[name]


def dtype_name(dtype: torch.dtype) -> str:
    """'float32' for torch.float32: the name configs and config.json use."""
    return str(dtype).removeprefix("torch.")


def rollout_dtype(cfg) -> str:
    """The dtype the rollout engine samples in: rollout.dtype, or with 'auto' the dtype
    train.precision computes in."""
    if cfg.rollout.dtype != "auto":
        return cfg.rollout.dtype
    return dtype_name(get(cfg.train.precision).compute_dtype)


def step(optimizer: torch.optim.Optimizer, params, grad_clip: float,
         scaler: torch.amp.GradScaler | None) -> torch.Tensor:
    """Clip the gradients to grad_clip (0 = no clipping) and take the optimiser step; with a
    loss scaler, unscale first, and skip the step (lowering the scale) when a gradient
    overflowed. Returns the gradient norm before clipping (inf on an overflow)."""
    if scaler is not None:
        scaler.unscale_(optimizer)
    norm = torch.nn.utils.clip_grad_norm_(params, grad_clip if grad_clip > 0 else float("inf"))
    if scaler is None:
        optimizer.step()
    else:
        scaler.step(optimizer)  # skipped when the unscaled gradients hold an inf or a NaN
        scaler.update()
    return norm


def backward(loss: torch.Tensor, scaler: torch.amp.GradScaler | None) -> None:
    (loss if scaler is None else scaler.scale(loss)).backward()


BF16_HALF_STEP = 2.0 ** -9
"""Half the spacing of bfloat16 numbers relative to their magnitude: an update of a weight w
smaller than |w| * BF16_HALF_STEP rounds back to w."""


def vanishing_fraction(model: torch.nn.Module, lr: float) -> float:
    """The fraction of weights that an update of size lr (an AdamW step's typical magnitude)
    cannot move in bfloat16, because lr < |w| * 2**-9."""
    small = total = 0
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                small += int((p.float().abs() * BF16_HALF_STEP > lr).sum())
                total += p.numel()
    return small / max(1, total)


def warn_vanishing_updates(model: torch.nn.Module, lr: float, what: str = "optim.lr") -> None:
    """bf16-true: say once when most AdamW updates of size lr would round away."""
    frac = vanishing_fraction(model, lr)
    if frac > 0.5:
        log.warning("train.precision=bf16-true: at %s=%g, %.0f%% of the weights are too large "
                    "for an update of that size to change their bfloat16 value (it must exceed "
                    "|w| * 2^-9); the run will barely move. Use train.precision=bf16-mixed "
                    "(float32 master weights, bf16 matmuls) or a larger lr", what, lr,
                    100 * frac)
