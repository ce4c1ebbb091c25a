"""Tests for gspo.objectives against independent float64 loop references.

Every expected value here comes either from a hand-computed example (arithmetic in a comment) or
from the `ref_*` functions below, which walk the batch sequence by sequence and token by token
with plain Python loops and the case analysis of min(r A, clip(r) A) written out by hand. They
never call the code under test.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

from gspo.distributed import Dist
from gspo.objectives import (
    OBJECTIVES,
    group_advantages,
    grpo_loss,
    gspo_loss,
    gspo_token_loss,
    kl_k3,
    sequence_log_ratio,
)
from gspo.step import whole_batch_std

F64 = torch.float64
AGGREGATIONS = ("seq-mean-token-mean", "token-mean", "seq-mean-token-sum-norm")
# (objective name, grpo aggregation or None): every loss/aggregation the trainer can pick.
LOSS_CASES = [("gspo", None), ("gspo_token", None)] + [("grpo", a) for a in AGGREGATIONS]
LOSS_IDS = [n if a is None else f"{n}-{a}" for n, a in LOSS_CASES]


# --------------------------------------------------------------------------------------------
# Independent references (float64, loops)
# --------------------------------------------------------------------------------------------


def _f(x):
    """A scalar tensor's value as a Python float, outside autograd."""
    return float(x.detach())


def _real(mask, i):
    """Indices of the real tokens of row i."""
    return [t for t in range(mask.shape[1]) if bool(mask[i, t])]


def _term(r, r_val, a, eps_low, eps_high):
    """min(r a, clip(r, 1-eps_low, 1+eps_high) a), spelled out case by case.

    r is a differentiable scalar tensor, r_val its float value, a a float. Returns
    (term, side) with side in {"high", "low", None}: the clipped branch wins the min only when
    a > 0 and r > 1+eps_high (term is the constant (1+eps_high) a) or a < 0 and r < 1-eps_low
    (term is (1-eps_low) a). Everywhere else the term is r a.
    """
    if a > 0 and r_val > 1.0 + eps_high:
        return r * 0.0 + (1.0 + eps_high) * a, "high"
    if a < 0 and r_val < 1.0 - eps_low:
        return r * 0.0 + (1.0 - eps_low) * a, "low"
    return r * a, None


def _ref_metrics(n_tok, n_low, n_high, ratios, kl_sum):
    return {
        "clip_frac": (n_low + n_high) / n_tok,
        "clip_frac_low": n_low / n_tok,
        "clip_frac_high": n_high / n_tok,
        "ratio_mean": sum(ratios) / len(ratios),
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
        "kl_old": kl_sum / n_tok,
    }


def ref_sequence_log_ratio(logp, old_logp, mask):
    out = []
    for i in range(logp.shape[0]):
        idx = _real(mask, i)
        out.append(sum(_f(logp[i, t]) - _f(old_logp[i, t]) for t in idx) / len(idx))
    return torch.tensor(out, dtype=F64)


def ref_gspo(logp, old_logp, adv, mask, eps_low, eps_high, denom=None):
    """J_GSPO = (1/denom) sum_i min(s_i A_i, clip(s_i) A_i), loss = -J. Returns (loss, metrics)."""
    B = logp.shape[0]
    total = logp.new_zeros(())
    n_tok = n_low = n_high = 0
    kl_sum = 0.0
    seq_ratios = []  # ratio_* metrics are over sequences for GSPO (implementation docstring)
    for i in range(B):
        idx = _real(mask, i)
        n = len(idx)
        log_s = sum(logp[i, t] - old_logp[i, t] for t in idx) / n
        s = torch.exp(log_s)
        term, side = _term(s, _f(s), float(adv[i]), eps_low, eps_high)
        total = total + term
        n_tok += n
        n_low += n if side == "low" else 0  # a clipped sequence clips every one of its tokens
        n_high += n if side == "high" else 0
        kl_sum += sum(_f(old_logp[i, t]) - _f(logp[i, t]) for t in idx)
        seq_ratios.append(_f(s))
    loss = -total / (B if denom is None else denom)
    return loss, _ref_metrics(n_tok, n_low, n_high, seq_ratios, kl_sum)


def ref_gspo_token(logp, old_logp, adv, mask, eps_low, eps_high, denom=None):
    """GSPO-token: s_i,t = sg[s_i] * p_t / sg[p_t]; adv (B,) or (B, T)."""
    B = logp.shape[0]
    total = logp.new_zeros(())
    n_tok = n_low = n_high = 0
    kl_sum = 0.0
    seq_ratios = []  # over sequences, as for GSPO
    for i in range(B):
        idx = _real(mask, i)
        n = len(idx)
        s_val = math.exp(sum(_f(logp[i, t]) - _f(old_logp[i, t]) for t in idx) / n)
        seq_total = logp.new_zeros(())
        for t in idx:
            # value s_i, derivative s_i * d logp_t: the stop-gradient written as a constant.
            s_it = s_val * torch.exp(logp[i, t] - _f(logp[i, t]))
            a = float(adv[i, t]) if adv.dim() == 2 else float(adv[i])
            term, side = _term(s_it, s_val, a, eps_low, eps_high)
            seq_total = seq_total + term
            n_low += side == "low"
            n_high += side == "high"
            kl_sum += _f(old_logp[i, t]) - _f(logp[i, t])
        total = total + seq_total / n
        n_tok += n
        seq_ratios.append(s_val)
    loss = -total / (B if denom is None else denom)
    return loss, _ref_metrics(n_tok, n_low, n_high, seq_ratios, kl_sum)


def ref_grpo(logp, old_logp, adv, mask, eps_low, eps_high, aggregation, denom=None,
             max_len=None):
    """GRPO with token ratios w_i,t = exp(logp - old_logp) and the three aggregations.

    seq-mean-token-sum-norm divides each sequence's token sum by the constant max_len (the
    generation budget; None -> T, the mask's width, per the implementation's docstring).
    """
    B, T = logp.shape
    total = logp.new_zeros(())
    n_tok = n_low = n_high = 0
    kl_sum = 0.0
    ratios = []  # over real tokens
    for i in range(B):
        idx = _real(mask, i)
        n = len(idx)
        seq_total = logp.new_zeros(())
        for t in idx:
            w = torch.exp(logp[i, t] - old_logp[i, t])
            a = float(adv[i, t]) if adv.dim() == 2 else float(adv[i])
            term, side = _term(w, _f(w), a, eps_low, eps_high)
            seq_total = seq_total + term
            n_low += side == "low"
            n_high += side == "high"
            kl_sum += _f(old_logp[i, t]) - _f(logp[i, t])
            ratios.append(_f(w))
        n_tok += n
        if aggregation == "seq-mean-token-mean":
            total = total + seq_total / n
        elif aggregation == "seq-mean-token-sum-norm":
            total = total + seq_total / (T if max_len is None else max_len)
        elif aggregation == "token-mean":
            total = total + seq_total
        else:
            raise AssertionError(aggregation)
    if denom is None:
        denom = n_tok if aggregation == "token-mean" else B
    return -total / denom, _ref_metrics(n_tok, n_low, n_high, ratios, kl_sum)


def ref_kl_k3(logp, ref_logp, mask):
    """k3 = exp(ref - logp) - (ref - logp) - 1 per token, mean over each sequence's tokens."""
    rows = []
    for i in range(logp.shape[0]):
        idx = _real(mask, i)
        acc = logp.new_zeros(())
        for t in idx:
            d = ref_logp[i, t] - logp[i, t]
            acc = acc + torch.exp(d) - d - 1.0
        rows.append(acc / len(idx))
    return torch.stack(rows)


def ref_loss(name, aggregation, logp, old_logp, adv, mask, eps_low, eps_high, denom=None):
    if name == "gspo":
        return ref_gspo(logp, old_logp, adv, mask, eps_low, eps_high, denom)
    if name == "gspo_token":
        return ref_gspo_token(logp, old_logp, adv, mask, eps_low, eps_high, denom)
    return ref_grpo(logp, old_logp, adv, mask, eps_low, eps_high, aggregation, denom)


