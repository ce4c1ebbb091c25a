"""Micro-batches packed by token count (train.max_tokens_per_micro), as verl's dynamic batch
size (`use_dynamic_bsz`, `ppo_max_token_len_per_gpu`) packs them.

A forward over a micro-batch computes every row at the prompt width plus the micro-batch's
longest response (gspo.logprobs.token_logprobs drops the columns past it), so its cost is

    rows x (prompt width + longest response)          padded tokens

(an upper bound where the G rows of a group share their prompt's forward, which then runs the
prompt once). A fixed number of rows either wastes that padding, when one long response sits
among short ones, or must be sized for the worst case. `pack_by_tokens` sorts rows by response
length and fills each micro-batch up to the budget, so short responses travel many to a
forward and long ones few. Pure Python over lengths: no tensors, no model. verl packs in the
same spirit (`rearrange_micro_batches`), but its inputs carry no padding (sequences are
concatenated), so it balances the real tokens of ceil(total / budget) micro-batches
(Karmarkar-Karp); gspo's forwards pad, so rows of like length go together and the count follows
from the budget.
"""

from __future__ import annotations

from typing import Sequence

Unit = list[int]  # positions that stay in one micro-batch (a group's rows, or one row)


def pack_by_tokens(lengths: Sequence[int], prompt_width: int, budget: int, group: int = 1,
                   count: int = 0) -> tuple[list[list[int]], list[int]]:
    """Positions 0..n-1 (rows, with response lengths `lengths`) packed into micro-batches whose
    padded cost len(micro) * (prompt_width + its longest length) stays within `budget`.

    group: each run of `group` consecutive positions (the G responses of one prompt) is kept in
        one micro-batch, where its rows share the prompt's forward; a run that alone costs more
        than the budget is split into single rows. n must be a multiple of it.
    count: at least this many micro-batches (under FSDP2 every rank must run the same number of
        forwards): the costliest micro-batch of more than one row is halved until there are
        that many, or n.

    Rows are taken longest first, and each micro-batch is filled in that order until the next
    unit would break the budget; so micro-batches come longest first. A row that alone exceeds
    the budget gets a micro-batch of its own. Returns (micro-batches as lists of positions,
    the positions whose own cost exceeds the budget).
    """
    n = len(lengths)
    if group < 1 or n % group:
        raise ValueError(f"{n} rows are not whole groups of {group}")
    if budget < 1:
        raise ValueError(f"the token budget must be >= 1, got {budget}")
    cost = lambda units: (sum(map(len, units))  # noqa: E731
                          * (prompt_width + max(lengths[i] for u in units for i in u)))
    units: list[Unit] = []
    for start in range(0, n, group):
        unit = list(range(start, start + group))
        units += [unit] if cost([unit]) <= budget else [[i] for i in unit]
    # longest first; sorted() is stable, so equal lengths keep their order
    units = sorted(units, key=lambda u: -max(lengths[i] for i in u))
    micro: list[list[Unit]] = []
    for unit in units:
        if micro and cost(micro[-1] + [unit]) <= budget:
            micro[-1].append(unit)
        else:
            micro.append([unit])
    while len(micro) < min(count, n):
        _halve_costliest(micro, cost)
    over = [i for i in range(n) if prompt_width + lengths[i] > budget]
    return [[i for u in m for i in u] for m in micro], over


def _halve_costliest(micro: list[list[Unit]], cost) -> None:
    """Split the costliest micro-batch holding more than one row in two, between its units where
    it has several (groups stay whole), else between the rows of its one unit."""
    j = max((k for k, m in enumerate(micro) if sum(map(len, m)) > 1),
            key=lambda k: cost(micro[k]))
    units = micro[j]
    if len(units) == 1:
        units = [[i] for i in units[0]]
    half = len(units) // 2
    micro[j:j + 1] = [units[:half], units[half:]]
