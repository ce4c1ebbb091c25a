"""The run around the RL steps: build it, warm it up, loop, evaluate, checkpoint, stop.

    train          the entry point: the run directory's lock and signals, then the below
    build_run      pre-flight (gspo.preflight), model, engine, optimiser, a resume's state
    run_warmup     the supervised warm-up of a new run (gspo.warmup)
    rl_loop        train.steps RL steps (gspo.step.rl_step: produce -> consume), held-out
                   evaluation, metrics rows, checkpoints, and a checkpoint and stop on a signal

Under torchrun the same loop runs on every rank, each on its share of the prompts
(gspo.distributed: DDP or FSDP2). Callbacks (gspo.callbacks) observe the run.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import resource
import shutil
import time
from pathlib import Path

import torch
import transformers

from gspo import metrics as M
from gspo import precision
from gspo.async_rollouts import SAMPLER, TRAINER, AsyncSampler, CoreShare
from gspo.callbacks import Callbacks
from gspo.checkpoint import (load_checkpoint, read_reference, read_training_state,
                              restore_moved_aside, save_checkpoint)
from gspo.config import Config, save_config, to_dict
from gspo.data import correctness_only
from gspo.distributed import (Policy, broadcast_weights, checkpoint_state, init_distributed,
                               load_optimizer_state, wrap_policy)
from gspo.engines import RolloutEngine, SamplingParams, engine_settings, make_engine
from gspo.errors import TrainingError
from gspo.evaluation import evaluate
from gspo.logger import METRICS_FILE, MetricsLogger, progress
from gspo.lora import (ADAPTER_DIR, LoraUnavailable, add_lora, is_lora, load_adapter,
                       merged_weights, save_adapter)
from gspo.metrics import WeightedMean
from gspo.moe import routing_for
from gspo.optim import build_optimizer
from gspo.preflight import data_parallel_mode, preflight, setting_warnings
from gspo.rewards import close_reward
from gspo.run import Run, Summary, policy_weights
from gspo.runlock import exclusive
from gspo.runrecord import write_record
from gspo.signals import Interrupted, StopRequest, under_torchrun
from gspo.step import rl_step, sample_batch, sampler_recomputes
from gspo.trackers import require as require_trackers
from gspo.warmup import warmup
from gspo.weights import copy_weights_

log = logging.getLogger(__name__)

WARMUP_DONE = "warmup_done"  # in a warm-up checkpoint's state: the warm-up steps it holds
UNEVALUATED = "unevaluated_row"  # in a stop's checkpoint: its step's row, evaluation abandoned


def train(cfg: Config, run_dir: str | Path, resume: bool = False, *, reward_fn=None,
          train_data=None, eval_data=None, callbacks=None) -> Summary:
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
    callbacks   gspo.Callback instances that observe the run (its phases, rows, evaluations
                and checkpoints), as TRL's TrainerCallback

    The saved config.yaml cannot record Python objects: to resume such a run, call train(...,
    resume=True) with the same objects again (each checkpoint's run.json records the reward's
    name and a fingerprint of the rows, and a resume with others is refused; so is
    `gspo train --resume`, which has only the config).
    """
    rank0 = int(os.environ.get("RANK", "0")) == 0
    with exclusive(run_dir, enabled=rank0), StopRequest() as stop:
        if resume and rank0:  # before the ranks meet in build_run and look for the checkpoint
            restore_moved_aside(run_dir)
        # ---- build the run: task, model, engine, optimiser; a resume's checkpoint restored
        run = build_run(cfg, Path(run_dir), resume, reward_fn=reward_fn, train_data=train_data,
                        eval_data=eval_data, callbacks=callbacks)
        try:
            # before the warm-up: a tracker that cannot start (wandb without a key) fails now
            with MetricsLogger(run.run_dir, enabled=run.dist.is_main,
                               # a row whose evaluation a signal abandoned is logged again
                               resume_from_step=(run.start_step - (UNEVALUATED in run.state)
                                                 if resume else None),
                               report_to=cfg.train.report_to, config=to_dict(cfg),
                               project=cfg.train.project,
                               history=run.checkpoint / METRICS_FILE if run.checkpoint else None
                               ) as logger:
                # ---- supervised warm-up (a new run)
                run_warmup(run, stop)
                save_run_config(run)
                start_sampler(run, end=cfg.train.steps)
                run.callbacks.on_train_begin(run)
                # ---- RL steps
                summary = rl_loop(run, resume, logger, stop)
            run.callbacks.on_train_end(run, summary)
            return summary
        finally:
            close_run(run)