def run_loss(name, aggregation, logp, old_logp, adv, mask, eps_low, eps_high, denom=None):
    """Call the code under test by name, through the OBJECTIVES registry."""
    kw = dict(eps_low=eps_low, eps_high=eps_high, denom=denom)
    if aggregation is not None:
        kw["aggregation"] = aggregation
    return OBJECTIVES[name](logp, old_logp, adv, mask, **kw)


def loss_and_grad(fn, logp, *args, **kw):
    """loss value and d loss / d logp for a fresh leaf copy of logp."""
    x = logp.detach().clone().requires_grad_(True)
    out = fn(x, *args, **kw)
    loss = out[0] if isinstance(out, tuple) else out
    (g,) = torch.autograd.grad(loss, x)
    return loss.detach(), g, (out[1] if isinstance(out, tuple) else None)


# --------------------------------------------------------------------------------------------
# Inputs
# --------------------------------------------------------------------------------------------


def make_batch(B=16, T=12, scale=0.3, seed=0, layout="right", dtype=F64):
    """Random (logp, old_logp, adv, adv_tok, mask) with variable lengths and garbage padding.

    layout "right": real tokens first then padding (the usual case); "scattered": real tokens
    anywhere in the row. Padding holds moderate random values so a missing mask shows up.
    """
    g = torch.Generator().manual_seed(seed)
    old_logp = -3.0 * torch.rand(B, T, generator=g, dtype=F64) - 0.01  # (B, T)
    # a per-sequence offset spreads the sequence ratios as widely as the token ratios
    offset = scale * torch.randn(B, 1, generator=g, dtype=F64)
    logp = old_logp + offset + scale * torch.randn(B, T, generator=g, dtype=F64)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    lengths[0] = T  # one full row, one single-token row
    lengths[1] = 1
    if layout == "right":
        mask = (torch.arange(T)[None, :] < lengths[:, None]).to(F64)  # (B, T)
    else:
        mask = torch.zeros(B, T, dtype=F64)
        for i in range(B):
            mask[i, torch.randperm(T, generator=g)[: int(lengths[i])]] = 1.0
    pad = mask == 0
    logp = torch.where(pad, 4.0 * torch.randn(B, T, generator=g, dtype=F64), logp)
    old_logp = torch.where(pad, 4.0 * torch.randn(B, T, generator=g, dtype=F64), old_logp)
    adv = torch.randn(B, generator=g, dtype=F64)  # (B,)
    adv_tok = torch.randn(B, T, generator=g, dtype=F64)  # (B, T)
    return tuple(x.to(dtype) for x in (logp, old_logp, adv, adv_tok, mask))


def assert_metrics_match(got, want, rtol=1e-9, atol=1e-12):
    for key, value in want.items():
        assert key in got, f"metric {key!r} missing; got {sorted(got)}"
        torch.testing.assert_close(
            got[key].double(), torch.tensor(value, dtype=F64), rtol=rtol, atol=atol, msg=key
        )


# --------------------------------------------------------------------------------------------
# 0. API: registry, paper defaults, scalar loss and detached metrics
# --------------------------------------------------------------------------------------------


def test_objectives_registry_maps_names_to_functions_and_paper_settings():
    assert {k: v.fn for k, v in OBJECTIVES.items()} == {
        "gspo": gspo_loss, "gspo_token": gspo_token_loss, "grpo": grpo_loss}
    assert (OBJECTIVES["gspo"].eps_low, OBJECTIVES["gspo"].eps_high) == (3e-4, 4e-4)
    assert (OBJECTIVES["grpo"].eps_low, OBJECTIVES["grpo"].eps_high) == (0.2, 0.27)
    assert OBJECTIVES["grpo"].normaliser("token-mean") == "tokens"
    assert OBJECTIVES["gspo"].normaliser("seq-mean-token-mean") == "sequences"


def test_paper_default_eps():
    import inspect

    for fn, eps in [(gspo_loss, (3e-4, 4e-4)), (gspo_token_loss, (3e-4, 4e-4)),
                    (grpo_loss, (0.2, 0.27))]:
        params = inspect.signature(fn).parameters
        assert (params["eps_low"].default, params["eps_high"].default) == eps, fn.__name__
        assert params["denom"].default is None, fn.__name__
    assert inspect.signature(grpo_loss).parameters["aggregation"].default == "seq-mean-token-mean"
    # and the defaults are what the call uses
    logp, old_logp, adv, _, mask = make_batch(scale=2e-3, seed=3)
    for name, fn, eps in [
        ("gspo", gspo_loss, (3e-4, 4e-4)),
        ("gspo_token", gspo_token_loss, (3e-4, 4e-4)),
        ("grpo", grpo_loss, (0.2, 0.27)),
    ]:
        loss, metrics = fn(logp, old_logp, adv, mask)
        agg = "seq-mean-token-mean" if name == "grpo" else None
        want, want_m = ref_loss(name, agg, logp, old_logp, adv, mask, *eps)
        torch.testing.assert_close(loss, want, rtol=1e-9, atol=1e-12)
        assert_metrics_match(metrics, want_m)


@pytest.mark.parametrize("name,aggregation", LOSS_CASES, ids=LOSS_IDS)
def test_loss_is_scalar_and_metrics_are_detached_tensors(name, aggregation):
    logp, old_logp, adv, _, mask = make_batch(seed=1)
    logp = logp.clone().requires_grad_(True)
    loss, metrics = run_loss(name, aggregation, logp, old_logp, adv, mask, 0.2, 0.27)
    assert loss.dim() == 0 and loss.requires_grad
    for key in ("clip_frac", "clip_frac_low", "clip_frac_high", "ratio_mean", "ratio_min",
                "ratio_max", "kl_old"):
        assert isinstance(metrics[key], torch.Tensor), key
        assert not metrics[key].requires_grad, key


# --------------------------------------------------------------------------------------------
# 1. Each loss against the loop reference: value, gradient and metrics
# --------------------------------------------------------------------------------------------

# (eps_low, eps_high, per-token log-ratio noise): the paper's GSPO and GRPO settings, a middle
# one and eps = 0; the noise is sized so that both sides clip for each setting.
EPS_CASES = [(3e-4, 4e-4, 2e-3), (0.2, 0.27, 0.4), (0.05, 0.1, 0.15), (0.0, 0.0, 0.05)]


