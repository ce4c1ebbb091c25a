"""The training loop: supervised warm-up, then GSPO (or GSPO-token, or GRPO) steps.

One RL step, top to bottom in :func:`train`:

    rollout     G responses per prompt from the current policy (the rollout engine)
    rewards     a verifiable reward per response
    advantages  group-normalised rewards (objectives.group_advantages)
    pi_old      per-token log-probs of the responses, recomputed by the training model
    updates     the batch split into `minibatches` AdamW steps; each loss normalised by the
                minibatch's global count so that micro-batches sum to the full gradient
    metrics     one row of metrics.jsonl per step; held-out evaluation every `eval_every` steps
    checkpoint  Hugging Face format plus optimiser / scheduler / RNG / data position

Under torchrun the same loop runs on every rank, each on its share of the prompts
(gspo.distributed: DDP or FSDP2).
"""

from __future__ import annotations

import contextlib
import copy
import math
import logging
import os
import random
import resource
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
import transformers

from gspo.async_rollouts import AsyncSampler
from gspo.checkpoint import (latest_checkpoint, load_checkpoint, read_reference,
                             read_training_state, save_checkpoint)
from gspo import precision
from gspo.config import Config, save_config, to_dict
from gspo.data import decode_responses, encode_prompts, score
from gspo.distributed import (Dist, Policy, as_local, broadcast_weights, checkpoint_state,
                               fsdp_available, init_distributed, iter_weights,
                               load_optimizer_state, no_sync, wrap_policy)
from gspo.errors import TrainingError
from gspo.evaluation import evaluate
from gspo.logger import METRICS_FILE, MetricsLogger, check_resumable
from gspo.rewards import RewardFn, close_reward
from gspo.runlock import exclusive
from gspo.runrecord import check_resume, check_rows, make_record, write_record
from gspo.signals import Interrupted, StopRequest, under_torchrun
from gspo.lora import (ADAPTER_DIR, LoraUnavailable, add_lora, is_lora, load_adapter,
                       merged_weights, save_adapter)
from gspo.engines import (RolloutEngine, Rollouts, SamplingParams, engine_class,
                          engine_settings, engines_with, left_pad, make_engine, right_pad)
from gspo.models import build_tiny_qwen3, build_tiny_qwen3_moe, build_tokenizer, load_model
from gspo import metrics as M
from gspo.metrics import WeightedMean
from gspo.moe import MoeRouting, NoRouting, routing_for
from gspo.objectives import (OBJECTIVES, engine_mismatch, group_advantages, kl_k3,
                             truncated_is_weights)
from gspo.tasks import build_task
from gspo.trackers import require as require_trackers
from gspo.weights import copy_weights_

log = logging.getLogger(__name__)


@dataclass
class Summary:
    run_dir: Path
    start_accuracy: float | None
    final_accuracy: float | None
    warmup_s: float
    rl_s: float
    peak_rss_mb: float
    steps: int


# --------------------------------------------------------------------------------------------
# set-up: model, task, optimiser


def build_model(cfg: Config, device: torch.device | str = "cpu", weights: bool = True,
                training: bool = True):
    """(model, tokenizer) of cfg.model. weights=False: a local or hub model is built on the meta
    device from its config alone (gspo.models.load_model); the tiny ones are built anyway.
    training=False (`gspo eval`): the weights in the dtype the engine samples in
    (rollout.dtype), and a local model need only fit for sampling, not for training."""
    m = cfg.model
    dtype = (precision.get(cfg.train.precision).param_dtype if training
             else getattr(torch, precision.rollout_dtype(cfg)))
    shape = dict(hidden_size=m.hidden_size, num_layers=m.num_layers, num_heads=m.num_heads,
                 num_kv_heads=m.num_kv_heads, seed=cfg.train.seed)
    if m.name_or_path == "tiny-qwen3":
        tokenizer = build_tokenizer()
        model = build_tiny_qwen3(tokenizer, intermediate_size=m.intermediate_size, **shape)
    elif m.name_or_path == "tiny-qwen3-moe":
        tokenizer = build_tokenizer()
        model = build_tiny_qwen3_moe(tokenizer, moe_intermediate_size=m.moe_intermediate_size,
                                     num_experts=m.num_experts,
                                     num_experts_per_tok=m.num_experts_per_tok, **shape)
    else:
        model, tokenizer = load_model(m.name_or_path, dtype=precision.dtype_name(dtype),
                                      weights=weights,
                                      full_training=training and not m.lora_rank)
        if not weights:
            return model, tokenizer  # on the meta device, in the weights' dtype
    return model.to(device=device, dtype=dtype), tokenizer


def build_optimizer(model, lr: float, cfg: Config):
    o = cfg.optim
    # fused: one kernel for the whole step (CPU and CUDA); halves the optimiser's time here
    fused = all(p.device.type in ("cpu", "cuda") for p in model.parameters())
    params = [p for p in model.parameters() if p.requires_grad]  # LoRA: the adapters alone
    opt = torch.optim.AdamW(params, lr=lr, betas=tuple(o.betas),
                            weight_decay=o.weight_decay, fused=fused)
    warm = max(1, o.warmup_steps)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warm))
    return opt, sched


def step_prompts(rows: list[dict], step: int, n: int, seed: int) -> list[dict]:
    """The prompts of RL step `step`: a function of (seed, step) alone, so resume is exact."""
    rng = random.Random(seed * 1_000_003 + step)
    return [rows[i] for i in rng.sample(range(len(rows)), min(n, len(rows)))]


# --------------------------------------------------------------------------------------------
# supervised warm-up


