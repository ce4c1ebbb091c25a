"""The objectives: GSPO, GSPO-token and GRPO, as pure functions of tensors.

Zheng et al., "Group Sequence Policy Optimization" (arXiv 2507.18071). Every formula of the
paper that the trainer uses lives here once. No model, no config object, no I/O.

Shapes, everywhere:
    B  responses in the (micro-)batch, laid out prompt-major (G consecutive rows per prompt)
    T  response tokens (right-padded)
    logp, old_logp, ref_logp, mask: (B, T); mask is 1 on real response tokens, 0 on padding.

Each loss returns ``(loss, metrics)``: ``loss`` is the NEGATED objective (minimise it) and
``metrics`` a dict of detached scalar tensors. ``denom=None`` normalises by the local count
(sequences, or tokens for token-mean); the trainer instead passes the global count over all
micro-batches and ranks, so that summing their gradients gives exactly the full-batch gradient.

"Clipped" follows PPO's one-sided rule: a term is clipped when the clipped branch of the
``min`` is the active one, i.e. ratio > 1 + eps_high with A > 0 (``clip_frac_high``) or
ratio < 1 - eps_low with A < 0 (``clip_frac_low``). Such a term carries no gradient. Fractions
count response tokens, as the paper does: for GSPO every token of a clipped sequence counts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

Metrics = dict[str, Tensor]

# Below this a group's reward std is treated as zero (all rewards equal up to rounding).
_STD_FLOOR = 1e-6

ADVANTAGE_SCALES = ("group", "batch", "none")
AGGREGATIONS = ("seq-mean-token-mean", "token-mean", "seq-mean-token-sum-norm")


# --------------------------------------------------------------------------------------------
# validation


class NonFiniteError(ValueError):
    """A NaN among an objective's inputs (the trainer names the step and the fix)."""


def _check_finite(name: str, x: Tensor) -> None:
    if torch.isnan(x).any():
        raise NonFiniteError(f"{name} contains NaN; check the log-probs/rewards that produced it")


def _check_inputs(logp: Tensor, old_logp: Tensor, mask: Tensor, adv: Tensor | None,
                  eps_low: float, eps_high: float) -> Tensor:
    """Validate the shared inputs and return the mask as logp's float dtype."""
    if logp.dim() != 2:
        raise ValueError(f"logp must be (B, T), got shape {tuple(logp.shape)}")
    for name, x in (("old_logp", old_logp), ("mask", mask)):
        if x.shape != logp.shape:
            raise ValueError(f"{name} shape {tuple(x.shape)} does not match logp shape "
                             f"{tuple(logp.shape)}")
    if adv is not None and adv.shape not in (logp.shape[:1], logp.shape):
        raise ValueError(f"adv must be (B,) or (B, T) = {tuple(logp.shape)}, "
                         f"got shape {tuple(adv.shape)}")
    if eps_low < 0 or eps_high < 0:
        raise ValueError(f"clip eps must be >= 0, got eps_low={eps_low}, eps_high={eps_high}")
    mask = mask.to(logp.dtype)
    if (mask.sum(-1) == 0).any():
        rows = torch.nonzero(mask.sum(-1) == 0).flatten().tolist()
        raise ValueError(f"mask rows {rows} have no response tokens; drop empty responses "
                         f"or give them at least one token (e.g. the EOS)")
    _check_finite("logp", logp)
    _check_finite("old_logp", old_logp)
    if adv is not None:
        _check_finite("adv", adv)
    return mask


def _masked(x: Tensor, mask: Tensor) -> Tensor:
    """x with padded positions set to exactly 0 (where, not multiply: padding may hold inf)."""
    return torch.where(mask > 0, x, torch.zeros_like(x))


# --------------------------------------------------------------------------------------------
# advantages and ratios


