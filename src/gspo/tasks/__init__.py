"""Prompt sources with verifiable rewards. Rows are dicts with at least 'prompt' and the fields
their reward reads ('answer' for arithmetic and math, 'tests' for code).

    arithmetic   the synthetic default (gspo.tasks.arithmetic), exact-match reward
    math         rows from data.path (gspo.tasks.datasets), math-verify reward
    code         rows from data.path, tests run in the sandbox (gspo.rewards.code)

`build_task` returns (train rows, held-out rows, reward function, worked-solution function).
The solution function feeds the supervised warm-up: for math and code it returns the row's
`data.solution_field`; without one it raises ConfigError saying to set warmup.steps=0, which
the trainer meets (and the CLI prints) at the first warm-up step.
"""

from __future__ import annotations

import random
from typing import Callable

from gspo.errors import ConfigError
from gspo.tasks import arithmetic

RewardFn = Callable[..., float]


def build_task(d) -> tuple[list[dict], list[dict], RewardFn, Callable[[dict], str]]:
    """(train rows, held-out rows, reward function, worked-solution function) of a DataConfig."""
    if d.task == "arithmetic":
        train_rows, eval_rows = arithmetic.make_splits(d.n_train, d.n_eval, d.digits,
                                                       d.operations, d.seed)
        reward = build_reward(d) if d.reward else arithmetic.exact_match_reward
        return train_rows, eval_rows, reward, arithmetic.solution
    from gspo.tasks.datasets import DatasetError, load_rows

    rows = load_rows(d.path, d)
    if d.eval_path:
        train_rows, eval_rows = rows, load_rows(d.eval_path, d)
    else:
        if d.n_eval >= len(rows):
            raise DatasetError(f"data.n_eval={d.n_eval} would hold out every one of the "
                               f"{len(rows)} rows of {d.path}; lower data.n_eval or set "
                               f"data.eval_path")
        order = list(range(len(rows)))
        random.Random(d.seed).shuffle(order)
        eval_rows = [rows[i] for i in sorted(order[:d.n_eval])]
        train_rows = [rows[i] for i in sorted(order[d.n_eval:])]
    return train_rows, eval_rows, build_reward(d), _solution_fn(d)


def build_reward(d, task: str | None = None) -> RewardFn:
    """data.reward (a built-in name or 'module:function'), else the task's own reward."""
    name = d.reward or task or d.task
    if name == "arithmetic":
        return arithmetic.exact_match_reward
    if name == "math":
        from gspo.rewards.math import MathReward

        return MathReward(timeout=d.reward_timeout, format_weight=d.format_weight)
    if name == "code":
        from gspo.rewards.code import CodeReward
        from gspo.sandbox import Limits

        limits = Limits(wall_s=d.code_timeout, cpu_s=d.code_timeout,
                        memory_mb=d.code_memory_mb)
        reward = CodeReward(mode=d.reward_mode, format_weight=d.format_weight, limits=limits,
                            workers=d.code_workers or None, python=d.code_python or None)
        reward.check()  # at start, not after a run of all-zero rewards
        return reward
    from gspo.rewards import load_reward

    return load_reward(name)


def _solution_fn(d) -> Callable[[dict], str]:
    if d.solution_field:
        return lambda row: row["solution"]

    def no_solution(row: dict) -> str:
        raise ConfigError(f"the supervised warm-up needs worked solutions but data.task="
                          f"{d.task} has no data.solution_field; set warmup.steps=0 (or name "
                          f"the solution field)")

    return no_solution