def warmup(policy, model, tokenizer, rows: list[dict], solution, cfg: Config, d: Dist,
           stop: StopRequest | None = None, on_stop: Callable | None = None, start: int = 0,
           optimizer_state: dict | None = None) -> float:
    """Cross-entropy on worked answers (prompt tokens unscored); returns the last loss.

    Runs through `policy` (DDP or FSDP2 on several ranks): every rank draws the same batch and
    scores its own share of it; the loss is normalised by the batch's GLOBAL token count and
    scaled by the world size, so the averaged gradient is the whole batch's.

    stop: checked before every step; when requested, on_stop(steps done, optimiser) is called
    (it saves and raises). start, optimizer_state: continue a warm-up stopped after `start`
    steps, exactly as if it had not stopped."""
    w = cfg.warmup
    opt, _ = build_optimizer(model, w.lr, cfg)
    scaler = precision.get(cfg.train.precision).grad_scaler(d.device)  # fp16-mixed only
    if optimizer_state is not None:
        load_optimizer_state(policy, opt, optimizer_state)
    rng = random.Random(cfg.train.seed)
    for _ in range(start):  # the batches already trained on, drawn again so the rest match
        rng.sample(rows, min(w.batch_size, len(rows)))
    eos = tokenizer.eos_token_id
    loss = torch.tensor(float("nan"))
    model.train()
    for step in _progress(range(start, w.steps), "warm-up", cfg.train.progress and d.is_main):
        if stop is not None and stop.requested(d):
            on_stop(step, opt)
        batch = rng.sample(rows, min(w.batch_size, len(rows)))[d.rank::d.world]
        prompt_ids, prompt_mask = left_pad(encode_prompts(tokenizer, batch,
                                                          cfg.data.system_prompt or None),
                                           tokenizer.pad_token_id)
        answers = [tokenizer.encode(solution(r), add_special_tokens=False) + [eos] for r in batch]
        resp_ids, resp_mask = right_pad(answers, tokenizer.pad_token_id)
        input_ids = torch.cat([prompt_ids, resp_ids], 1).to(d.device)
        attn = torch.cat([prompt_mask, resp_mask.long()], 1).to(d.device)
        resp_mask = resp_mask.to(d.device)
        logp = policy(input_ids, attn, resp_ids.shape[1], 1.0, cfg.model.logprob_chunk_size)  # (B, T)
        n_tokens = d.sum([float(resp_mask.sum())])[0]
        loss = -(logp * resp_mask).sum() / n_tokens * d.world
        opt.zero_grad(set_to_none=True)
        precision.backward(loss, scaler)
        precision.step(opt, model.parameters(), cfg.optim.grad_clip, scaler)
    return d.sum([float(loss.detach()) / d.world])[0]


# --------------------------------------------------------------------------------------------
# the pieces of one RL step


@torch.no_grad()
def policy_logprobs(policy, r: Rollouts, temperature: float, micro: int, chunk: int,
                    with_entropy: bool = False, route=None):
    """Per-token log-probs (and entropies) of the responses under `policy` (a Policy, possibly
    wrapped by DDP or sharded), no gradient.

    route: optional `rows -> context manager` (a RoutingRecorder's record), entered around
    each micro-batch so that MoE routing is recorded per row.
    """
    outs = []
    for rows in torch.arange(r.response_ids.shape[0]).split(micro):
        with route(rows) if route else contextlib.nullcontext():
            outs.append(policy(r.input_ids[rows], r.attention_mask[rows],
                               r.response_ids.shape[1], temperature, chunk, with_entropy,
                               share_prompts=route is None))
    if not with_entropy:
        return torch.cat(outs)
    return torch.cat([o[0] for o in outs]), torch.cat([o[1] for o in outs])  # (B, T) each


def reduce_mismatch(m: dict[str, float], r: Rollouts, d: Dist) -> dict[str, float]:
    """engine_mismatch's means weighted over ranks (tokens, sequences), its maxes maxed."""
    w = WeightedMean()
    w.add("token_abs_mean", m["token_abs_mean"], float(r.response_mask.sum()))
    w.add("seq_log_ratio_mean", m["seq_log_ratio_mean"], float(r.response_mask.shape[0]))
    w.add_max("token_abs_max", m["token_abs_max"])
    w.add_max("seq_log_ratio_abs_max", m["seq_log_ratio_abs_max"])
    out = w.result(d)
    return {k: out[k] for k in m}  # engine_mismatch's order


