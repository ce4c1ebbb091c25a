import itertools
from math import comb

import numpy as np
import pytest
import torch

from gspo.data import score
from gspo.evaluation import pass_at_k


def brute_force_pass_at_k(n, c, k):
    """Enumerate every k-subset of n samples (c correct) and count those with a correct one."""
    samples = [1] * c + [0] * (n - c)
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(samples[i] for i in s) for s in subsets) / len(subsets)


@pytest.mark.parametrize("n", [1, 2, 3, 5, 8])
def test_pass_at_k_matches_enumeration(n):
    for c in range(n + 1):
        for k in range(1, n + 1):
            assert pass_at_k(n, c, k) == pytest.approx(brute_force_pass_at_k(n, c, k), abs=1e-12)


def test_pass_at_k_large_n_matches_binomial_formula():
    # 1 - C(n-c, k) / C(n, k) with exact integers
    assert pass_at_k(100, 3, 10) == pytest.approx(1 - comb(97, 10) / comb(100, 10), rel=1e-12)


def test_pass_at_k_rejects_bad_counts():
    with pytest.raises(ValueError):
        pass_at_k(4, 5, 1)
    with pytest.raises(ValueError):
        pass_at_k(4, 1, 5)


def test_a_raising_reward_scores_zero_and_is_counted():
    def reward(completion, answer):
        if completion == "boom":
            raise RuntimeError("bad")
        return float(completion == answer)

    rows = [{"prompt": "p", "answer": "1"}] * 3
    rewards, failures, first = score(reward, ["1", "boom", "2"], rows)
    assert rewards == [1.0, 0.0, 0.0] and failures == 1 and first == "RuntimeError: bad"


def _exits(completion, **_):
    raise SystemExit(3)


def _sleeps(completion, **_):
    import time
    time.sleep(30)
    return 1.0


@pytest.mark.parametrize("reward, says", [
    (lambda c, **_: float("nan"), "ValueError: reward nan is not a finite number"),
    (lambda c, **_: 1e30, "ValueError: reward 1e+30 is not a finite number within +-1e+06"),
    (lambda c, **_: "high", "TypeError: the reward <lambda> returned the text 'high', not a "
                            "number; return a float"),
    # text that float() would read as a number: a reward's bug, never converted
    (lambda c, **_: "1", "TypeError: the reward <lambda> returned the text '1', not a number"),
    (lambda c, **_: np.str_("0.5"), "TypeError: the reward <lambda> returned the text '0.5'"),
    (lambda c, **_: b"1", "TypeError: the reward <lambda> returned the text b'1'"),
    (lambda c, **_: None, "TypeError: the reward <lambda> returned a NoneType (None)"),
    (lambda c, **_: [1.0], "TypeError: the reward <lambda> returned a list ([1.0])"),
    (lambda c, **_: torch.ones(2), "TypeError: the reward <lambda> returned a Tensor"),
    (_exits, "SystemExit: 3"),  # used to end the whole run with exit 3 and no message
])
def test_a_reward_that_is_not_a_sane_number_fails_and_is_counted(reward, says):
    rewards, failures, first = score(reward, ["x", "y"], [{"prompt": "p"}] * 2)
    assert rewards == [0.0, 0.0] and failures == 2 and first.startswith(says), first


@pytest.mark.parametrize("value", [1, 0.5, True, np.float32(0.5), np.int64(1), np.array(0.5),
                                   torch.tensor(0.5), torch.tensor([1.0])])
def test_a_number_of_any_kind_is_a_reward(value):
    rewards, failures, _ = score(lambda c, **_: value, ["x"], [{"prompt": "p"}])
    assert failures == 0 and rewards == [float(value)]


def test_a_part_of_summed_rewards_that_returns_text_is_named():
    from gspo.config import load_config
    from gspo.tasks import user_reward

    def fmt(completion, **_):
        return 0.5

    def label(completion, **_):
        return "1"

    summed = user_reward([fmt, label], load_config().data)
    rewards, failures, first = score(summed, ["x"], [{"prompt": "p"}])
    assert rewards == [0.0] and failures == 1
    assert first == ("TypeError: the reward label returned the text '1', not a number; return "
                     "a float")


def test_a_reward_past_its_timeout_fails_without_waiting_for_it():
    import time
    t0 = time.monotonic()
    rewards, failures, first = score(_sleeps, ["x"] * 4, [{"prompt": "p"}] * 4, workers=2,
                                     timeout=0.3)
    assert rewards == [0.0] * 4 and failures == 4
    assert first == "TimeoutError: the reward took longer than 0.3 s (data.reward_fn_timeout)"
    assert time.monotonic() - t0 < 5  # two batches of 2 calls, 0.3 s each, not 4 x 30 s


class _MeetsAPartner:
    """A reward whose calls only succeed two at a time: each waits for another at a barrier."""

    workers = 2

    def __init__(self, wait_s: float = 10.0):
        import threading
        self.barrier = threading.Barrier(2, timeout=wait_s)

    def __call__(self, completion, **_):
        self.barrier.wait()
        return 1.0


def test_score_runs_as_many_calls_at_once_as_the_reward_has_workers():
    # evaluation passes no workers: it gets the reward's own, as the RL step does
    rewards, failures, _ = score(_MeetsAPartner(), ["x"] * 4, [{"prompt": "p"}] * 4)
    assert rewards == [1.0] * 4 and failures == 0
    # one at a time the barrier breaks: each call fails, none hangs
    rewards, failures, first = score(_MeetsAPartner(wait_s=0.2), ["x"], [{"prompt": "p"}],
                                 workers=1)
    assert rewards == [0.0] and failures == 1 and first.startswith("BrokenBarrierError")
