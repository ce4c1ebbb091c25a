"""The metrics of a run: their names, defined once, and the weighted mean that reduces them.

The trainer writes one row of metrics.jsonl per RL step under these names; `gspo plot`, the
benchmarks and the tests take the names from here instead of spelling the strings.

`WeightedMean` gathers what a step measures over micro-batches, minibatches and ranks: means
weighted by what they average over (tokens, sequences, problems), plain sums, minima and maxima.
`result` reduces them over ranks in one all-reduce per kind, so every rank gets the values one
big batch on one process would give.
"""

from __future__ import annotations

# ---- one row per RL step
REWARD_MEAN = "reward/mean"            # mean reward of the step's completions (with
                                       # rollout.filter_groups: of those trained on, not the
                                       # dropped groups)
REWARD_STD = "reward/std"              # their standard deviation (unbiased)
REWARD_FAILURES = "reward/failures"    # reward calls that raised, timed out or gave no number
LOSS = "loss"                          # the minimised loss, mean over the step's minibatches
CLIP_FRAC = "clip/frac"                # fraction of tokens whose ratio was clipped
CLIP_FRAC_LOW = "clip/frac_low"        # ... below 1 - eps_low (advantage < 0)
CLIP_FRAC_HIGH = "clip/frac_high"      # ... above 1 + eps_high (advantage > 0)
RATIO_MEAN = "ratio/mean"              # importance ratio (per sequence for GSPO, token for GRPO)
RATIO_MIN = "ratio/min"
RATIO_MAX = "ratio/max"
KL_OLD = "kl/old"                      # per-token KL(pi_old || pi_theta) estimate
ENTROPY = "entropy"                    # per-token entropy of pi_old on the responses
GRAD_NORM = "grad_norm"                # before clipping, mean over the step's minibatches
LR = "lr"
LOSS_SCALE = "fp16/loss_scale"         # fp16-mixed: the dynamic loss scale after the step
SKIPPED_STEPS = "fp16/skipped_steps"   # fp16-mixed: optimiser steps skipped on an overflow
RESPONSE_LEN = "response/len_mean"     # mean response length in tokens
TRUNCATED = "response/truncated_frac"  # the fraction cut at rollout.max_new_tokens (no stop token)
OVERLONG_PENALTY = "reward/overlong_penalty"  # algorithm.overlong=soft_penalty: its mean (<= 0),
                                       # added to the reward the advantages see (not reward/mean)
TIME_ROLLOUT = "time/rollout_s"        # sampling and rewards
TIME_OLD_LOGP = "time/old_logp_s"
TIME_UPDATE = "time/update_s"          # the optimiser steps and the rollout engine's weight sync
TOKENS_PER_S = "throughput/tokens_per_s"
STALENESS = "rollout/staleness"        # updates between the sampling weights and the trainer's
TIME_SAMPLE = "time/sample_s"          # rollout.max_staleness >= 1: sampling, in its own thread
                                       # (time/rollout_s is then the trainer's wait for it)
FILTERED_GROUPS = "rollout/filtered_groups"  # rollout.filter_groups, summed over ranks: groups
                                       # whose rewards were all equal, dropped
EXTRA_PROMPTS = "rollout/extra_prompts"  # ... prompts sampled beyond rollout.prompts_per_step
FILLED_GROUPS = "rollout/filled_groups"  # ... slots that rollout.filter_max_rounds left to
                                       # dropped groups (trained on, zero advantage)
IS_WEIGHT_MEAN = "is/weight_mean"       # algorithm.is_correction: its weights' mean over tokens
IS_WEIGHT_MIN = "is/weight_min"
IS_WEIGHT_MAX = "is/weight_max"
IS_MASKED_TOKENS = "is/masked_token_frac"  # ... the fraction of tokens it masked (weight 0)
IS_MASKED_SEQS = "is/masked_seq_frac"      # ... of sequences with no token left
MISMATCH = "mismatch/"                 # prefix: trainer vs rollout-engine log-probs
MOE = "moe/"                           # prefix: router load and expert volatility
MOE_AUX_LOSS = "moe/aux_loss"          # the router load-balancing loss of the update forwards
                                       # (algorithm.router_aux_loss_coef > 0), unweighted

