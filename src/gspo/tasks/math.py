"""The math task: rows read from data.path, their final answers checked with math-verify
(gspo.rewards.math). What gspo.tasks registers as data.task=math; math-verify's helper process
starts only when the reward first scores.
"""

from __future__ import annotations

from typing import Any

from gspo.rewards import RewardFn


def reward(d) -> RewardFn:
    """The math-verify reward under data.reward_timeout and data.format_weight."""
    from gspo.rewards.math import MathReward

    return MathReward(timeout=d.reward_timeout, format_weight=d.format_weight)


def parse_answer(value: Any, raw: dict, d) -> str | list[str]:
    """The reference answer of a row, as text; several accepted forms stay a list (the reward
    takes any one of them). ValueError for a list that holds no answer: every sample would
    score 0."""
    if isinstance(value, (list, tuple)):
        answers = [str(a).strip() for a in value]
        if not answers:
            raise ValueError("an empty list; give the answer, or a list of its accepted forms")
        if not all(answers):
            raise ValueError(f"answer {answers.index('') + 1} of the list is empty; give each "
                             f"accepted form, or drop the empty one")
        return answers
    return str(value).strip()


def sample_answer(row: dict) -> tuple[str, str]:
    """(the reference answer written as a model would, what it is) for the dry run's check."""
    from gspo.rewards.math import reference_text

    answer = row["answer"][0] if isinstance(row["answer"], list) else row["answer"]
    return f"The answer is {reference_text(answer)}.", "reference answer"