def group_advantages(rewards: Tensor, group_size: int, scale: str = "group",
                     batch_std: Tensor | None = None) -> Tensor:
    """Group-normalised advantages, one per response.

        A_i = (r_i - mean_{j in group(i)} r_j) / std          (paper, eq. for GSPO and GRPO)

    rewards: (B,) with B = P * G, prompt-major (rows i*G .. i*G+G-1 share prompt i).
    scale:   "group" - std over the response's own group (the paper);
             "batch" - std over the whole batch (group mean still subtracted);
             "none"  - no division (Dr.GRPO).
    batch_std: "batch" where `rewards` are one rank's share of the batch: the std over all of
    it (gspo.step.whole_batch_std), so that the advantages do not depend on the ranks.
    std is the unbiased sample std (torch's default, correction=1). Where it is below 1e-6
    (all rewards of the group equal) the advantage is 0, never NaN; a group of one response
    likewise gets 0. Returns (B,) in the rewards' floating dtype.
    """
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be (B,), got shape {tuple(rewards.shape)}")
    if group_size < 1 or rewards.numel() % group_size != 0:
        raise ValueError(f"{rewards.numel()} rewards are not divisible by group_size "
                         f"{group_size}; each prompt needs exactly group_size responses")
    if scale not in ADVANTAGE_SCALES:
        raise ValueError(f"unknown advantage scale {scale!r}; choose one of {ADVANTAGE_SCALES}")
    rewards = rewards.to(torch.promote_types(rewards.dtype, torch.float32))
    _check_finite("rewards", rewards)
    if group_size == 1:
        return torch.zeros_like(rewards)
    r = rewards.view(-1, group_size)  # (P, G)
    centred = r - r.mean(-1, keepdim=True)
    if scale == "none":
        return centred.flatten()
    if scale == "group":
        std = r.std(-1, keepdim=True)  # (P, 1)
    else:
        std = (rewards.std() if batch_std is None else batch_std.to(rewards)).expand(r.shape[0], 1)
    adv = torch.where(std > _STD_FLOOR, centred / std.clamp_min(_STD_FLOOR), torch.zeros_like(r))
    return adv.flatten()


def varying_groups(rewards: Tensor, group_size: int) -> Tensor:
    """(P,) bool: the groups whose rewards vary, std above the floor under which
    group_advantages treats them as equal. The others carry zero advantage whatever the scale
    (group, batch or none: mean-centred, they are 0 up to rounding), so they teach nothing:
    DAPO's dynamic sampling (rollout.filter_groups) drops them. rewards: (B,) prompt-major,
    B = P * group_size, group_size >= 2."""
    if group_size < 2 or rewards.dim() != 1 or rewards.numel() % group_size:
        raise ValueError(f"rewards of shape {tuple(rewards.shape)} are not groups of "
                         f"{group_size} >= 2 responses")
    r = rewards.to(torch.promote_types(rewards.dtype, torch.float32)).view(-1, group_size)
    return r.std(-1) > _STD_FLOOR  # (P,)


def overlong_penalty(lengths: Tensor, max_len: int, buffer: int, penalty: float = 1.0
                     ) -> Tensor:
    """DAPO's soft overlong punishment (Yu et al., arXiv 2503.14476, eq. 13), added to the
    reward of each response of |y| tokens with a budget of max_len and a buffer of L_c:

        R_len(y) = 0                                      |y| <= max_len - L_c
                 = penalty * ((max_len - L_c) - |y|) / L_c  max_len - L_c < |y| <= max_len
                 = -penalty                               |y| > max_len

    lengths (B,); returns (B,) float32, <= 0."""
    if not 0 < buffer < max_len:
        raise ValueError(f"the overlong buffer must be in (0, {max_len}), got {buffer}")
    over = (lengths.float() - (max_len - buffer)).clamp(min=0, max=buffer)  # (B,)
    return -penalty * over / buffer


def sequence_log_ratio(logp: Tensor, old_logp: Tensor, mask: Tensor) -> Tensor:
    """Length-normalised sequence log-likelihood ratio, log s_i.

        log s_i = (1/|y_i|) * sum_t (log pi_theta(y_i,t) - log pi_old(y_i,t))

    logp, old_logp, mask: (B, T). Returns (B,).
    """
    mask = _check_inputs(logp, old_logp, mask, None, 0.0, 0.0)
    return _seq_log_ratio(logp, old_logp, mask)