@pytest.mark.parametrize("layout", ["right", "scattered"])
@pytest.mark.parametrize("eps_low,eps_high,scale", EPS_CASES)
@pytest.mark.parametrize("name,aggregation", LOSS_CASES, ids=LOSS_IDS)
def test_loss_matches_loop_reference(name, aggregation, eps_low, eps_high, scale, layout):
    logp, old_logp, adv, _, mask = make_batch(scale=scale, seed=10, layout=layout)
    loss, grad, metrics = loss_and_grad(
        lambda x: run_loss(name, aggregation, x, old_logp, adv, mask, eps_low, eps_high), logp
    )
    want, want_grad, want_m = loss_and_grad(
        lambda x: ref_loss(name, aggregation, x, old_logp, adv, mask, eps_low, eps_high), logp
    )
    # The inputs must exercise both clip sides, or this test checks less than it claims.
    assert want_m["clip_frac_low"] > 0 and want_m["clip_frac_high"] > 0
    assert want_m["clip_frac"] < 1
    torch.testing.assert_close(loss, want, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(grad, want_grad, rtol=1e-9, atol=1e-12)
    assert_metrics_match(metrics, want_m)


@pytest.mark.parametrize("eps_low,eps_high,scale", EPS_CASES)
def test_gspo_token_with_per_token_adv_matches_loop_reference(eps_low, eps_high, scale):
    logp, old_logp, _, adv_tok, mask = make_batch(scale=scale, seed=12)
    loss, grad, metrics = loss_and_grad(
        gspo_token_loss, logp, old_logp, adv_tok, mask, eps_low=eps_low, eps_high=eps_high
    )
    want, want_grad, want_m = loss_and_grad(
        lambda x: ref_gspo_token(x, old_logp, adv_tok, mask, eps_low, eps_high), logp
    )
    assert want_m["clip_frac_low"] > 0 and want_m["clip_frac_high"] > 0
    torch.testing.assert_close(loss, want, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(grad, want_grad, rtol=1e-9, atol=1e-12)
    assert_metrics_match(metrics, want_m)


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_grpo_with_per_token_adv_matches_loop_reference(aggregation):
    logp, old_logp, _, adv_tok, mask = make_batch(scale=0.4, seed=12)
    loss, grad, metrics = loss_and_grad(
        grpo_loss, logp, old_logp, adv_tok, mask, eps_low=0.2, eps_high=0.27,
        aggregation=aggregation,
    )
    want, want_grad, want_m = loss_and_grad(
        lambda x: ref_grpo(x, old_logp, adv_tok, mask, 0.2, 0.27, aggregation), logp
    )
    assert want_m["clip_frac_low"] > 0 and want_m["clip_frac_high"] > 0
    torch.testing.assert_close(loss, want, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(grad, want_grad, rtol=1e-9, atol=1e-12)
    assert_metrics_match(metrics, want_m)


@pytest.mark.parametrize("name,aggregation", LOSS_CASES, ids=LOSS_IDS)
def test_old_logp_and_adv_receive_no_gradient(name, aggregation):
    logp, old_logp, adv, _, mask = make_batch(scale=0.3, seed=18)
    logp, old_logp, adv = (x.clone().requires_grad_(True) for x in (logp, old_logp, adv))
    loss, _ = run_loss(name, aggregation, logp, old_logp, adv, mask, 0.2, 0.27)
    loss.backward()
    assert logp.grad is not None
    assert old_logp.grad is None or (old_logp.grad == 0).all()
    assert adv.grad is None or (adv.grad == 0).all()


def test_gspo_token_gradient_is_sg_ratio_times_token_adv_over_length():
    # Paper: grad of GSPO-token = (1/B) sum_i (1/|y_i|) sum_t s_i A_i,t grad logp_t (unclipped
    # tokens). Written out per token, without any autograd through a reference.
    logp, old_logp, _, adv_tok, mask = make_batch(scale=0.1, seed=13)
    eps_low, eps_high = 0.2, 0.27
    _, grad, _ = loss_and_grad(
        gspo_token_loss, logp, old_logp, adv_tok, mask, eps_low=eps_low, eps_high=eps_high
    )
    B, T = logp.shape
    want = torch.zeros(B, T, dtype=F64)
    s = ref_sequence_log_ratio(logp, old_logp, mask).exp()
    for i in range(B):
        idx = _real(mask, i)
        for t in idx:
            a = float(adv_tok[i, t])
            clipped = (a > 0 and s[i] > 1 + eps_high) or (a < 0 and s[i] < 1 - eps_low)
            want[i, t] = 0.0 if clipped else -float(s[i]) * a / len(idx) / B
    torch.testing.assert_close(grad, want, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("layout", ["right", "scattered"])
def test_sequence_log_ratio_matches_loop_reference(layout):
    logp, old_logp, _, _, mask = make_batch(seed=14, layout=layout)
    got = sequence_log_ratio(logp, old_logp, mask)
    assert got.shape == (logp.shape[0],)
    torch.testing.assert_close(got, ref_sequence_log_ratio(logp, old_logp, mask))


def test_bool_mask_equals_float_mask():
    logp, old_logp, adv, _, mask = make_batch(scale=0.3, seed=15)
    bmask = mask.bool()
    torch.testing.assert_close(
        sequence_log_ratio(logp, old_logp, bmask), sequence_log_ratio(logp, old_logp, mask)
    )
    for name, aggregation in LOSS_CASES:
        lf, gf, mf = loss_and_grad(
            lambda x: run_loss(name, aggregation, x, old_logp, adv, mask, 0.2, 0.27), logp
        )
        lb, gb, mb = loss_and_grad(
            lambda x: run_loss(name, aggregation, x, old_logp, adv, bmask, 0.2, 0.27), logp
        )
        torch.testing.assert_close(lb, lf)
        torch.testing.assert_close(gb, gf)
        for k in mf:
            torch.testing.assert_close(mb[k], mf[k], msg=k)


def test_kl_k3_matches_loop_reference():
    logp, ref_logp, _, _, mask = make_batch(scale=0.5, seed=16)
    got, grad, _ = loss_and_grad(lambda x: kl_k3(x, ref_logp, mask).sum(), logp)
    want, want_grad, _ = loss_and_grad(lambda x: ref_kl_k3(x, ref_logp, mask).sum(), logp)
    per_seq = kl_k3(logp, ref_logp, mask)
    assert per_seq.shape == (logp.shape[0],)
    torch.testing.assert_close(per_seq, ref_kl_k3(logp, ref_logp, mask))
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(grad, want_grad)


def test_kl_k3_is_zero_on_policy_and_nonnegative():
    logp, ref_logp, _, _, mask = make_batch(scale=0.5, seed=17)
    torch.testing.assert_close(kl_k3(logp, logp, mask), torch.zeros(16, dtype=F64))
    assert (kl_k3(logp, ref_logp, mask) >= 0).all()


# --------------------------------------------------------------------------------------------
# Hand-computed GSPO example
# --------------------------------------------------------------------------------------------


def test_gspo_hand_computed_two_sequences():
    # eps_low = 3e-4, eps_high = 4e-4, so the trust region is [0.9997, 1.0004].
    # seq 1: 2 tokens, logp - old = [0.002, 0.004] -> mean 0.003, s_1 = e^0.003 = 1.0030045045
    #        A_1 = +1 and s_1 > 1.0004: clipped high, term = 1.0004 * 1 = 1.0004, no gradient.
    # seq 2: 3 tokens, logp - old = [-0.0003, 0.0001, -0.0001] -> mean -1e-4,
    #        s_2 = e^-1e-4 = 0.99990000499983, inside the region, A_2 = -1:
    #        term = -0.99990000499983.
    # J = (1.0004 - 0.99990000499983) / 2 = 0.00049999500017 / 2 = 2.49997500085e-4; loss = -J.
    # grad: seq 1 tokens 0; seq 2 token t: d(-J)/dlogp_t = -(1/2) * A_2 * s_2 * (1/3)
    #       = s_2 / 6 = 0.166650000833; padding 0.
    # clip_frac = 2 clipped tokens / 5 real = 0.4 (all high); kl_old = -(0.0057) / 5 = -0.00114.
    old_logp = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, -1.5, -0.7]], dtype=F64)
    diff = torch.tensor([[0.002, 0.004, 7.0], [-0.0003, 0.0001, -0.0001]], dtype=F64)
    logp = old_logp + diff
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]], dtype=F64)
    adv = torch.tensor([1.0, -1.0], dtype=F64)
    loss, grad, metrics = loss_and_grad(
        gspo_loss, logp, old_logp, adv, mask, eps_low=3e-4, eps_high=4e-4
    )
    torch.testing.assert_close(loss, torch.tensor(-2.49997500085e-4, dtype=F64),
                               rtol=1e-9, atol=1e-15)
    g2 = 0.99990000499983 / 6
    want_grad = torch.tensor([[0.0, 0.0, 0.0], [g2, g2, g2]], dtype=F64)
    torch.testing.assert_close(grad, want_grad, rtol=1e-9, atol=1e-15)
    torch.testing.assert_close(metrics["clip_frac"].double(), torch.tensor(0.4, dtype=F64))
    torch.testing.assert_close(metrics["clip_frac_high"].double(), torch.tensor(0.4, dtype=F64))
    torch.testing.assert_close(metrics["clip_frac_low"].double(), torch.tensor(0.0, dtype=F64))
    torch.testing.assert_close(metrics["kl_old"].double(), torch.tensor(-0.00114, dtype=F64))
    torch.testing.assert_close(metrics["ratio_max"].double(),
                               torch.tensor(1.0030045045, dtype=F64), rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(metrics["ratio_min"].double(),
                               torch.tensor(0.99990000499983, dtype=F64), rtol=1e-9, atol=1e-14)


def test_grpo_hand_computed_aggregations():
    # Two sequences, T = 3, eps 0.2 / 0.27 -> region [0.8, 1.27]; log-ratios chosen as logs of
    # round ratios. seq 1 (A = +1, 2 tokens): w = [1.5, 0.5] -> terms min(1.5, 1.27) = 1.27
    # (clipped high), min(0.5, 0.8) = 0.5. seq 2 (A = -2, 3 tokens): w = [1.0, 0.6, 1.1] ->
    # terms -2.0, max(0.6, 0.8)*-2 = -1.6 (clipped low), -2.2.
    # seq sums: 1.77 and -5.8.
    # seq-mean-token-mean: (1.77/2 + -5.8/3) / 2 = (0.885 - 1.93333333) / 2 = -0.524166667
    # token-mean: (1.77 - 5.8) / 5 = -0.806
    # seq-mean-token-sum-norm (normaliser T = 3): (1.77/3 - 5.8/3) / 2 = -4.03/6 = -0.671666667
    # clip_frac = 2/5, low 1/5, high 1/5; loss = -J.
    w = torch.tensor([[1.5, 0.5, 1.0], [1.0, 0.6, 1.1]], dtype=F64)
    old_logp = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -1.5, -0.7]], dtype=F64)
    logp = old_logp + w.log()
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]], dtype=F64)
    adv = torch.tensor([1.0, -2.0], dtype=F64)
    expected = {
        "seq-mean-token-mean": -0.524166666666667,
        "token-mean": -0.806,
        "seq-mean-token-sum-norm": -4.03 / 6,
    }
    for aggregation, j in expected.items():
        loss, metrics = grpo_loss(logp, old_logp, adv, mask, eps_low=0.2, eps_high=0.27,
                                  aggregation=aggregation)
        torch.testing.assert_close(loss, torch.tensor(-j, dtype=F64), msg=aggregation)
        torch.testing.assert_close(metrics["clip_frac"].double(), torch.tensor(0.4, dtype=F64))
        torch.testing.assert_close(metrics["clip_frac_low"].double(), torch.tensor(0.2, dtype=F64))
        torch.testing.assert_close(metrics["clip_frac_high"].double(),
                                   torch.tensor(0.2, dtype=F64))
        torch.testing.assert_close(metrics["ratio_max"].double(), torch.tensor(1.5, dtype=F64))
        torch.testing.assert_close(metrics["ratio_min"].double(), torch.tensor(0.5, dtype=F64))
        torch.testing.assert_close(metrics["ratio_mean"].double(), torch.tensor(4.7 / 5, dtype=F64))


