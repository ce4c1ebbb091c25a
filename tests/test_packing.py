"""train.max_tokens_per_micro: micro-batches packed by token count (gspo.packing), the same
gradient as fixed-size micro-batches and as the whole minibatch, forwards that compute only
their own columns, and runs with it."""

import logging
import random

import pytest
import torch
from transformers.models.qwen3 import modeling_qwen3

from gspo import metrics as M
from gspo.config import load_config
from gspo.engines import Rollouts
from gspo.logger import read_metrics
from gspo.packing import pack_by_tokens
from gspo.step import micro_batches, minibatches, old_policy, update
from gspo.trainer import close_run, prepare, train
from conftest import TINY_OVERRIDES

# ---- the packing itself, by hand


def test_rows_go_longest_first_and_fill_each_micro_batch_up_to_the_budget():
    # prompt width 1, budget 20; longest first: pos 1 (9), 2 (4), 0 (2), 3 (1)
    #   [1]       1 x (1 + 9) = 10;  + pos 2: 2 x (1 + 9) = 20 <= 20
    #   + pos 0:  3 x 10 = 30 > 20, so a new micro-batch [0]: 1 x (1 + 2) = 3
    #   + pos 3:  2 x (1 + 2) = 6
    assert pack_by_tokens([2, 9, 4, 1], 1, 20) == ([[1, 2], [0, 3]], [])


def test_whole_groups_stay_together():
    # groups of 4, prompt width 2: group 0 (max 8) costs 4 x 10 = 40, group 1 (max 3) 4 x 5 = 20;
    # together 8 x 10 = 80
    lengths = [1, 1, 8, 2, 3, 3, 3, 3]
    assert pack_by_tokens(lengths, 2, 48, group=4) == ([[0, 1, 2, 3], [4, 5, 6, 7]], [])
    assert pack_by_tokens(lengths, 2, 80, group=4) == ([[0, 1, 2, 3, 4, 5, 6, 7]], [])
    # rows alone would pack otherwise: [2] = 10, then 3, 3, 3, 3 at 5 each (max 8 rows x 5 = 40)
    assert pack_by_tokens(lengths, 2, 48)[0] == [[2, 4, 5, 6], [7, 3, 0, 1]]


def test_a_group_over_the_budget_is_split_into_rows():
    # budget 30: group 0 (4 x 10 = 40) is split; group 1 (20) is not. Longest first:
    #   [2] (8): 10;  + group 1 (3): 5 x 10 = 50 > 30, new: 4 x 5 = 20
    #   + [3] (2): 5 x 5 = 25;  + [0] (1): 6 x 5 = 30;  + [1] (1): 7 x 5 = 35 > 30, new
    lengths = [1, 1, 8, 2, 3, 3, 3, 3]
    assert pack_by_tokens(lengths, 2, 30, group=4) == ([[2], [4, 5, 6, 7, 3, 0], [1]], [])


def test_a_row_over_the_budget_goes_alone_and_is_reported():
    # prompt width 2, budget 8: row 0 costs 2 + 10 = 12 > 8; rows 1 and 2 pack: 2 x 3 = 6
    assert pack_by_tokens([10, 1, 1], 2, 8) == ([[0], [1, 2]], [0])
    # every row over it: one each
    assert pack_by_tokens([3, 4], 5, 6) == ([[1], [0]], [0, 1])


def test_a_count_to_reach_halves_the_costliest_micro_batch():
    # from [[1, 2] (20), [0, 3] (6)]: 3 -> [1, 2] halved; 4 -> then [0, 3] (the only one left
    # with two rows); more than the rows cannot be had
    assert pack_by_tokens([2, 9, 4, 1], 1, 20, count=3)[0] == [[1], [2], [0, 3]]
    assert pack_by_tokens([2, 9, 4, 1], 1, 20, count=4)[0] == [[1], [2], [0], [3]]
    assert pack_by_tokens([2, 9, 4, 1], 1, 20, count=9)[0] == [[1], [2], [0], [3]]
    # groups are halved between groups first, then a group between its rows
    lengths = [1, 1, 8, 2, 3, 3, 3, 3]
    assert pack_by_tokens(lengths, 2, 80, group=4, count=2)[0] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert pack_by_tokens(lengths, 2, 80, group=4, count=3)[0] == [[0, 1], [2, 3], [4, 5, 6, 7]]


def test_rows_that_are_not_whole_groups_are_refused():
    with pytest.raises(ValueError, match="whole groups of 4"):
        pack_by_tokens([1] * 6, 1, 100, group=4)