def _seq_log_ratio(logp: Tensor, old_logp: Tensor, mask: Tensor) -> Tensor:
    return _masked(logp - old_logp, mask).sum(-1) / mask.sum(-1)  # (B,)


def _clip_flags(ratio: Tensor, adv: Tensor, eps_low: float, eps_high: float
                ) -> tuple[Tensor, Tensor]:
    """Where the clipped branch of min(ratio*A, clip(ratio)*A) is active (one-sided, as PPO)."""
    high = (adv > 0) & (ratio > 1 + eps_high)
    low = (adv < 0) & (ratio < 1 - eps_low)
    return low, high


def _clipped_surrogate(ratio: Tensor, adv: Tensor, eps_low: float, eps_high: float) -> Tensor:
    return torch.minimum(ratio * adv, ratio.clamp(1 - eps_low, 1 + eps_high) * adv)


def _token_frac(flags: Tensor, mask: Tensor) -> Tensor:
    """Fraction of real tokens flagged; flags (B,) count for every token of their sequence."""
    if flags.dim() == 1:
        flags = flags[:, None].expand_as(mask)
    return (flags.to(mask.dtype) * mask).sum() / mask.sum()


def _metrics(ratio: Tensor, ratio_mask: Tensor | None, low: Tensor, high: Tensor,
             logp: Tensor, old_logp: Tensor, mask: Tensor) -> Metrics:
    """Shared metrics; ratio is (B,) per sequence or (B, T) per token (then ratio_mask=mask)."""
    with torch.no_grad():
        r = ratio.detach()
        if ratio_mask is not None:
            sel = ratio_mask > 0
            r_count = ratio_mask.sum()
            r_mean = _masked(r, ratio_mask).sum() / r_count
            r_min, r_max = r[sel].min(), r[sel].max()
        else:
            r_count = torch.tensor(float(r.numel()))
            r_mean, r_min, r_max = r.mean(), r.min(), r.max()
        frac_low, frac_high = _token_frac(low, mask), _token_frac(high, mask)
        return {
            "clip_frac": frac_low + frac_high,  # low and high are disjoint
            "clip_frac_low": frac_low,
            "clip_frac_high": frac_high,
            "ratio_mean": r_mean,
            "ratio_min": r_min,
            "ratio_max": r_max,
            "ratio_count": r_count,  # what ratio_mean averages over: sequences or tokens
            "kl_old": _masked(old_logp - logp.detach(), mask).sum() / mask.sum(),
        }


# --------------------------------------------------------------------------------------------
# losses


def aggregate(per_tok: Tensor, mask: Tensor, aggregation: str, max_len: int | None = None
              ) -> tuple[Tensor, Tensor | int]:
    """Per-token loss terms (B, T), zero on padding, to (numerator, local denominator):

        "seq-mean-token-mean"      sum_i (1/|y_i|) sum_t term,   B
        "token-mean"               sum_i sum_t term,             sum_i |y_i|
        "seq-mean-token-sum-norm"  sum_i sum_t term / max_len,   B   (Dr.GRPO; max_len=None -> T)

    The loss is -numerator / denominator; the trainer replaces the local denominator by the
    global one (see `LossSpec.normaliser`)."""
    if aggregation == "seq-mean-token-mean":
        return (per_tok.sum(-1) / mask.sum(-1)).sum(), per_tok.shape[0]
    if aggregation == "token-mean":
        return per_tok.sum(), mask.sum()
    if aggregation == "seq-mean-token-sum-norm":
        return per_tok.sum() / (per_tok.shape[1] if max_len is None else max_len), per_tok.shape[0]
    raise ValueError(f"unknown aggregation {aggregation!r}; choose one of {AGGREGATIONS}")


