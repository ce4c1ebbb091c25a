"""From task rows to token ids, and from completions to rewards.

Rewards are plain callables ``f(completion: str, **row_fields) -> float``. A reward function
that raises or returns a non-finite value scores 0 for that completion and is counted, never
killing the run.
"""

from __future__ import annotations

import logging
import math
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Sequence

log = logging.getLogger(__name__)

RewardFn = Callable[..., float]


def encode_prompts(tokenizer, rows: Sequence[dict], system_prompt: str | None = None
                   ) -> list[list[int]]:
    """Token ids of each row's prompt, through the tokenizer's chat template when it has one."""
    out = []
    for row in rows:
        if getattr(tokenizer, "chat_template", None):
            messages = [{"role": "user", "content": row["prompt"]}]
            if system_prompt:
                messages.insert(0, {"role": "system", "content": system_prompt})
            text = tokenizer.apply_chat_template(messages, tokenize=False,
                                                 add_generation_prompt=True)
        else:
            text = row["prompt"]
        out.append(tokenizer.encode(text, add_special_tokens=False))
    return out


def score(reward_fn: RewardFn, completions: Sequence[str], rows: Sequence[dict],
          workers: int = 1) -> tuple[list[float], int]:
    """Rewards of completions[i] against rows[i]; returns (rewards, number of failed calls).

    workers > 1 scores in a thread pool (for rewards that wait on subprocesses, e.g. code)."""
    def one(completion: str, row: dict) -> tuple[float, Exception | None]:
        fields = {k: v for k, v in row.items() if k != "prompt"}
        try:
            r = float(reward_fn(completion, **fields))
            if not math.isfinite(r):
                raise ValueError(f"non-finite reward {r}")
            return r, None
        except Exception as e:  # a user's reward must never kill the run
            return 0.0, e

    if len(completions) != len(rows):
        raise ValueError(f"{len(completions)} completions but {len(rows)} rows")
    if workers > 1:
        with ThreadPoolExecutor(workers) as pool:
            results = list(pool.map(one, completions, rows))
    else:
        results = [one(c, r) for c, r in zip(completions, rows)]
    errors = [e for _, e in results if e is not None]
    if errors:
        log.warning("reward function %s failed on %d of %d completions (first: %s: %s); "
                    "scored 0", getattr(reward_fn, "__name__", reward_fn), len(errors),
                    len(results), type(errors[0]).__name__, errors[0])
    return [r for r, _ in results], len(errors)
