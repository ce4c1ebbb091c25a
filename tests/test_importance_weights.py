"""The off-policy correction (algorithm.is_correction): its weights on hand-computed cases, the
objectives weighted by them against a float64 reference written out term by term, the metrics
it reports, and a run with it, with pi_old recomputed or taken from the engine."""

import math

import pytest
import torch

from gspo.config import load_config
from gspo.errors import ConfigError
from gspo.logger import read_metrics
from gspo.objectives import OBJECTIVES, importance_weights, importance_weight_metrics
from gspo.trainer import train

# trainer / engine log-prob differences per token: 0.5, -1, 2 and one padded position
LOGP = torch.tensor([[-1.0, -2.0, 0.0, 9.0], [-1.0, -1.0, -1.0, -1.0]], dtype=torch.float64)
ENGINE = torch.tensor([[-1.5, -1.0, -2.0, -9.0], [-1.1, -0.9, -1.0, -1.0]], dtype=torch.float64)
MASK = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
E = math.exp


def test_truncated_token_weights():
    w = importance_weights(LOGP, ENGINE, MASK, "truncate", "token", cap=2.0, floor=0.5)
    # row 0: e^0.5 = 1.65, e^-1 = 0.37 -> raised to the floor 0.5, e^2 -> capped at 2, padding 1
    # row 1: e^0.1, e^-0.1, 1, 1
    torch.testing.assert_close(w, torch.tensor([[E(0.5), 0.5, 2.0, 1.0],
                                                [E(0.1), E(-0.1), 1.0, 1.0]],
                                               dtype=torch.float64))


def test_masked_token_weights_drop_what_lies_outside_the_bounds():
    w = importance_weights(LOGP, ENGINE, MASK, "mask", "token", cap=2.0, floor=0.5)
    torch.testing.assert_close(w, torch.tensor([[E(0.5), 0.0, 0.0, 1.0],
                                                [E(0.1), E(-0.1), 1.0, 1.0]],
                                               dtype=torch.float64))


def test_sequence_and_geometric_weights():
    # row 0: sum of log-ratios 1.5 over 3 tokens; row 1: 0.0 over 4
    seq = importance_weights(LOGP, ENGINE, MASK, "truncate", "sequence", cap=10.0)
    torch.testing.assert_close(seq, torch.tensor([E(1.5), 1.0], dtype=torch.float64))
    assert float(importance_weights(LOGP, ENGINE, MASK, "truncate", "sequence", cap=2.0)[0]) \
        == pytest.approx(2.0)
    geo = importance_weights(LOGP, ENGINE, MASK, "mask", "geometric", cap=1.7)  # e^0.5 = 1.65
    torch.testing.assert_close(geo, torch.tensor([E(0.5), 1.0], dtype=torch.float64))
    masked = importance_weights(LOGP, ENGINE, MASK, "mask", "sequence", cap=2.0)
    torch.testing.assert_close(masked, torch.tensor([0.0, 1.0], dtype=torch.float64))


def test_relative_weights_are_what_the_correction_leaves_of_the_ratio():
    # for an objective whose ratio is already w (pi_old = the engine's): truncate gives
    # bounded(w) / w, mask 1 or 0. Row 0: e^0.5 kept (1), e^-1 raised to 0.5 (0.5 / e^-1),
    # e^2 capped at 2 (2 / e^2), padding 1; row 1 within the bounds throughout
    w = importance_weights(LOGP, ENGINE, MASK, "truncate", "token", cap=2.0, floor=0.5,
                           relative=True)
    torch.testing.assert_close(w, torch.tensor([[1.0, 0.5 * E(1), 2 * E(-2), 1.0],
                                                [1.0, 1.0, 1.0, 1.0]], dtype=torch.float64))
    m = importance_weights(LOGP, ENGINE, MASK, "mask", "token", cap=2.0, floor=0.5,
                           relative=True)
    torch.testing.assert_close(m, torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0] * 4],
                                               dtype=torch.float64))


@pytest.mark.parametrize("name, level, correction", [
    ("gspo", "geometric", "truncate"), ("gspo", "geometric", "mask"),
    ("grpo", "token", "truncate"), ("grpo", "token", "mask")])
