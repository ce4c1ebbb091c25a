"""What a run checks and loads before it builds anything heavy, shared by `build_run` (the run)
and `dry_run` (`gspo train --dry-run`, which stops after it):

    check_launch        how the batch divides over the ranks, what runs in one process only
    run_dir_checkpoint  a new run's empty directory, or a resume's checkpoint and what it was
    build_task          the rows (a bad one fails now, before a large model is loaded), reward
    check_rows          a resume's rows are the run's rows
    build_model         the model and tokenizer (on the meta device for the dry run)
    fitting_prompts     every prompt leaves room for the response in the model's context
    check_launch        again, with the row counts

`preflight` runs that sequence once for both; `setting_warnings` names the settings known to
fail, for both to say.
"""

from __future__ import annotations

import logging
import platform
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from gspo import precision
from gspo.checkpoint import latest_checkpoint
from gspo.config import Config
from gspo.data import encode_prompts
from gspo.distributed import Dist, fsdp_available
from gspo.engines import engine_class, engine_settings, engines_with
from gspo.errors import TrainingError
from gspo.logger import METRICS_FILE, check_resumable
from gspo.logprobs import logit_transform
from gspo.models import build_tiny_qwen3, build_tiny_qwen3_moe, build_tokenizer, load_model
from gspo.rewards import RewardFn, close_reward
from gspo.runrecord import check_resume, check_rows, make_record
from gspo.tasks import build_task
from gspo.tasks.datasets import DatasetError

log = logging.getLogger(__name__)


@dataclass
class Preflight:
    """What `preflight` checked and loaded."""
    checkpoint: Path | None          # the checkpoint a resume starts from (None: a new run)
    record: dict | None              # what that run was (gspo.runrecord), None for a new run
    train_rows: list[dict]           # each prompt fits the model's context
    eval_rows: list[dict]
    reward: RewardFn
    solution: Callable[[dict], str]  # a row's worked answer, for the warm-up
    what_it_is: dict                 # this run's record, saved with each checkpoint
    model: torch.nn.Module
    tokenizer: object
    bad_rows: list[str]              # every_bad_row: the malformed rows, each named


def preflight(cfg: Config, run_dir: Path | None, resume: bool, world: int, *,
              device: torch.device | str = "cpu", weights: bool = True, verify: bool = True,
              every_bad_row: bool = False, reward_fn=None, train_data=None, eval_data=None
              ) -> Preflight:
    """The checks and loads above, in that order. weights=False: the model on the meta device
    (the dry run); verify: check a resume's checkpoint files against its manifest;
    every_bad_row: read every row and name every malformed one (the dry run) instead of
    stopping at the first (or skipping them, as data.on_bad_row says); run_dir
    None or not yet there: nothing to resume from. reward_fn, train_data, eval_data: Python
    objects in place of data.reward / data.path / data.eval_path (see gspo.trainer.train).
    The reward is closed if a later check fails."""
    check_launch(cfg, world)  # before anything is loaded; the warm-up batch once rows are
    ckpt = record = None
    if run_dir is not None and (resume or Path(run_dir).exists()):
        ckpt, record = run_dir_checkpoint(cfg, Path(run_dir), resume, verify,
                                          reward_fn=reward_fn, train_data=train_data,
                                          eval_data=eval_data)
    bad_rows: list[str] = []
    train_rows, eval_rows, reward, solution = build_task(cfg.data, train_data, eval_data,
                                                         reward_fn,
                                                         bad_rows if every_bad_row else None)
    try:
        check_rows(record, cfg, Path(run_dir or "."), train_rows, eval_rows)
        if bad_rows and cfg.data.on_bad_row == "fail":
            raise DatasetError(f"{len(bad_rows)} malformed row(s): {'; '.join(bad_rows[:5])}"
                               f"{'; ...' if len(bad_rows) > 5 else ''} (data.on_bad_row=skip "
                               f"leaves such rows out)")
        what_it_is = make_record(cfg, reward_fn, train_data, eval_data, train_rows, eval_rows)
        model, tokenizer = build_model(cfg, device, weights)
        train_rows, eval_rows = (fitting_prompts(rows, what, model, tokenizer, cfg)
                                 for rows, what in ((train_rows, "training"),
                                                    (eval_rows, "held-out")))
        check_launch(cfg, world, len(train_rows), resume, len(eval_rows))
    except BaseException:
        close_reward(reward)
        raise
    return Preflight(ckpt, record, train_rows, eval_rows, reward, solution, what_it_is, model,
                     tokenizer, bad_rows)


CLIP_RANGE_FACTOR = 100
"""a clip range more than this many times off the objective's own is a mistake. Not less: GSPO
with pi_old from a bf16 sampler needs its clip range beyond the engine's ~1e-2 sequence
mismatch, and at 3e-2 (75-100x) it learned best (docs/results/engine_likelihoods.md)"""


