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


def test_correctness_only_drops_the_format_bonus_of_each_built_in_part():
    from gspo.data import RewardSum, correctness_only
    from gspo.rewards.code import CodeReward
    from gspo.rewards.math import MathReward

    def plain(completion, **_):
        return 0.25

    assert correctness_only(plain) is plain
    no_bonus = MathReward()
    assert correctness_only(no_bonus) is no_bonus
    math = MathReward(format_weight=0.3)
    held = correctness_only(math)
    assert held is not math and held.format_weight == 0.0 and math.format_weight == 0.3
    assert held.timeout == math.timeout and held.max_chars == math.max_chars
    code = CodeReward(mode="fraction", format_weight=0.5)
    held_code = correctness_only(code)
    assert (held_code.mode, held_code.format_weight, held_code.sandbox) == ("fraction", 0.0,
                                                                           code.sandbox)
    total = RewardSum([math, plain], [1.0, 2.0], name="math+2*plain")
    held_total = correctness_only(total)
    assert held_total.parts[1] is plain and held_total.parts[0].format_weight == 0.0
    assert held_total.weights == [1.0, 2.0] and held_total.__name__ == "math+2*plain"
    assert held_total("\\boxed{7}", answer="6") == 0.5  # 0 + 2 * 0.25; the bonus was 0.3
    assert abs(total("\\boxed{7}", answer="6") - 0.8) < 1e-12
    untouched = RewardSum([no_bonus, plain])
    assert correctness_only(untouched) is untouched
    for r in (math, held, held_total, total):
        r.close()


def test_closing_a_run_closes_each_reward_part_once():
    """The held-out reward (format bonus off) shares a sum's other parts with the training
    reward: each is closed once, a user's close() included."""
    from types import SimpleNamespace

    from gspo.callbacks import Callbacks
    from gspo.data import RewardSum, correctness_only
    from gspo.rewards.math import MathReward
    from gspo.trainer import close_run

    class Counted:
        closes = 0

        def __call__(self, completion, **_):
            return 0.0

        def close(self):
            self.closes += 1

    user, math = Counted(), MathReward(format_weight=0.2)
    total = RewardSum([math, user])
    held = correctness_only(total)
    closed = []
    held.parts[0].close = lambda: closed.append("held-out math")
    math.close = lambda: closed.append("math")
    nothing = SimpleNamespace(close=lambda: None)
    run = SimpleNamespace(sampler=None, threads=None, engine=nothing, routing=nothing,
                          reward_fn=total, eval_reward_fn=held, callbacks=Callbacks())
    close_run(run)
    assert user.closes == 1 and sorted(closed) == ["held-out math", "math"]
