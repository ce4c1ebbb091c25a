"""The code task: rows read from data.path with tests (gspo.rewards.code_tests reads their
formats), a completion's program run against them in the sandbox (gspo.rewards.code). What
gspo.tasks registers as data.task=code; the sandbox is imported only when the reward is built.
"""

from __future__ import annotations

from typing import Any

from gspo.rewards import RewardFn
from gspo.rewards.code_tests import normalize_tests


def reward(d) -> RewardFn:
    """The sandboxed-tests reward under data.reward_mode, code_timeout, code_memory_mb,
    code_workers and code_python; checked at once to run on this machine."""
    from gspo.rewards.code import CodeReward
    from gspo.sandbox import Limits

    limits = Limits(wall_s=d.code_timeout, cpu_s=d.code_timeout, memory_mb=d.code_memory_mb)
    code_reward = CodeReward(mode=d.reward_mode, format_weight=d.format_weight, limits=limits,
                             workers=d.code_workers or None, python=d.code_python or None)
    code_reward.check()  # at start, not after a run of all-zero rewards
    return code_reward


def parse_tests(value: Any, raw: dict, d) -> list[dict]:
    """The row's tests in canonical form; call tests without a name take the row's
    data.fn_name_field. ValueError when malformed."""
    fn_name = raw.get(d.fn_name_field) if d.fn_name_field else None
    return normalize_tests(value, fn_name or None)


def sample_answer(row: dict) -> tuple[str, str]:
    """(a program a model could write, what it is) for the dry run's check: it need not pass,
    only be scored."""
    return "```python\nprint()\n```", "placeholder program"