@pytest.mark.parametrize("seed", range(20))
def test_every_row_once_within_the_budget_groups_whole_when_they_fit(seed):
    rng = random.Random(seed)
    G, n_groups, width = rng.choice([1, 2, 4]), rng.randint(1, 6), rng.randint(0, 5)
    lengths = [rng.randint(1, 30) for _ in range(G * n_groups)]
    budget = rng.randint(5, 150)
    parts, over = pack_by_tokens(lengths, width, budget, G, count=rng.randint(0, 8))
    assert sorted(i for p in parts for i in p) == list(range(len(lengths)))
    for p in parts:
        assert len(p) * (width + max(lengths[i] for i in p)) <= budget or len(p) == 1
    assert over == [i for i, n in enumerate(lengths) if width + n > budget]
    # count=0: a group that fits the budget is never split
    parts, _ = pack_by_tokens(lengths, width, budget, G)
    where = {i: k for k, p in enumerate(parts) for i in p}
    for g in range(n_groups):
        rows = range(g * G, (g + 1) * G)
        if G * (width + max(lengths[i] for i in rows)) <= budget:
            assert len({where[i] for i in rows}) == 1


# ---- in the update: the gradient, the forwards


def _f64_rms_norm(self, hidden):
    # transformers' RMSNorm computes in float32 whatever the weights' dtype; a float64 model
    # must not, or float32 rounding (1e-8 here) hides what the test compares
    variance = hidden.pow(2).mean(-1, keepdim=True)
    return self.weight * (hidden * torch.rsqrt(variance + self.variance_epsilon))


P, G, LP, T = 4, 4, 6, 24
LENGTHS = [1, 24, 3, 2, 5, 6, 4, 5, 20, 22, 24, 19, 2, 1, 12, 3]  # very different lengths


@pytest.fixture
def f64_run(tmp_path, monkeypatch):
    """A tiny run with its model in float64, and a fixed batch of 4 prompts x 4 responses
    (rows of a group share their prompt) of very different lengths, pi_old near the policy."""
    monkeypatch.setattr(modeling_qwen3.Qwen3RMSNorm, "forward", _f64_rms_norm)
    tiny = [o for o in TINY_OVERRIDES if not o.startswith(("rollout.", "warmup."))]
    cfg = load_config(overrides=tiny + [f"rollout.prompts_per_step={P}",
                                        f"rollout.group_size={G}", f"rollout.max_new_tokens={T}",
                                        "warmup.steps=0", "train.eval_every=0",
                                        "optim.grad_clip=0", "algorithm.minibatches=2"])
    run = prepare(cfg, tmp_path / "run", False)
    run.model.double()
    g = torch.Generator().manual_seed(0)
    vocab = len(run.tokenizer)
    prompt = torch.randint(4, vocab, (P, LP), generator=g).repeat_interleave(G, 0)
    prompt_mask = torch.ones_like(prompt)
    prompt_mask[:G, :2] = 0  # a left-padded prompt
    response = torch.randint(4, vocab, (P * G, T), generator=g)
    mask = (torch.arange(T)[None] < torch.tensor(LENGTHS)[:, None]).double()
    r = Rollouts(prompt, prompt_mask, response, mask, torch.zeros(P * G, T, dtype=torch.float64))
    r, device = r.to(run.dist.device), run.dist.device
    with torch.no_grad():
        old = run.policy(r.input_ids, r.attention_mask, T, 1.0, 1024)
    old = old + 0.01 * torch.randn(old.shape, generator=g, dtype=torch.float64).to(device)
    adv = torch.randn(P * G, generator=g, dtype=torch.float64).to(device)
    yield run, r, old, adv
    close_run(run)


def _first_minibatch_gradient(run, r, old, adv, micro: int, budget: int) -> torch.Tensor:
    """The gradient of the update's first minibatch, from the same weights and the same
    minibatch partition each time."""
    grads = []
    hook = run.optimizer.register_step_pre_hook(lambda *_: grads.append(torch.cat(
        [p.grad.flatten() for p in run.model.parameters()])))
    state, gen = {k: v.clone() for k, v in run.model.state_dict().items()}, run.gen.get_state()
    run.micro, run.cfg.train.max_tokens_per_micro = micro, budget
    try:
        update(run, r, old, None, adv)
    finally:
        hook.remove()
        run.model.load_state_dict(state)
        run.gen.set_state(gen)
    return grads[0]


