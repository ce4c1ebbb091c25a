"""From task rows to token ids, from sampled token ids to text, and from completions to rewards.

Rewards are plain callables ``f(completion: str, **row_fields) -> float``. A reward function
that raises or returns a non-finite value scores 0 for that completion and is counted, never
killing the run.
"""

from __future__ import annotations

import logging
import math
import numbers
import threading
import time
from typing import Sequence

from gspo.rewards import RewardFn

log = logging.getLogger(__name__)


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


def decode_responses(tokenizer, rollouts) -> list[str]:
    """Response texts without special tokens (EOS, padding) so rewards see plain text."""
    lengths = rollouts.response_mask.sum(-1).long().tolist()
    return [tokenizer.decode(ids[:n], skip_special_tokens=True)
            for ids, n in zip(rollouts.response_ids.tolist(), lengths)]


MAX_ABS_REWARD = 1e6
"""A reward beyond this magnitude is taken for a bug (an unscaled sum, a sentinel) and fails."""


def reward_name(reward_fn) -> str:
    """How messages name a reward: its function's name, or a callable object's class."""
    return getattr(reward_fn, "__name__", type(reward_fn).__name__)


def as_reward(value, reward_fn) -> float:
    """What `reward_fn` returned, as a float: a number (numpy's included) or a tensor / array of
    one. Anything else is a TypeError naming the reward and the value, never converted: text
    such as "1" is a reward's bug (a parsed label never made a number), which float() hides."""
    if not isinstance(value, numbers.Real) and hasattr(value, "item"):
        try:  # a tensor, an array or a numpy scalar of one element
            value = value.item()
        except (ValueError, RuntimeError):  # several elements
            pass
    if isinstance(value, numbers.Real):
        return float(value)
    what = (f"the text {value!r:.60}" if isinstance(value, (str, bytes))
            else f"a {type(value).__name__} ({value!r:.60})")
    raise TypeError(f"the reward {reward_name(reward_fn)} returned {what}, not a number; "
                    f"return a float")


def score(reward_fn: RewardFn, completions: Sequence[str], rows: Sequence[dict],
          workers: int | None = None, timeout: float | None = None
          ) -> tuple[list[float], int, str | None]:
    """Rewards of completions[i] against rows[i]; returns (rewards, number of failed calls, the
    first failure as one line, or None). Training and evaluation both score through here.

    A call fails (scores 0, counted) when it raises (SystemExit included), returns a non-number
    (text such as "1" included: see `as_reward`), a non-finite value or one beyond
    MAX_ABS_REWARD, or runs past `timeout` seconds; a call past its timeout is abandoned in its
    (daemon) thread. workers > 1 scores that many calls at once (for rewards that wait on
    subprocesses, e.g. code); None takes the reward's own `workers` attribute (CodeReward has
    one), else 1."""
    if workers is None:
        workers = getattr(reward_fn, "workers", None) or 1
    def one(completion: str, row: dict) -> tuple[float, BaseException | None]:
        fields = {k: v for k, v in row.items() if k != "prompt"}
        try:
            r = as_reward(reward_fn(completion, **fields), reward_fn)
            if not math.isfinite(r) or abs(r) > MAX_ABS_REWARD:
                raise ValueError(f"reward {r} is not a finite number within +-{MAX_ABS_REWARD:g}")
            return r, None
        except (Exception, SystemExit) as e:  # a user's reward must never kill the run
            return 0.0, e

    if len(completions) != len(rows):
        raise ValueError(f"{len(completions)} completions but {len(rows)} rows")
    if timeout is None and workers <= 1:
        results = [one(c, r) for c, r in zip(completions, rows)]
    else:
        results = _bounded(one, list(zip(completions, rows)), max(1, workers), timeout)
    errors = [e for _, e in results if e is not None]
    first = None
    if errors:
        lines = str(errors[0]).strip().splitlines()
        first = type(errors[0]).__name__ + (f": {lines[0][:300]}" if lines else "")
        log.warning("reward function %s failed on %d of %d completions (first: %s); scored 0",
                    reward_name(reward_fn), len(errors), len(results), first)
    return [r for r, _ in results], len(errors), first


def _bounded(one, calls: list[tuple], workers: int, timeout: float | None) -> list[tuple]:
    """one(*call) for every call, `workers` at a time in daemon threads, each given `timeout`."""
    results: list = [None] * len(calls)

    def run(i):
        results[i] = one(*calls[i])

    for start in range(0, len(calls), workers):
        batch = range(start, min(start + workers, len(calls)))
        threads = {i: threading.Thread(target=run, args=(i,), daemon=True) for i in batch}
        for t in threads.values():
            t.start()
        deadline = None if timeout is None else time.monotonic() + timeout
        for i, t in threads.items():
            t.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
            if results[i] is None:
                results[i] = (0.0, TimeoutError(f"the reward took longer than {timeout:g} s "
                                                f"(data.reward_fn_timeout)"))
    return results