# ---- held-out evaluation (step 0, every train.eval_every steps and the last)
EVAL_ACCURACY = "eval/accuracy"        # avg@k
ROW_ORDER = (REWARD_MEAN, REWARD_STD, REWARD_FAILURES, LOSS, CLIP_FRAC, CLIP_FRAC_LOW,
             CLIP_FRAC_HIGH, RATIO_MEAN, RATIO_MIN, RATIO_MAX, KL_OLD, ENTROPY, GRAD_NORM, LR,
             RESPONSE_LEN, TRUNCATED, TIME_ROLLOUT, TIME_OLD_LOGP, TIME_UPDATE, TOKENS_PER_S)
"""The order of a step's row in metrics.jsonl; then mismatch/*, moe/* and any other."""


def in_row_order(row: dict[str, float]) -> dict[str, float]:
    """`row` with its keys in ROW_ORDER (a stable sort: prefixed groups keep their order)."""
    def rank(key: str) -> tuple[int, int]:
        if key in ROW_ORDER:
            return 0, ROW_ORDER.index(key)
        return (1 if key.startswith(MISMATCH) else 2 if key.startswith(MOE) else 3), 0
    return dict(sorted(row.items(), key=lambda kv: rank(kv[0])))


OBJECTIVE = {"clip_frac": CLIP_FRAC, "clip_frac_low": CLIP_FRAC_LOW,
             "clip_frac_high": CLIP_FRAC_HIGH, "kl_old": KL_OLD,
             "is_weight_mean": IS_WEIGHT_MEAN, "is_masked_token_frac": IS_MASKED_TOKENS}
"""The token-weighted metrics of gspo.objectives' losses, as the trainer logs them."""


def eval_pass_at(k: int) -> str:
    return f"eval/pass@{k}"


TITLES = {REWARD_MEAN: "reward (mean)", EVAL_ACCURACY: "held-out accuracy",
          CLIP_FRAC: "clip fraction", KL_OLD: "KL to pi_old", ENTROPY: "entropy",
          RESPONSE_LEN: "response length (mean tokens)"}
"""What `gspo plot` draws by default, with its chart titles."""


class WeightedMean:
    """Named means, sums and extremes accumulated locally, reduced over ranks by `result`.

    Every rank must add the same names (the reduction is a collective over their values)."""

    def __init__(self) -> None:
        self._totals: dict[str, float] = {}   # name -> sum of weight * value
        self._weights: dict[str, float] = {}  # name -> sum of weight
        self._sums: dict[str, float] = {}
        self._min: dict[str, float] = {}
        self._max: dict[str, float] = {}

    def add(self, name: str, value: float, weight: float = 1.0) -> None:
        """A value that is the mean over `weight` items (tokens, sequences, ...)."""
        self.add_total(name, float(weight) * float(value), weight)

    def add_total(self, name: str, total: float, weight: float) -> None:
        """A total over `weight` items, e.g. a sum of rewards and the number of completions."""
        self._totals[name] = self._totals.get(name, 0.0) + float(total)
        self._weights[name] = self._weights.get(name, 0.0) + float(weight)

    def add_sum(self, name: str, value: float) -> None:
        self._sums[name] = self._sums.get(name, 0.0) + float(value)

    def add_min(self, name: str, value: float) -> None:
        self._min[name] = min(self._min.get(name, float("inf")), float(value))

    def add_max(self, name: str, value: float) -> None:
        self._max[name] = max(self._max.get(name, float("-inf")), float(value))

    def result(self, d) -> dict[str, float]:
        """The means, sums and extremes over everything added on every rank of `d` (a
        gspo.distributed.Dist): one sum all-reduce, and one max all-reduce if any extremes."""
        means, sums = sorted(self._totals), sorted(self._sums)
        reduced = d.sum([self._totals[k] for k in means] + [self._weights[k] for k in means] +
                        [self._sums[k] for k in sums])
        n = len(means)
        out = {k: reduced[i] / reduced[n + i] for i, k in enumerate(means)}
        out.update(zip(sums, reduced[2 * n:]))
        lows, highs = sorted(self._min), sorted(self._max)
        if lows or highs:
            extremes = d.max([-self._min[k] for k in lows] + [self._max[k] for k in highs])
            out.update({k: -v for k, v in zip(lows, extremes)})
            out.update(zip(highs, extremes[len(lows):]))
        return out