@pytest.mark.parametrize("algorithm", [["name=gspo"], ["name=grpo", "aggregation=token-mean"]])
def test_token_budget_micro_batches_give_the_fixed_size_and_whole_minibatch_gradient(
        f64_run, algorithm, caplog):
    run, r, old, adv = f64_run
    for setting in algorithm:
        setattr(run.cfg.algorithm, *setting.split("="))
    whole = _first_minibatch_gradient(run, r, old, adv, micro=8, budget=0)
    fixed = _first_minibatch_gradient(run, r, old, adv, micro=2, budget=0)
    assert whole.abs().max() > 0.01
    torch.testing.assert_close(fixed, whole, rtol=0, atol=1e-10)
    # the first minibatch: groups 0 and 1, rows 0-7, lengths 1 24 3 2 | 5 6 4 5, prompt width 6
    mb = minibatches(run, len(LENGTHS))[0]
    run.gen.set_state(torch.Generator().manual_seed(run.cfg.train.seed).get_state())
    assert mb.tolist() == list(range(8))
    packed = {  # budget: the micro-batches it makes of that minibatch
        25: [[1], [5, 4], [7, 6], [2, 3], [0]],  # row 1 (6 + 24 = 30) over it, alone
        60: [[1], [4, 5, 6, 7, 2], [3, 0]],  # group 0 (4 x 30) split, group 1 (4 x 12) whole
        200: [[0, 1, 2, 3], [4, 5, 6, 7]],  # each group whole, not both (8 x 30 = 240)
    }
    with caplog.at_level(logging.WARNING, logger="gspo.step"):
        for budget, parts in packed.items():
            run.cfg.train.max_tokens_per_micro = budget
            assert [p.tolist() for p in micro_batches(run, r, run.policy, mb)] == parts
            got = _first_minibatch_gradient(run, r, old, adv, micro=8, budget=budget)
            torch.testing.assert_close(got, whole, rtol=0, atol=1e-10, msg=f"budget {budget}")
    said = [x.getMessage() for x in caplog.records if "max_tokens_per_micro" in x.getMessage()]
    assert len(said) == 1 and "1 row(s) of up to 30 tokens" in said[0], said


def test_each_forward_computes_only_its_micro_batchs_columns(f64_run):
    run, r, old, adv = f64_run
    run.cfg.train.max_tokens_per_micro = 60
    seen = []  # the decoder's input shapes, call by call
    hook = run.model.get_decoder().embed_tokens.register_forward_hook(
        lambda module, args, out: seen.append(tuple(args[0].shape)))
    gen = run.gen.get_state()
    parts = [p.tolist() for mb in minibatches(run, len(LENGTHS))
             for p in micro_batches(run, r, run.policy, mb)]
    run.gen.set_state(gen)
    try:
        update(run, r, old, None, adv)
    finally:
        hook.remove()
    want = []
    for part in parts:
        longest, prompts = max(LENGTHS[i] for i in part), len({i // G for i in part})
        if prompts == len(part):  # no prompt to share: one forward over prompt + response
            want.append((len(part), LP + longest - 1))
        else:  # each prompt once, then the responses on its cache, to this longest response
            want += [(prompts, LP)] + ([(len(part), longest - 1)] if longest > 1 else [])
    assert seen == want
    assert any(width < T - 1 for _, width in seen[1:])  # the padding was not computed


def test_pi_olds_packed_forwards_give_the_unpacked_log_probs(f64_run):
    run, r, _, _ = f64_run
    run.cfg.train.max_tokens_per_micro = 0
    want, want_entropy, _ = old_policy(run, r, 0)
    run.cfg.train.max_tokens_per_micro = 60
    assert len(micro_batches(run, r, run.policy)) > 2  # the whole batch, packed
    got, entropy, _ = old_policy(run, r, 0)
    mask = r.response_mask
    torch.testing.assert_close(got * mask, want * mask, rtol=0, atol=1e-12)
    torch.testing.assert_close(entropy * mask, want_entropy * mask, rtol=0, atol=1e-12)


# ---- runs


DENSE = "data.reward=tests/dist_update_worker.py:digit_fraction"  # non-zero advantages


def test_a_run_with_a_token_budget_trains_as_the_run_without(tmp_path):
    common = TINY_OVERRIDES + [DENSE, "rollout.max_new_tokens=12", "train.eval_every=0",
                               "train.save_every=0", "train.steps=2"]
    train(load_config(overrides=common), tmp_path / "fixed")
    train(load_config(overrides=common + ["train.max_tokens_per_micro=60"]), tmp_path / "tokens")
    fixed, tokens = read_metrics(tmp_path / "fixed"), read_metrics(tmp_path / "tokens")
    # step 1 samples the same rollouts from the same weights; its update differs by rounding
    assert tokens[0][M.REWARD_MEAN] == fixed[0][M.REWARD_MEAN]
    assert tokens[0][M.GRAD_NORM] > 0
    for key in (M.LOSS, M.GRAD_NORM, M.KL_OLD, M.RATIO_MEAN):
        assert tokens[0][key] == pytest.approx(fixed[0][key], rel=1e-4, abs=1e-7), key
    assert [r["step"] for r in tokens] == [1, 2]


def test_routing_replay_replays_forwards_cut_to_their_micro_batch(tmp_path):
    # MoE with Routing Replay: pi_old's recorded routing covers each row's full width, and a
    # packed forward stops at its micro-batch's longest response
    common = TINY_OVERRIDES + [DENSE, "model.name_or_path=tiny-qwen3-moe", "algorithm=grpo",
                               "algorithm.routing_replay=true", "rollout.max_new_tokens=12",
                               "train.eval_every=0", "train.save_every=0", "train.steps=1",
                               "train.max_tokens_per_micro=50"]
    train(load_config(overrides=common), tmp_path / "run")
    (row,) = read_metrics(tmp_path / "run")
    assert "moe/volatility" in row and row[M.RATIO_MAX] >= row[M.RATIO_MIN] > 0