def build_run(cfg: Config, run_dir: Path, resume: bool, *, reward_fn=None, train_data=None,
              eval_data=None, callbacks=None) -> Run:
    """Build task, model, engine and optimiser, and restore the checkpoint a resume starts
    from; the warm-up is not run here (see `run_warmup`). reward_fn, train_data, eval_data: Python
    objects in place of data.reward / data.path / data.eval_path, callbacks: gspo.Callback
    instances (see `train`)."""
    t, a = cfg.train, cfg.algorithm
    require_trackers(t.report_to)  # a missing package fails now, not after the warm-up
    d = init_distributed(t.device, t.dist_timeout_s)
    torch.manual_seed(t.seed)
    p = preflight(cfg, run_dir, resume, d.world, device=d.device, reward_fn=reward_fn,
                  train_data=train_data, eval_data=eval_data)
    for warning in setting_warnings(cfg, on_cpu=d.device.type == "cpu") if d.is_main else []:
        log.warning(warning)
    run_dir.mkdir(parents=True, exist_ok=True)
    transformers.utils.logging.disable_progress_bar()  # no "Writing model shards" bar per save
    ckpt, model = p.checkpoint, p.model
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
    engine = build_engine(model, p.tokenizer, cfg, own_copy=mode == "fsdp" or lora
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
                a.routing_replay and a.old_logprobs == "rollout") else None,
                a.router_aux_loss_coef)
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
                   tokenizer=p.tokenizer, engine=engine, optimizer=optimizer,
                   scheduler=scheduler, train_rows=p.train_rows, eval_rows=p.eval_rows,
                   reward_fn=p.reward, eval_reward_fn=correctness_only(p.reward),
                   solution=p.solution, ref_policy=ref_policy,
                   routing=routing, gen=gen, scaler=scaler,
                   micro=a.micro_batch_size or rows // a.minibatches, checkpoint=ckpt,
                   state=state, record=p.what_it_is, callbacks=Callbacks(callbacks))
    except BaseException:
        engine.close()
        close_reward(p.reward)
        raise


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


