"""One RL step, in call order: a producer that samples and scores, a consumer that learns.

    rl_step    produce -> consume, each phase timed and shown to the run's callbacks
    produce    this rank's share of the step's prompts, G responses to each, decoded and
               scored; with rollout.filter_groups, more prompts in place of the groups whose
               rewards are all equal (gspo.group_filter). With rollout.max_staleness >= 1 it
               runs in the sampler's thread (sample_batch), so it holds no collective
    consume    group advantages -> pi_old (and pi_ref) -> minibatch updates, each weighted by
               the off-policy correction (algorithm.is_correction) -> the engine's new
               weights -> the step's row of metrics. With rollout.max_staleness >= 1 the
               sampler's thread may recompute pi_old while the updates run (`old_policy`)

Every function here works on a gspo.run.Run; the loop around the steps (evaluation,
checkpoints, signals) is gspo.trainer's.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import random
import time

import torch

from gspo import metrics as M
from gspo import precision
from gspo.async_rollouts import Batch, Rows
from gspo.data import decode_responses, encode_prompts, score
from gspo.distributed import Dist, Policy, as_local, is_sharded, no_sync
from gspo.engines import Rollouts, SamplingParams, stop_token_ids
from gspo.errors import TrainingError
from gspo.metrics import WeightedMean
from gspo.group_filter import Round, extra_prompts, fill, merge
from gspo.lora import is_lora
from gspo.moe import NoRouting
from gspo.objectives import (OBJECTIVES, NonFiniteError, engine_mismatch, group_advantages,
                             importance_weights, kl_k3, overlong_penalty, varying_groups)
from gspo.packing import pack_by_tokens
from gspo.run import Run, policy_weights
from gspo.signals import StopRequest

log = logging.getLogger(__name__)


def rl_step(run: Run, step: int, stop: StopRequest | None = None) -> dict[str, float] | None:
    """One RL step; returns its metrics row, or None when `stop` was requested during the
    rollout (the step is abandoned before any update)."""
    t0, times = time.perf_counter(), {}
    run.callbacks.on_step_begin(run, step)
    with _phase(run, step, "rollout", times):
        batch = (run.sampler.take(step) if run.sampler is not None
                 else produce(run, step, stop))
    if batch is None or (stop is not None and stop.requested(run.dist)):
        return None
    row = consume(run, step, batch, times)
    row[M.TOKENS_PER_S] = row.pop("tokens") / (time.perf_counter() - t0)
    row = M.in_row_order(row)
    run.callbacks.on_step_end(run, step, row)
    return row


@contextlib.contextmanager
def _phase(run: Run, step: int, name: str, times: dict[str, float]):
    run.callbacks.on_phase_begin(run, step, name)
    t0 = time.perf_counter()
    yield
    times[name] = time.perf_counter() - t0
    run.callbacks.on_phase_end(run, step, name, times[name])


# --------------------------------------------------------------------------------------------
# the producer: sample and score


def produce(run: Run, step: int, stop: StopRequest | None = None) -> Batch | None:
    """Step `step`'s batch, sampled from the current weights (the synchronous step). None when
    `stop` is requested after the sampling (the rewards are not computed, except those that
    rollout.filter_groups needed to choose its groups)."""
    def sampled() -> bool:
        run.engine.sleep()  # until the update's push (an engine that sleeps: EngineSettings)
        return stop is not None and stop.requested(run.dist)

    return sample_batch(run, step, abandon=sampled)


def sample_batch(run: Run, step: int, hold=contextlib.nullcontext,
                 abandon=lambda: False) -> Batch | None:
    """Step `step`'s batch, sampled and scored: the synchronous step's producer and the
    sampler thread's. The engine is used only inside `with hold():`, which gives it the
    weights this step samples from (and lets an evaluation borrow it between rounds); the
    batch's version is the caller's to set. abandon(): called once the sampling is done, before
    the scoring (after it with rollout.filter_groups, whose rounds score as they go); True
    returns None."""
    if run.cfg.rollout.filter_groups:
        batch = filtered_batch(run, step, hold)
        return None if abandon() else batch
    with hold():
        t0 = time.perf_counter()
        rows, rollouts, texts = sample(run, step)
        rollout_s = time.perf_counter() - t0
    if abandon():
        return None
    t1 = time.perf_counter()
    rewards, failures, first_error = score_texts(run, rows, texts)
    return Batch(rows, rollouts, texts, rewards, failures, first_error, version=step,
                 rollout_s=rollout_s, reward_s=time.perf_counter() - t1)


def sample(run: Run, step: int, round: int = 0, n: int = 0
           ) -> tuple[list[dict], Rollouts, list[str]]:
    """This rank's share of step `step`'s prompts, G responses to each, decoded (no
    collectives: with rollout.max_staleness >= 1 it runs in the sampler's thread). round >= 1:
    rollout.filter_groups' extra round, n more prompts (gspo.group_filter.extra_prompts)."""
    r, d, seed = run.cfg.rollout, run.dist, run.cfg.train.seed
    first = step_indices(len(run.train_rows), step, r.prompts_per_step, seed)
    share = len(first) // d.world
    if round == 0:
        index = first[d.rank * share:(d.rank + 1) * share]
    else:
        index = extra_prompts(len(run.train_rows), first, step, round, n, share, d.rank, d.world,
                              seed)
    rows = [run.train_rows[i] for i in index]
    rollouts = generate(run, rows, step, round)
    return rows, rollouts, decode_responses(run.tokenizer, rollouts)


def step_prompts(rows: list[dict], step: int, n: int, seed: int) -> list[dict]:
    """The prompts of RL step `step`: a function of (seed, step) alone, so resume is exact."""
    return [rows[i] for i in step_indices(len(rows), step, n, seed)]


def step_indices(n_rows: int, step: int, n: int, seed: int) -> list[int]:
    """The row indices of step_prompts."""
    rng = random.Random(seed * 1_000_003 + step)
    return rng.sample(range(n_rows), min(n, n_rows))


def generate(run: Run, rows: list[dict], step: int, round: int = 0) -> Rollouts:
    """Sample G responses per prompt (recording the engine's MoE routing when pi_old's is
    taken from it). round: rollout.filter_groups' sampling round, seeded apart from round 0,
    whose seeds are the step's without filtering."""
    r = run.cfg.rollout
    prompts = encode_prompts(run.tokenizer, rows, run.cfg.data.system_prompt or None)
    params = SamplingParams(r.temperature, r.top_p, r.max_new_tokens)
    seed = run.cfg.train.seed * 7_919 + step + 1_000_003 * run.dist.rank
    if round:
        seed = random.Random(f"gspo-filter-groups/{seed}/{round}").getrandbits(31)
    with run.routing.sampling(len(prompts) * r.group_size):
        rollouts = run.engine.generate(prompts, n=r.group_size, params=params, seed=seed)
    run.routing.sampled(rollouts.input_ids.shape[1] - 1, rollouts.routing)
    return rollouts.to(run.dist.device)  # an engine may hand back host tensors (vLLM)


def score_texts(run: Run, rows: list[dict], texts: list[str]):
    """(rewards, failed calls, the first failure) of the decoded responses to `rows`."""
    G = run.cfg.rollout.group_size
    return score(run.reward_fn, texts, [row for row in rows for _ in range(G)],
                 timeout=run.cfg.data.reward_fn_timeout or None)


def filtered_batch(run: Run, step: int, hold=contextlib.nullcontext) -> Batch:
    """rollout.filter_groups: rounds of sampling and scoring until this rank's share of the
    step holds groups whose rewards vary, or the bound is spent (gspo.group_filter). The
    engine is used only inside `with hold():`, as in sample_batch."""
    r = run.cfg.rollout
    times = {"rollout": 0.0, "reward": 0.0}

    def one_round(round: int, n: int) -> Round:
        with hold():
            t0 = time.perf_counter()
            rows, rollouts, texts = sample(run, step, round, n)
            times["rollout"] += time.perf_counter() - t0
        t1 = time.perf_counter()
        rewards, failures, first_error = score_texts(run, rows, texts)
        times["reward"] += time.perf_counter() - t1
        trained, _ = shaped_rewards(run, rollouts, torch.tensor(rewards, device=run.dist.device))
        return Round(rows, rollouts, texts, rewards, failures, first_error,
                     varying_groups(trained, r.group_size).tolist())

    rounds, picks, stats = fill(one_round, r.prompts_per_step // run.dist.world,
                                r.filter_max_rounds)
    pad = run.tokenizer.pad_token_id
    rows, rollouts, texts, rewards = merge(rounds, picks, r.group_size,
                                           pad if pad is not None else 0)
    if stats.filled and "filter_groups" not in run.warned:
        run.warned.add("filter_groups")
        log.warning("rollout.filter_groups: %d extra round(s) left %d of the %d groups of step "
                    "%d on rank %d with rewards all equal (no gradient from them); "
                    "rollout/filled_groups counts such groups every step: raise "
                    "rollout.filter_max_rounds, or the data or reward may be too easy or too "
                    "hard for the policy", stats.rounds, stats.filled, len(picks), step + 1,
                    run.dist.rank)
    errors = [rd.first_error for rd in rounds if rd.first_error]
    return Batch(rows, rollouts, texts, rewards, sum(rd.failures for rd in rounds),
                 errors[0] if errors else None, version=step, rollout_s=times["rollout"],
                 reward_s=times["reward"], filter=stats)


# --------------------------------------------------------------------------------------------
# the consumer: advantages, pi_old, updates, metrics


def consume(run: Run, step: int, batch: Batch, times: dict[str, float]) -> dict[str, float]:
    """Learn from `batch`: advantages, pi_old, the minibatch updates and the engine's (or the
    sampler's) new weights; returns the step's metrics, reduced over ranks, with "tokens" (the
    step's response tokens) for the caller's throughput."""
    cfg, d = run.cfg, run.dist
    rollouts = batch.rollouts
    # ---- group advantages
    scored = batch.filter.scored if batch.filter else len(batch.rewards)  # all rounds
    _, failures = check_reward_failures(run, step, scored, batch.reward_failures,
                                        batch.first_error)
    n = len(batch.rewards) * d.world  # the trained completions: the same number on each rank
    rewards = torch.tensor(batch.rewards, device=d.device)  # (B,)
    # ---- responses cut at the budget: a length penalty on the reward, or out of the loss
    cut = truncated(rollouts, stop_token_ids(run.model, run.tokenizer),
                    cfg.rollout.max_new_tokens)  # (B,) bool
    trained, penalty = shaped_rewards(run, rollouts, rewards)
    keep = ~cut if cfg.algorithm.overlong == "mask" else None
    scale = cfg.algorithm.advantage_scale
    adv = group_advantages(trained, cfg.rollout.group_size, scale,
                           whole_batch_std(trained, d) if scale == "batch" else None)
    parts = minibatches(run, len(batch.rewards))  # before pi_old, which may follow their order
    try:
        # ---- pi_old (and pi_ref); or pi_old's rows as the sampler's thread recomputes them
        with _phase(run, step, "old_logp", times):
            old_logp, entropy, mismatch = old_policy(run, rollouts, step, parts)
            ref_logp = (policy_logprobs(run.ref_policy, rollouts, cfg.rollout.temperature,
                                        micro_batches(run, rollouts, run.ref_policy),
                                        cfg.model.logprob_chunk_size)
                        if run.ref_policy else None)
        # ---- minibatch updates, then the new weights to whoever samples next
        with _phase(run, step, "update", times):
            m = update(run, rollouts, old_logp, ref_logp, adv, keep, parts)
            if run.sampler is None:
                run.engine.load_weights(policy_weights(run.policy, run.model))
            else:  # version step + 1, for the batch of step + 1 + max_staleness
                run.sampler.publish(step + 1, policy_weights(run.policy, run.model))
        if isinstance(old_logp, Rows):  # every row's pi_old, for the metrics
            old_logp, entropy = old_logp.get()
            mismatch = mismatch_metrics(run, old_logp, rollouts)
    except NonFiniteError as e:  # weights an earlier update (or the warm-up) broke
        what = str(e).split(";")[0]  # "logp contains NaN"
        raise TrainingError(f"{what} at RL step {step + 1}: the policy's weights are no longer "
                            f"finite; lower optim.lr (now {cfg.optim.lr:g}) or warmup.lr; the "
                            f"last finished checkpoint is kept") from None
    m.update(run.routing.step_metrics(
        lambda route: policy_logprobs(run.policy, rollouts, cfg.rollout.temperature,
                                      micro_batches(run, rollouts, run.policy),
                                      cfg.model.logprob_chunk_size, route=route),
        rollouts.response_mask, rollouts.input_ids.shape[1] - 1, d))
    # ---- metrics (over this step's completions and tokens on every rank)
    mask = rollouts.response_mask
    totals = WeightedMean()
    totals.add_total(M.REWARD_MEAN, rewards.sum(), len(rewards))
    totals.add_total(M.ENTROPY, (entropy * mask).sum(), mask.sum())
    totals.add_total(M.RESPONSE_LEN, mask.sum(), len(rewards))
    totals.add_total(M.TRUNCATED, cut.sum(), len(rewards))
    if penalty is not None:
        totals.add_total(M.OVERLONG_PENALTY, penalty.sum(), len(rewards))
    totals.add_sum("squares", (rewards ** 2).sum())
    totals.add_sum("tokens", mask.sum())
    f = batch.filter
    if f is not None:
        for name, count in ((M.FILTERED_GROUPS, f.filtered), (M.EXTRA_PROMPTS, f.extra_prompts),
                            (M.FILLED_GROUPS, f.filled)):
            totals.add_sum(name, count)
    row = totals.result(d)
    if f is not None:
        row.update({k: int(row[k]) for k in (M.FILTERED_GROUPS, M.EXTRA_PROMPTS, M.FILLED_GROUPS)})
    r_mean, r_sq = row[M.REWARD_MEAN], row.pop("squares")
    row[M.REWARD_STD] = math.sqrt(max(0.0, (r_sq - n * r_mean ** 2) / max(1.0, n - 1)))
    warn_constant_reward(run, row[M.REWARD_STD], step)
    row.update(m, **mismatch)
    if run.sampler is not None:
        row.update({M.STALENESS: step - batch.version, M.TIME_SAMPLE: batch.rollout_s})
    row.update({M.REWARD_FAILURES: int(failures), M.LR: run.scheduler.get_last_lr()[0],
                M.TIME_ROLLOUT: times["rollout"], M.TIME_OLD_LOGP: times["old_logp"],
                M.TIME_UPDATE: times["update"]})
    return row


def shaped_rewards(run: Run, r: Rollouts, rewards: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(the rewards the advantages see, the overlong penalty in them or None): with
    algorithm.overlong=soft_penalty DAPO's length penalty is added to the task's reward."""
    cfg = run.cfg
    if cfg.algorithm.overlong != "soft_penalty":
        return rewards, None
    a = cfg.algorithm
    penalty = overlong_penalty(r.response_lengths, cfg.rollout.max_new_tokens,
                               a.overlong_buffer or cfg.rollout.max_new_tokens // 4,
                               a.overlong_penalty).to(rewards.dtype)
    return rewards + penalty, penalty


def truncated(r: Rollouts, stop_ids: list[int], max_new_tokens: int) -> torch.Tensor:
    """(B,) bool: the responses cut at the budget, max_new_tokens long without a stop token at
    the end."""
    lengths = r.response_lengths  # (B,)
    last = r.response_ids.gather(1, (lengths - 1).clamp(min=0)[:, None])[:, 0]  # (B,)
    stops = torch.isin(last, torch.tensor(stop_ids, device=last.device))
    return (lengths >= max_new_tokens) & ~stops


REWARD_WINDOW = 10  # RL steps over which data.max_reward_failures is judged
CONSTANT_REWARD_STEPS = 5  # steps of identical rewards after which the run warns


def check_reward_failures(run: Run, step: int, n: int, failures: int, first: str | None
                          ) -> tuple[float, float]:
    """Stop the run when its reward cannot be trusted: every completion of the first step
    failed (a missing package, a wrong field name), or more than data.max_reward_failures of
    the last REWARD_WINDOW steps' completions did. Returns (completions, failures) summed over
    ranks."""
    n, failures = run.dist.sum([n, failures])
    window = run.reward_window
    window.append((n, failures))
    del window[:-REWARD_WINDOW]
    limit = run.cfg.data.max_reward_failures
    seen, failed = (sum(x) for x in zip(*window))
    first_step = step == run.start_step and failures == n > 0
    if limit < 1 and (first_step or (len(window) == REWARD_WINDOW and failed > limit * seen)):
        where = "of the first RL step" if first_step else f"of the last {REWARD_WINDOW} RL steps"
        raise TrainingError(f"the reward {run.record['reward']} failed on {int(failed)} of "
                            f"{int(seen)} completions "
                            f"{where} (first error: {first or 'on another rank'}); fix the "
                            f"reward function, or raise data.max_reward_failures (now {limit:g})")
    return n, failures


def warn_constant_reward(run: Run, r_std: float, step: int) -> None:
    """Say once per streak when every reward of CONSTANT_REWARD_STEPS steps was the same: the
    advantages are all 0 and nothing is learned."""
    run.constant_reward_steps = run.constant_reward_steps + 1 if r_std <= 1e-9 else 0
    if run.constant_reward_steps == CONSTANT_REWARD_STEPS:
        log.warning("every reward of RL steps %d-%d was the same: the group advantages are 0 and "
                    "the policy does not learn; check the reward function and the data",
                    step - CONSTANT_REWARD_STEPS + 2, step + 1)


def old_policy(run: Run, r: Rollouts, step: int, parts: list[torch.Tensor] | None = None
               ) -> tuple[torch.Tensor | Rows, torch.Tensor | None, dict]:
    """pi_old's per-token log-probs, the per-token entropy, and engine-mismatch metrics.

    recompute: a no-grad forward of the training model (recording MoE routing for replay);
               with rollout.sampler_recomputes (where `sampler_recomputes` allows it), the
               forward runs in the sampler's thread, on its copy of the current weights,
               while the trainer updates: pi_old is then the Rows it fills in, in the order of
               the minibatches `parts`, and the entropy and metrics come after the update
    rollout:   the sampler's own log-probs, with no forward pass, except every
               `mismatch_every` steps a recompute only to measure the mismatch. The entropy
               is then estimated as -logp of the sampled tokens (unbiased for the sampler's).
    """
    a, chunk, temp = run.cfg.algorithm, run.cfg.model.logprob_chunk_size, run.cfg.rollout.temperature
    if parts is not None and sampler_recomputes(run):
        return recompute_in_sampler(run, r, step, parts), None, {}
    use_rollout = a.old_logprobs == "rollout"
    monitor = use_rollout and a.mismatch_every > 0 and step % a.mismatch_every == 0
    metrics = {}
    if not use_rollout or monitor:
        # pi_old's MoE routing, recorded here unless the engine recorded it as it sampled
        B, L = r.input_ids.shape
        route = run.routing.recording(B, L - 1)
        train_logp, entropy = policy_logprobs(run.policy, r, temp,
                                              micro_batches(run, r, run.policy), chunk, True,
                                              route=route)
        metrics = mismatch_metrics(run, train_logp, r)
    if use_rollout:
        return r.logp, -r.logp, metrics
    return train_logp, entropy, metrics


def mismatch_metrics(run: Run, train_logp: torch.Tensor, r: Rollouts) -> dict[str, float]:
    """mismatch/*: the engine's log-probs against the trainer's, over ranks (and said once,
    when pi_old is the engine's, if they differ by more than the clip range)."""
    mismatch = engine_mismatch(train_logp, r.logp, r.response_mask)
    mismatch = reduce_mismatch({k: float(v) for k, v in mismatch.items()}, r, run.dist)
    if run.cfg.algorithm.old_logprobs == "rollout":
        warn_mismatch(run, mismatch)
    return {M.MISMATCH + k: v for k, v in mismatch.items()}


def sampler_recomputes(run: Run) -> bool:
    """pi_old's recompute may run in the sampler's thread (rollout.sampler_recomputes): an
    asynchronous run on the CPU (where it was measured: the two threads share the cores)
    whose engine samples from its own copy of the weights in their dtype (the same forward,
    under the same autocast, as the trainer's), unsharded, dense (no MoE routing to record)
    and without LoRA (the copy holds merged weights)."""
    model = getattr(run.engine, "model", None)
    return (run.sampler is not None and run.cfg.rollout.sampler_recomputes
            and run.dist.device.type == "cpu"
            and run.cfg.algorithm.old_logprobs == "recompute"
            and isinstance(model, torch.nn.Module) and model is not run.model
            and next(model.parameters()).dtype == next(run.model.parameters()).dtype
            and not is_sharded(run.policy) and not is_lora(run.model)
            and isinstance(run.routing, NoRouting))


def recompute_in_sampler(run: Run, r: Rollouts, step: int, parts: list[torch.Tensor]) -> Rows:
    """pi_old recomputed in the sampler's thread, on its copy loaded with weight version
    `step` (the trainer's now), minibatch by minibatch in the update's order from the second
    on: the first takes pi_old (and the entropy) from its own forward (`update`), at theta =
    theta_old still."""
    temp, chunk = run.cfg.rollout.temperature, run.cfg.model.logprob_chunk_size
    compute_dtype = getattr(run.policy, "module", run.policy).compute_dtype  # under DDP too
    training = run.model.training  # the trainer's mode now (dropout), as its recompute's

    def work(engine, rows: Rows, checkpoint) -> None:
        policy, was = Policy(engine.model, compute_dtype), engine.model.training
        engine.model.train(training)
        try:
            for mb in parts[1:]:  # the first minibatch's are the trainer's (`update`)
                for idx in micro_batches(run, r, policy, mb):
                    checkpoint()
                    with torch.no_grad():
                        rows.put(idx, *policy(r.input_ids[idx], r.attention_mask[idx],
                                              r.response_ids.shape[1], temp, chunk, True))
        finally:
            engine.model.train(was)

    return run.sampler.recompute(step, work, *r.response_ids.shape, r.response_ids.device)


MISMATCH_WARN_FACTOR = 1.0
"""warn when the engine's mean mismatch, on the objective's ratio scale, exceeds this many
times its clip range"""


def warn_mismatch(run: Run, mismatch: dict[str, float]) -> None:
    """Said once: pi_old taken from the engine differs from the trainer's own likelihoods by
    more than the clip range, so at theta = theta_old many ratios already sit outside it and
    their terms carry no gradient. Measured on SmolLM2 (docs/results/paper_claims.md): a bf16
    sampler's 40-token responses sit ~1e-2 from a bf16-mixed trainer in GSPO's length-
    normalised log-ratio, 25x its 4e-4, and GSPO did not learn in 10 steps."""
    a = run.cfg.algorithm
    spec = OBJECTIVES[a.name]
    key = "seq_log_ratio_abs_mean" if spec.ratio == "sequence" else "token_abs_mean"
    eps = max(a.eps_low, a.eps_high)  # the config holds the preset's when not set
    if mismatch[key] <= MISMATCH_WARN_FACTOR * eps or "mismatch" in run.warned:
        return
    run.warned.add("mismatch")
    log.warning("algorithm.old_logprobs=rollout: the engine's log-probs differ from the "
                "trainer's by %.2g on average (mismatch/%s), %.0fx %s's clip range %g: terms "
                "that far outside it are clipped on precision alone and carry no gradient; "
                "recompute pi_old (algorithm.old_logprobs=recompute: the ratio is then exactly "
                "1 at theta_old) or widen the clip range (said once)",
                mismatch[key], key, mismatch[key] / eps, a.name, eps)


@torch.no_grad()
def policy_logprobs(policy, r: Rollouts, temperature: float, parts: list[torch.Tensor],
                    chunk: int, with_entropy: bool = False, route=None):
    """Per-token log-probs (and entropies) of the responses under `policy` (a Policy, possibly
    wrapped by DDP or sharded), no gradient, one forward per micro-batch of `parts` (row
    indices covering every row once, as micro_batches gives them).

    route: optional `rows -> context manager` (a RoutingRecorder's record), entered around
    each micro-batch so that MoE routing is recorded per row.
    """
    outs = []
    for rows in parts:
        with route(rows) if route else contextlib.nullcontext():
            outs.append(policy(r.input_ids[rows], r.attention_mask[rows],
                               r.response_ids.shape[1], temperature, chunk, with_entropy,
                               share_prompts=route is None))
    order = torch.cat(parts)  # (B,): the row each output row belongs to
    back = torch.empty_like(order)
    back[order] = torch.arange(len(order))
    if not with_entropy:
        return torch.cat(outs)[back]
    return torch.cat([o[0] for o in outs])[back], torch.cat([o[1] for o in outs])[back]  # (B, T)


def reduce_mismatch(m: dict[str, float], r: Rollouts, d: Dist) -> dict[str, float]:
    """engine_mismatch's means weighted over ranks (tokens, sequences), its maxes maxed."""
    w = WeightedMean()
    w.add("token_abs_mean", m["token_abs_mean"], float(r.response_mask.sum()))
    w.add("seq_log_ratio_mean", m["seq_log_ratio_mean"], float(r.response_mask.shape[0]))
    w.add("seq_log_ratio_abs_mean", m["seq_log_ratio_abs_mean"], float(r.response_mask.shape[0]))
    w.add_max("token_abs_max", m["token_abs_max"])
    w.add_max("seq_log_ratio_abs_max", m["seq_log_ratio_abs_max"])
    out = w.result(d)
    return {k: out[k] for k in m}  # engine_mismatch's order


def update(run: Run, r: Rollouts, old_logp, ref_logp, adv, keep=None,
           parts: list[torch.Tensor] | None = None) -> dict[str, float]:
    """`minibatches` optimiser steps over this rank's rollout rows (`parts`, drawn here when
    not given); returns metrics reduced over ranks (token-weighted means, global min / max).
    keep: (B,) bool, the rows that stay in the loss (algorithm.overlong=mask); the others
    carry no advantage and no KL, and leave the denominators. old_logp: pi_old's log-probs,
    or the Rows the sampler's thread recomputes them into, in which case the first minibatch,
    at theta = theta_old still, takes pi_old from its own forward (its ratio exactly 1) and
    puts its rows (the entropy too, for the metrics) into the Rows.

    Every loss is divided by the GLOBAL count of its minibatch (sequences, or tokens for
    token-mean) and multiplied by the world size, so that DDP's gradient average over ranks of
    the micro-batch sums is exactly the full-batch gradient. With algorithm.routing_replay the
    forwards replay pi_old's recorded MoE routing."""
    cfg, d, a = run.cfg, run.dist, run.cfg.algorithm
    spec = OBJECTIVES[a.name]
    token_mean = spec.normaliser(a.aggregation) == "tokens"
    objective = functools.partial(spec, **spec.settings(a.eps_low, a.eps_high, a.aggregation,
                                                         cfg.rollout.max_new_tokens))
    T, mask = r.response_ids.shape[1], r.response_mask
    stats = WeightedMean()
    grad_norms, losses, skipped = [], [], 0
    run.model.train()
    rows = torch.ones(len(adv), device=adv.device) if keep is None else keep.to(adv.dtype)
    adv = adv * (rows if adv.dim() == 1 else rows[:, None])
    for j, mb in enumerate(parts or minibatches(run, r.response_ids.shape[0])):
        # the global normalisers of this optimiser step, shared by all its micro-batches:
        # sequences (the KL's, and the objective's unless token-mean) and tokens
        sequences = (float(len(mb) * d.world) if keep is None
                     else max(1.0, d.sum([float(rows[mb].sum())])[0]))
        denom = (max(1.0, d.sum([float((mask[mb] * rows[mb, None]).sum())])[0]) if token_mean
                 else sequences)
        run.optimizer.zero_grad(set_to_none=True)
        mb_loss, bad = 0.0, None
        parts = micro_batches(run, r, run.policy, mb)
        for i, idx in enumerate(parts):
            with (run.routing.replaying(idx), run.routing.balancing() as load,
                  no_sync(run.policy, skip=i < len(parts) - 1)):
                # at theta = theta_old (the first minibatch, pi_old in the sampler's rows),
                # this forward is pi_old's too: its rows, entropy included, go to them
                first = isinstance(old_logp, Rows) and j == 0
                logp = run.policy(r.input_ids[idx], r.attention_mask[idx], T,
                                  cfg.rollout.temperature, cfg.model.logprob_chunk_size,
                                  first, share_prompts=not run.routing.replays)
                if first:
                    logp, entropy = logp
                    old_logp.put(idx, logp.detach(), entropy.detach())
                old = (old_logp[idx] if not isinstance(old_logp, Rows)
                       else old_logp.get(idx)[0])
                loss, metrics = micro_loss(run, r, idx, logp, old, ref_logp, adv,
                                           objective, denom, sequences, rows[idx])
                if load is not None:  # the routers' load-balancing loss, its rows' share
                    aux = load.loss()
                    loss = loss + run.routing.aux_coef * aux * len(idx) / (len(mb) * d.world)
                    stats.add(M.MOE_AUX_LOSS, float(aux.detach()), len(idx))
                if bad is None and not torch.isfinite(loss):
                    bad = (float(loss.detach()), dict(metrics))
                precision.backward(loss * d.world, run.scaler)
            mb_loss += float(loss.detach())
            add_loss_metrics(stats, metrics, mask[idx])
        _check_loss(bad, d)  # before the optimiser step: a non-finite loss changes no weight
        norm = float(as_local(precision.step(run.optimizer, run.model.parameters(),
                                             cfg.optim.grad_clip, run.scaler)))
        if math.isfinite(norm):  # fp16-mixed: an overflowed step was skipped, the scale lowered
            grad_norms.append(norm)
        else:
            skipped += 1
        run.scheduler.step()
        losses.append(mb_loss)
    # the gradients are not needed until the next step: free them for the rollout and pi_old
    run.optimizer.zero_grad(set_to_none=True)
    stats.add_sum(M.LOSS, sum(losses) / len(losses))  # each loss is global-normalised
    out = stats.result(d)
    # after the all-reduce: the same on all ranks
    out[M.GRAD_NORM] = sum(grad_norms) / len(grad_norms) if grad_norms else float("nan")
    if run.scaler is not None:
        out[M.LOSS_SCALE] = float(run.scaler.get_scale())
        out[M.SKIPPED_STEPS] = skipped
    return out


def minibatches(run: Run, B: int) -> list[torch.Tensor]:
    """A random partition of the B rows into algorithm.minibatches index tensors."""
    G, size = run.cfg.rollout.group_size, B // run.cfg.algorithm.minibatches
    if size % G == 0:
        # minibatches of whole groups: a random partition still, and the G rows of a group
        # share their prompt's forward in token_logprobs (measured 0.218 -> 0.168 s per step)
        groups = torch.randperm(B // G, generator=run.gen)
        order = (groups[:, None] * G + torch.arange(G)).flatten()
    else:
        order = torch.randperm(B, generator=run.gen)
    return list(order.split(size))


def micro_batches(run: Run, r: Rollouts, policy, rows: torch.Tensor | None = None
                  ) -> list[torch.Tensor]:
    """`rows` (a minibatch; default all of them, for the no-grad forwards) as the micro-batches
    `policy` computes them: run.micro rows each, in order; with train.max_tokens_per_micro,
    packed by padded token cost (gspo.packing: longest responses first, whole groups together
    where `rows` holds whole groups, so that their rows share the prompt's forward).

    Ranks may hold other lengths and so pack another number of micro-batches. DDP needs no
    more: each rank makes one synchronised backward per minibatch (no_sync on all but its last
    micro-batch), however many it makes in all. A sharded (FSDP2) policy does: each forward and
    backward of a sharded layer is a collective, so every rank packs the largest count among
    them (one all-reduce)."""
    if rows is None:
        rows = torch.arange(r.response_ids.shape[0])
    budget = run.cfg.train.max_tokens_per_micro
    if not budget:
        return list(rows.split(run.micro))
    G = run.cfg.rollout.group_size
    lengths = r.response_lengths[rows].tolist()
    # whole groups: each run of G rows is one prompt's (minibatches keeps them so when it can)
    whole = len(rows) % G == 0 and bool((rows.reshape(-1, G) // G
                                         == rows.reshape(-1, G)[:, :1] // G).all())
    pack = lambda count=0: pack_by_tokens(lengths, r.prompt_ids.shape[1], budget,  # noqa: E731
                                          G if whole else 1, count)
    parts, over = pack()
    if is_sharded(policy):
        count = int(run.dist.max([len(parts)])[0])
        if count > len(parts):
            parts, over = pack(count)
    if over and "max_tokens_per_micro" not in run.warned:
        run.warned.add("max_tokens_per_micro")
        longest = r.prompt_ids.shape[1] + max(lengths)
        log.warning("train.max_tokens_per_micro=%d: %d row(s) of up to %d tokens (prompt width "
                    "%d + response) exceed it and get a micro-batch each; raise it to %d to "
                    "bound every forward by the budget (said once)", budget, len(over), longest,
                    r.prompt_ids.shape[1], longest)
    return [rows[torch.tensor(p)] for p in parts]


def whole_batch_std(values: torch.Tensor, d: Dist) -> torch.Tensor | None:
    """The std of every rank's `values` (B,) together, in rank order: one process's batch
    split over ranks gives one process's std, bit for bit (a sum over ranks of vectors that
    are zero outside each rank's share is exact). None in one process."""
    if not d.enabled:
        return None
    B = values.numel()
    whole = [0.0] * (B * d.world)
    whole[d.rank * B:(d.rank + 1) * B] = values.tolist()
    return torch.tensor(d.sum(whole), dtype=values.dtype).std()


def micro_loss(run: Run, r: Rollouts, idx, logp, old, ref_logp, adv, objective,
               denom: float, sequences: float, rows: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """The loss of rows `idx` (logp: their forward; old: their pi_old): `objective` (a
    LossSpec with its settings bound) with the off-policy correction's weights, plus the KL
    penalty when algorithm.beta > 0. denom: the objective's global normaliser; sequences: the
    minibatch's global sequence count (the KL's); rows: 1 for the rows that stay in the loss,
    0 for the others."""
    a, mask = run.cfg.algorithm, r.response_mask[idx]
    weights = None
    if a.is_correction != "none":
        # between the engine that sampled and the trainer: pi_old where it was recomputed;
        # else the current policy, whose ratio against the engine the objective already
        # takes (pi_old is the engine's): the weight is then what truncation or masking
        # leaves of that ratio, not the ratio a second time
        rollout = a.old_logprobs == "rollout"
        trainer_logp = logp.detach() if rollout else old
        weights = importance_weights(trainer_logp, r.logp[idx], mask, a.is_correction,
                                     a.is_level, a.is_cap, a.is_floor, relative=rollout)
    loss, metrics = objective(logp, old, adv[idx], mask, denom=denom,
                              is_weights=weights)
    if a.beta > 0:
        loss = loss + a.beta * (kl_k3(logp, ref_logp[idx], mask) * rows).sum() / sequences
    return loss, metrics


def add_loss_metrics(stats: WeightedMean, metrics: dict, mask: torch.Tensor) -> None:
    """A micro-batch's objective metrics into the step's: ratio_mean weighted by what it
    averages over, the extremes as extremes, sequence fractions by sequences, the rest (token
    fractions, kl_old, the correction's mean weight) by tokens."""
    stats.add(M.RATIO_MEAN, metrics.pop("ratio_mean"), metrics.pop("ratio_count"))
    stats.add_min(M.RATIO_MIN, metrics.pop("ratio_min"))
    stats.add_max(M.RATIO_MAX, metrics.pop("ratio_max"))
    if "is_weight_min" in metrics:
        stats.add_min(M.IS_WEIGHT_MIN, metrics.pop("is_weight_min"))
        stats.add_max(M.IS_WEIGHT_MAX, metrics.pop("is_weight_max"))
        stats.add(M.IS_MASKED_SEQS, metrics.pop("is_masked_seq_frac"), mask.shape[0])
    n_tokens = float(mask.sum())
    for k, v in metrics.items():
        stats.add(M.OBJECTIVE.get(k, k), v, n_tokens)


def _check_loss(bad: tuple[float, dict] | None, d: Dist) -> None:
    """Stop on a non-finite loss on any rank (all ranks stop together, none hangs): one
    all-reduce per minibatch. bad: this rank's first non-finite loss and its metrics."""
    if d.sum([0.0 if bad is None else 1.0])[0]:
        loss, metrics = bad if bad is not None else (float("nan"), {})
        raise TrainingError(f"non-finite loss {loss} (metrics: "
                            f"{ {k: round(float(v), 4) for k, v in metrics.items()} }"
                            f"{'' if bad is not None else ' on another rank'}); lower "
                            f"optim.lr or check the rewards; the last finished checkpoint is kept")
