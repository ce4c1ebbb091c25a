"""gspo.rewards itself: closing rewards that hold resources (load_reward is tested with the data
mapping in test_datasets.py)."""

import logging
import threading

from gspo.config import DataConfig
from gspo.rewards import close_reward
from gspo.rewards.code import CodeReward
from gspo.sandbox import Limits
from gspo.tasks import user_reward


class Closable:
    def __init__(self, fails: bool = False):
        self.closed, self.fails = 0, fails
        self.__name__ = "closable"

    def __call__(self, completion, **_):
        return 1.0

    def close(self):
        self.closed += 1
        if self.fails:
            raise RuntimeError("lost the helper")


def test_close_reward_closes_what_has_a_close_and_passes_over_plain_functions():
    def plain(completion, **_):
        return 0.0

    one, two = Closable(), Closable()
    close_reward(plain)
    close_reward(one)
    close_reward([plain, two, len])
    assert (one.closed, two.closed) == (1, 1)


def test_a_close_that_raises_is_logged_and_the_others_are_still_closed(caplog):
    broken, fine = Closable(fails=True), Closable()
    with caplog.at_level(logging.WARNING):
        close_reward((broken, fine))  # must not raise: it runs in finally blocks
    assert (broken.closed, fine.closed) == (1, 1)
    assert "closing reward closable failed: RuntimeError: lost the helper" in caplog.text


def test_closing_a_sum_of_python_rewards_closes_each_part():
    parts = [Closable(), Closable()]
    summed = user_reward(parts, DataConfig())
    assert summed("x") == 2.0
    close_reward(summed)
    assert [p.closed for p in parts] == [1, 1]


def _sandbox_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("gspo-sandbox")]


def test_the_code_reward_releases_its_pool_and_starts_a_new_one_when_called_again():
    reward = CodeReward(workers=2, limits=Limits(wall_s=10.0, cpu_s=5.0))
    program, tests = "```python\nprint(3)\n```", [{"input": "", "output": "3"}]
    before = set(_sandbox_threads())
    assert reward(program, tests=tests) == 1.0
    assert set(_sandbox_threads()) - before  # the pool's threads
    close_reward(reward)
    assert not set(_sandbox_threads()) - before
    assert reward(program, tests=tests) == 1.0
    close_reward(reward)
