"""rollout.filter_groups (DAPO's dynamic sampling): which groups vary, which prompts an extra
round draws, how rounds fill a rank's share and when they stop; runs whose trained batches hold
no constant group while the bound allows, metrics equal to a hand count of every reward call,
and a run with the filter on that equals the run without it when no group is constant."""

import pytest
import torch

import gspo.step as step_mod
from gspo import metrics as M
from gspo.config import load_config
from gspo.engines import Rollouts
from gspo.errors import ConfigError
from gspo.group_filter import Round, extra_prompts, fill, merge, round_size
from gspo.objectives import varying_groups
from gspo.trainer import close_run, prepare

FILTER = ["rollout.filter_groups=true", "data.reward_fn_timeout=0",  # calls in order
          "warmup.steps=2", "train.eval_every=0"]


def test_varying_groups_on_hand_made_rewards():
    rewards = torch.tensor([1.0, 1.0, 1.0,      # all equal: constant
                            0.0, 1.0, 0.0,      # varies
                            0.1, 0.1, 0.1,      # equal (mean-centred: 0 up to rounding)
                            2.0, 2.0, 2.0 + 1e-3])  # varies, barely
    assert varying_groups(rewards, 3).tolist() == [False, True, False, True]
    with pytest.raises(ValueError, match="not groups of 3"):
        varying_groups(rewards[:4], 3)


def test_extra_prompts_avoid_the_first_ones_and_each_other_while_the_rows_last():
    first = [3, 17, 5, 11]  # the step's first prompts, both ranks' shares
    seen = set()
    for rank in range(2):
        for rnd in (1, 2, 3):
            got = extra_prompts(40, first, step=7, round=rnd, n=2, share=2, rank=rank, world=2,
                                seed=0)
            assert len(got) == 2 and not set(got) & set(first)
            assert not set(got) & seen  # no prompt twice in a step, over ranks and rounds
            seen |= set(got)
            # a function of (seed, step, round, rank): the same again, another step differs
            assert extra_prompts(40, first, 7, rnd, 2, 2, rank, 2, 0) == got
            # fewer prompts are the first ones of the same window
            assert extra_prompts(40, first, 7, rnd, 1, 2, rank, 2, 0) == got[:1]
    assert extra_prompts(40, first, 8, 1, 2, 2, 0, 2, 0) != extra_prompts(40, first, 7, 1, 2, 2,
                                                                            0, 2, 0)
    # 6 rows, 4 taken by the first prompts: the 2 others, then the first ones, then again
    first = [3, 5, 2, 0]
    got = [i for rnd in (1, 2, 3, 4) for i in extra_prompts(6, first, 0, rnd, 2, 2, 0, 1, 0)]
    assert sorted(got[:2]) == [1, 4] and got[2:6] == first and got[6:] == got[:2]


@pytest.mark.parametrize("missing, seen, kept, share, want", [
    (3, 4, 1, 4, 4),   # 1 in 4 varied: 12 needed for 3, capped at the share
    (2, 8, 6, 8, 3),   # 6 in 8 varied: ceil(2 * 8 / 6) = 3
    (1, 4, 4, 4, 1),   # everything varied so far: what is missing
    (2, 4, 0, 4, 4),   # nothing varied yet: the whole share
])
def test_round_size_scales_what_is_missing_by_the_rate_seen(missing, seen, kept, share, want):
    assert round_size(missing, seen, kept, share) == want


