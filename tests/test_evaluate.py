import itertools
from math import comb

import pytest

from gspo.data import score
from gspo.evaluate import pass_at_k


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
    rewards, failures = score(reward, ["1", "boom", "2"], rows)
    assert rewards == [1.0, 0.0, 0.0] and failures == 1


def test_a_nan_reward_scores_zero():
    rewards, failures = score(lambda c, **_: float("nan"), ["x"], [{"prompt": "p"}])
    assert rewards == [0.0] and failures == 1