def test_the_correction_on_engine_log_probs_equals_it_on_a_recomputed_pi_old(name, level,
                                                                            correction):
    """old_logprobs=rollout (the ratio against the engine, relative weights from the current
    policy) against old_logprobs=recompute at its first minibatch (pi_old = the current policy,
    the weights against the engine): the same loss and gradient, where the objective clips
    nothing (wide bounds) and the weights are on the objective's own scale (GSPO's ratio is
    geometric: with is_level=sequence the two modes weight by different ratios). One token with a log-ratio of 0.1 and a cap of 2: the gradient's
    factor is e^0.1 (it was e^0.2: the ratio counted twice); a cap of 1.05 makes it 1.05."""
    torch.manual_seed(1)
    B, T = 4, 5
    mask = torch.ones(B, T, dtype=torch.long)
    mask[1, 3:] = 0
    logp = -torch.rand(B, T, dtype=torch.float64)
    engine = logp + 0.2 * torch.randn(B, T, dtype=torch.float64)
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5], dtype=torch.float64)
    spec = OBJECTIVES[name]
    raw = importance_weights(logp, engine, mask, "truncate", level, cap=1e6)
    real = raw[mask > 0] if raw.dim() == 2 else raw
    floor, cap = float(real.quantile(0.2)), float(real.quantile(0.8))
    settings = spec.settings(10.0, 10.0, None, T)  # wide: the objective clips nothing
    losses, grads = [], []
    for old, relative in ((engine, True), (logp.detach(), False)):
        lp = logp.clone().requires_grad_()
        w = importance_weights(lp, engine, mask, correction, level, cap=cap, floor=floor,
                               relative=relative)
        loss, _ = spec(lp, old, adv, mask, is_weights=w, **settings)
        losses.append(loss)
        grads.append(torch.autograd.grad(loss, lp)[0])
    torch.testing.assert_close(losses[0], losses[1])
    torch.testing.assert_close(grads[0], grads[1])
    one = torch.ones(1, 1, dtype=torch.float64)
    for cap, factor in ((2.0, E(0.1)), (1.05, 1.05)):
        lp = (-0.9 * one).requires_grad_()
        w = importance_weights(lp, -one, one, "truncate", "token", cap=cap, relative=True)
        loss, _ = OBJECTIVES["grpo"](lp, -one, one[0], one, is_weights=w,
                                     **OBJECTIVES["grpo"].settings(0.2, 0.27, None, 1))
        assert -float(torch.autograd.grad(loss, lp)[0]) == pytest.approx(factor)


def test_a_long_sequence_cannot_overflow_before_the_bound():
    huge = importance_weights(torch.full((1, 4), 100.0), torch.zeros(1, 4), torch.ones(1, 4),
                              "truncate", "sequence", cap=3.0)
    assert float(huge) == pytest.approx(3.0)
    dropped = importance_weights(torch.full((1, 4), 100.0), torch.zeros(1, 4), torch.ones(1, 4),
                                 "mask", "sequence", cap=3.0)
    assert float(dropped) == 0.0


@pytest.mark.parametrize("kwargs, words", [
    (dict(correction="clip", level="token", cap=2.0), "unknown correction"),
    (dict(correction="mask", level="word", cap=2.0), "unknown importance-weight level"),
    (dict(correction="mask", level="token", cap=2.0, floor=2.0), "floor < cap"),
    (dict(correction="mask", level="token", cap=0.0), "floor < cap"),
])
def test_bad_bounds_and_names_are_value_errors(kwargs, words):
    with pytest.raises(ValueError, match=words):
        importance_weights(LOGP, ENGINE, MASK, **kwargs)


def test_the_metrics_count_masked_tokens_and_sequences():
    w = torch.tensor([[0.0, 0.0, 0.0, 5.0], [0.5, 0.0, 1.0, 2.0]], dtype=torch.float64)
    m = importance_weight_metrics(w, MASK)
    # real tokens: 0, 0, 0 | 0.5, 0, 1, 2 -> mean 3.5 / 7, min 0, max 2 (the padded 5 is not)
    assert float(m["is_weight_mean"]) == pytest.approx(3.5 / 7)
    assert float(m["is_weight_min"]) == 0.0 and float(m["is_weight_max"]) == 2.0
    assert float(m["is_masked_token_frac"]) == pytest.approx(4 / 7)
    assert float(m["is_masked_seq_frac"]) == pytest.approx(1 / 2)  # row 0 has no token left


def _clipped(ratio, adv, lo, hi):
    return torch.minimum(ratio * adv, ratio.clamp(1 - lo, 1 + hi) * adv)