def fake_round(varying: list[bool], tag: int, G: int = 2) -> Round:
    """Round `tag`: group g's G rows have response token and reward tag * 10 + g, text
    "tag.g", and prompts 1 + tag tokens wide."""
    B = len(varying) * G
    group = [tag * 10 + i // G for i in range(B)]
    prompt = torch.ones(B, 1 + tag, dtype=torch.long)
    r = Rollouts(prompt, prompt.clone(), torch.tensor(group)[:, None], torch.ones(B, 1),
                 torch.zeros(B, 1))
    return Round([{"id": (tag, g)} for g in range(len(varying))], r,
                 [f"{tag}.{i // G}" for i in range(B)], [float(x) for x in group],
                 failures=tag, first_error=None, varying=varying)


def test_fill_takes_varying_groups_in_order_and_stops_at_the_share():
    plan = {0: [True, False, False, True], 1: [False, True, True], 2: [True]}
    calls = []

    def sample(k, n):
        calls.append((k, n))
        return fake_round(plan[k][:n], k)
    rounds, picks, stats = fill(sample, share=4, max_rounds=5)
    # round 0: 2 of 4 vary; round 1: 2 missing at 2/4 -> 4 asked, 3 planned; 4 found
    assert calls == [(0, 4), (1, 4)]
    assert picks == [(0, 0), (0, 3), (1, 1), (1, 2)]
    assert (stats.scored, stats.filtered, stats.extra_prompts, stats.filled, stats.rounds) == \
        ((4 + 3) * 2, 3, 3, 0, 1)


def test_fill_respects_the_bound_and_fills_with_dropped_groups_in_sampling_order():
    calls = []

    def sample(k, n):
        calls.append((k, n))
        return fake_round([k == 1 and g == 2 for g in range(n)], k)  # one varying group in all
    rounds, picks, stats = fill(sample, share=3, max_rounds=2)
    assert calls == [(0, 3), (1, 3), (2, 3)]  # the bound: 2 extra rounds, then no more
    assert picks == [(1, 2), (0, 0), (0, 1)]  # the varying group, then the first dropped ones
    assert (stats.filtered, stats.extra_prompts, stats.filled, stats.rounds) == (6, 6, 2, 2)
    rows, r, texts, rewards = merge(rounds, picks, 2, pad_id=0)
    assert rows == [{"id": (1, 2)}, {"id": (0, 0)}, {"id": (0, 1)}]
    assert r.response_ids[:, 0].tolist() == [12, 12, 0, 0, 1, 1]  # prompt-major, G = 2
    assert texts == ["1.2", "1.2", "0.0", "0.0", "0.1", "0.1"]
    assert rewards == [12.0, 12.0, 0.0, 0.0, 1.0, 1.0]
    assert r.prompt_ids.shape[1] == 3  # the widest round's prompts (round 2's)


def test_filter_groups_refuses_routing_recorded_while_sampling():
    with pytest.raises(ConfigError, match="filter_groups does not run with algorithm.routing_"):
        load_config(overrides=["rollout.filter_groups=true", "algorithm.routing_replay=true",
                               "algorithm.old_logprobs=rollout"])


# ---- runs


class Recorder:
    """A reward that records every call (answer, value) in order; `value(completion, answer)`."""

    def __init__(self, value):
        self.value, self.calls = value, []

    def __call__(self, completion: str, answer: str = "", **_) -> float:
        v = float(self.value(completion, answer))
        self.calls.append((answer, v))
        return v


def half_constant(completion, answer):
    return 1.0 if int(answer) % 2 == 0 else sum(map(ord, completion)) % 5


def hand_count(calls, G, share):
    """What one step's reward calls say filtering did: groups of G consecutive calls."""
    groups = [[v for _, v in calls[i:i + G]] for i in range(0, len(calls), G)]
    varying = sum(len(set(g)) > 1 for g in groups)
    filled = max(0, share - varying)
    return {M.FILTERED_GROUPS: len(groups) - varying - filled,
            M.EXTRA_PROMPTS: len(groups) - share, M.FILLED_GROUPS: filled}


def stepped(tmp_path, overrides, reward, steps, monkeypatch):
    """`steps` RL steps of a prepared run: (each step's batch, row and reward calls)."""
    run = prepare(load_config(overrides=overrides), tmp_path, resume=False, reward_fn=reward)
    batches = []
    produce = step_mod.produce
    monkeypatch.setattr(step_mod, "produce",
                        lambda *a, **k: batches.append(produce(*a, **k)) or batches[-1])
    out = []
    try:
        for step in range(steps):
            before = len(reward.calls)
            row = step_mod.rl_step(run, step)
            out.append((batches[-1], row, reward.calls[before:]))
    finally:
        close_run(run)
    return out


def test_trained_batches_hold_no_constant_group_and_metrics_equal_a_hand_count(
        tmp_path, tiny_overrides, monkeypatch):
    reward = Recorder(half_constant)
    G, P = 4, 4
    steps = stepped(tmp_path, tiny_overrides + FILTER + ["rollout.filter_max_rounds=8"], reward,
                    3, monkeypatch)
    dropped = 0
    for batch, row, calls in steps:
        want = hand_count(calls, G, P)
        assert {k: row[k] for k in want} == want
        assert want[M.FILLED_GROUPS] == 0  # the bound allowed a full step every time
        groups = torch.tensor(batch.rewards).view(P, G)
        assert (groups.std(-1) > 0).all()  # no constant group trained on
        assert batch.rollouts.response_ids.shape[0] == P * G == len(batch.texts)
        # the trained rewards are the recorded ones of the groups kept, and reward/mean theirs
        recorded = [calls[i:i + G] for i in range(0, len(calls), G)]
        kept = [g for g in recorded if len({v for _, v in g}) > 1]
        assert [v for g in kept[:P] for _, v in g] == batch.rewards
        assert [row["answer"] for row in batch.rows] == [g[0][0] for g in kept[:P]]
        assert row[M.REWARD_MEAN] == pytest.approx(sum(batch.rewards) / (P * G))
        dropped += want[M.FILTERED_GROUPS]
    assert dropped > 0  # the reward made some groups constant: the test filtered something


def test_the_bound_is_respected_and_constant_groups_fill_the_step(tmp_path, tiny_overrides,
                                                                  monkeypatch, caplog):
    reward = Recorder(lambda completion, answer: 0.5)  # every group constant
    steps = stepped(tmp_path, tiny_overrides + FILTER + ["rollout.filter_max_rounds=2"], reward,
                    2, monkeypatch)
    for batch, row, calls in steps:
        assert len(calls) == (1 + 2) * 4 * 4  # round 0 and 2 extra rounds of 4 prompts, no more
        assert (row[M.FILTERED_GROUPS], row[M.EXTRA_PROMPTS], row[M.FILLED_GROUPS]) == (8, 8, 4)
        assert batch.rollouts.response_ids.shape[0] == 16 and row[M.LOSS] == 0.0
    said = [r.getMessage() for r in caplog.records if "rollout.filter_groups" in r.getMessage()]
    assert len(said) == 1 and "2 extra round(s) left 4 of the 4 groups of step 1" in said[0]


class Alternating:
    """0, 1, 0, 1, ... call after call: every group of an even G varies."""

    def __init__(self):
        self.n = 0

    def __call__(self, completion: str, **_) -> float:
        self.n += 1
        return float(self.n % 2)


def test_with_no_constant_group_the_filter_changes_nothing(tmp_path, tiny_overrides):
    """Round 0 samples the step's prompts with the step's seeds: when every group varies, the
    run with filtering equals the run without, bit for bit, but for the filter's counts."""
    from gspo.logger import read_metrics
    from gspo.trainer import train
    rows = {}
    for on in (False, True):
        cfg = load_config(overrides=tiny_overrides + ["data.reward_fn_timeout=0",
                                                      "train.steps=3",
                                                      f"rollout.filter_groups={on}"])
        train(cfg, tmp_path / str(on), reward_fn=Alternating())
        rows[on] = [{k: v for k, v in r.items() if not k.startswith(("time/", "throughput/"))}
                    for r in read_metrics(tmp_path / str(on))]
    filtered = [r for r in rows[True] if M.FILTERED_GROUPS in r]
    assert len(filtered) == 3
    assert all((r.pop(M.FILTERED_GROUPS), r.pop(M.EXTRA_PROMPTS), r.pop(M.FILLED_GROUPS))
               == (0, 0, 0) for r in filtered)
    assert rows[True] == rows[False]
    assert any(r.get(M.GRAD_NORM, 0) > 0 for r in rows[False])  # the steps learned something


def test_killed_and_resumed_with_the_filter_on_equals_an_uninterrupted_run(tmp_path):
    """Extra prompts and seeds are a function of (seed, step, round, rank): a step re-run
    after kill -9 samples the same rounds."""
    import os
    import random
    import signal
    import subprocess
    import sys
    import time

    from safetensors.torch import load_file

    from gspo.logger import read_metrics
    from test_bad_inputs import USER
    from test_run_control import TINY, deterministic, finish, steps_logged

    args = TINY + ["train.steps=4", "train.save_every=1", "rollout.filter_groups=true",
                   "rollout.filter_max_rounds=3", f"data.reward={USER}:even_answers_constant"]

    def launch(run_dir, resume=False):
        where = ["--resume", str(run_dir)] if resume else ["--output-dir", str(run_dir)]
        return subprocess.Popen([sys.executable, "-m", "gspo", "train", *where, *args],
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)

    ref, run = tmp_path / "ref", tmp_path / "run"
    code, err = finish(launch(ref), timeout=300)
    assert code == 0, err[-2000:]
    rows = read_metrics(ref)
    assert sum(r.get(M.EXTRA_PROMPTS, 0) for r in rows) > 0  # extra rounds were sampled
    proc = launch(run)
    t0 = time.monotonic()
    while steps_logged(run) < 2 and proc.poll() is None and time.monotonic() - t0 < 300:
        time.sleep(0.05)
    time.sleep(random.Random(0).uniform(0.0, 0.5))  # into step 3's rounds, or its update
    assert proc.poll() is None, "the run ended before the kill"
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    code, err = finish(launch(run, resume=True), timeout=300)
    assert code == 0, err[-2000:]
    assert deterministic(read_metrics(run)) == deterministic(rows)
    want = load_file(ref / "checkpoints" / "step_000004" / "model.safetensors")
    got = load_file(run / "checkpoints" / "step_000004" / "model.safetensors")
    assert set(got) == set(want) and all(bool((got[k] == want[k]).all()) for k in want)


def test_moe_routing_replay_runs_on_the_merged_rounds(tmp_path, tiny_overrides, monkeypatch):
    """pi_old's recompute records the routing of the joined batch and every update forward
    replays it: with one minibatch each ratio is 1 (a replay of another row's experts, or
    of another padding, would move it)."""
    reward = Recorder(half_constant)
    (batch, row, calls), = stepped(
        tmp_path, tiny_overrides + FILTER + [
            "model.name_or_path=tiny-qwen3-moe", "model.moe_intermediate_size=32",
            "algorithm=grpo", "algorithm.routing_replay=true", "algorithm.minibatches=1"],
        reward, 1, monkeypatch)
    assert row[M.EXTRA_PROMPTS] > 0  # rounds were joined
    assert row[M.RATIO_MIN] == pytest.approx(1.0, abs=1e-5)
    assert row[M.RATIO_MAX] == pytest.approx(1.0, abs=1e-5)
    assert 0 <= row[M.MOE + "volatility"] <= 1