def update(run: "Run", r: Rollouts, old_logp, ref_logp, adv) -> dict[str, float]:
    """`minibatches` optimiser steps over this rank's rollout rows; returns metrics reduced
    over ranks (token-weighted means, global min / max).

    Every loss is divided by the GLOBAL count of its minibatch (sequences, or tokens for
    token-mean) and multiplied by the world size, so that DDP's gradient average over ranks of
    the micro-batch sums is exactly the full-batch gradient. With algorithm.routing_replay the
    forwards replay pi_old's recorded MoE routing."""
    cfg, d = run.cfg, run.dist
    a = cfg.algorithm
    objective = OBJECTIVES[a.name]
    kwargs = {"eps_low": a.eps_low, "eps_high": a.eps_high,
              **objective.options(a.aggregation, cfg.rollout.max_new_tokens)}
    token_mean = objective.normaliser(a.aggregation) == "tokens"
    B, T = r.response_ids.shape
    mb_size = B // a.minibatches
    mask = r.response_mask
    stats = WeightedMean()
    grad_norms, losses, skipped = [], [], 0
    G = cfg.rollout.group_size
    if mb_size % G == 0:
        # minibatches of whole groups: a random partition still, and the G rows of a group
        # share their prompt's forward in token_logprobs (measured 0.218 -> 0.168 s per step)
        groups = torch.randperm(B // G, generator=run.gen)
        order = (groups[:, None] * G + torch.arange(G)).flatten()
    else:
        order = torch.randperm(B, generator=run.gen)
    run.model.train()
    for mb in order.split(mb_size):
        # the global normaliser of this optimiser step, shared by all its micro-batches
        denom = d.sum([float(mask[mb].sum())])[0] if token_mean else float(len(mb) * d.world)
        run.optimizer.zero_grad(set_to_none=True)
        mb_loss = 0.0
        parts = mb.split(run.micro)
        for i, idx in enumerate(parts):
            with (run.routing.replaying(idx),
                  no_sync(run.policy, skip=i < len(parts) - 1)):
                logp = run.policy(r.input_ids[idx], r.attention_mask[idx], T,
                                  cfg.rollout.temperature, cfg.model.logprob_chunk_size,
                                  share_prompts=not run.routing.replays)
                loss, metrics = objective(logp, old_logp[idx], adv[idx], mask[idx],
                                          denom=denom, **kwargs)
                if a.beta > 0:
                    loss = loss + a.beta * kl_k3(logp, ref_logp[idx], mask[idx]).sum() / (
                        len(mb) * d.world)
                _check_loss(loss, metrics, d)
                precision.backward(loss * d.world, run.scaler)
            mb_loss += float(loss.detach())
            # ratio_mean is weighted by what it averages over, the token fractions by tokens
            stats.add(M.RATIO_MEAN, metrics.pop("ratio_mean"), metrics.pop("ratio_count"))
            stats.add_min(M.RATIO_MIN, metrics.pop("ratio_min"))
            stats.add_max(M.RATIO_MAX, metrics.pop("ratio_max"))
            n_tokens = float(mask[idx].sum())
            for k, v in metrics.items():
                stats.add(M.OBJECTIVE.get(k, k), v, n_tokens)
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


def _check_loss(loss: torch.Tensor, metrics: dict, d: Dist) -> None:
    """Stop on a non-finite loss on any rank (all ranks stop together, none hangs)."""
    bad = d.sum([0.0 if torch.isfinite(loss) else 1.0])[0]
    if bad:
        raise TrainingError(f"non-finite loss {loss.item()} (metrics: "
                            f"{ {k: round(float(v), 4) for k, v in metrics.items()} }); lower "
                            f"optim.lr or check the rewards; the last finished checkpoint is kept")


def _progress(it, desc: str, enabled: bool):
    if not enabled:
        return it
    from tqdm.auto import tqdm
    return tqdm(it, desc=desc, file=sys.stderr, dynamic_ncols=True, leave=False)


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


# --------------------------------------------------------------------------------------------
# the loop


@dataclass(kw_only=True)
class Run:
    """Everything one training run holds, built once by :func:`build_run`."""
    cfg: Config
    run_dir: Path
    dist: Dist                               # rank / world size (1 without torchrun)
    model: torch.nn.Module                   # this rank's training model (sharded under FSDP2)
    policy: torch.nn.Module                  # the model's log-prob forward: DDP / FSDP2 on >1 rank
    tokenizer: transformers.PreTrainedTokenizerBase
    engine: RolloutEngine
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    train_rows: list[dict]
    eval_rows: list[dict]
    reward_fn: RewardFn
    solution: Callable[[dict], str]          # a row's worked answer, for the warm-up
    ref_policy: Policy | None                # pi_ref, unsharded, when algorithm.beta > 0
    routing: MoeRouting | NoRouting          # record / replay / measure MoE routing
    gen: torch.Generator                     # minibatch shuffling
    scaler: torch.amp.GradScaler | None      # fp16-mixed's dynamic loss scale
    micro: int                               # rows per forward (algorithm.micro_batch_size)
    checkpoint: Path | None                  # the checkpoint resumed from
    state: dict                              # its training state (step, accuracies, RNG)
    record: dict                             # what the run is (gspo.runrecord), saved with each
                                             # checkpoint
    sampler: AsyncSampler | None = None      # rollout.max_staleness >= 1
    threads: int | None = None               # torch's threads before the sampler halved them
    warmup_s: float = 0.0
    reward_window: list = field(default_factory=list)  # (completions, failures) of recent steps
    constant_reward_steps: int = 0           # consecutive steps whose rewards were all equal

    @property
    def start_step(self) -> int:
        return int(self.state.get("step", 0))


def policy_weights(policy, model):
    """(name, tensor) of the policy as a plain model, for the rollout engine and pi_ref: LoRA's
    merged weights, else the model's own (gathered one at a time when sharded)."""
    return merged_weights(model) if is_lora(model) else iter_weights(policy, model)


def fitting_prompts(rows: list[dict], what: str, model, tokenizer, cfg: Config) -> list[dict]:
    """The rows whose prompt (chat template included) leaves room for rollout.max_new_tokens in
    the model's context; a longer one fails the run naming it, or is skipped with
    data.on_bad_row=skip. Only rows long enough to possibly overflow are tokenized."""
    context = getattr(model.config, "max_position_embeddings", None)
    if not context or not rows:
        return rows
    room = context - cfg.rollout.max_new_tokens
    system = cfg.data.system_prompt or None
    # a token spans at least one byte of UTF-8 (at most 4 per character); templates add ~100
    suspects = [i for i, r in enumerate(rows) if 4 * len(r["prompt"]) + 256 > room]
    too_long = {}
    for i in suspects:
        n = len(encode_prompts(tokenizer, [rows[i]], system)[0])
        if n > room:
            too_long[i] = n
    if not too_long:
        return rows
    i, n = next(iter(too_long.items()))
    message = (f"{len(too_long)} {what} prompt(s) do not fit the model's context of {context} "
               f"tokens with rollout.max_new_tokens={cfg.rollout.max_new_tokens}; the first "
               f"({n} tokens) starts {rows[i]['prompt'][:40]!r}")
    if cfg.data.on_bad_row != "skip":
        raise TrainingError(f"{message}: shorten them, or set data.on_bad_row=skip")
    log.warning("%s; skipped", message)
    return [r for j, r in enumerate(rows) if j not in too_long]


def build_engine(model, tokenizer, cfg: Config, own_copy: bool = False) -> RolloutEngine:
    """The rollout engine rollout.engine names (gspo.engines.ENGINES), from the model's weights,
    with the options the engine reads from cfg.rollout; `gspo train` and `gspo eval` both
    build theirs here."""
    r = cfg.rollout
    try:
        options = engine_settings(r, cfg.algorithm.routing_replay).options
        return make_engine(r.engine, model, tokenizer, dtype=precision.rollout_dtype(cfg),
                           seed=cfg.train.seed, own_copy=own_copy, **options)
    except (ImportError, RuntimeError, ValueError) as e:  # an engine that cannot start here
        raise TrainingError(f"rollout.engine={r.engine}: {e}") from e


def check_launch(cfg: Config, world: int, n_train_rows: int | None = None,
                 resume: bool = False, n_eval_rows: int | None = None) -> None:
    """What a run on `world` ranks needs that the config alone cannot check: how the step's
    prompts, each rank's rollouts and the warm-up batch divide over the ranks, whether there
    are rows enough for a step and for each rank's share of the evaluation (once the rows are
    known), and what runs in one process only. Shared by `prepare` and `gspo train --dry-run`
    (which passes a planned world size)."""
    r, a = cfg.rollout, cfg.algorithm
    if r.prompts_per_step % world:
        raise TrainingError(f"rollout.prompts_per_step={r.prompts_per_step} must be divisible "
                            f"by the {world} ranks (whole groups stay on one rank)")
    rows = r.prompts_per_step * r.group_size // world
    if world > 1 and rows % a.minibatches:
        raise TrainingError(f"each of the {world} ranks holds {rows} rollouts per step, which "
                            f"is not divisible by algorithm.minibatches={a.minibatches}; raise "
                            f"rollout.prompts_per_step or lower algorithm.minibatches")
    if world > 1 and cfg.model.lora_rank > 0:
        raise TrainingError("model.lora_rank > 0 runs in one process for now; launch without "
                            "torchrun, or train every weight (model.lora_rank=0)")
    engine = engine_class(r.engine)
    if r.tensor_parallel_size > 1 and (not engine.tensor_parallel
                                       or world % r.tensor_parallel_size):
        raise TrainingError(f"rollout.tensor_parallel_size={r.tensor_parallel_size} needs "
                            f"rollout.engine={engines_with('tensor_parallel')} under torchrun "
                            f"with a multiple of that many ranks per node (here: "
                            f"rollout.engine={r.engine}, {world} rank(s))")
    if r.max_staleness:
        check_async(cfg, world)
    if world > 1 and engine.single_process:
        raise TrainingError(f"rollout.engine={r.engine} runs one engine in one process; under "
                            f"torchrun use rollout.engine={engines_with('single_process', False)}")
    if a.routing_replay and a.old_logprobs == "rollout" and not engine.records_routing:
        why = getattr(engine, "no_routing_reason", None)
        raise TrainingError(f"routing replay with old_logprobs=rollout needs an engine that "
                            f"records MoE routing; rollout.engine={r.engine} does not here"
                            f"{f' ({why})' if why else ''}: use rollout.engine="
                            f"{engines_with('records_routing')} or "
                            f"algorithm.old_logprobs=recompute")
    source = cfg.data.path or "the training rows"
    if n_train_rows is not None and n_train_rows < r.prompts_per_step:
        raise TrainingError(f"{source} has {n_train_rows} training row(s) (held-out rows not "
                            f"counted), fewer than the rollout.prompts_per_step="
                            f"{r.prompts_per_step} distinct prompts each RL step draws; add rows "
                            f"or lower rollout.prompts_per_step (a divisor of the ranks' and "
                            f"minibatches' counts)")
    if n_eval_rows is not None and cfg.train.eval_every > 0 and n_eval_rows < world:
        raise TrainingError(f"{n_eval_rows} held-out row(s) for {world} ranks: each rank "
                            f"evaluates its share; add held-out rows (data.n_eval, "
                            f"data.eval_path) or set train.eval_every=0")
    warm_batch = min(cfg.warmup.batch_size, n_train_rows or 0)
    if n_train_rows is not None and cfg.warmup.steps and not resume and warm_batch % world:
        raise TrainingError(f"the warm-up batch ({warm_batch} = min(warmup.batch_size, training "
                            f"rows)) must be divisible by the {world} ranks (each scores its "
                            f"share of the batch)")


def check_async(cfg: Config, world: int) -> None:
    """What asynchronous rollouts (rollout.max_staleness >= 1) do not run with yet."""
    r, why = cfg.rollout, None
    if cfg.algorithm.routing_replay:
        why = ("algorithm.routing_replay (pi_old's routing would be recorded on one version "
               "and replayed on another)")
    elif engine_settings(r).sleeps:
        why = f"{engine_settings(r).sleeps} (the engine samples while the trainer updates)"
    elif r.tensor_parallel_size > 1:
        why = "rollout.tensor_parallel_size > 1 (its collectives would run in the sampler's thread)"
    elif world > 1:
        # it ran (DDP and FSDP2, 2 CPU ranks), but a rank aborted ("terminate called without
        # an active exception") in 2 of ~20 runs on a loaded machine, cause not found yet
        why = "torchrun yet (a rank aborted intermittently in our tests)"
    if why:
        raise TrainingError(f"rollout.max_staleness={r.max_staleness} does not run with {why}; "
                            f"set rollout.max_staleness=0")


def run_dir_checkpoint(cfg: Config, run_dir: Path, resume: bool, verify: bool = True,
                       **objects) -> tuple[Path | None, dict | None]:
    """(the checkpoint a resume starts from, its run record; None, None for a new run), after
    refusing a new run in a directory that holds checkpoints, a resume that changes what the
    run was (gspo.runrecord.check_resume) and one that would lose a metrics row
    (gspo.logger.check_resumable). verify: check the checkpoint's files against its
    manifest (reads them all). objects: reward_fn, train_data, eval_data as for `train`."""
    if not resume and latest_checkpoint(run_dir) is not None:
        raise TrainingError(f"{run_dir} already holds checkpoints; pass --resume {run_dir} to "
                            f"continue it or choose a new --output-dir")
    if not resume:
        return None, None
    ckpt = latest_checkpoint(run_dir, verify=verify)
    if ckpt is None:
        raise TrainingError(f"--resume {run_dir}: no finished checkpoint found there")
    record = check_resume(cfg, run_dir, ckpt, **objects)
    check_resumable(run_dir / METRICS_FILE, int(ckpt.name.rsplit("_", 1)[1]),
                    ckpt / METRICS_FILE)  # on every rank, though rank 0 alone writes it
    return ckpt, record


def build_run(cfg: Config, run_dir: Path, resume: bool, *, reward_fn=None, train_data=None,
              eval_data=None) -> Run:
    """Build task, model, engine and optimiser, and restore the checkpoint a resume starts
    from; the warm-up is not run here (see `warm_up`). reward_fn, train_data, eval_data: Python
    objects in place of data.reward / data.path / data.eval_path (see `train`)."""
    t, a = cfg.train, cfg.algorithm
    require_trackers(t.report_to)  # a missing package fails now, not after the warm-up
    d = init_distributed(t.device, t.dist_timeout_s)
    check_launch(cfg, d.world)  # before anything is loaded; the warm-up batch once rows are
    ckpt, record = run_dir_checkpoint(cfg, run_dir, resume, reward_fn=reward_fn,
                                      train_data=train_data, eval_data=eval_data)
    run_dir.mkdir(parents=True, exist_ok=True)
    transformers.utils.logging.disable_progress_bar()  # no "Writing model shards" bar per save
    torch.manual_seed(t.seed)

    # the data first: a bad row fails the run before a large model is loaded
    train_rows, eval_rows, reward, solution = build_task(cfg.data, train_data, eval_data,
                                                         reward_fn)
    try:
        check_rows(record, cfg, run_dir, train_rows, eval_rows)
    except TrainingError:
        close_reward(reward)
        raise
    what_it_was = make_record(cfg, reward_fn, train_data, eval_data, train_rows, eval_rows)
    model, tokenizer = build_model(cfg, d.device)
    train_rows, eval_rows = (fitting_prompts(rows, what, model, tokenizer, cfg)
                             for rows, what in ((train_rows, "training"), (eval_rows, "held-out")))
    check_launch(cfg, d.world, len(train_rows), resume, len(eval_rows))
    state = {}
    lora = cfg.model.lora_rank > 0
    if ckpt is not None:  # weights and RNG now, the optimiser's state once it is built
        # LoRA: the base stays as loaded; the adapter is restored once it is injected
        try:
            state = load_checkpoint(ckpt, model, load_weights=not lora)
        except ValueError as e:  # an old checkpoint (no run.json) of another shape
            raise TrainingError(f"--resume {run_dir}: {e}; start a new run with --output-dir "
                                f"for a model of another shape") from None
        log.info("resumed from %s at step %d", ckpt, state["step"])
    broadcast_weights(model, d)  # every rank starts from rank 0's weights
    mode = data_parallel_mode(cfg, d)
    prec = precision.get(t.precision)
    compute_dtype = prec.compute_dtype if prec.mixed else None
    # copies while the weights are whole (FSDP2 shards them in place); refreshed after warm-up
    # LoRA: the engine holds a plain copy, refreshed with the merged weights
    # rollout.max_staleness >= 1: the sampler's thread samples while the trainer updates
    engine = build_engine(model, tokenizer, cfg, own_copy=mode == "fsdp" or lora
                          or cfg.rollout.max_staleness > 0)
    try:  # from here on a failure closes the engine (a vLLM engine holds process-wide state)
        ref_policy = Policy(copy.deepcopy(model).eval(), compute_dtype) if a.beta > 0 else None
        if lora:  # after pi_ref's copy: the reference is the plain base model
            model = with_lora(model, cfg, engine, ckpt, compute_dtype)
        if ref_policy is not None and ckpt is not None:
            ref_policy.model.load_state_dict(reference_weights(ckpt, a.beta))
        policy = wrap_policy(model, d, mode, compute_dtype)
        if t.precision == "bf16-true":
            precision.warn_vanishing_updates(model, cfg.optim.lr)
        try:
            routing = routing_for(model, a.routing_replay, getattr(engine, "model", None) if (
                a.routing_replay and a.old_logprobs == "rollout") else None)
        except ValueError as e:
            raise TrainingError(f"{e}; {cfg.model.name_or_path} has none") from None
        gen = torch.Generator().manual_seed(t.seed)
        if "update_rng" in state:
            gen.set_state(state["update_rng"])
        optimizer, scheduler = build_optimizer(model, cfg.optim.lr, cfg)
        scaler = prec.grad_scaler(d.device)
        if ckpt is not None and WARMUP_DONE not in state:  # else: the warm-up's optimiser
            optimizer_state, scheduler_state = read_training_state(ckpt)
            load_optimizer_state(policy, optimizer, optimizer_state)
            scheduler.load_state_dict(scheduler_state)
            if scaler is not None and "grad_scaler" in state:
                scaler.load_state_dict(state["grad_scaler"])
        rows = cfg.rollout.prompts_per_step * cfg.rollout.group_size // d.world  # this rank's
        return Run(cfg=cfg, run_dir=run_dir, dist=d, model=model, policy=policy,
                   tokenizer=tokenizer, engine=engine, optimizer=optimizer, scheduler=scheduler,
                   train_rows=train_rows, eval_rows=eval_rows, reward_fn=reward,
                   solution=solution, ref_policy=ref_policy, routing=routing, gen=gen,
                   scaler=scaler, micro=a.micro_batch_size or rows // a.minibatches,
                   checkpoint=ckpt, state=state, record=what_it_was)
    except BaseException:
        engine.close()
        raise


def with_lora(model, cfg: Config, engine: RolloutEngine, ckpt: Path | None,
              base_dtype: torch.dtype | None = None):
    """The model with LoRA adapters (peft), restored from `ckpt` on a resume. base_dtype: the
    frozen base is kept in it (mixed precision: a bf16 base, the float32 adapters are the
    master weights), as its matmuls run in it anyway."""
    m = cfg.model
    try:
        model = add_lora(model, m.lora_rank, m.lora_alpha, m.lora_dropout, m.lora_target_modules)
        if base_dtype is not None:
            for p in model.parameters():
                if not p.requires_grad:
                    p.data = p.data.to(base_dtype)
        if ckpt is not None:
            load_adapter(model, ckpt / ADAPTER_DIR)
            engine.load_weights(merged_weights(model))  # it was built from the base alone
    except (LoraUnavailable, ValueError) as e:
        raise TrainingError(str(e)) from None
    return model


def reference_weights(ckpt: Path, beta: float) -> dict:
    """pi_ref's weights as `ckpt` saved them (a KL penalty's reference)."""
    reference = read_reference(ckpt)
    if reference is None:
        raise TrainingError(f"algorithm.beta={beta} needs pi_ref, but {ckpt} holds no "
                            f"reference.pt (saved without a KL penalty); resume with "
                            f"algorithm.beta=0 or start a new run")
    return reference


def run_warmup(run: Run, stop: StopRequest | None = None) -> None:
    """The supervised warm-up of a new run (none when resuming, except from a warm-up a signal
    stopped, or with warmup.steps=0); then the rollout engine and pi_ref take its weights: RL
    starts from the warmed-up policy. A signal stops it within one step, with a checkpoint that
    a resume continues the warm-up from."""
    cfg = run.cfg
    done = run.state.get(WARMUP_DONE)
    if (run.checkpoint is not None and done is None) or cfg.warmup.steps <= 0:
        return

    def on_stop(step: int, optimizer) -> None:
        save_run_config(run)
        save(run, 0, None, None, warmup=(step, optimizer))
        _stopped(run, stop, f"during the warm-up, after {step} of {cfg.warmup.steps} steps", 0)

    t0 = time.perf_counter()
    loss = warmup(run.policy, run.model, run.tokenizer, run.train_rows, run.solution, cfg,
                  run.dist, stop, on_stop, start=done or 0,
                  optimizer_state=read_training_state(run.checkpoint)[0] if done else None)
    run.warmup_s = time.perf_counter() - t0
    log.info("warm-up: %d steps, final loss %.4f, %.1fs", cfg.warmup.steps, loss, run.warmup_s)
    run.engine.load_weights(policy_weights(run.policy, run.model))
    if run.ref_policy is not None:
        copy_weights_(run.ref_policy.model, policy_weights(run.policy, run.model))


def save_run_config(run: Run) -> None:
    """config.yaml, written only once the run has started: a resume that fails to start leaves
    the run's config as it was."""
    if run.dist.is_main:
        save_config(run.cfg, run.run_dir / "config.yaml")


def prepare(cfg: Config, run_dir: Path, resume: bool, **objects) -> Run:
    """A run ready for its first RL step: `build_run`, the warm-up and the saved config (what
    `train` does before its loop; benchmarks and tests then call `rl_step` themselves).
    objects: reward_fn, train_data, eval_data as for `train`."""
    run = build_run(cfg, run_dir, resume, **objects)
    try:
        run_warmup(run)
        save_run_config(run)
        start_sampler(run)
    except BaseException:
        close_run(run)
        raise
    return run


def close_run(run: Run) -> None:
    """Release what the run holds outside Python's reach: the engine (vLLM's process-wide
    state), the reward's resources and the routing hooks."""
    if run.sampler is not None:
        run.sampler.close()
    if run.threads is not None:
        torch.set_num_threads(run.threads)
    run.engine.close()
    run.routing.close()
    close_reward(run.reward_fn)


def data_parallel_mode(cfg: Config, d: Dist) -> str:
    """'none' on one process, else 'fsdp' or 'ddp' as train.data_parallel asks."""
    if not d.enabled:
        return "none"
    mode = cfg.train.data_parallel
    if mode == "auto":
        return "fsdp" if fsdp_available() else "ddp"
    if mode == "fsdp" and not fsdp_available():
        raise TrainingError(f"train.data_parallel=fsdp needs torch.distributed.fsdp.fully_shard "
                            f"(torch >= 2.6; this is {torch.__version__}); use ddp")
    return mode


def run_eval(run: Run, stop: StopRequest | None = None) -> dict[str, float] | None:
    """Held-out avg@k and pass@k with the rollout engine (fixed seed: common random numbers);
    each rank evaluates its share of the problems and the means are reduced over ranks. None
    when `stop` was requested: a rank stops within one batch of its own signal (evaluate has
    no collective), then the ranks agree."""
    t, r, d = run.cfg.train, run.cfg.rollout, run.dist
    rows = run.eval_rows[d.rank::d.world]
    with (run.sampler.borrow(policy_weights(run.policy, run.model)) if run.sampler
          else contextlib.nullcontext(run.engine)) as engine:
        res = _evaluate(run, engine, rows, stop)
    if stop is not None and stop.requested(d):
        return None
    m = WeightedMean()  # means over problems
    m.add(M.EVAL_ACCURACY, res.avg_at_k, len(rows))
    for k, v in sorted(res.pass_at.items()):
        m.add(M.eval_pass_at(k), v, len(rows))
    return m.result(d)


def _evaluate(run: Run, engine: RolloutEngine, rows: list[dict], stop: StopRequest | None):
    t, r, d = run.cfg.train, run.cfg.rollout, run.dist
    return evaluate(engine, run.tokenizer, rows, run.reward_fn, t.eval_k,
                    SamplingParams(t.eval_temperature, r.top_p, r.max_new_tokens),
                    seed=t.seed + 999_983 + d.rank,
                    system_prompt=run.cfg.data.system_prompt or None,
                    reward_timeout_s=run.cfg.data.reward_fn_timeout or None,
                    should_stop=None if stop is None else lambda: stop.signum is not None)


def generate(run: Run, rows: list[dict], step: int) -> Rollouts:
    """Sample G responses per prompt (recording the engine's MoE routing when pi_old's is
    taken from it)."""
    r = run.cfg.rollout
    prompts = encode_prompts(run.tokenizer, rows, run.cfg.data.system_prompt or None)
    params = SamplingParams(r.temperature, r.top_p, r.max_new_tokens)
    seed = run.cfg.train.seed * 7_919 + step + 1_000_003 * run.dist.rank
    with run.routing.sampling(len(prompts) * r.group_size):
        rollouts = run.engine.generate(prompts, n=r.group_size, params=params, seed=seed)
    run.routing.sampled(rollouts.input_ids.shape[1] - 1, rollouts.routing)
    return rollouts.to(run.dist.device)  # an engine may hand back host tensors (vLLM)


def old_policy(run: Run, r: Rollouts, step: int) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """pi_old's per-token log-probs, the per-token entropy, and engine-mismatch metrics.

    recompute: a no-grad forward of the training model (recording MoE routing for replay);
    rollout:   the sampler's own log-probs, with no forward pass, except every
               `mismatch_every` steps a recompute only to measure the mismatch. The entropy
               is then estimated as -logp of the sampled tokens (unbiased for the sampler's).
    """
    a, chunk, temp = run.cfg.algorithm, run.cfg.model.logprob_chunk_size, run.cfg.rollout.temperature
    use_rollout = a.old_logprobs == "rollout"
    monitor = use_rollout and a.mismatch_every > 0 and step % a.mismatch_every == 0
    metrics = {}
    if not use_rollout or monitor:
        # pi_old's MoE routing, recorded here unless the engine recorded it as it sampled
        B, L = r.input_ids.shape
        route = run.routing.recording(B, L - 1)
        train_logp, entropy = policy_logprobs(run.policy, r, temp, run.micro, chunk, True,
                                              route=route)
        mismatch = engine_mismatch(train_logp, r.logp, r.response_mask)
        mismatch = reduce_mismatch({k: float(v) for k, v in mismatch.items()}, r, run.dist)
        metrics = {M.MISMATCH + k: v for k, v in mismatch.items()}
    if use_rollout:
        return r.logp, -r.logp, metrics
    return train_logp, entropy, metrics


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


def sample(run: Run, step: int) -> tuple[list[dict], Rollouts, list[str]]:
    """This rank's share of step `step`'s prompts, G responses to each, decoded (no
    collectives: with rollout.max_staleness >= 1 it runs in the sampler's thread)."""
    r = run.cfg.rollout
    rows = step_prompts(run.train_rows, step, r.prompts_per_step, run.cfg.train.seed)
    share = len(rows) // run.dist.world
    rows = rows[run.dist.rank * share:(run.dist.rank + 1) * share]
    rollouts = generate(run, rows, step)
    return rows, rollouts, decode_responses(run.tokenizer, rollouts)


def score_texts(run: Run, rows: list[dict], texts: list[str]):
    """(rewards, failed calls, the first failure) of the decoded responses to `rows`."""
    G = run.cfg.rollout.group_size
    return score(run.reward_fn, texts, [row for row in rows for _ in range(G)],
                 timeout=run.cfg.data.reward_fn_timeout or None)


def start_sampler(run: Run) -> None:
    """rollout.max_staleness >= 1: the background sampler (gspo.async_rollouts), from the
    engine's weights, which are the policy's (version run.start_step). On the CPU the two
    threads share the cores: each computes with half of torch's threads."""
    if run.cfg.rollout.max_staleness == 0:
        return
    sampler_threads = run.cfg.rollout.sampler_threads or None
    if run.dist.device.type == "cpu" and sampler_threads is None:
        run.threads = torch.get_num_threads()
        sampler_threads = max(1, run.threads // 2)
        torch.set_num_threads(max(1, run.threads - sampler_threads))
    log.info("asynchronous rollouts: the sampler computes with %s thread(s), the trainer with "
             "%d", sampler_threads or torch.get_num_threads(), torch.get_num_threads())
    run.sampler = AsyncSampler(run.engine, run.cfg.rollout.max_staleness, run.start_step,
                               policy_weights(run.policy, run.model),
                               lambda step: sample(run, step),
                               lambda rows, texts: score_texts(run, rows, texts),
                               sampler_threads)


def rl_step(run: Run, step: int, stop: StopRequest | None = None) -> dict[str, float] | None:
    """One RL step: rollout -> rewards -> advantages -> pi_old -> minibatch updates. None when
    `stop` was requested during the rollout (the step is abandoned before any update). With
    rollout.max_staleness >= 1 the rollout and its rewards come from the sampler's thread."""
    cfg, t0 = run.cfg, time.perf_counter()
    G = cfg.rollout.group_size
    # ---- rollout (this rank's share of the step's prompts) and its rewards
    if run.sampler is None:
        rows, rollouts, texts = sample(run, step)
        run.engine.sleep()  # until the update's push (an engine that sleeps: EngineSettings)
        t_rollout, lag = time.perf_counter() - t0, {}
        if stop is not None and stop.requested(run.dist):
            return None
        rewards, reward_failures, first_error = score_texts(run, rows, texts)
    else:
        batch = run.sampler.take(step)
        t_rollout = time.perf_counter() - t0  # the wait for it
        if stop is not None and stop.requested(run.dist):
            return None
        rows, rollouts, rewards = batch.rows, batch.rollouts, batch.rewards
        reward_failures, first_error = batch.reward_failures, batch.first_error
        lag = {M.STALENESS: step - batch.version, M.TIME_SAMPLE: batch.rollout_s}
    # ---- group advantages
    n, failures = check_reward_failures(run, step, len(rewards), reward_failures, first_error)
    rewards = torch.tensor(rewards, device=run.dist.device)  # (B,)
    adv = group_advantages(rewards, G, cfg.algorithm.advantage_scale)
    # ---- pi_old (and pi_ref)
    t1 = time.perf_counter()
    old_logp, entropy, mismatch = old_policy(run, rollouts, step)
    if cfg.algorithm.tis != "none":
        w = truncated_is_weights(old_logp, rollouts.logp, rollouts.response_mask,
                                 cfg.algorithm.tis, cfg.algorithm.tis_cap)
        adv = adv[:, None] * w if w.dim() == 2 else adv * w  # w > 0 commutes with the min
    ref_logp = (policy_logprobs(run.ref_policy, rollouts, cfg.rollout.temperature, run.micro,
                                cfg.model.logprob_chunk_size) if run.ref_policy else None)
    t_old = time.perf_counter() - t1
    # ---- minibatch updates
    t2 = time.perf_counter()
    m = update(run, rollouts, old_logp, ref_logp, adv)
    if run.sampler is None:
        run.engine.load_weights(policy_weights(run.policy, run.model))
    else:  # version step + 1, for the batch of step + 1 + max_staleness
        run.sampler.publish(step + 1, policy_weights(run.policy, run.model))
    t_update = time.perf_counter() - t2
    m.update(run.routing.step_metrics(
        lambda route: policy_logprobs(run.policy, rollouts, cfg.rollout.temperature, run.micro,
                                      cfg.model.logprob_chunk_size, route=route),
        rollouts.response_mask, rollouts.input_ids.shape[1] - 1, run.dist))
    # ---- metrics (over this step's completions and tokens on every rank)
    mask = rollouts.response_mask
    totals = WeightedMean()
    totals.add_total(M.REWARD_MEAN, rewards.sum(), len(rewards))
    totals.add_total(M.ENTROPY, (entropy * mask).sum(), mask.sum())
    totals.add_total(M.RESPONSE_LEN, mask.sum(), len(rewards))
    totals.add_sum("squares", (rewards ** 2).sum())
    totals.add_sum("tokens", mask.sum())
    row = totals.result(run.dist)
    r_mean, r_sq, n_tokens = row[M.REWARD_MEAN], row.pop("squares"), row.pop("tokens")
    row[M.REWARD_STD] = math.sqrt(max(0.0, (r_sq - n * r_mean ** 2) / max(1.0, n - 1)))
    warn_constant_reward(run, row[M.REWARD_STD], step)
    row.update(m, **mismatch, **lag)
    row.update({M.REWARD_FAILURES: int(failures), M.LR: run.scheduler.get_last_lr()[0],
                M.TIME_ROLLOUT: t_rollout, M.TIME_OLD_LOGP: t_old, M.TIME_UPDATE: t_update,
                M.TOKENS_PER_S: n_tokens / (time.perf_counter() - t0)})
    return M.in_row_order(row)


def train(cfg: Config, run_dir: str | Path, resume: bool = False, *, reward_fn=None,
          train_data=None, eval_data=None) -> Summary:
    """Run warm-up (unless resuming) and `train.steps` RL steps; write everything to run_dir.
    Holds run_dir's lock throughout (one writer per run); SIGTERM / SIGINT stop it with a
    checkpoint (gspo.signals).

    From Python, the reward and the data can be objects instead of config strings (TRL's
    GRPOTrainer takes `reward_funcs` and `train_dataset` alike; gspo's rewards score one
    completion at a time):

    reward_fn   f(completion: str, **row_fields) -> float, or a list of them (rewards summed);
                replaces data.reward and the task's own reward
    train_data  the training prompts in place of data.path: a list of dicts or a
                `datasets.Dataset`, each row mapped and checked as a file row is (data.task
                math or code; data.prompt_field, data.answer_field / data.tests_field, ...;
                a bad row is named as `train_data row N`)
    eval_data   the held-out prompts in place of data.eval_path (default: data.n_eval rows
                held out of train_data)

    The saved config.yaml cannot record Python objects: to resume such a run, call train(...,
    resume=True) with the same objects again (each checkpoint's run.json records the reward's
    name and a fingerprint of the rows, and a resume with others is refused; so is
    `gspo train --resume`, which has only the config).
    """
    with exclusive(run_dir, enabled=int(os.environ.get("RANK", "0")) == 0), StopRequest() as stop:
        # ---- build the run: task, model, engine, optimiser; a resume's checkpoint restored
        run = build_run(cfg, Path(run_dir), resume, reward_fn=reward_fn, train_data=train_data,
                        eval_data=eval_data)
        try:
            # ---- supervised warm-up (a new run)
            run_warmup(run, stop)
            save_run_config(run)
            start_sampler(run)
            # ---- RL steps
            with MetricsLogger(run.run_dir, enabled=run.dist.is_main,
                               resume_from_step=run.start_step if resume else None,
                               report_to=cfg.train.report_to, config=to_dict(cfg),
                               project=cfg.train.project,
                               history=run.checkpoint / METRICS_FILE if run.checkpoint else None
                               ) as logger:
                return rl_loop(run, resume, logger, stop)
        finally:
            close_run(run)


WARMUP_DONE = "warmup_done"  # in a warm-up checkpoint's state: the warm-up steps it holds


def save(run: Run, done: int, start_acc, final_acc,
         warmup: tuple[int, torch.optim.Optimizer] | None = None) -> int:
    """Checkpoint the state after `done` RL steps (a collective when sharded); returns done.
    warmup: (steps done, its optimiser) of a warm-up stopped part-way, which the checkpoint
    holds instead of the RL optimiser's state, for a resume to continue it."""
    # DDP: every rank holds the same state, rank 0's is the run's; FSDP: gathered to 0
    optimizer = run.optimizer if warmup is None else warmup[1]
    weights, optimizer_state = checkpoint_state(run.policy, run.model, optimizer)
    lora = is_lora(run.model)
    if lora:  # the merged model for plain transformers; lora/ for an exact resume
        weights = dict(merged_weights(run.model))
    reference = run.ref_policy.model.state_dict() if run.ref_policy else None
    def extra(d: Path) -> None:  # inside the checkpoint's atomic write
        write_record(d, run.record)
        metrics = run.run_dir / METRICS_FILE  # the rows so far, to repair the run's file from
        if metrics.is_file():
            shutil.copyfile(metrics, d / METRICS_FILE)
        if lora:
            save_adapter(run.model, d / ADAPTER_DIR)

    if run.dist.is_main:
        state = {"step": done, "start_accuracy": start_acc, "final_accuracy": final_acc,
                 "update_rng": run.gen.get_state(),
                 **({WARMUP_DONE: warmup[0]} if warmup is not None else {}),
                 **({"grad_scaler": run.scaler.state_dict()} if run.scaler is not None else {})}
        save_checkpoint(run.run_dir, done, run.model, run.tokenizer, optimizer,
                        run.scheduler, state,
                        keep_last=run.cfg.train.keep_last, weights=weights,
                        optimizer_state=optimizer_state, reference=reference, extra=extra)
    return done


def _halt(run: Run, stop: StopRequest, done: int, saved: int | None, start_acc,
          final_acc, note: str = "") -> None:
    """After a signal: checkpoint the last finished step (unless it is saved) and stop."""
    if saved != done:
        save(run, done, start_acc, final_acc)
    _stopped(run, stop, f"after {done} of {run.cfg.train.steps} RL steps{note}", done)


def _stopped(run: Run, stop: StopRequest, when: str, step: int) -> None:
    """Raise Interrupted saying where the run stopped and how to resume (checkpoint saved)."""
    run.dist.barrier()
    signum, name = stop.name(run.dist)
    # torchrun re-raises a signal it got as its own SignalException traceback, after ours
    # (torch.distributed.run has no way to keep it quiet): say that it is not a failure
    torchrun = (f" (every rank stopped cleanly: a SignalException traceback from torchrun "
                f"after this line only reports the {name} it got and passed on)"
                if under_torchrun() else "")
    raise Interrupted(f"stopped by {name} {when}; checkpoint "
                      f"{run.run_dir / 'checkpoints' / f'step_{step:06d}'} holds it{torchrun}; "
                      f"continue with: gspo train --resume {run.run_dir}", signum)


def rl_loop(run: Run, resume: bool, logger: MetricsLogger,
            stop: StopRequest | None = None) -> Summary:
    """train.steps RL steps from run.start_step: held-out evaluation, metrics rows, checkpoints,
    and a checkpoint and stop on a signal."""
    cfg = run.cfg
    t = cfg.train
    start_acc = run.state.get("start_accuracy")
    # the step the newest checkpoint holds (a stopped warm-up's is not one to end with)
    saved = run.start_step if resume and WARMUP_DONE not in run.state else None
    # the evaluation before RL: a new run's, or one a signal stopped (or the warm-up before it)
    if t.eval_every > 0 and run.start_step == 0 and start_acc is None:
        first = run_eval(run, stop)
        if first is None:
            _halt(run, stop, 0, saved, None, None, " (the evaluation before RL abandoned)")
        start_acc = first[M.EVAL_ACCURACY]
        logger.log(0, first)
    final_acc = run.state.get("final_accuracy", start_acc)
    rl_t0 = time.perf_counter()
    bar = _progress(range(run.start_step, t.steps), cfg.algorithm.name.upper(),
                    t.progress and run.dist.is_main)
    for step in bar:
        row = None if stop and stop.requested(run.dist) else rl_step(run, step, stop)
        if row is None:  # a signal: nothing of this step is applied
            _halt(run, stop, step, saved, start_acc, final_acc)
        done = step + 1
        if t.eval_every > 0 and (done % t.eval_every == 0 or done == t.steps):
            evaluated = run_eval(run, stop)
            if evaluated is None:  # a signal: the step's own row is kept, its evaluation not
                logger.log(done, row)
                _halt(run, stop, done, saved, start_acc, final_acc,
                      " (its evaluation abandoned)")
            row.update(evaluated)
            final_acc = row[M.EVAL_ACCURACY]
        logger.log(done, row)
        if hasattr(bar, "set_postfix"):
            bar.set_postfix(reward=f"{row[M.REWARD_MEAN]:.2f}",
                            acc="-" if final_acc is None else f"{final_acc:.2f}")
        if (t.save_every > 0 and done % t.save_every == 0) or done == t.steps:
            saved = save(run, done, start_acc, final_acc)
        run.dist.barrier()
    if saved is None:  # train.steps=0: the warm-up's checkpoint, to resume or to use
        save(run, 0, start_acc, final_acc)
    return Summary(run.run_dir, start_acc, final_acc, run.warmup_s,
                   time.perf_counter() - rl_t0, _peak_rss_mb(), t.steps)
