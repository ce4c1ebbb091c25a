"""The embedded default task: integer arithmetic with an exact, verifiable answer.

A row is ``{"prompt": "47+85=", "answer": "132"}``. The train and held-out splits are drawn
from one seeded generator and never share a problem. The reward is exact match on the
extracted answer: the response must be the integer alone (surrounding whitespace allowed);
anything else scores 0 and never raises. `rows`, `reward` and `solution` are what gspo.tasks
registers as data.task=arithmetic.
"""

from __future__ import annotations

import random
import re

from gspo.rewards import RewardFn

_ANSWER = re.compile(r"\s*(-?\d+)\s*")
_OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


def make_splits(n_train: int, n_eval: int, digits: int = 2, operations: str = "+",
                seed: int = 1234) -> tuple[list[dict], list[dict]]:
    """Disjoint train and held-out problems, each operand with 1..digits digits."""
    rng = random.Random(seed)
    hi = 10 ** digits - 1
    n_distinct = (hi + 1) ** 2 * len(set(operations))
    if n_train + n_eval > n_distinct:
        raise ValueError(f"only {n_distinct} distinct problems exist with digits={digits} and "
                         f"operations={operations!r}; ask for fewer than {n_train + n_eval}")
    seen: set[str] = set()
    rows: list[dict] = []
    while len(rows) < n_train + n_eval:
        a, b, op = rng.randint(0, hi), rng.randint(0, hi), rng.choice(operations)
        prompt = f"{a}{op}{b}="
        if prompt in seen:
            continue
        seen.add(prompt)
        rows.append({"prompt": prompt, "answer": str(_OPS[op](a, b))})
    return rows[n_eval:], rows[:n_eval]


def extract_answer(completion: str) -> str | None:
    """The integer the completion states, or None when it is malformed."""
    if not isinstance(completion, str):
        return None
    m = _ANSWER.fullmatch(completion)
    return str(int(m.group(1))) if m else None


def exact_match_reward(completion: str, answer: str = "", **_: object) -> float:
    """1.0 when the extracted answer equals the reference integer, else 0.0."""
    got = extract_answer(completion)
    return float(got is not None and got == str(answer).strip())


def solution(row: dict) -> str:
    """The worked answer used by the supervised warm-up."""
    return row["answer"]


def rows(d) -> tuple[list[dict], list[dict]]:
    """(train, held-out) rows of a DataConfig: data.n_train, n_eval, digits, operations, seed."""
    return make_splits(d.n_train, d.n_eval, d.digits, d.operations, d.seed)


def reward(d) -> RewardFn:
    """The task's own reward, which no data.* setting changes: exact match."""
    return exact_match_reward