def gspo_loss(logp: Tensor, old_logp: Tensor, adv: Tensor, mask: Tensor,
              eps_low: float = 3e-4, eps_high: float = 4e-4,
              denom: float | Tensor | None = None) -> tuple[Tensor, Metrics]:
    """GSPO: sequence-level importance ratio and sequence-level clipping.

        s_i    = exp( (1/|y_i|) * sum_t (logp_i,t - old_logp_i,t) )
        J_GSPO = (1/G) * sum_i min( s_i * A_i, clip(s_i, 1 - eps_low, 1 + eps_high) * A_i )
        loss   = -sum_i min(...) / denom                    (denom=None -> B, the local count)

    logp (B, T) requires grad; old_logp (B, T) is a constant (detached here); adv (B,);
    mask (B, T). Paper defaults eps_low=3e-4, eps_high=4e-4.
    Metrics: ratio_* are over sequences; clip fractions count every token of a clipped
    sequence; kl_old is the token mean of old_logp - logp.
    """
    mask = _check_inputs(logp, old_logp, mask, adv, eps_low, eps_high)
    if adv.dim() != 1:
        raise ValueError(f"gspo_loss needs one advantage per sequence, adv (B,); got shape "
                         f"{tuple(adv.shape)} (use gspo_token_loss for per-token advantages)")
    old_logp, adv = old_logp.detach(), adv.detach().to(logp.dtype)
    ratio = torch.exp(_seq_log_ratio(logp, old_logp, mask))  # (B,)
    per_seq = _clipped_surrogate(ratio, adv, eps_low, eps_high)  # (B,)
    denom = logp.shape[0] if denom is None else denom
    loss = -per_seq.sum() / denom
    low, high = _clip_flags(ratio.detach(), adv, eps_low, eps_high)
    return loss, _metrics(ratio, None, low, high, logp, old_logp, mask)


def gspo_token_loss(logp: Tensor, old_logp: Tensor, adv: Tensor, mask: Tensor,
                    eps_low: float = 3e-4, eps_high: float = 4e-4,
                    denom: float | Tensor | None = None) -> tuple[Tensor, Metrics]:
    """GSPO-token: per-token advantages with the sequence-level ratio's value.

        s_i,t = sg[s_i] * pi_theta(y_i,t) / sg[pi_theta(y_i,t)]
              = exp( sg[log s_i] + logp_i,t - sg[logp_i,t] )    (value s_i, gradient of logp_i,t)
        J     = (1/G) * sum_i (1/|y_i|) * sum_t min( s_i,t A_i,t, clip(s_i,t, 1-eps_low, 1+eps_high) A_i,t )
        loss  = -sum_i (1/|y_i|) sum_t min(...) / denom      (denom=None -> B)

    adv is (B,) (broadcast over tokens) or (B, T). With adv constant within each sequence
    this equals gspo_loss in value and gradient. Metrics as gspo_loss (ratio_* over sequences).
    """
    mask = _check_inputs(logp, old_logp, mask, adv, eps_low, eps_high)
    old_logp, adv = old_logp.detach(), adv.detach().to(logp.dtype)
    adv_t = adv[:, None].expand_as(logp) if adv.dim() == 1 else adv  # (B, T)
    log_s = _seq_log_ratio(logp, old_logp, mask).detach()  # (B,) stop-gradient
    # masked before exp: -inf - (-inf) on padding would put NaN into the gradient
    ratio_t = torch.exp(log_s[:, None] + _masked(logp - logp.detach(), mask))  # (B, T) = s_i
    per_tok = _masked(_clipped_surrogate(ratio_t, adv_t, eps_low, eps_high), mask)
    numer, local = aggregate(per_tok, mask, "seq-mean-token-mean")
    loss = -numer / (local if denom is None else denom)
    low, high = _clip_flags(ratio_t.detach(), adv_t, eps_low, eps_high)
    return loss, _metrics(torch.exp(log_s), None, low, high, logp, old_logp, mask)