def test_grpo_sum_norm_uses_max_len_when_given():
    # Same batch as above with the generation budget max_len = 10 as normaliser:
    # J = (1.77/10 - 5.8/10) / 2 = -0.2015, loss = 0.2015.
    w = torch.tensor([[1.5, 0.5, 1.0], [1.0, 0.6, 1.1]], dtype=F64)
    old_logp = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -1.5, -0.7]], dtype=F64)
    logp = old_logp + w.log()
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]], dtype=F64)
    adv = torch.tensor([1.0, -2.0], dtype=F64)
    loss, _ = grpo_loss(logp, old_logp, adv, mask, eps_low=0.2, eps_high=0.27,
                        aggregation="seq-mean-token-sum-norm", max_len=10)
    torch.testing.assert_close(loss, torch.tensor(0.2015, dtype=F64))


def test_grpo_sum_norm_micro_batches_of_different_widths_agree_with_max_len():
    # Micro-batches trimmed to their own width (12, 6, 8, 3 here) would each get a different
    # T as normaliser; a fixed max_len makes the sum of their gradients the full-batch one.
    logp, old_logp, adv, _, _ = make_batch(B=16, T=12, scale=0.3, seed=73)
    lengths = torch.tensor([12, 1, 5, 3, 4, 4, 2, 6, 8, 7, 1, 2, 3, 3, 3, 3])
    mask = (torch.arange(12)[None, :] < lengths[:, None]).to(F64)  # (B, T)
    widths = (12, 6, 8, 3)

    def accumulated_grad(**kw):
        x = logp.detach().clone().requires_grad_(True)
        for k, w in enumerate(widths):
            sl = slice(4 * k, 4 * k + 4)
            mb_loss, _ = grpo_loss(x[sl, :w], old_logp[sl, :w], adv[sl], mask[sl, :w],
                                   aggregation="seq-mean-token-sum-norm", denom=16, **kw)
            mb_loss.backward()
        return x.grad

    _, full_grad, _ = loss_and_grad(grpo_loss, logp, old_logp, adv, mask,
                                    aggregation="seq-mean-token-sum-norm", max_len=12)
    torch.testing.assert_close(accumulated_grad(max_len=12), full_grad, rtol=0, atol=1e-12)
    assert not torch.allclose(accumulated_grad(), full_grad)  # width as normaliser: differs


def test_grpo_rejects_unknown_aggregation():
    logp, old_logp, adv, _, mask = make_batch(B=2, T=3)
    with pytest.raises(ValueError, match="aggregation"):
        grpo_loss(logp, old_logp, adv, mask, aggregation="mean-of-everything")


# --------------------------------------------------------------------------------------------
# 2. Autograd against central finite differences (float64)
# --------------------------------------------------------------------------------------------


def finite_difference_grad(f, x, h=1e-6):
    """Central differences of the scalar f at x over every entry."""
    g = torch.zeros_like(x)
    for idx in range(x.numel()):
        xp, xm = x.clone(), x.clone()
        xp.view(-1)[idx] += h
        xm.view(-1)[idx] -= h
        g.view(-1)[idx] = (f(xp) - f(xm)) / (2 * h)
    return g


def _min_distance_to_clip_boundary(name, logp, old_logp, mask, eps_low, eps_high):
    if name == "grpo":
        r = (logp - old_logp)[mask.bool()].exp()
    else:
        r = ref_sequence_log_ratio(logp, old_logp, mask).exp()
    return torch.minimum((r - (1 - eps_low)).abs(), (r - (1 + eps_high)).abs()).min().item()


@pytest.mark.parametrize("eps_low,eps_high,scale", [(0.2, 0.27, 0.4), (3e-4, 4e-4, 2e-3)])
@pytest.mark.parametrize("name,aggregation", LOSS_CASES, ids=LOSS_IDS)
def test_autograd_matches_finite_differences(name, aggregation, eps_low, eps_high, scale):
    logp, old_logp, adv, _, mask = make_batch(B=6, T=5, scale=scale, seed=21)
    h = 1e-7
    # The loss is piecewise smooth; stay many steps h away from its kinks.
    assert _min_distance_to_clip_boundary(name, logp, old_logp, mask, eps_low, eps_high) > 1e2 * h

    def f(x):
        return run_loss(name, aggregation, x, old_logp, adv, mask, eps_low, eps_high)[0]

    _, grad, _ = loss_and_grad(f, logp)
    fd = finite_difference_grad(lambda x: f(x).item(), logp, h=h)
    assert grad.abs().max() > 0  # some terms are unclipped
    torch.testing.assert_close(grad, fd, rtol=1e-5, atol=1e-8)


def test_gspo_token_autograd_matches_finite_differences_for_row_constant_adv():
    # With per-token advantages GSPO-token's gradient is by design not the derivative of its
    # value (stop-gradients); with A_i,t = A_i it is.
    logp, old_logp, adv, _, mask = make_batch(B=6, T=5, scale=0.4, seed=22)
    adv_tok = adv[:, None].expand(-1, 5)
    assert _min_distance_to_clip_boundary("gspo", logp, old_logp, mask, 0.2, 0.27) > 1e-5

    def f(x):
        return gspo_token_loss(x, old_logp, adv_tok, mask, eps_low=0.2, eps_high=0.27)[0]

    _, grad, _ = loss_and_grad(f, logp)
    fd = finite_difference_grad(lambda x: f(x).item(), logp, h=1e-7)
    torch.testing.assert_close(grad, fd, rtol=1e-5, atol=1e-8)


