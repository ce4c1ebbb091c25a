"""From task rows to token ids, from sampled token ids to text, and from completions to rewards.

Rewards are plain callables ``f(completion: str, **row_fields) -> float``. A reward function
that raises or returns a non-finite value scores 0 for that completion and is counted, never
killing the run. Two more forms score through the same `score`:

- a batched reward: an object with `batch(completions, rows) -> list[float]` (rows whole, the
  prompt included), called with at most its `batch_size` completions at a time, and an
  optional `prepare()` called first, outside the timeout (a reward model reads its weights);
- `RewardSum`: a weighted sum of rewards of either form (`data.reward=math+0.5*model:PATH`, or
  a list given from Python), each part scored its own way.
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


class RewardSum:
    """sum_k weights[k] * parts[k](completion): `data.reward=math+0.5*model:PATH`, or a list of
    rewards given from Python (weights 1, as TRL sums its reward_funcs). `score` scores each
    part its own way (batched or per call, with its own workers); a completion on which any
    part fails scores 0 and counts as one failure. Calling the sum works where every part is a
    callable. `close()` closes each part."""

    def __init__(self, parts: Sequence, weights: Sequence[float] | None = None,
                 name: str | None = None):
        self.parts = list(parts)
        self.weights = [1.0] * len(self.parts) if weights is None else list(weights)
        self.__name__ = name or "+".join(reward_name(f) for f in self.parts)

    def __call__(self, completion: str, **fields) -> float:
        return sum(w * as_reward(f(completion, **fields), f)
                   for w, f in zip(self.weights, self.parts))

    def prepare(self) -> None:
        for f in self.parts:
            _prepare(f)

    def close(self) -> None:
        from gspo.rewards import close_reward
        close_reward(self.parts)


def correctness_only(reward_fn: RewardFn) -> RewardFn:
    """`reward_fn` without its format bonus (data.format_weight), which held-out accuracy must
    not count: a boxed wrong answer would raise avg@k, and in code's 'fraction' mode half the
    tests plus a 0.5 bonus would be a pass. The same object where there is no bonus; a sum's
    other parts are shared."""
    if isinstance(reward_fn, RewardSum):
        parts = [correctness_only(f) for f in reward_fn.parts]
        if all(a is b for a, b in zip(parts, reward_fn.parts, strict=True)):
            return reward_fn
        return RewardSum(parts, reward_fn.weights, name=reward_fn.__name__)
    if getattr(reward_fn, "format_weight", 0) and hasattr(reward_fn, "with_format_weight"):
        return reward_fn.with_format_weight(0.0)
    return reward_fn


def _prepare(reward_fn) -> None:
    prepare = getattr(reward_fn, "prepare", None)
    if callable(prepare):
        prepare()


class RewardBatchError(RuntimeError):
    """A batched reward's call that raised or answered wrongly: each of its completions fails."""


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
    one), else 1. A batched reward's call is one batch: `timeout` bounds it, and when it fails
    each of its completions is counted; its `prepare()` runs first, and raises (a reward that
    cannot be loaded can never score)."""
    if len(completions) != len(rows):
        raise ValueError(f"{len(completions)} completions but {len(rows)} rows")
    _prepare(reward_fn)
    results = _results(reward_fn, list(completions), list(rows), workers, timeout)
    errors = [e for _, e in results if e is not None]
    first = None
    if errors:
        lines = str(errors[0]).strip().splitlines()
        first = type(errors[0]).__name__ + (f": {lines[0][:300]}" if lines else "")
        log.warning("reward function %s failed on %d of %d completions (first: %s); scored 0",
                    reward_name(reward_fn), len(errors), len(results), first)
    return [r for r, _ in results], len(errors), first


Result = tuple[float, "BaseException | None"]  # a completion's reward, or 0.0 and why it failed


def _checked(value, reward_fn) -> float:
    r = as_reward(value, reward_fn)
    if not math.isfinite(r) or abs(r) > MAX_ABS_REWARD:
        raise ValueError(f"reward {r} is not a finite number within +-{MAX_ABS_REWARD:g}")
    return r


def _results(reward_fn, completions: list[str], rows: list[dict], workers: int | None,
             timeout: float | None) -> list[Result]:
    """Each completion's result, by the reward's form: a sum part by part, a batched reward
    batch by batch, a plain one call by call."""
    if isinstance(reward_fn, RewardSum):
        per_part = [_results(f, completions, rows, workers, timeout) for f in reward_fn.parts]
        summed = []
        for parts in zip(*per_part):
            failed = next((e for _, e in parts if e is not None), None)
            summed.append((0.0, failed) if failed is not None else
                          (sum(w * r for w, (r, _) in zip(reward_fn.weights, parts)), None))
        return summed
    if callable(getattr(reward_fn, "batch", None)):
        return _batched(reward_fn, completions, rows, timeout)
    if workers is None:
        workers = getattr(reward_fn, "workers", None) or 1

    def one(completion: str, row: dict) -> Result:
        fields = {k: v for k, v in row.items() if k != "prompt"}
        try:
            return _checked(reward_fn(completion, **fields), reward_fn), None
        except (Exception, SystemExit) as e:  # a user's reward must never kill the run
            return 0.0, e

    if timeout is None and workers <= 1:
        return [one(c, r) for c, r in zip(completions, rows)]
    return _bounded(one, list(zip(completions, rows)), max(1, workers), timeout)


def _batched(reward_fn, completions: list[str], rows: list[dict], timeout: float | None
             ) -> list[Result]:
    """A batched reward's results, `batch_size` completions a call (default: all at once)."""
    size = getattr(reward_fn, "batch_size", None) or len(completions) or 1
    name = reward_name(reward_fn)

    def one(cs: list[str], rs: list[dict]) -> tuple[list[Result], None]:  # _bounded's shape
        try:
            values = list(reward_fn.batch(cs, rs))
        except (Exception, SystemExit) as e:  # every completion of the batch fails with it
            lines = str(e).strip().splitlines()
            failed = RewardBatchError(f"{name} raised on a batch of {len(cs)} completions: "
                                      f"{type(e).__name__}" + (f": {lines[0]}" if lines else ""))
            return [(0.0, failed)] * len(cs), None
        if len(values) != len(cs):
            failed = RewardBatchError(f"{name} returned {len(values)} rewards for a batch of "
                                      f"{len(cs)} completions; return one per completion")
            return [(0.0, failed)] * len(cs), None
        out = []
        for value in values:  # a value that is not a sane number fails its completion alone
            try:
                out.append((_checked(value, reward_fn), None))
            except (TypeError, ValueError) as e:
                out.append((0.0, e))
        return out, None

    calls = [(completions[i:i + size], rows[i:i + size]) for i in range(0, len(rows), size)]
    if timeout is None:
        done = [one(*call) for call in calls]
    else:
        done = _bounded(one, calls, 1, timeout)
    results: list[Result] = []
    for (cs, _), (out, e) in zip(calls, done):
        results += out if e is None else [(0.0, e)] * len(cs)  # e: the batch timed out
    return results


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