# what float16 cost on the CPUs gspo was measured on (docs/results/smollm2_tuned.md)
FP16_CPU_MEASURED = {
    "train": "one fp16-mixed SmolLM2 step did not finish in 13 min on a 2-core AMD EPYC with "
             "AVX512-BF16 and took 17 min on one with AVX2 only, against ~1 min in bf16-mixed "
             "with AVX512-BF16",
    "rollout": "on a 2-core AMD EPYC with AVX512-BF16, a float16 sampler ran 3-4.5x slower per "
               "token than a float32 one",
}
# and bfloat16 where the CPU has no bf16 instructions (benchmarks/README.md, 2026-12-07)
BF16_SLOW_CPU_MEASURED = ("on a 2-core AMD EPYC with AVX2 only, torch 2.13 ran a bf16 GEMM at "
                          "1 GFLOP/s against 94 in float32, a tiny model's bf16-mixed RL step "
                          "7.8x slower than fp32, and one SmolLM2 step took over 20 min; vLLM's "
                          "CPU backend sampled SmolLM2 at 21 tokens/s in bf16, 110 in float32")


def cpu_has_bf16() -> bool:
    """Whether this CPU has bf16 matmul instructions: on x86 AVX512-BF16 or AMX (oneDNN's bf16
    path on plain AVX512 emulates them), elsewhere what torch's oneDNN says (an ARM CPU with
    bf16); True when torch cannot tell."""
    try:
        if platform.machine().lower() in ("x86_64", "amd64", "i386", "i686"):
            return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return True


def setting_warnings(cfg: Config, on_cpu: bool = False,
                     flags: dict[str, str] | None = None) -> list[str]:
    """Settings that run but are known to fail, one line each: a clip range far from the
    objective's own (GSPO given GRPO's 0.2: its length-normalised sequence ratio stays within
    ~1e-3 of 1, so nothing is ever clipped and the update is unbounded, the misconfiguration
    peers' users hit, trl#3834; GRPO given GSPO's 3e-4: almost every token is clipped and
    carries no gradient). A token-sum aggregation of a sequence ratio (ROLL#165) cannot be
    configured: a sequence objective takes its one aggregation (gspo.objectives.LossSpec).
    float16 where the run computes on the CPU (`on_cpu`): most CPUs have no fast float16 matmul
    (FP16_CPU_MEASURED says what it cost here; the fix offers bf16 only where the CPU has it);
    bfloat16 there when the CPU has no bf16 instructions (cpu_has_bf16): 5x to 90x slower than
    float32 (BF16_SLOW_CPU_MEASURED). `flags`: the command-line
    flag that sets a key, where the caller takes it as one (gspo eval: {"rollout.dtype":
    "--dtype"}), so that a warning names what its user types."""
    from gspo.objectives import OBJECTIVES

    def say(key: str, value: str) -> str:
        return f"{flags[key]} {value}" if key in (flags or {}) else f"{key}={value}"

    a, spec, out = cfg.algorithm, OBJECTIVES[cfg.algorithm.name], []
    for side, eps, own in (("eps_low", a.eps_low, spec.eps_low),
                           ("eps_high", a.eps_high, spec.eps_high)):
        if own > 0 and eps > CLIP_RANGE_FACTOR * own:
            out.append(f"algorithm.{side}={eps:g} is {eps / own:.0f}x {a.name}'s own clip range "
                       f"({own:g}): its ratio seldom moves that far from 1, so almost nothing "
                       f"is clipped and the update is unbounded; use {own:g} (the paper's) or "
                       f"a few times it")
        elif own > 0 and eps < own / CLIP_RANGE_FACTOR:
            out.append(f"algorithm.{side}={eps:g} is 1/{own / max(eps, 1e-12):.0f} of "
                       f"{a.name}'s own clip range ({own:g}): almost every term is clipped "
                       f"and carries no gradient; use {own:g} or a fraction of it near 1")
    has_bf16 = not on_cpu or cpu_has_bf16()
    if on_cpu and cfg.train.precision == "fp16-mixed":
        fix = f"{say('train.precision', 'bf16-mixed')} or fp32" if has_bf16 else \
            say("train.precision", "fp32")
        out.append(f"{say('train.precision', 'fp16-mixed')} on the CPU: most CPUs have no fast "
                   f"float16 matmul ({FP16_CPU_MEASURED['train']}); use {fix}")
    if on_cpu and cfg.rollout.dtype == "float16":
        fix = f"{say('rollout.dtype', 'bfloat16')} or float32" if has_bf16 else \
            say("rollout.dtype", "float32")
        out.append(f"{say('rollout.dtype', 'float16')} on the CPU: most CPUs have no fast "
                   f"float16 matmul ({FP16_CPU_MEASURED['rollout']}); use {fix}")
    # the settings that compute in bfloat16, and their fixes: the trainer, and either engine
    # (vLLM's CPU backend too: BF16_SLOW_CPU_MEASURED)
    bf16, fixes = [], []
    if on_cpu and precision.get(cfg.train.precision).compute_dtype == torch.bfloat16:
        bf16.append(say("train.precision", cfg.train.precision))
        fixes.append(say("train.precision", "fp32"))
    if on_cpu and precision.rollout_dtype(cfg) == "bfloat16":
        auto = " (bfloat16)" if cfg.rollout.dtype == "auto" else ""
        bf16.append(say("rollout.dtype", cfg.rollout.dtype) + auto)
        fixes.append(say("rollout.dtype", "float32"))
    if bf16 and not has_bf16:
        out.append(f"{' and '.join(bf16)} on a CPU without bf16 instructions (x86: AVX512-BF16 "
                   f"or AMX): its bf16 matmuls are emulated ({BF16_SLOW_CPU_MEASURED}); use "
                   f"{' '.join(fixes)} on this machine")
    r = cfg.rollout
    if (r.top_p < 1 and a.old_logprobs == "rollout"
            and not getattr(engine_class(r.engine), "logp_before_top_p", True)):
        out.append(f"rollout.top_p={r.top_p:g} with algorithm.old_logprobs=rollout: "
                   f"rollout.engine={r.engine} returns the log-probs of the top-p truncated "
                   f"distribution, renormalised over the nucleus, above the policy's own: pi_old "
                   f"is too high and every ratio too low; use algorithm.old_logprobs=recompute "
                   f"or rollout.top_p=1")
    return out


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
    if why:
        raise TrainingError(f"rollout.max_staleness={r.max_staleness} does not run with {why}; "
                            f"set rollout.max_staleness=0")