def test_kl_k3_autograd_matches_finite_differences():
    logp, ref_logp, _, _, mask = make_batch(B=4, T=5, scale=0.5, seed=23)
    f = lambda x: kl_k3(x, ref_logp, mask).sum()  # noqa: E731
    _, grad, _ = loss_and_grad(f, logp)
    fd = finite_difference_grad(lambda x: f(x).item(), logp, h=1e-6)
    torch.testing.assert_close(grad, fd, rtol=1e-5, atol=1e-8)


# --------------------------------------------------------------------------------------------
# 3. GSPO-token == GSPO when advantages are constant within each sequence
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("eps_low,eps_high,scale", EPS_CASES)
def test_gspo_token_equals_gspo_for_sequence_constant_adv(eps_low, eps_high, scale):
    logp, old_logp, adv, _, mask = make_batch(scale=scale, seed=31)
    T = logp.shape[1]
    l_seq, g_seq, m_seq = loss_and_grad(
        gspo_loss, logp, old_logp, adv, mask, eps_low=eps_low, eps_high=eps_high
    )
    for adv_in in (adv[:, None].expand(-1, T), adv[:, None].repeat(1, T), adv):
        l_tok, g_tok, m_tok = loss_and_grad(
            gspo_token_loss, logp, old_logp, adv_in, mask, eps_low=eps_low, eps_high=eps_high
        )
        torch.testing.assert_close(l_tok, l_seq, rtol=1e-10, atol=1e-13)
        torch.testing.assert_close(g_tok, g_seq, rtol=1e-10, atol=1e-13)
        for key in ("clip_frac", "clip_frac_low", "clip_frac_high", "kl_old"):
            torch.testing.assert_close(m_tok[key], m_seq[key], msg=key)


# --------------------------------------------------------------------------------------------
# 4. GSPO == GRPO for one-token responses
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("T", [1, 4])
@pytest.mark.parametrize("eps_low,eps_high", [(0.2, 0.27), (3e-4, 4e-4)])
def test_gspo_equals_grpo_for_one_token_responses(T, eps_low, eps_high):
    # T = 1: the whole response is one token. T = 4: one real token per row somewhere, garbage
    # around it; s_i = w_i,t then, so the two objectives coincide term by term.
    B = 12
    g = torch.Generator().manual_seed(41)
    old_logp = -2.0 * torch.rand(B, T, generator=g, dtype=F64)
    scale = 0.4 if eps_low > 0.01 else 1e-3
    logp = old_logp + scale * torch.randn(B, T, generator=g, dtype=F64)
    mask = torch.zeros(B, T, dtype=F64)
    mask[torch.arange(B), torch.randint(0, T, (B,), generator=g)] = 1.0
    logp = torch.where(mask.bool(), logp, 9.0 * torch.randn(B, T, generator=g, dtype=F64))
    adv = torch.randn(B, generator=g, dtype=F64)
    kw = dict(eps_low=eps_low, eps_high=eps_high)
    l_gspo, g_gspo, m_gspo = loss_and_grad(gspo_loss, logp, old_logp, adv, mask, **kw)
    l_grpo, g_grpo, m_grpo = loss_and_grad(
        grpo_loss, logp, old_logp, adv, mask, aggregation="seq-mean-token-mean", **kw
    )
    assert m_grpo["clip_frac"] > 0
    torch.testing.assert_close(l_gspo, l_grpo, rtol=1e-10, atol=1e-13)
    torch.testing.assert_close(g_gspo, g_grpo, rtol=1e-10, atol=1e-13)
    for key in ("clip_frac", "clip_frac_low", "clip_frac_high", "ratio_mean", "ratio_min",
                "ratio_max", "kl_old"):
        torch.testing.assert_close(m_gspo[key], m_grpo[key], msg=key)


# --------------------------------------------------------------------------------------------
# 5. Padding changes nothing
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("garbage", [30.0, 1e4], ids=["moderate", "huge"])
@pytest.mark.parametrize("name,aggregation", LOSS_CASES, ids=LOSS_IDS)
def test_padding_changes_nothing(name, aggregation, garbage):
    # Appending masked columns full of garbage (up to 1e4: exp overflows there unless the
    # code masks before exp) changes neither loss, gradient on real tokens, nor metrics; the
    # gradient on the padding is exactly zero. (sum-norm divides by the mask's width T by
    # default, so there the loss scales by T / (T + extra), checked against the reference.)
    logp, old_logp, adv, _, mask = make_batch(scale=0.3, seed=51)
    B, T = logp.shape
    extra = 5
    g = torch.Generator().manual_seed(52)
    junk = lambda: garbage * torch.randn(B, extra, generator=g, dtype=F64)  # noqa: E731
    logp_p = torch.cat([logp, junk()], dim=1)
    old_p = torch.cat([old_logp, junk()], dim=1)
    mask_p = torch.cat([mask, torch.zeros(B, extra, dtype=F64)], dim=1)
    eps = (0.2, 0.27)
    l0, g0, m0 = loss_and_grad(
        lambda x: run_loss(name, aggregation, x, old_logp, adv, mask, *eps), logp)
    l1, g1, m1 = loss_and_grad(
        lambda x: run_loss(name, aggregation, x, old_p, adv, mask_p, *eps), logp_p)
    assert torch.isfinite(l1) and torch.isfinite(g1).all()
    assert (g1[:, T:] == 0).all()
    if aggregation == "seq-mean-token-sum-norm":
        want, want_g, _ = loss_and_grad(
            lambda x: ref_grpo(x, old_p, adv, mask_p, *eps, aggregation), logp_p)
        torch.testing.assert_close(l1, want)
        torch.testing.assert_close(g1, want_g)
        torch.testing.assert_close(l1 * (T + extra), l0 * T)
    else:
        torch.testing.assert_close(l1, l0, rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(g1[:, :T], g0, rtol=1e-12, atol=1e-14)
    for key in m0:
        torch.testing.assert_close(m1[key], m0[key], msg=key)


def test_padding_changes_nothing_grpo_sum_norm_with_max_len():
    logp, old_logp, adv, _, mask = make_batch(scale=0.3, seed=55)
    B, T = logp.shape
    g = torch.Generator().manual_seed(56)
    logp_p = torch.cat([logp, 1e4 * torch.randn(B, 4, generator=g, dtype=F64)], 1)
    old_p = torch.cat([old_logp, -1e4 * torch.rand(B, 4, generator=g, dtype=F64)], 1)
    mask_p = torch.cat([mask, torch.zeros(B, 4, dtype=F64)], dim=1)
    kw = dict(aggregation="seq-mean-token-sum-norm", max_len=32)
    l0, g0, m0 = loss_and_grad(grpo_loss, logp, old_logp, adv, mask, **kw)
    l1, g1, m1 = loss_and_grad(grpo_loss, logp_p, old_p, adv, mask_p, **kw)
    torch.testing.assert_close(l1, l0)
    torch.testing.assert_close(g1[:, :T], g0)
    assert (g1[:, T:] == 0).all()
    for key in m0:
        torch.testing.assert_close(m1[key], m0[key], msg=key)


@pytest.mark.parametrize("garbage", [30.0, 1e4], ids=["moderate", "huge"])
def test_padding_changes_nothing_gspo_token_per_token_adv_and_helpers(garbage):
    logp, old_logp, _, adv_tok, mask = make_batch(scale=0.3, seed=53)
    B, T = logp.shape
    g = torch.Generator().manual_seed(54)
    junk = lambda: garbage * torch.randn(B, 3, generator=g, dtype=F64)  # noqa: E731
    logp_p, old_p, adv_p = (torch.cat([x, junk()], 1) for x in (logp, old_logp, adv_tok))
    mask_p = torch.cat([mask, torch.zeros(B, 3, dtype=F64)], dim=1)
    l0, g0, m0 = loss_and_grad(gspo_token_loss, logp, old_logp, adv_tok, mask)
    l1, g1, m1 = loss_and_grad(gspo_token_loss, logp_p, old_p, adv_p, mask_p)
    torch.testing.assert_close(l1, l0)
    torch.testing.assert_close(g1[:, :T], g0)
    assert (g1[:, T:] == 0).all()
    for key in m0:
        torch.testing.assert_close(m1[key], m0[key], msg=key)
    torch.testing.assert_close(
        sequence_log_ratio(logp_p, old_p, mask_p), sequence_log_ratio(logp, old_logp, mask)
    )
    torch.testing.assert_close(kl_k3(logp_p, old_p, mask_p),
                               kl_k3(logp, old_logp, mask))


@pytest.mark.parametrize("name,aggregation", LOSS_CASES, ids=LOSS_IDS)
def test_minus_inf_padding_gives_finite_loss_and_zero_gradient(name, aggregation):
    # A log-prob of -inf (probability 0, e.g. a masked-out vocabulary entry) may sit at a
    # padded position. It must not reach the loss, and its gradient must be 0, not NaN: a NaN
    # there would flow back into the model's parameters.
    logp, old_logp, adv, _, mask = make_batch(scale=0.3, seed=57)
    pad = mask == 0
    logp_inf = logp.masked_fill(pad, float("-inf"))
    old_inf = old_logp.masked_fill(pad, float("-inf"))
    l0, g0, m0 = loss_and_grad(
        lambda x: run_loss(name, aggregation, x, old_logp, adv, mask, 0.2, 0.27), logp)
    l1, g1, m1 = loss_and_grad(
        lambda x: run_loss(name, aggregation, x, old_inf, adv, mask, 0.2, 0.27), logp_inf)
    torch.testing.assert_close(l1, l0)
    assert not torch.isnan(g1).any(), f"NaN gradient at {torch.isnan(g1).nonzero().tolist()}"
    torch.testing.assert_close(g1, g0.masked_fill(pad, 0.0))
    for key in m0:
        torch.testing.assert_close(m1[key], m0[key], msg=key)


# --------------------------------------------------------------------------------------------
# 6. At theta = theta_old the gradient is the plain policy gradient
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name,aggregation",
                         [("gspo", None), ("gspo_token", None), ("grpo", "seq-mean-token-mean")])
