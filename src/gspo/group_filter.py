"""rollout.filter_groups: DAPO's dynamic sampling (Yu et al., arXiv 2503.14476, sec. 3.2), as
verl's algorithm.filter_groups does it, on each rank's own share of the step.

A group whose G rewards are all equal (as the advantages see them: with
algorithm.overlong=soft_penalty, the penalty included) has zero advantage: it adds nothing to
the gradient but still takes its place in the batch. With filtering on, each rank samples its
share of the step's prompts (round 0: the same prompts and engine seeds as without
filtering), drops the constant groups, and samples more prompts in extra rounds until its
share holds groups whose rewards vary, or rollout.filter_max_rounds extra rounds are spent. Slots still empty then take
dropped groups (zero advantage, so they change no gradient), in the order they were sampled:
the step keeps its shape, so the minibatches divide as before and every rank runs the same
collectives after sampling. Nothing here is a collective: ranks may take different numbers of
rounds, and the sampler thread (rollout.max_staleness >= 1) runs it.

Where verl samples whole generation batches and stops the run when its bound is hit, an extra
round here samples what is missing, scaled up by the share of varying groups seen so far in
the step (at most the rank's share), and a step at the bound trains on with the dropped groups
it has (counted in rollout/filled_groups).

The extra prompts of round k >= 1 on rank r are a function of (train.seed, step, k, r): the
rows the step's first prompts left out, shuffled once per step and dealt round-robin to the
ranks, each round reading the next window of its rank's stream; a step sees no prompt twice
while the rows last (then the stream starts over).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Callable

import torch

from gspo.engines import Rollouts


@dataclass
class Round:
    """One sampling round of this rank: its prompts, G responses to each, decoded and scored."""
    rows: list[dict]
    rollouts: Rollouts
    texts: list[str]
    rewards: list[float]
    failures: int
    first_error: str | None
    varying: list[bool]  # per prompt: whether its G rewards (as the advantages see them) vary


@dataclass
class FilterStats:
    """What filtering did on this rank in one step (metrics sum them over ranks)."""
    scored: int           # completions scored in every round
    filtered: int         # constant groups dropped (sampled, not trained on)
    extra_prompts: int    # prompts sampled beyond the rank's share
    filled: int           # slots the bound left to constant groups
    rounds: int           # extra rounds taken


def extra_prompts(n_rows: int, first: list[int], step: int, round: int, n: int, share: int,
                  rank: int, world: int, seed: int) -> list[int]:
    """Row indices of extra round `round` (>= 1) of step `step` on `rank`: the first n of its
    window of `share`. first: the indices of the step's first prompts (every rank's)."""
    if round < 1 or not 0 <= n <= share:
        raise ValueError(f"extra round {round} of {n} prompts (share {share})")
    taken = set(first)
    stream = [i for i in range(n_rows) if i not in taken]
    random.Random(f"gspo-filter-groups/{seed}/{step}").shuffle(stream)  # a str seed: stable
    stream += first  # only once the other rows are spent: a new group of the same prompt
    start = (round - 1) * share
    return [stream[((start + j) * world + rank) % len(stream)] for j in range(n)]


def round_size(missing: int, seen: int, kept: int, share: int) -> int:
    """Prompts for the next extra round: the missing groups scaled up by the share of varying
    groups among those seen so far in the step (the whole share when none varied yet), at
    least `missing`, at most `share`."""
    if kept == 0:
        return share
    return min(share, max(missing, -(-missing * seen // kept)))


def fill(sample: Callable[[int, int], Round], share: int, max_rounds: int
         ) -> tuple[list[Round], list[tuple[int, int]], FilterStats]:
    """Sample rounds (`sample(round, n)`: round 0 is the rank's share, n == share) until `share`
    varying groups are found or `max_rounds` extra rounds are spent. Returns the rounds, the
    `share` groups to train on as (round, group) pairs (the varying ones in sampling order,
    then dropped ones to fill what is left) and the stats."""
    rounds = [sample(0, share)]
    kept = [(0, g) for g, v in enumerate(rounds[0].varying) if v]
    seen = share
    while len(kept) < share and len(rounds) <= max_rounds:
        k = len(rounds)
        rounds.append(sample(k, round_size(share - len(kept), seen, len(kept), share)))
        kept += [(k, g) for g, v in enumerate(rounds[k].varying) if v]
        seen += len(rounds[k].varying)
    constant = [(k, g) for k, rd in enumerate(rounds) for g, v in enumerate(rd.varying)
                if not v]
    filled = max(0, share - len(kept))
    picks = kept[:share] + constant[:filled]
    stats = FilterStats(scored=sum(len(rd.rewards) for rd in rounds),
                        filtered=len(constant) - filled, extra_prompts=seen - share,
                        filled=filled, rounds=len(rounds) - 1)
    return rounds, picks, stats


def merge(rounds: list[Round], picks: list[tuple[int, int]], group_size: int, pad_id: int
          ) -> tuple[list[dict], Rollouts, list[str], list[float]]:
    """The picked groups as one batch, in the order picked, G rows each (prompt-major): their
    rows, rollouts (padded to the widest round), decoded texts and rewards."""
    G, offsets, start = group_size, [], 0
    for rd in rounds:
        offsets.append(start)
        start += len(rd.rewards)
    index = [offsets[k] + g * G + i for k, g in picks for i in range(G)]
    rollouts = Rollouts.cat([rd.rollouts for rd in rounds], pad_id)
    rollouts = rollouts.select(torch.tensor(index, device=rollouts.response_ids.device))
    texts = [t for rd in rounds for t in rd.texts]
    rewards = [x for rd in rounds for x in rd.rewards]
    rows = [rounds[k].rows[g] for k, g in picks]
    return rows, rollouts, [texts[i] for i in index], [rewards[i] for i in index]