def grpo_loss(logp: Tensor, old_logp: Tensor, adv: Tensor, mask: Tensor,
              eps_low: float = 0.2, eps_high: float = 0.27,
              aggregation: str = "seq-mean-token-mean",
              denom: float | Tensor | None = None,
              max_len: int | None = None) -> tuple[Tensor, Metrics]:
    """GRPO, the baseline: token-level importance ratio and token-level clipping.

        w_i,t  = exp(logp_i,t - old_logp_i,t)
        term   = min( w_i,t A_i, clip(w_i,t, 1 - eps_low, 1 + eps_high) A_i )
        J_GRPO = (1/G) * sum_i (1/|y_i|) * sum_t term           ("seq-mean-token-mean", paper)

    aggregation (loss = -numerator / denom):
        "seq-mean-token-mean"      numerator sum_i (1/|y_i|) sum_t term; denom=None -> B
        "token-mean"               numerator sum_i sum_t term;           denom=None -> sum |y_i|
        "seq-mean-token-sum-norm"  numerator sum_i sum_t term / max_len;  denom=None -> B
                                   (Dr.GRPO: a constant length normaliser, the generation
                                   budget; max_len=None -> T, the mask's width)
    adv (B,) or (B, T). Metrics: ratio_* over real tokens.
    """
    mask = _check_inputs(logp, old_logp, mask, adv, eps_low, eps_high)
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"unknown aggregation {aggregation!r}; choose one of {AGGREGATIONS}")
    old_logp, adv = old_logp.detach(), adv.detach().to(logp.dtype)
    adv_t = adv[:, None].expand_as(logp) if adv.dim() == 1 else adv  # (B, T)
    ratio = torch.exp(_masked(logp - old_logp, mask))  # (B, T); 1 on padding
    per_tok = _masked(_clipped_surrogate(ratio, adv_t, eps_low, eps_high), mask)  # (B, T)
    numer, local = aggregate(per_tok, mask, aggregation, max_len)
    loss = -numer / (local if denom is None else denom)
    low, high = _clip_flags(ratio.detach(), adv_t, eps_low, eps_high)
    low, high = low & (mask > 0), high & (mask > 0)
    return loss, _metrics(ratio, mask, low, high, logp, old_logp, mask)


def kl_k3(logp: Tensor, ref_logp: Tensor, mask: Tensor) -> Tensor:
    """k3 estimator of KL(pi_theta || pi_ref), averaged over each sequence's tokens.

        k3_t = exp(ref_logp_t - logp_t) - (ref_logp_t - logp_t) - 1     (>= 0, unbiased)
        kl_i = (1/|y_i|) * sum_t k3_t

    logp, ref_logp, mask: (B, T). Returns (B,), differentiable through logp. The trainer adds
    beta * sum_i kl_i / denom to the loss (off by default, as in the paper).
    """
    mask = _check_inputs(logp, ref_logp, mask, None, 0.0, 0.0)
    delta = _masked(ref_logp.detach() - logp, mask)  # (B, T)
    k3 = _masked(torch.exp(delta) - delta - 1, mask)
    return k3.sum(-1) / mask.sum(-1)


Objective = Callable[..., tuple[Tensor, Metrics]]