def test_on_policy_gradient_is_plain_policy_gradient(name, aggregation):
    # s_i = 1, nothing clips: grad J = (1/B) sum_i A_i (1/|y_i|) sum_t grad logp_i,t, and the
    # loss is -J, so d loss / d logp_i,t = -A_i / (B |y_i|) on real tokens and 0 on padding.
    _, old_logp, adv, _, mask = make_batch(scale=0.0, seed=61)
    B = old_logp.shape[0]
    logp = old_logp.clone()
    loss, grad, metrics = loss_and_grad(
        lambda x: run_loss(name, aggregation, x, old_logp, adv, mask, 3e-4, 4e-4), logp
    )
    want = torch.zeros_like(grad)
    for i in range(B):
        idx = _real(mask, i)
        for t in idx:
            want[i, t] = -float(adv[i]) / (B * len(idx))
    torch.testing.assert_close(grad, want, rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(loss, -adv.sum() / B)
    assert metrics["clip_frac"] == 0
    torch.testing.assert_close(metrics["ratio_mean"].double(), torch.tensor(1.0, dtype=F64))
    torch.testing.assert_close(metrics["kl_old"].double(), torch.tensor(0.0, dtype=F64))


# --------------------------------------------------------------------------------------------
# 7. Micro-batches with a global denominator == one full batch
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [F64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("name,aggregation", LOSS_CASES + [("gspo_token_per_token_adv", None)],
                         ids=LOSS_IDS + ["gspo_token-per-token-adv"])
def test_micro_batches_with_global_denom_sum_to_full_batch(name, aggregation, dtype):
    logp, old_logp, adv, adv_tok, mask = make_batch(B=16, scale=0.3, seed=71, dtype=dtype)
    if name == "gspo_token_per_token_adv":
        name, adv = "gspo_token", adv_tok
    eps = (0.2, 0.27)
    denom = int(mask.sum()) if aggregation == "token-mean" else 16
    full_loss, full_grad, _ = loss_and_grad(
        lambda x: run_loss(name, aggregation, x, old_logp, adv, mask, *eps), logp)
    x = logp.detach().clone().requires_grad_(True)
    total = 0.0
    for sl in (slice(0, 4), slice(4, 8), slice(8, 12), slice(12, 16)):
        mb_loss, _ = run_loss(name, aggregation, x[sl], old_logp[sl], adv[sl], mask[sl], *eps,
                              denom=denom)
        mb_loss.backward()  # accumulates into x.grad like gradient accumulation does
        total += mb_loss.item()
    tol = dict(rtol=0, atol=1e-12) if dtype == F64 else dict(rtol=0, atol=1e-6)
    torch.testing.assert_close(x.grad, full_grad, **tol)
    assert abs(total - full_loss.item()) < tol["atol"] * 10


def test_denom_scales_loss_and_gradient():
    logp, old_logp, adv, _, mask = make_batch(scale=0.3, seed=72)
    for name, aggregation in LOSS_CASES:
        l0, g0, _ = loss_and_grad(
            lambda x: run_loss(name, aggregation, x, old_logp, adv, mask, 0.2, 0.27), logp)
        default = int(mask.sum()) if aggregation == "token-mean" else 16
        l1, g1, _ = loss_and_grad(
            lambda x: run_loss(name, aggregation, x, old_logp, adv, mask, 0.2, 0.27,
                               denom=3 * default), logp)
        torch.testing.assert_close(l1 * 3, l0, msg=name)
        torch.testing.assert_close(g1 * 3, g0, msg=name)


# --------------------------------------------------------------------------------------------
# 8. Clipping is one-sided, as in PPO
# --------------------------------------------------------------------------------------------

# (ratio above 1+eps_high or below 1-eps_low, advantage, expected clipped side or None);
# eps 0.2 / 0.27 with ratios 1.5 / 0.5 for grpo, 3e-4 / 4e-4 with 1.01 / 0.99 for the GSPO pair.
ONE_SIDED = [
    ("above", +1.0, "high"),
    ("above", -1.0, None),
    ("below", -1.0, "low"),
    ("below", +1.0, None),
]


@pytest.mark.parametrize("where,a,side", ONE_SIDED)
@pytest.mark.parametrize("name", ["gspo", "gspo_token", "grpo"])
def test_clipping_is_one_sided(name, where, a, side):
    eps = (0.2, 0.27) if name == "grpo" else (3e-4, 4e-4)
    if name == "grpo":
        ratio = 1.5 if where == "above" else 0.5
    else:
        ratio = 1.01 if where == "above" else 0.99
    T = 3
    old_logp = torch.tensor([[-1.0, -0.3, -2.0]], dtype=F64)
    logp = old_logp + math.log(ratio)
    mask = torch.ones(1, T, dtype=F64)
    adv = torch.tensor([a], dtype=F64)
    loss, grad, metrics = loss_and_grad(
        lambda x: run_loss(name, None, x, old_logp, adv, mask, *eps), logp)
    if side is None:
        # unclipped: loss = -ratio * A, d loss / d logp_t = -A * ratio / T for every objective
        torch.testing.assert_close(loss, torch.tensor(-ratio * a, dtype=F64))
        torch.testing.assert_close(grad, torch.full((1, T), -a * ratio / T, dtype=F64))
        assert metrics["clip_frac"] == 0
    else:
        bound = 1 + eps[1] if side == "high" else 1 - eps[0]
        torch.testing.assert_close(loss, torch.tensor(-bound * a, dtype=F64))
        assert (grad == 0).all()
        assert metrics["clip_frac"] == 1 and metrics[f"clip_frac_{side}"] == 1
        other = "low" if side == "high" else "high"
        assert metrics[f"clip_frac_{other}"] == 0


def test_grpo_eps_low_and_eps_high_are_not_swapped():
    # Token ratios 0.75 and 1.25 with eps_low 0.2 / eps_high 0.27: region [0.8, 1.27].
    # 0.75 < 0.8 clips for A<0; 1.25 < 1.27 does not clip for A>0. Swapped eps would give
    # region [0.73, 1.2] and the opposite verdicts.
    old_logp = torch.tensor([[-1.0], [-1.0]], dtype=F64)
    logp = old_logp + torch.tensor([[math.log(0.75)], [math.log(1.25)]], dtype=F64)
    mask = torch.ones(2, 1, dtype=F64)
    adv = torch.tensor([-1.0, 1.0], dtype=F64)
    loss, grad, m = loss_and_grad(grpo_loss, logp, old_logp, adv, mask,
                                  eps_low=0.2, eps_high=0.27)
    # J = (0.8 * -1 + 1.25 * 1) / 2 = 0.225
    torch.testing.assert_close(loss, torch.tensor(-0.225, dtype=F64))
    assert grad[0, 0] == 0 and grad[1, 0] != 0
    torch.testing.assert_close(m["clip_frac_low"].double(), torch.tensor(0.5, dtype=F64))
    assert m["clip_frac_high"] == 0


@pytest.mark.parametrize("ratio", [1.5, 0.5])
@pytest.mark.parametrize("name,aggregation", LOSS_CASES, ids=LOSS_IDS)
def test_ratio_metrics_ignore_padding(name, aggregation, ratio):
    # Every real token has ratio 1.5 (or 0.5), so every ratio metric is exactly that, however
    # the padding (garbage, or a neutral ratio of 1) is treated.
    old_logp = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -0.2, -0.1]], dtype=F64)
    logp = old_logp + math.log(ratio)
    logp[0, 2] = 5.0
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=F64)
    adv = torch.tensor([1.0, -1.0], dtype=F64)
    _, m = run_loss(name, aggregation, logp, old_logp, adv, mask, 0.2, 0.27)
    for key in ("ratio_mean", "ratio_min", "ratio_max"):
        torch.testing.assert_close(m[key].double(), torch.tensor(ratio, dtype=F64), msg=key)
    torch.testing.assert_close(m["kl_old"].double(), torch.tensor(-math.log(ratio), dtype=F64))