def start_sampler(run: Run, end: int | None = None) -> None:
    """rollout.max_staleness >= 1: the background sampler (gspo.async_rollouts), from the
    engine's weights, which are the policy's (version run.start_step), for the steps before
    `end` (None: as many as rl_step asks for). On the CPU the two
    threads share the cores (CoreShare): each computes with half of torch's threads (or the
    sampler with rollout.sampler_threads, the trainer with all) while both work, and with all
    of them while the other waits."""
    if run.cfg.rollout.max_staleness == 0:
        return
    sampler_threads = run.cfg.rollout.sampler_threads or None
    cores = None
    if run.dist.device.type == "cpu":
        run.threads = torch.get_num_threads()
        shares = ({SAMPLER: sampler_threads, TRAINER: run.threads} if sampler_threads else
                  {SAMPLER: max(1, run.threads // 2), TRAINER: max(1, run.threads - run.threads // 2)})
        cores = CoreShare(run.threads, shares, lend=run.cfg.rollout.share_cores)
        cores.join(TRAINER)
        cores.watch(run.model)
        sampler_threads = shares[SAMPLER]
    run.sampler = AsyncSampler(run.engine, run.cfg.rollout.max_staleness, run.start_step,
                               policy_weights(run.policy, run.model),
                               lambda step, hold: sample_batch(run, step, hold),
                               sampler_threads, cores, end)
    # pi_old's recompute in the sampler's thread: one job a step, before the batch it samples
    # from the same weights
    run.sampler.jobs_each_step = sampler_recomputes(run)
    log.info("asynchronous rollouts: the sampler computes with %s thread(s), the trainer with "
             "%d%s%s", sampler_threads or torch.get_num_threads(), torch.get_num_threads(),
             f" (either with {run.threads} while the other waits)" if run.cfg.rollout.share_cores
             and cores else "",
             "; pi_old is recomputed in the sampler's thread" if run.sampler.jobs_each_step
             else "")


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
        run.callbacks.on_evaluate(run, 0, first)
    final_acc = run.state.get("final_accuracy", start_acc)
    if UNEVALUATED in run.state:  # a signal abandoned the evaluation of the step resumed at
        final_acc = _evaluate_resumed(run, logger, stop, start_acc, final_acc)
    rl_t0 = time.perf_counter()
    bar = progress(range(run.start_step, t.steps), cfg.algorithm.name.upper(),
                    t.progress and run.dist.is_main)
    for step in bar:
        row = None if stop and stop.requested(run.dist) else rl_step(run, step, stop)
        if row is None:  # a signal: nothing of this step is applied
            _halt(run, stop, step, saved, start_acc, final_acc)
        done = step + 1
        if t.eval_every > 0 and (done % t.eval_every == 0 or done == t.steps):
            evaluated = run_eval(run, stop)
            if evaluated is None:  # a signal: the step's own row is kept, and evaluated and
                logger.log(done, row)  # logged again by the resume
                _halt(run, stop, done, saved, start_acc, final_acc,
                      " (its evaluation abandoned)", unevaluated=row)
            run.callbacks.on_evaluate(run, done, evaluated)
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


def _evaluate_resumed(run: Run, logger: MetricsLogger, stop: StopRequest | None, start_acc,
                      final_acc):
    """The evaluation a signal abandoned after step run.start_step, as the run never stopped
    would have made it: its row logged again with it (the checkpoint keeps the row: a resume
    from it again evaluates again, to the same numbers). Returns the held-out accuracy."""
    done, row, t = run.start_step, dict(run.state[UNEVALUATED]), run.cfg.train
    if t.eval_every > 0 and (done % t.eval_every == 0 or done == t.steps):
        evaluated = run_eval(run, stop)
        if evaluated is None:  # stopped again: the checkpoint holds the row still
            _halt(run, stop, done, done, start_acc, final_acc, " (its evaluation abandoned)")
        run.callbacks.on_evaluate(run, done, evaluated)
        row.update(evaluated)
        final_acc = row[M.EVAL_ACCURACY]
    logger.log(done, row)
    return final_acc


def run_eval(run: Run, stop: StopRequest | None = None) -> dict[str, float] | None:
    """Held-out avg@k and pass@k with the rollout engine (fixed seed: common random numbers);
    each rank evaluates its share of the problems and the means are reduced over ranks. None
    when `stop` was requested: a rank stops within one batch of its own signal (evaluate has
    no collective), then the ranks agree."""
    d = run.dist
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
    return evaluate(engine, run.tokenizer, rows, run.eval_reward_fn, t.eval_k,
                    SamplingParams(t.eval_temperature, r.top_p, r.max_new_tokens),
                    seed=t.seed + 999_983 + d.rank,
                    system_prompt=run.cfg.data.system_prompt or None,
                    reward_timeout_s=run.cfg.data.reward_fn_timeout or None,
                    should_stop=None if stop is None else lambda: stop.signum is not None)


def save(run: Run, done: int, start_acc, final_acc,
         warmup: tuple[int, torch.optim.Optimizer] | None = None,
         unevaluated: dict[str, float] | None = None) -> int:
    """Checkpoint the state after `done` RL steps (a collective when sharded); returns done.
    warmup: (steps done, its optimiser) of a warm-up stopped part-way, which the checkpoint
    holds instead of the RL optimiser's state, for a resume to continue it. unevaluated: step
    `done`'s row, whose evaluation a signal abandoned, for a resume to evaluate."""
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
                 **({UNEVALUATED: dict(unevaluated)} if unevaluated is not None else {}),
                 **({"grad_scaler": run.scaler.state_dict()} if run.scaler is not None else {})}
        save_checkpoint(run.run_dir, done, run.model, run.tokenizer, optimizer,
                        run.scheduler, state,
                        keep_last=run.cfg.train.keep_last, weights=weights,
                        optimizer_state=optimizer_state, reference=reference, extra=extra)
    run.callbacks.on_save(run, done)
    return done


def _halt(run: Run, stop: StopRequest, done: int, saved: int | None, start_acc,
          final_acc, note: str = "", unevaluated: dict[str, float] | None = None) -> None:
    """After a signal: checkpoint the last finished step (unless it is saved) and stop.
    unevaluated: the step's row, whose evaluation was abandoned (see `save`)."""
    if saved != done:
        save(run, done, start_acc, final_acc, unevaluated=unevaluated)
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


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def prepare(cfg: Config, run_dir: Path, resume: bool, **objects) -> Run:
    """A run ready for its first RL step: `build_run`, the warm-up and the saved config (what
    `train` does before its loop; benchmarks and tests then call `rl_step` themselves).
    objects: reward_fn, train_data, eval_data, callbacks as for `train`."""
    run = build_run(cfg, run_dir, resume, **objects)
    try:
        run_warmup(run)
        save_run_config(run)
        start_sampler(run)
        run.callbacks.on_train_begin(run)
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
    # the held-out reward's own parts: a sum shares the others with reward_fn (closed once)
    theirs = getattr(run.reward_fn, "parts", [run.reward_fn])
    close_reward([f for f in getattr(run.eval_reward_fn, "parts", [run.eval_reward_fn])
                  if not any(f is g for g in theirs)])
    # a callback that kept `run` closes a cycle (run -> callbacks -> it -> run) that reference
    # counting cannot free: left to a later collection (at interpreter exit, under torchrun,
    # gloo's teardown can then abort the rank: gspo.distributed.shutdown)
    run.callbacks = Callbacks()
