"""algorithm.overlong: DAPO's soft length penalty on hand-worked lengths, truncation found from
the token ids, and masking: the update with the cut rows masked has the gradient of the update
on the other rows alone."""

import pytest
import torch

from gspo.config import load_config
from gspo.engines import Rollouts
from gspo.errors import ConfigError
from gspo.logger import read_metrics
from gspo.objectives import overlong_penalty
from gspo.step import truncated, update
from gspo.trainer import close_run, prepare, train


def test_the_soft_penalty_on_hand_worked_lengths():
    # budget 10, buffer 4: free up to 6 tokens, then -1/4 per token down to -1 at 10
    lengths = torch.tensor([1, 6, 7, 8, 10])
    torch.testing.assert_close(overlong_penalty(lengths, 10, 4),
                               torch.tensor([0.0, 0.0, -0.25, -0.5, -1.0]))
    torch.testing.assert_close(overlong_penalty(lengths, 10, 4, penalty=0.5),
                               torch.tensor([0.0, 0.0, -0.125, -0.25, -0.5]))
    with pytest.raises(ValueError, match="overlong buffer"):
        overlong_penalty(lengths, 10, 10)


def test_truncated_means_the_whole_budget_without_a_stop_token():
    EOS, PAD = 2, 0
    ids = torch.tensor([[5, 6, 7, 8],      # 4 tokens, no eos: cut
                        [5, 6, 7, EOS],    # 4 tokens ending in eos: finished
                        [5, EOS, PAD, PAD],  # finished early
                        [9, 9, 9, 3]])     # 4 tokens ending in the second stop token
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 1]]).float()
    r = Rollouts(torch.ones(4, 2, dtype=torch.long), torch.ones(4, 2, dtype=torch.long), ids,
                 mask, torch.zeros(4, 4))
    assert truncated(r, [EOS, 3], 4).tolist() == [True, False, False, False]
    assert truncated(r, [EOS], 4).tolist() == [True, False, False, True]


def test_a_buffer_as_long_as_the_budget_is_a_config_error():
    with pytest.raises(ConfigError, match="overlong_buffer=8 must be below"):
        load_config(overrides=["rollout.max_new_tokens=8", "algorithm.overlong=soft_penalty",
                               "algorithm.overlong_buffer=8"])


def test_a_default_buffer_of_zero_tokens_is_a_config_error():
    """The default buffer is a quarter of the budget: 0 tokens below 4, which the penalty
    refuses only at the first step, after any warm-up; 3 tokens with a buffer of 1 is fine."""
    with pytest.raises(ConfigError, match=r"default buffer.*is 0 tokens: set "
                                          r"algorithm.overlong_buffer between 1 and 2"):
        load_config(overrides=["rollout.max_new_tokens=3", "algorithm.overlong=soft_penalty"])
    load_config(overrides=["rollout.max_new_tokens=3", "algorithm.overlong=soft_penalty",
                           "algorithm.overlong_buffer=1"])


def _gradients(run, r, adv, keep):
    """The gradient of one update (minibatches=1): the sum over its micro-batches, captured as
    it accumulates."""
    grads = {}
    hooks = [p.register_post_accumulate_grad_hook(
        lambda p, name=name: grads.__setitem__(name, p.grad.detach().clone()))
        for name, p in run.model.named_parameters()]
    old_logp = r.logp
    update(run, r, old_logp, None, adv, keep)
    for h in hooks:
        h.remove()
    return grads


@pytest.mark.parametrize("algorithm", [["algorithm=gspo"],
                                       ["algorithm=grpo", "algorithm.aggregation=token-mean"]])
def test_masking_equals_training_on_the_rows_that_were_not_cut(tmp_path, tiny_overrides,
                                                               algorithm):
    overrides = tiny_overrides + algorithm + [
        "algorithm.minibatches=1", "warmup.steps=0", "train.eval_every=0",
        "algorithm.overlong=mask"]
    runs = [prepare(load_config(overrides=overrides), tmp_path / f"run{i}", resume=False)
            for i in range(2)]
    try:
        torch.manual_seed(0)
        r = runs[0].engine.generate([[5, 6, 7]] * 4, n=4, params=_params(), seed=1)
        B = r.response_ids.shape[0]
        keep = torch.zeros(B, dtype=torch.bool)
        keep[[0, 3, 5, 6, 9, 14]] = True
        adv = torch.randn(B)
        masked = _gradients(runs[0], r, adv, keep)
        k = keep.nonzero().flatten()
        sub = Rollouts(r.prompt_ids[k], r.prompt_mask[k], r.response_ids[k], r.response_mask[k],
                       r.logp[k])
        alone = _gradients(runs[1], sub, adv[k], None)
        assert masked.keys() == alone.keys() and masked
        for name in masked:
            torch.testing.assert_close(masked[name], alone[name], rtol=1e-4, atol=1e-7,
                                       msg=name)
    finally:
        for run in runs:
            close_run(run)


def _params():
    from gspo.engines import SamplingParams
    return SamplingParams(1.0, 1.0, 4)


def test_a_run_with_the_soft_penalty_logs_it(tmp_path, tiny_overrides):
    cfg = load_config(overrides=tiny_overrides + [
        "train.eval_every=0", "algorithm.overlong=soft_penalty", "algorithm.overlong_buffer=2"])
    train(cfg, tmp_path / "run")
    for row in read_metrics(tmp_path / "run"):
        assert -1.0 <= row["reward/overlong_penalty"] <= 0.0
        assert 0.0 <= row["response/truncated_frac"] <= 1.0