def test_zero_advantage_is_never_clipped():
    logp, old_logp, _, _, mask = make_batch(scale=0.5, seed=81)
    adv = torch.zeros(16, dtype=F64)
    for name, aggregation in LOSS_CASES:
        loss, grad, m = loss_and_grad(
            lambda x: run_loss(name, aggregation, x, old_logp, adv, mask, 0.2, 0.27), logp)
        assert loss == 0 and (grad == 0).all() and m["clip_frac"] == 0, name


# --------------------------------------------------------------------------------------------
# 9. Extreme log-ratios stay finite
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [F64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("name,aggregation", LOSS_CASES, ids=LOSS_IDS)
def test_extreme_log_ratios_stay_finite(name, aggregation, dtype):
    # Four sequences: log-ratio +50 or -50 on every token, each with A > 0 and A < 0.
    T = 4
    old_logp = torch.full((4, T), -60.0, dtype=dtype)
    shift = torch.tensor([50.0, 50.0, -50.0, -50.0], dtype=dtype)[:, None]
    logp = old_logp + shift
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0], [1, 1, 1, 0]], dtype=dtype)
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0], dtype=dtype)
    eps = (0.2, 0.27) if name == "grpo" else (3e-4, 4e-4)
    for a in (adv, -adv):
        loss, grad, m = loss_and_grad(
            lambda x: run_loss(name, aggregation, x, old_logp, a, mask, *eps), logp)
        assert torch.isfinite(loss), loss
        assert torch.isfinite(grad).all(), grad
        for key, value in m.items():
            assert torch.isfinite(value).all(), key


def test_kl_k3_extreme_log_ratios_stay_finite():
    logp = torch.full((2, 3), -5.0, dtype=torch.float32).requires_grad_(True)
    ref_logp = logp.detach() + torch.tensor([[50.0], [-50.0]])
    out = kl_k3(logp, ref_logp, torch.ones(2, 3))
    out.sum().backward()
    assert torch.isfinite(out).all() and torch.isfinite(logp.grad).all()


# --------------------------------------------------------------------------------------------
# 10. group_advantages
# --------------------------------------------------------------------------------------------


def test_group_advantages_group_scale_hand_computed():
    # group 1: r = [1, 0, 0, 1], mean 0.5, unbiased std sqrt((4 * 0.25) / 3) = sqrt(1/3)
    #          = 0.577350269, A = +-0.5 / 0.577350269 = +-0.866025404
    # group 2: r = [2, 2, 2, 2], std 0 -> A = 0 (not NaN)
    # group 3: r = [3, 1, 2, 2], mean 2, unbiased std sqrt((1 + 1 + 0 + 0) / 3) = 0.816496581,
    #          A = [1.224744871, -1.224744871, 0, 0]
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0, 3.0, 1.0, 2.0, 2.0])
    a = 0.866025403784
    b = 1.224744871392
    want = torch.tensor([a, -a, -a, a, 0, 0, 0, 0, b, -b, 0, 0])
    got = group_advantages(rewards, 4, scale="group")
    assert got.shape == (12,)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(group_advantages(rewards, 4), got)  # "group" is the default


def test_group_advantages_batch_scale_hand_computed():
    # Subtract the group mean, divide by the std of all 12 rewards (unbiased).
    # rewards mean 18/12 = 1.5; squared deviations: group 1: 0.25, 2.25, 2.25, 0.25 (5.0);
    # group 2: 4 * 0.25 (1.0); group 3: 2.25, 0.25, 0.25, 0.25 (3.0); sum 9.0;
    # std = sqrt(9 / 11) = 0.904534034.
    # A = (r - group mean) / 0.904534034: group 1 +-0.5 -> +-0.552770798;
    # group 2 0; group 3 [1, -1, 0, 0] -> [1.105541597, -1.105541597, 0, 0].
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0, 3.0, 1.0, 2.0, 2.0])
    a = 0.5 / math.sqrt(9 / 11)
    b = 1.0 / math.sqrt(9 / 11)
    want = torch.tensor([a, -a, -a, a, 0, 0, 0, 0, b, -b, 0, 0])
    torch.testing.assert_close(group_advantages(rewards, 4, scale="batch"), want,
                               rtol=1e-6, atol=1e-6)


def test_group_advantages_batch_scale_over_ranks_equals_one_process():
    """advantage_scale=batch with the batch split over 2 ranks: each rank's std over its own
    share would give rank 0 +-0.866 and rank 1 +-1.0 here, one process +-0.966; with the
    whole batch's std (whole_batch_std, the sum of each rank's zero-padded share) each rank
    gets one process's advantages, bit for bit."""
    @dataclass(frozen=True)
    class WithOtherRank(Dist):  # the sum over ranks: this rank's values plus the other's
        other: tuple = ()

        def sum(self, values):
            return [a + b for a, b in zip(values, self.other)]

    r = torch.tensor([1.0, 0.0, 1.0, 0.0, 1.0, 1.0, 1.0, 0.0])
    shares = [r[:4], r[4:]]
    padded = [s.tolist() + [0.0] * 4 for s in shares[:1]] + [[0.0] * 4 + shares[1].tolist()]
    whole = group_advantages(r, 2, "batch")
    for rank in (0, 1):
        d = WithOtherRank(rank=rank, world=2, other=tuple(padded[1 - rank]))
        std = whole_batch_std(shares[rank], d)
        assert torch.equal(std, r.std())
        got = group_advantages(shares[rank], 2, "batch", std)
        assert torch.equal(got, whole[4 * rank:4 * rank + 4])
        assert not torch.allclose(group_advantages(shares[rank], 2, "batch"), got)
    assert whole_batch_std(r, Dist()) is None  # one process: its own std


