"""A new objective is one function and one registry line: added here through the public API
only (gspo.objectives.register_objective), then trained with `algorithm=NAME`."""

import pytest
import torch

from gspo import metrics as M
from gspo.config import ConfigError, load_config
from gspo.logger import read_metrics
from gspo.objectives import OBJECTIVES, LossSpec, aggregate, register_objective
from gspo.trainer import train


def toy_cispo_loss(logp, old_logp, adv, mask, *, eps_low, eps_high, denom=None,
                   aggregation="token-mean", max_len=None):
    """A CISPO-like toy: the clipped token ratio as a stop-gradient weight on logp * A."""
    old_logp, adv = old_logp.detach(), adv.detach()
    ratio = torch.exp((logp - old_logp) * mask)  # (B, T)
    weight = ratio.clamp(1 - eps_low, 1 + eps_high).detach()
    per_tok = weight * adv[:, None] * logp * mask
    numer, local = aggregate(per_tok, mask, aggregation, max_len)
    loss = -numer / (local if denom is None else denom)
    clipped = (ratio != ratio.clamp(1 - eps_low, 1 + eps_high)) & (mask > 0)
    frac = clipped.float().sum() / mask.sum()
    return loss, {"ratio_mean": (ratio * mask).sum() / mask.sum(), "ratio_min": ratio.min(),
                  "ratio_max": ratio.max(), "ratio_count": mask.sum(), "clip_frac": frac,
                  "clip_frac_low": frac * 0, "clip_frac_high": frac,
                  "kl_old": ((old_logp - logp) * mask).sum().detach() / mask.sum()}


@pytest.fixture
def toy():
    register_objective("toy_cispo", LossSpec(toy_cispo_loss, eps_low=0.5, eps_high=0.5,
                                             aggregations=("token-mean", "seq-mean-token-mean"),
                                             token_advantages=True))
    yield "toy_cispo"
    del OBJECTIVES["toy_cispo"]


def test_registered_objective_gets_its_defaults_and_trains(toy, tmp_path, tiny_overrides):
    cfg = load_config(overrides=tiny_overrides + [f"algorithm={toy}", "train.steps=2"])
    a = cfg.algorithm
    assert (a.eps_low, a.eps_high, a.aggregation) == (0.5, 0.5, "token-mean")
    train(cfg, tmp_path / "run")
    rows = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "loss" in r]
    assert len(rows) == 2 and all(r[M.CLIP_FRAC] is not None for r in rows)


def test_registered_objective_rejects_an_aggregation_it_does_not_take(toy, tiny_overrides):
    with pytest.raises(ConfigError, match="does not apply to toy_cispo"):
        load_config(overrides=tiny_overrides + [f"algorithm={toy}",
                                                "algorithm.aggregation=seq-mean-token-sum-norm"])


def test_a_name_is_registered_once(toy):
    with pytest.raises(ValueError, match="already registered"):
        register_objective(toy, OBJECTIVES[toy])


def test_token_mean_is_normalised_by_the_global_token_count(toy):
    # 2 sequences of 1 and 3 tokens, all ratios 1, A = 1: token-mean sums logp over 4 tokens
    logp = torch.tensor([[-1.0, 0.0, 0.0], [-2.0, -3.0, -4.0]], requires_grad=True)
    mask = torch.tensor([[1.0, 0, 0], [1, 1, 1]])
    loss, _ = OBJECTIVES[toy](logp, logp.detach(), torch.ones(2), mask, eps_low=0.5,
                              eps_high=0.5, denom=8.0)
    assert float(loss) == pytest.approx(10.0 / 8.0)  # -(-1 - 2 - 3 - 4) / 8
