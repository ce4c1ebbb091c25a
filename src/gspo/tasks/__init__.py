"""Tasks: where a run's prompts come from and how their answers are rewarded, by name.

    arithmetic   the synthetic default (gspo.tasks.arithmetic), exact-match reward
    math         rows from data.path (gspo.tasks.math), math-verify reward
    code         rows from data.path, tests run in the sandbox (gspo.tasks.code)

Each is a TaskSpec in TASKS (gspo.tasks.registry, re-exported here), which data.task names;
config validation, `build_task`, `build_reward` and the row mapping
(gspo.tasks.datasets.map_row) all read it. A new task is one module (its rows or the parsing of
its field, its reward) and one `register_task` line. Rows are dicts with at least 'prompt' and
the field their reward reads ('answer' for arithmetic and math, 'tests' for code).

`build_task` returns (train rows, held-out rows, reward function, worked-solution function).
Rows are generated (a synthetic task) or come from data.path / data.eval_path, or from Python
(`train_data` / `eval_data`: a list of dicts or a `datasets.Dataset`, mapped through the same
data.* fields and checks as a file); a Python `reward_fn` replaces data.reward.
The solution function feeds the supervised warm-up: the task's own (arithmetic), else the
row's `data.solution_field`; without one it raises ConfigError saying to set warmup.steps=0,
which the trainer meets (and the CLI prints) at the first warm-up step.
"""

from __future__ import annotations

import random
from typing import Callable

from gspo.data import RewardSum
from gspo.errors import ConfigError
from gspo.rewards import MODEL_PREFIX, RewardFn, close_reward, load_reward, parse_reward_spec
from gspo.tasks.registry import TASKS, TaskSpec, file_tasks, get_task, register_task


def build_task(d, train_data=None, eval_data=None, reward_fn=None,
               bad_rows: list[str] | None = None
               ) -> tuple[list[dict], list[dict], RewardFn, Callable[[dict], str]]:
    """(train rows, held-out rows, reward function, worked-solution function) of a DataConfig,
    with rows and reward given from Python in place of data.path / data.eval_path /
    data.reward. bad_rows: see gspo.tasks.datasets.map_rows."""
    task = get_task(d.task)
    reward = user_reward(reward_fn, d) if reward_fn is not None else None
    if task.make_rows is not None:
        if train_data is not None or eval_data is not None:
            raise ConfigError(f"train_data / eval_data rows are read with data.task="
                              f"{' or '.join(file_tasks())} (their fields mapped by "
                              f"data.prompt_field, data.answer_field or data.tests_field); set "
                              f"data.task")
        train_rows, eval_rows = task.make_rows(d)
    else:
        train_rows, eval_rows = _read_rows(d, train_data, eval_data, bad_rows)
    solution = task.solution or _solution_fn(d)
    return train_rows, eval_rows, build_reward(d) if reward is None else reward, solution


def _read_rows(d, train_data, eval_data, bad_rows) -> tuple[list[dict], list[dict]]:
    """(train, held-out) rows of a task read from data.path / data.eval_path or Python rows."""
    from gspo.tasks.datasets import DatasetError, load_rows, map_rows, python_rows

    def rows_of(data, what, key, split):  # Python rows, else the file, else None
        if data is not None and getattr(d, key):
            raise ConfigError(f"both {what} and data.{key} are given; pass one")
        if data is not None:
            return map_rows(python_rows(data, what), what, d, d.task, bad_rows)
        path = getattr(d, key)
        return load_rows(path, d, split=split, bad_rows=bad_rows) if path else None

    rows = rows_of(train_data, "train_data", "path", d.split)
    if rows is None:
        raise ConfigError(f"data.task={d.task} reads its prompts from data.path: set data.path="
                          f"FILE (.jsonl, .parquet, .csv, a datasets directory or a hub dataset "
                          f"id), or from Python pass train(..., train_data=rows)")
    held_out = rows_of(eval_data, "eval_data", "eval_path", d.eval_split or d.split)
    if held_out is not None:
        return rows, held_out
    if d.n_eval >= len(rows):
        raise DatasetError(f"data.n_eval={d.n_eval} would hold out every one of the "
                           f"{len(rows)} rows of {d.path or 'train_data'}; lower data.n_eval or "
                           f"set data.eval_path")
    order = list(range(len(rows)))
    random.Random(d.seed).shuffle(order)
    return [rows[i] for i in sorted(order[d.n_eval:])], [rows[i] for i in sorted(order[:d.n_eval])]


def user_reward(reward_fn, d) -> RewardFn:
    """A reward given from Python: one callable f(completion, **row_fields) -> float (or a
    batched reward, see gspo.data.score), or a list of them whose rewards are summed (as TRL
    sums its reward_funcs)."""
    if d.reward:
        raise ConfigError(f"a reward_fn is given and data.reward={d.reward!r} too; pass one")
    fns = list(reward_fn) if isinstance(reward_fn, (list, tuple)) else [reward_fn]
    bad = [f for f in fns if not callable(f) and not callable(getattr(f, "batch", None))]
    if bad or not fns:
        raise ConfigError(f"reward_fn must be a callable f(completion, **row_fields) -> float "
                          f"or a list of them, got {type(bad[0]).__name__ if bad else 'an empty list'}")
    return fns[0] if len(fns) == 1 else RewardSum(fns)


def build_reward(d, task: str | None = None) -> RewardFn:
    """data.reward, else the reward of `task` (default data.task). data.reward names one reward
    or a weighted sum of them ('math+0.5*model:PATH', gspo.rewards.parse_reward_spec), each a
    task's name (for its reward), 'module:function' / 'file.py:function', or 'model:PATH' (a
    reward model, gspo.rewards.model)."""
    parts = parse_reward_spec(d.reward) if d.reward else [(1.0, task or d.task)]
    built: list = []
    try:
        for _, name in parts:
            built.append(_one_reward(name, d))
    except BaseException:
        close_reward(built)
        raise
    if len(parts) == 1 and parts[0][0] == 1.0:
        return built[0]
    return RewardSum(built, [w for w, _ in parts], name=d.reward)


def _one_reward(name: str, d) -> RewardFn:
    if name in TASKS:
        return TASKS[name].make_reward(d)
    if name.startswith(MODEL_PREFIX):
        from gspo.rewards.model import RewardModel  # torch and transformers: only when asked
        return RewardModel(name[len(MODEL_PREFIX):], device=d.reward_device,
                           dtype=d.reward_dtype, batch_size=d.reward_batch_size,
                           system_prompt=d.system_prompt)
    return load_reward(name)


def _solution_fn(d) -> Callable[[dict], str]:
    if d.solution_field:
        return lambda row: row["solution"]

    def no_solution(row: dict) -> str:
        raise ConfigError(f"the supervised warm-up needs worked solutions but data.task="
                          f"{d.task} has no data.solution_field; set warmup.steps=0 (or name "
                          f"the solution field)")

    return no_solution


__all__ = ["TASKS", "TaskSpec", "build_reward", "build_task", "file_tasks", "get_task",
           "register_task", "user_reward"]