def test_group_advantages_none_scale_is_dr_grpo():
    # Only the group mean is subtracted: group 1 [0.5, -0.5, -0.5, 0.5], group 2 0,
    # group 3 [1, -1, 0, 0].
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0, 3.0, 1.0, 2.0, 2.0])
    want = torch.tensor([0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0, 1, -1, 0, 0])
    torch.testing.assert_close(group_advantages(rewards, 4, scale="none"), want)


def test_group_advantages_match_loop_reference():
    g = torch.Generator().manual_seed(101)
    P, G = 5, 8
    rewards = torch.randint(0, 3, (P * G,), generator=g).to(F64)
    rewards[:G] = 1.0  # one constant group
    r = rewards.tolist()
    mu_all = sum(r) / len(r)
    std_all = math.sqrt(sum((x - mu_all) ** 2 for x in r) / (len(r) - 1))
    want = {"group": [], "batch": [], "none": []}
    for p in range(P):
        grp = r[p * G:(p + 1) * G]
        mu = sum(grp) / G
        std = math.sqrt(sum((x - mu) ** 2 for x in grp) / (G - 1))
        for x in grp:
            want["none"].append(x - mu)
            want["group"].append(0.0 if std == 0 else (x - mu) / std)
            want["batch"].append((x - mu) / std_all)
    for scale, values in want.items():
        torch.testing.assert_close(group_advantages(rewards, G, scale=scale),
                                   torch.tensor(values, dtype=F64), rtol=1e-6, atol=1e-6,
                                   msg=scale)


def test_group_advantages_all_equal_rewards_give_zero_not_nan():
    rewards = torch.full((8,), 0.7)
    for scale in ("group", "batch", "none"):
        got = group_advantages(rewards, 4, scale=scale)
        assert not torch.isnan(got).any(), scale
        torch.testing.assert_close(got, torch.zeros(8), msg=scale)


def test_group_advantages_tiny_std_counts_as_zero():
    # Documented floor: a std below 1e-6 (equal rewards up to rounding) gives 0, not +-0.7.
    rewards = torch.tensor([1.0, 1.0 + 1e-7, 0.0, 1.0], dtype=F64)
    got = group_advantages(rewards, 2)
    torch.testing.assert_close(got, torch.tensor([0.0, 0.0, -0.70710678118, 0.70710678118],
                                                 dtype=F64))


def test_group_advantages_integer_rewards_give_float():
    # r = [1, 0] -> mean 0.5, unbiased std sqrt(0.5) -> A = +-0.5 / 0.70710678 = +-0.70710678
    got = group_advantages(torch.tensor([1, 0, 0, 0]), 2)
    assert got.dtype.is_floating_point
    torch.testing.assert_close(got, torch.tensor([0.70710678, -0.70710678, 0.0, 0.0]))


def test_group_advantages_group_of_one_is_zero_or_rejected():
    # The unbiased std of one sample is undefined; the result must not be NaN.
    rewards = torch.tensor([1.0, 0.0, 3.0])
    try:
        got = group_advantages(rewards, 1)
    except ValueError:
        return
    torch.testing.assert_close(got, torch.zeros(3))


@pytest.mark.parametrize(
    "rewards,group_size,kwargs,word",
    [
        (torch.ones(10), 4, {}, "divisible"),
        (torch.tensor([1.0, float("nan"), 0.0, 1.0]), 2, {}, "nan"),
        (torch.ones(8), 4, {"scale": "median"}, "scale"),
        (torch.ones(8), 0, {}, "group_size"),
        (torch.ones(2, 4), 4, {}, "shape"),
    ],
    ids=["not-divisible", "nan", "unknown-scale", "zero-group-size", "2d-rewards"],
)
def test_group_advantages_bad_input_raises(rewards, group_size, kwargs, word):
    with pytest.raises(ValueError, match=f"(?i){word}"):
        group_advantages(rewards, group_size, **kwargs)


# --------------------------------------------------------------------------------------------
# 11. Bad input raises ValueError naming the problem
# --------------------------------------------------------------------------------------------


def _bad_cases():
    logp, old_logp, adv, _, mask = make_batch(B=4, T=5, seed=111)
    empty = mask.clone()
    empty[2] = 0
    nan_logp, nan_old, nan_adv = logp.clone(), old_logp.clone(), adv.clone()
    nan_logp[0, 0] = float("nan")
    nan_old[0, 0] = float("nan")
    nan_adv[1] = float("nan")
    ok = dict(logp=logp, old_logp=old_logp, adv=adv, mask=mask)
    return [
        ("logp-1d", {**ok, "logp": logp[0], "old_logp": old_logp[0], "mask": mask[0]}, {},
         "shape"),
        ("old_logp-shape", {**ok, "old_logp": old_logp[:, :4]}, {}, "old_logp.*shape"),
        ("mask-shape", {**ok, "mask": mask[:3]}, {}, "mask.*shape"),
        ("adv-shape", {**ok, "adv": adv[:3]}, {}, "adv.*shape"),
        ("adv-3d", {**ok, "adv": adv[:, None, None].expand(4, 5, 2)}, {}, "adv.*shape"),
        ("empty-row", {**ok, "mask": empty}, {}, "(no .*tokens|empty)"),
        ("eps_low<0", ok, {"eps_low": -0.1}, "eps"),
        ("eps_high<0", ok, {"eps_high": -1e-4}, "eps"),
        ("nan-logp", {**ok, "logp": nan_logp}, {}, "logp.*nan"),
        ("nan-old_logp", {**ok, "old_logp": nan_old}, {}, "old_logp.*nan"),
        ("nan-adv", {**ok, "adv": nan_adv}, {}, "adv.*nan"),
    ]


BAD_CASES = _bad_cases()


@pytest.mark.parametrize("case,inputs,kwargs,word", BAD_CASES, ids=[c[0] for c in BAD_CASES])
@pytest.mark.parametrize("name", ["gspo", "gspo_token", "grpo"])
def test_loss_bad_input_raises(name, case, inputs, kwargs, word):
    with pytest.raises(ValueError, match=f"(?i){word}"):
        OBJECTIVES[name](inputs["logp"], inputs["old_logp"], inputs["adv"], inputs["mask"],
                         **kwargs)


def test_gspo_token_bad_token_adv_shape_raises():
    logp, old_logp, _, adv_tok, mask = make_batch(B=4, T=5, seed=112)
    with pytest.raises(ValueError, match="(?i)shape"):
        gspo_token_loss(logp, old_logp, adv_tok[:, :4], mask)


@pytest.mark.parametrize("which", ["sequence_log_ratio", "kl_k3"])
def test_helpers_bad_input_raises(which):
    fn = {"sequence_log_ratio": sequence_log_ratio, "kl_k3": kl_k3}[which]
    logp, old_logp, _, _, mask = make_batch(B=4, T=5, seed=113)
    empty = mask.clone()
    empty[0] = 0
    nan_logp = logp.clone()
    nan_logp[1, 0] = float("nan")
    with pytest.raises(ValueError, match="(?i)shape"):
        fn(logp, old_logp[:, :3], mask)
    with pytest.raises(ValueError, match="(?i)shape"):
        fn(logp, old_logp, mask[:2])
    with pytest.raises(ValueError, match="(?i)(no .*tokens|empty)"):
        fn(logp, old_logp, empty)
    with pytest.raises(ValueError, match="(?i)nan"):
        fn(nan_logp, old_logp, mask)


def test_gspo_rejects_per_token_adv():
    # GSPO has one advantage per sequence; a (B, T) adv belongs to gspo_token_loss.
    logp, old_logp, _, adv_tok, mask = make_batch(B=4, T=5, seed=114)
    with pytest.raises(ValueError, match="(?i)shape"):
        gspo_loss(logp, old_logp, adv_tok, mask)