@dataclass(frozen=True)
class LossSpec:
    """An objective as the config and the trainer see it: the function, its paper clip range,
    the aggregations it accepts and whether it takes per-token advantages. Calling the spec
    calls the function.

    The function's signature is the shared one: ``fn(logp, old_logp, adv, mask, *, eps_low,
    eps_high, denom, **options) -> (loss, metrics)``, where options are ``aggregation`` and
    ``max_len`` when it accepts more than one aggregation. Metrics must hold ratio_mean,
    ratio_min, ratio_max, ratio_count, clip_frac, clip_frac_low, clip_frac_high and kl_old."""

    fn: Objective
    eps_low: float
    eps_high: float
    aggregations: tuple[str, ...] = ("seq-mean-token-mean",)
    """the ones it accepts; the first is its default (algorithm.aggregation)"""
    token_advantages: bool = False
    """takes (B, T) advantages (needed by algorithm.tis=token)"""
    ratio: str = "token"
    """the log-ratio its clip range bounds: 'token', or 'sequence' (GSPO's length-normalised
    one); the run compares the engine's mismatch on that scale with the clip range"""

    def __call__(self, logp: Tensor, old_logp: Tensor, adv: Tensor, mask: Tensor, *,
                 is_weights: Tensor | None = None, **kwargs) -> tuple[Tensor, Metrics]:
        """fn's loss and metrics. is_weights: the off-policy correction's weights
        (`importance_weights`: (B,) per sequence or (B, T) per token, >= 0, constants) that
        multiply each term of the objective; since a weight w >= 0 commutes with the clipped
        min, min(s A, clip(s) A) w = min(s (A w), clip(s) (A w)), they weight the advantages.
        The metrics then also hold is_weight_mean (over tokens), is_weight_min, is_weight_max,
        is_masked_token_frac and is_masked_seq_frac (weight 0)."""
        if is_weights is None:
            return self.fn(logp, old_logp, adv, mask, **kwargs)
        if is_weights.dim() == 2 and not self.token_advantages:
            raise ValueError("per-token importance weights need an objective that takes "
                             "per-token advantages (this one has one advantage per sequence)")
        if is_weights.dim() == 2:
            adv = (adv[:, None] if adv.dim() == 1 else adv) * is_weights  # (B, T)
        else:
            adv = adv * (is_weights if adv.dim() == 1 else is_weights[:, None])
        loss, metrics = self.fn(logp, old_logp, adv, mask, **kwargs)
        return loss, {**metrics, **importance_weight_metrics(is_weights, mask)}

    def settings(self, eps_low: float | None, eps_high: float | None,
                 aggregation: str | None, max_len: int) -> dict:
        """The keyword settings `fn` takes beyond the tensors and denom, from the config's
        values (None: this objective's default clip range and aggregation)."""
        out = {"eps_low": self.eps_low if eps_low is None else eps_low,
               "eps_high": self.eps_high if eps_high is None else eps_high}
        if len(self.aggregations) > 1:
            out.update(aggregation=aggregation or self.aggregations[0], max_len=max_len)
        return out

    @staticmethod
    def normaliser(aggregation: str) -> str:
        """What the global denominator counts: 'tokens' for token-mean, else 'sequences'."""
        return "tokens" if aggregation == "token-mean" else "sequences"



OBJECTIVES: dict[str, LossSpec] = {
    "gspo": LossSpec(gspo_loss, eps_low=3e-4, eps_high=4e-4, ratio="sequence"),
    "gspo_token": LossSpec(gspo_token_loss, eps_low=3e-4, eps_high=4e-4, token_advantages=True,
                           ratio="sequence"),
    "grpo": LossSpec(grpo_loss, eps_low=0.2, eps_high=0.27, aggregations=AGGREGATIONS,
                     token_advantages=True),
}
"""algorithm.name -> LossSpec; `register_objective` adds one."""


def register_objective(name: str, spec: LossSpec) -> None:
    """Make `algorithm=NAME` train with `spec` (a new name only)."""
    if name in OBJECTIVES:
        raise ValueError(f"objective {name!r} is already registered")
    OBJECTIVES[name] = spec


# --------------------------------------------------------------------------------------------
# training engine vs inference engine


IS_CORRECTIONS = ("none", "truncate", "mask")
IS_LEVELS = ("token", "sequence", "geometric")


