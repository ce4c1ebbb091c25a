"""Held-out evaluation: avg@k (mean accuracy over k samples, as the paper's AIME'24 avg@32)
and the unbiased pass@k estimator (Chen et al., 2021). The trainer's periodic evaluation and
`gspo eval` share this code.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

from gspo.data import decode_responses, encode_prompts, score
from gspo.engines import RolloutEngine, SamplingParams
from gspo.rewards import RewardFn


def pass_at_k(n: int, c: int, k: int) -> float:
    """P(at least one of k samples drawn without replacement from n is correct), c correct.

        pass@k = 1 - C(n - c, k) / C(n, k) = 1 - prod_{i=n-c+1}^{n} (1 - k / i)
    """
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    if n - c < k:
        return 1.0
    prob_all_wrong = 1.0
    for i in range(n - c + 1, n + 1):
        prob_all_wrong *= 1.0 - k / i
    return 1.0 - prob_all_wrong


@dataclass
class EvalResult:
    avg_at_k: float                       # mean reward over all problems and samples
    pass_at: dict[int, float]             # k -> mean unbiased pass@k over problems
    per_problem: list[dict] = field(default_factory=list)
    reward_failures: int = 0
    first_error: str | None = None        # the first failed reward call, as one line


def evaluate(engine: RolloutEngine, tokenizer, rows: Sequence[dict], reward_fn: RewardFn,
             k: int, params: SamplingParams, seed: int, batch_size: int = 64,
             system_prompt: str | None = None, success_threshold: float = 1.0,
             reward_timeout_s: float | None = None,
             should_stop: Callable[[], bool] | None = None) -> EvalResult:
    """Sample k responses per row and score them; a sample counts as correct for pass@k when
    its reward is >= success_threshold. A reward call past reward_timeout_s fails (scores 0).
    should_stop: checked before each batch; when true, the rows evaluated so far are returned
    (a stop request is honoured within one batch)."""
    per_problem, failures, first_error = [], 0, None
    for start in range(0, len(rows), batch_size):
        if should_stop is not None and should_stop():
            break
        chunk = rows[start:start + batch_size]
        rollouts = engine.generate(encode_prompts(tokenizer, chunk, system_prompt), n=k,
                                   params=params, seed=seed + start)
        texts = decode_responses(tokenizer, rollouts)
        rewards, fails, first = score(reward_fn, texts, [row for row in chunk for _ in range(k)],
                                      timeout=reward_timeout_s)
        failures, first_error = failures + fails, first_error or first
        for i, row in enumerate(chunk):
            rs = rewards[i * k:(i + 1) * k]
            per_problem.append({"prompt": row["prompt"], "rewards": rs,
                                "completions": texts[i * k:(i + 1) * k],
                                "correct": sum(r >= success_threshold for r in rs)})
    avg = sum(sum(p["rewards"]) for p in per_problem) / max(1, len(per_problem) * k)
    pass_at = {j: sum(pass_at_k(k, p["correct"], j) for p in per_problem) / max(1, len(per_problem))
               for j in _ks(k)}
    return EvalResult(avg, pass_at, per_problem, failures, first_error)


def _ks(k: int) -> list[int]:
    """1, 2, 4, ... up to k, and k itself."""
    ks, j = [], 1
    while j < k:
        ks.append(j)
        j *= 2
    return ks + [k]