def run_dir_checkpoint(cfg: Config, run_dir: Path, resume: bool, verify: bool = True,
                       **objects) -> tuple[Path | None, dict | None]:
    """(the checkpoint a resume starts from, its run record; None, None for a new run), after
    refusing a new run in a directory that holds checkpoints or a config.yaml of its own (see
    `foreign_config`), a resume that changes what the run was (gspo.runrecord.check_resume)
    and one that would lose a metrics row (gspo.logger.check_resumable). verify: check the
    checkpoint's files against its manifest (reads them all). objects: reward_fn, train_data,
    eval_data as for `train`."""
    if not resume and latest_checkpoint(run_dir) is not None:
        raise TrainingError(f"{run_dir} already holds checkpoints; pass --resume {run_dir} to "
                            f"continue it or choose a new --output-dir")
    if not resume and foreign_config(run_dir):
        raise TrainingError(f"{run_dir / 'config.yaml'} is not a gspo run's (no {METRICS_FILE} "
                            f"beside it): a new run writes its resolved config there and would "
                            f"overwrite it; choose another --output-dir (e.g. a subdirectory)")
    if not resume:
        return None, None
    ckpt = latest_checkpoint(run_dir, verify=verify)
    if ckpt is None:
        raise TrainingError(f"--resume {run_dir}: no finished checkpoint found there")
    record = check_resume(cfg, run_dir, ckpt, **objects)
    check_resumable(run_dir / METRICS_FILE, int(ckpt.name.rsplit("_", 1)[1]),
                    ckpt / METRICS_FILE)  # on every rank, though rank 0 alone writes it
    return ckpt, record


def foreign_config(run_dir: Path) -> bool:
    """Whether run_dir's config.yaml is not a gspo run's (the user's own config, say, with
    `--output-dir .`). A run opens its metrics.jsonl before it writes config.yaml, so a run
    directory that holds the one holds the other, checkpoints or not (a run stopped before its
    first)."""
    return (run_dir / "config.yaml").is_file() and not (run_dir / METRICS_FILE).is_file()


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
        transform = logit_transform(model.config) if training else None
        if transform:
            raise TrainingError(
                f"{m.name_or_path} transforms its logits after the output layer "
                f"(config.{transform}), which gspo's log-probs do not apply yet: the trainer's "
                f"policy would not be the one that samples. Train a model without it (Qwen3, "
                f"Llama, Mistral, SmolLM2); `gspo eval` samples with the model's own forward "
                f"and runs it as is")
        if not weights:
            return model, tokenizer  # on the meta device, in the weights' dtype
    return model.to(device=device, dtype=dtype), tokenizer


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
    if len(too_long) == len(rows):  # the budget is the problem, not the prompts
        shortest = min(too_long.values())
        raise TrainingError(f"rollout.max_new_tokens={cfg.rollout.max_new_tokens} leaves "
                            f"{max(room, 0)} of the model's {context}-token context for the "
                            f"prompt, and none of the {len(rows)} {what} prompts fits (the "
                            f"shortest has {shortest} tokens): set rollout.max_new_tokens to "
                            f"at most {context - shortest}")
    i, n = next(iter(too_long.items()))
    message = (f"{len(too_long)} {what} prompt(s) do not fit the model's context of {context} "
               f"tokens with rollout.max_new_tokens={cfg.rollout.max_new_tokens}; the first "
               f"({n} tokens) starts {rows[i]['prompt'][:40]!r}")
    if cfg.data.on_bad_row != "skip":
        raise TrainingError(f"{message}: shorten them, or set data.on_bad_row=skip")
    log.warning("%s; skipped", message)
    return [r for j, r in enumerate(rows) if j not in too_long]


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