def importance_weights(logp: Tensor, rollout_logp: Tensor, mask: Tensor, correction: str,
                       level: str, cap: float, floor: float = 0.0,
                       relative: bool = False) -> Tensor:
    """Off-policy correction weights for responses sampled by another engine (or by older
    weights): the rollout engine's likelihoods (rollout_logp) against the trainer's (logp).

        "token":     w_i,t = pi(y_i,t) / pi_rollout(y_i,t)                      -> (B, T)
        "sequence":  w_i   = prod_t pi(y_i,t) / pi_rollout(y_i,t)                -> (B,)
        "geometric": w_i   = (prod_t pi(y_i,t) / pi_rollout(y_i,t))^(1/|y_i|)    -> (B,)
    correction "truncate": min(max(w, floor), cap) (TIS, truncated importance sampling);
               "mask":     w where floor <= w <= cap, else 0 (the term leaves the loss).
    A constant (no gradient). Padded positions get weight 1 (token level). Sequence weights
    are bounded in log space, so a long response cannot overflow exp before the cap applies.

    relative: what the correction leaves of w, for an objective whose ratio is already against
    the rollout engine (pi_old = pi_rollout, old_logprobs=rollout): truncate min(max(w, floor),
    cap) / w, mask 1 or 0; times that ratio, the total is the correction's, not w twice.
    """
    mask = _check_inputs(logp, rollout_logp, mask, None, 0.0, 0.0)
    if correction not in IS_CORRECTIONS[1:]:
        raise ValueError(f"unknown correction {correction!r}; use one of {IS_CORRECTIONS[1:]}")
    if level not in IS_LEVELS:
        raise ValueError(f"unknown importance-weight level {level!r}; use one of {IS_LEVELS}")
    if not cap > 0 or not 0 <= floor < cap:
        raise ValueError(f"the correction's bounds need 0 <= floor < cap, got floor={floor}, "
                         f"cap={cap}")
    delta = _masked(logp.detach() - rollout_logp.detach(), mask)  # (B, T) log-ratios
    if level == "token":
        log_w = delta
    elif level == "sequence":
        log_w = delta.sum(-1)  # (B,)
    else:
        log_w = delta.sum(-1) / mask.sum(-1)  # (B,)
    log_cap, log_floor = math.log(cap), (math.log(floor) if floor > 0 else -math.inf)
    if correction == "truncate":
        bounded = log_w.clamp(min=log_floor, max=log_cap)
        return torch.exp(bounded - log_w if relative else bounded)
    keep = (log_w <= log_cap) & (log_w >= log_floor)
    kept = torch.ones_like(log_w) if relative else torch.exp(log_w.clamp(max=log_cap))
    return torch.where(keep, kept, torch.zeros_like(log_w))


def importance_weight_metrics(w: Tensor, mask: Tensor) -> Metrics:
    """The weights' mean over real tokens, their range and the fractions masked (weight 0):
    of the tokens, and of the sequences with no token left."""
    mask = mask.to(w.dtype)
    w_t = w if w.dim() == 2 else w[:, None].expand_as(mask)  # (B, T)
    real = mask > 0
    with torch.no_grad():
        zero = (w_t == 0) & real
        return {"is_weight_mean": (w_t * mask).sum() / mask.sum(),
                "is_weight_min": w_t[real].min(), "is_weight_max": w_t[real].max(),
                "is_masked_token_frac": zero.sum() / mask.sum(),
                "is_masked_seq_frac": (zero.sum(-1) == real.sum(-1)).to(w.dtype).mean()}


def engine_mismatch(logp: Tensor, rollout_logp: Tensor, mask: Tensor) -> Metrics:
    """How far the inference engine's log-probs are from the training engine's.

        token_abs_mean     mean over real tokens of |logp - rollout_logp|
        token_abs_max      max of the same
        seq_log_ratio_mean mean over sequences of (1/|y_i|) sum_t (logp - rollout_logp), the
                           length-normalised log-ratio GSPO's s_i would see at theta = theta_old
        seq_log_ratio_abs_mean mean over sequences of its absolute value (to compare with
                           GSPO's clip range: a sequence beyond it is clipped on precision alone)
        seq_log_ratio_abs_max  max over sequences of its absolute value
    """
    mask = _check_inputs(logp, rollout_logp, mask, None, 0.0, 0.0)
    with torch.no_grad():
        delta = _masked(logp - rollout_logp, mask)
        seq = delta.sum(-1) / mask.sum(-1)
        return {"token_abs_mean": delta.abs().sum() / mask.sum(),
                "token_abs_max": delta.abs().max(),
                "seq_log_ratio_mean": seq.mean(),
                "seq_log_ratio_abs_mean": seq.abs().mean(),
                "seq_log_ratio_abs_max": seq.abs().max()}