def _reference(name, logp, old, adv, mask, w, lo, hi):
    """The weighted objective written out per sequence and token, float64."""
    B = logp.shape[0]
    total = 0.0
    for i in range(B):
        n = int(mask[i].sum())
        lp, op = logp[i, :n], old[i, :n]
        s = torch.exp((lp - op).sum() / n)
        if name == "gspo":
            total = total + w[i] * _clipped(s, adv[i], lo, hi)
        else:  # grpo, per-token weights
            total = total + (w[i, :n] * _clipped(torch.exp(lp - op), adv[i], lo, hi)).sum() / n
    return -total / B


@pytest.mark.parametrize("name, level", [("gspo", "geometric"), ("gspo", "sequence"),
                                         ("grpo", "token")])
def test_the_weighted_objective_equals_the_reference_in_value_and_gradient(name, level):
    torch.manual_seed(0)
    B, T = 4, 5
    mask = torch.ones(B, T, dtype=torch.long)
    mask[1, 3:] = 0
    old = -torch.rand(B, T, dtype=torch.float64)
    logp = (old + 0.01 * torch.randn(B, T, dtype=torch.float64)).requires_grad_()
    engine = old + 0.3 * torch.randn(B, T, dtype=torch.float64)
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5], dtype=torch.float64)
    spec = OBJECTIVES[name]
    lo, hi = (0.003, 0.004) if name == "gspo" else (0.2, 0.27)
    raw = importance_weights(old, engine, mask, "truncate", level, cap=1e6)
    real = raw[mask > 0] if raw.dim() == 2 else raw
    floor, cap = float(real.quantile(0.2)), float(real.quantile(0.8))  # drops the extremes
    w = importance_weights(old, engine, mask, "mask", level, cap=cap, floor=floor)
    assert 0 < float((w == 0).sum()) < w.numel()  # some terms masked, some kept
    loss, metrics = spec(logp, old, adv, mask, is_weights=w,
                         **spec.settings(lo, hi, None, T))
    ref = _reference(name, logp, old, adv, mask, w, lo, hi)
    torch.testing.assert_close(loss, ref)
    g, = torch.autograd.grad(loss, logp)
    g_ref, = torch.autograd.grad(ref, logp)
    torch.testing.assert_close(g, g_ref)
    assert float(metrics["is_masked_token_frac"]) > 0


def test_token_weights_on_a_sequence_objective_are_refused():
    w = torch.ones(2, 4, dtype=torch.float64)
    with pytest.raises(ValueError, match="per-token importance weights"):
        OBJECTIVES["gspo"](LOGP, LOGP, torch.ones(2, dtype=torch.float64), MASK, is_weights=w)


@pytest.mark.parametrize("old_logprobs", ["recompute", "rollout"])
def test_a_run_with_the_correction_logs_its_weights(tmp_path, tiny_overrides, old_logprobs):
    # the sampler in bf16, the trainer in float32: geometric weights within ~5e-4 of 1 here,
    # some outside [0.9997, 1.0003]
    cfg = load_config(overrides=tiny_overrides + [
        "train.eval_every=0", "rollout.dtype=bfloat16", "algorithm.is_correction=mask",
        "algorithm.is_level=geometric", "algorithm.is_cap=1.0003", "algorithm.is_floor=0.9997",
        f"algorithm.old_logprobs={old_logprobs}"])
    train(cfg, tmp_path / "run")
    rows = read_metrics(tmp_path / "run")
    for row in rows:
        assert row["is/weight_max"] <= 1.0003  # a kept weight lies within the bounds
        assert row["is/weight_min"] == 0 or row["is/weight_min"] >= 0.9997
        assert (row["is/masked_token_frac"] > 0) == (row["is/masked_seq_frac"] > 0)
        assert math.isfinite(row["loss"])
    assert any(0 < row["is/masked_seq_frac"] < 1 for row in rows)  # some dropped, some kept


def test_the_retired_tis_is_read_as_truncate(tmp_path):
    cfg = load_config(overrides=["algorithm=grpo", "algorithm.tis=token", "algorithm.tis_cap=3"])
    a = cfg.algorithm
    assert (a.is_correction, a.is_level, a.is_cap, a.tis) == ("truncate", "token", 3.0, "none")
    with pytest.raises(ConfigError, match="drop algorithm.tis"):
        load_config(overrides=["algorithm.tis=sequence", "algorithm.is_correction=mask"])
