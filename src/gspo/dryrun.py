"""`gspo train --dry-run`: what a run checks before its first step, without the run.

Given a resolved config: load the tokenizer and the model's config (a local or hub model is
built on the meta device, so no weights are read; the tiny built-in models are built, they are
cheap), read and check every row of the data (naming every malformed one), build the reward and
call it once on a sample answer (a reward model is checked from its config and tokenizer, its
weights not read, and not called), check how the batch divides over the ranks of the launch
(`WORLD_SIZE`, or a planned `world`), then print the resolved config, the rollout batch, the
token budget of a step and an estimate of the memory per rank. Nothing is written: no run
directory, no lock, no checkpoint.

What only the machine the run goes to must have (the rollout engine's or a tracker's package,
a CUDA device) is a warning here, not an error, so that a GPU recipe can be checked on a laptop.
Left out: the memory of activations, logits and the allocator's slack (the estimate says so),
and anything that needs the weights (a checkpoint's manifest is not verified on resume).
"""

from __future__ import annotations

import importlib.util
import random
import sys
from pathlib import Path
from typing import TextIO

import torch
import yaml

from gspo import precision
from gspo.config import Config, to_dict
from gspo.data import RewardSum, encode_prompts, reward_name, score
from gspo.distributed import Dist, launch_world, resolve_device
from gspo.engines import engine_class, engine_settings
from gspo.errors import ConfigError
from gspo.rewards import close_reward, reward_model_paths
from gspo.rewards.model import RewardModel
from gspo.runlock import check_run_dir
from gspo.tasks import get_task
from gspo.trackers import require
from gspo.preflight import data_parallel_mode, preflight, setting_warnings

GIB = 2 ** 30
MAX_MEASURED = 2000  # prompts tokenized for the token budget (a seeded sample of larger sets)


def dry_run(cfg: Config, world: int | None = None, run_dir: str | Path | None = None,
            resume: bool = False, *, reward_fn=None, train_data=None, eval_data=None,
            out: TextIO | None = None) -> dict:
    """Check that `cfg` can start on `world` ranks (default: $WORLD_SIZE, else 1) and print
    what the run would hold; returns the figures printed (GspoError when it cannot start).
    run_dir: the directory the run would write (checked for checkpoints, never created);
    out: where the report goes (default: stdout)."""
    world = launch_world(planned=True) if world is None else world
    if world < 1:
        raise ConfigError(f"--world-size {world}: a launch has at least 1 rank; give the number "
                          f"of ranks torchrun will start (--nnodes x --nproc-per-node), or leave "
                          f"it out for $WORLD_SIZE, else 1")
    warnings = machine_warnings(cfg)
    if run_dir is not None:
        check_run_dir(run_dir)
    pf = preflight(cfg, None if run_dir is None else Path(run_dir), resume, world, weights=False,
                  verify=False, every_bad_row=True, reward_fn=reward_fn, train_data=train_data,
                  eval_data=eval_data)
    mode = data_parallel_mode(cfg, Dist(world=world))
    model, tokenizer, train_rows, eval_rows = pf.model, pf.tokenizer, pf.train_rows, pf.eval_rows
    reward, solution, bad_rows = pf.reward, pf.solution, pf.bad_rows
    if cfg.warmup.steps and not resume:
        solution(train_rows[0])  # a task without worked solutions says to set warmup.steps=0
    value, sample = try_reward(cfg, reward, solution, train_rows[0])
    prompt_max, prompt_mean, measured = prompt_lengths(train_rows, tokenizer, cfg)
    figures = {
        "world": world, "data_parallel": mode, "train_rows": len(train_rows),
        "eval_rows": len(eval_rows), "bad_rows": len(bad_rows), "reward": value,
        "parameters": sum(p.numel() for p in model.parameters()),
        "prompt_tokens_max": prompt_max, "prompt_tokens_mean": prompt_mean,
        "memory": memory_estimate(model, cfg, world, mode, prompt_max),
    }
    on_cpu = cfg.train.device == "cpu" or (cfg.train.device == "auto"
                                           and not torch.cuda.is_available())
    warnings += capacity_warning(cfg, figures["memory"]) + setting_warnings(cfg, on_cpu)
    warnings += budget_warning(cfg, prompt_max + cfg.rollout.max_new_tokens)
    print_report(cfg, figures, model, tokenizer, sample, measured, warnings, out)
    return figures


def machine_warnings(cfg: Config) -> list[str]:
    """What the run needs that this machine lacks (the engine's and the trackers' packages,
    CUDA): warnings."""
    warnings = []
    needs = engine_class(cfg.rollout.engine).requires
    if needs and importlib.util.find_spec(needs) is None:
        warnings.append(f"rollout.engine={cfg.rollout.engine} (the {needs} package)")
    if cfg.train.device.startswith("cuda") and not torch.cuda.is_available():
        warnings.append(f"train.device={cfg.train.device} (a CUDA device)")
    else:
        resolve_device(cfg.train.device)  # a device spec that cannot work anywhere fails
    if (reward_model_paths(cfg.data.reward) and cfg.data.reward_device.startswith("cuda")
            and not torch.cuda.is_available()):
        warnings.append(f"data.reward_device={cfg.data.reward_device} (a CUDA device)")
    for name in cfg.train.report_to:
        try:
            require([name])  # what the run's start refuses
        except ConfigError:
            warnings.append(f"train.report_to={name} (pip install 'gspo[trackers]')")
    return [f"checked on this machine: {w} not available here; needed at run time"
            for w in warnings]


def capacity_warning(cfg: Config, memory: dict) -> list[str]:
    """A warning when the estimate exceeds the memory of this machine's device, if it has the
    device the run trains on (a laptop checking a GPU recipe has nothing to compare with)."""
    cuda = cfg.train.device.startswith("cuda") or (cfg.train.device == "auto"
                                                   and torch.cuda.is_available())
    if cuda and not torch.cuda.is_available():
        return []
    from gspo.models import _available_bytes
    total = torch.cuda.get_device_properties(0).total_memory if cuda else _available_bytes()
    need = sum(memory.values())
    share = engine_settings(cfg.rollout).gpu_share
    if cuda and share:  # the engine reserves its share, its weights inside
        need += share * total - memory["rollout_copy"]
    if total is None or need <= total:
        return []
    return [f"the estimate, {need / GIB:.1f} GiB per rank, exceeds the {total / GIB:.1f} GiB "
            f"{'of this GPU' if cuda else 'of memory available here'}"]


def budget_warning(cfg: Config, per_seq: int) -> list[str]:
    """A warning when a sequence at full length alone exceeds train.max_tokens_per_micro."""
    budget = cfg.train.max_tokens_per_micro
    if not budget or per_seq <= budget:
        return []
    return [f"train.max_tokens_per_micro={budget:,} is below a full-length sequence's "
            f"{per_seq:,} tokens: such a sequence gets a micro-batch of its own, over the budget"]


def micro_line(cfg: Config, per_seq: int, world: int) -> str:
    """How a minibatch (this rank's share) is cut into forward/backward passes: fixed rows, or
    packed under a token budget; per_seq: the longest prompt plus max_new_tokens."""
    a, r = cfg.algorithm, cfg.rollout
    rows = r.prompts_per_step * r.group_size // world // a.minibatches  # per rank
    budget = cfg.train.max_tokens_per_micro
    if not budget:
        m = a.micro_batch_size or rows
        return (f"micro       {m:,} sequences per forward/backward "
                f"({'algorithm.micro_batch_size' if a.micro_batch_size else 'the minibatch'}), "
                f"<= {m * per_seq:,} tokens each")
    unused = (f"; algorithm.micro_batch_size={a.micro_batch_size} not used"
              if a.micro_batch_size else "")
    prompt = per_seq - r.max_new_tokens
    full, short = (max(1, min(rows, budget // n)) for n in (per_seq, prompt + 1))
    return (f"micro       packed by tokens: <= {budget:,} per forward/backward "
            f"(train.max_tokens_per_micro, counted as rows x (prompt width + longest "
            f"response)): per forward {full:,} of a minibatch's {rows:,} sequences at full "
            f"length, up to {short:,} with one-token responses{unused}")


def try_reward(cfg: Config, reward, solution, row: dict) -> tuple[float | None, str]:
    """The reward of a sample answer to `row`: its worked solution where the data has one,
    else the task's sample answer (math: the reference answer written out; code: a placeholder
    program), else the row's reward field as it is; reward models are described, not called
    (None where they are the whole reward)."""
    try:
        sample, what = solution(row), "worked solution"
    except ConfigError:  # no worked solutions: an answer as a model would write it
        task = get_task(cfg.data.task)
        if task.sample_answer is not None:
            sample, what = task.sample_answer(row)
        else:
            sample, what = str(row.get(task.field, "")), "reference answer"
    rules, models = without_models(reward)
    try:
        if rules is None:  # reward models alone: nothing to call without their weights
            return None, "; ".join(m.describe() for m in models)
        (value,), failures, first = score(rules, [sample], [row],
                                          timeout=cfg.data.reward_fn_timeout or None)
    finally:
        close_reward(reward)
    name = reward_name(rules)
    if failures:
        raise ConfigError(f"the reward {name} failed on a sample answer (a {what}) to the first "
                          f"training row: {first}; fix the reward function or the data fields")
    return value, "; ".join([f"{name} on the first training row with a {what}: {value:g}"]
                            + [m.describe() for m in models])


def without_models(reward) -> tuple[object | None, list[RewardModel]]:
    """(the reward less its reward models, or None when nothing is left; the reward models):
    the dry run reads no weights, so a reward model is checked from its config and tokenizer
    (when it was built) and not called."""
    parts, weights = ((reward.parts, reward.weights) if isinstance(reward, RewardSum)
                      else ([reward], [1.0]))
    models = [p for p in parts if isinstance(p, RewardModel)]
    rules = [(w, p) for w, p in zip(weights, parts) if not isinstance(p, RewardModel)]
    if not models:
        return reward, []
    if not rules:
        return None, models
    if len(rules) == 1 and rules[0][0] == 1.0:
        return rules[0][1], models
    return RewardSum([p for _, p in rules], [w for w, _ in rules]), models


def prompt_lengths(rows: list[dict], tokenizer, cfg: Config) -> tuple[int, float, int]:
    """(longest, mean, number measured) prompt length in tokens, chat template included."""
    if len(rows) > MAX_MEASURED:
        rows = random.Random(cfg.data.seed).sample(rows, MAX_MEASURED)
    lengths = [len(ids) for ids in encode_prompts(tokenizer, rows, cfg.data.system_prompt or None)]
    return max(lengths), sum(lengths) / len(lengths), len(lengths)


def memory_estimate(model, cfg: Config, world: int, mode: str, prompt_max: int) -> dict:
    """Bytes per rank of what a run holds for the whole run: weights, gradients and AdamW's two
    moments (sharded over the ranks under FSDP; AdamW keeps them in the parameters' dtype:
    float32 but in bf16-true), the low-precision weights a mixed-precision forward holds
    (autocast's casts; FSDP2 gathers one layer at a time), the rollout engine's own full copy
    (split over its tensor-parallel ranks) and pi_ref's, and the KV cache of an engine whose
    cache grows with the batch, for this rank's sequences at full length (gspo.engines'
    EngineSettings says which). Activations and logits come on top."""
    n = sum(p.numel() for p in model.parameters())
    prec = precision.get(cfg.train.precision)
    width = prec.param_dtype.itemsize
    roll_dtype = precision.rollout_dtype(cfg)
    roll_width = getattr(torch, roll_dtype).itemsize
    trainable = n if not cfg.model.lora_rank else lora_parameters(model, cfg)
    shard = world if mode == "fsdp" else 1
    engine = engine_settings(cfg.rollout)
    own_copy = (engine.own_copy or mode == "fsdp" or cfg.model.lora_rank > 0
                or getattr(torch, roll_dtype) != prec.param_dtype)
    c = model.config
    heads = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    sequences = cfg.rollout.prompts_per_step * cfg.rollout.group_size // world
    kv = (2 * c.num_hidden_layers * heads * head_dim * roll_width * sequences
          * (prompt_max + cfg.rollout.max_new_tokens))
    return {"weights": n * width / shard, "gradients": trainable * width / shard,
            "adamw": 2 * trainable * width / shard,
            "compute_casts": n * prec.compute_dtype.itemsize if prec.mixed and mode != "fsdp"
            else 0,
            "rollout_copy": n * roll_width / engine.shards if own_copy else 0,
            "reference": n * width if cfg.algorithm.beta > 0 else 0,
            "kv_cache": kv if engine.kv_cache else 0}


def lora_parameters(model, cfg: Config) -> int:
    """Parameters of LoRA adapters on the target linear layers: rank * (in + out) each."""
    targets, r = set(cfg.model.lora_target_modules), cfg.model.lora_rank
    return sum(r * (m.in_features + m.out_features) for name, m in model.named_modules()
               if isinstance(m, torch.nn.Linear) and name.rsplit(".", 1)[-1] in targets)


def _count(n: float) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.1f} M" if n >= 1e5 else f"{n:,}"


def _size(b: float) -> str:
    return f"{b / GIB:8.2f} GiB" if b >= GIB / 10 else f"{b / 2 ** 20:8.1f} MiB"


def objective_line(cfg: Config) -> str:
    """The objective, its clip range and aggregation, and the switches around it that are on."""
    a = cfg.algorithm
    on = [f"pi_old {a.old_logprobs}"]
    if a.is_correction != "none":
        on.append(f"is_correction={a.is_correction} ({a.is_level}, weights in "
                  f"[{a.is_floor:g}, {a.is_cap:g}])")
    if a.overlong != "none":
        buffer = a.overlong_buffer or cfg.rollout.max_new_tokens // 4
        on.append(f"overlong={a.overlong}" + (f" (-{a.overlong_penalty:g} over the last {buffer} "
                                              f"tokens)" if a.overlong == "soft_penalty" else ""))
    if a.beta > 0:
        on.append(f"KL beta={a.beta:g}")
    return (f"{a.name}, clip [1 - {a.eps_low:g}, 1 + {a.eps_high:g}], {a.aggregation}; "
            + "; ".join(on))


def filter_lines(cfg: Config, world: int) -> list[str]:
    """rollout.filter_groups: the most a step can sample (every round, every group constant)."""
    r = cfg.rollout
    if not r.filter_groups:
        return []
    most = (1 + r.filter_max_rounds) * r.prompts_per_step
    return [f"filter      rollout.filter_groups: groups whose {r.group_size} rewards are all "
            f"equal are dropped and resampled, up to {r.filter_max_rounds} extra rounds; at "
            f"worst {most:,} prompts x {r.group_size} = {most * r.group_size:,} rollouts "
            f"sampled per step ({most // world * r.group_size:,} per rank, in rounds of at most "
            f"{r.prompts_per_step // world * r.group_size:,}), still "
            f"{r.prompts_per_step * r.group_size:,} trained"]


def print_report(cfg: Config, f: dict, model, tokenizer, sample: str, measured: int,
                 warnings: list[str], out: TextIO) -> None:
    r, a, m = cfg.rollout, cfg.algorithm, f["memory"]
    world, seqs = f["world"], r.prompts_per_step * r.group_size
    per_seq = f["prompt_tokens_max"] + r.max_new_tokens
    n = f["parameters"]
    width = precision.dtype_name(precision.get(cfg.train.precision).param_dtype)
    shard = f" / {world} ranks" if f["data_parallel"] == "fsdp" else ""
    mode = {"none": "one process", "fsdp": "FSDP2", "ddp": "DDP"}[f["data_parallel"]]
    lines = [
        "resolved config:", *("  " + line for line in
                              yaml.safe_dump(to_dict(cfg), sort_keys=False).splitlines()),
        "",
        f"model       {type(model).__name__}, {_count(n)} parameters "
        f"({'built' if cfg.model.name_or_path.startswith('tiny-') else 'from its config, no weights read'}); "
        f"tokenizer of {len(tokenizer):,} tokens, "
        f"{'chat template' if getattr(tokenizer, 'chat_template', None) else 'no chat template (raw prompts)'}",
        f"data        {f['train_rows']:,} training and {f['eval_rows']:,} held-out rows, every "
        f"row{f' up to data.max_rows={cfg.data.max_rows}' if cfg.data.max_rows else ''} checked "
        f"({f['bad_rows']} malformed{', skipped' if f['bad_rows'] else ''})",
        f"reward      {sample}",
        f"launch      {world} rank(s), {mode}",
        f"rollout     {r.prompts_per_step} prompts x {r.group_size} = {seqs:,} sequences per "
        f"step; per rank {r.prompts_per_step // world} x {r.group_size} = {seqs // world:,}; "
        f"{a.minibatches} minibatches of {seqs // a.minibatches:,} ({seqs // world // a.minibatches:,} "
        f"per rank)",
        f"objective   {objective_line(cfg)}",
        *filter_lines(cfg, world),
        f"tokens      per sequence <= {per_seq:,} = prompt <= {f['prompt_tokens_max']:,} "
        f"(mean {f['prompt_tokens_mean']:.0f}, {measured:,} prompts measured) + "
        f"max_new_tokens {r.max_new_tokens:,}; per step <= {seqs * per_seq:,} "
        f"({seqs // world * per_seq:,} per rank)",
        micro_line(cfg, per_seq, world),
        "memory per rank, estimated (activations, logits and the allocator's slack on top):",
        f"  weights       {_size(m['weights'])}  {_count(n)} x {width}{shard}",
        f"  gradients     {_size(m['gradients'])}"
        + ("  LoRA adapters only" if cfg.model.lora_rank else ""),
        f"  AdamW state   {_size(m['adamw'])}  two moments in {width}",
    ]
    if m["compute_casts"]:
        lines.append(f"  casts         {_size(m['compute_casts'])}  train.precision="
                     f"{cfg.train.precision}: autocast's copy of the weights during a forward")
    if m["rollout_copy"]:
        engine = engine_settings(r)
        tp = engine.shards
        lines.append(f"  rollout copy  {_size(m['rollout_copy'])}  the {r.engine} "
                     f"engine's {'full ' if tp == 1 else ''}weights in "
                     f"{precision.rollout_dtype(cfg)}"
                     + (f", split over {tp} ranks (rollout.tensor_parallel_size)" if tp > 1
                        else "")
                     + (f" ({engine.memory_note})" if engine.memory_note else ""))
    if m["reference"]:
        lines.append(f"  pi_ref copy   {_size(m['reference'])}  algorithm.beta > 0")
    if m["kv_cache"]:
        lines.append(f"  KV cache      {_size(m['kv_cache'])}  {seqs // world:,} "
                     f"sequences x {per_seq:,} tokens, {r.engine} engine")
    lines.append(f"  total         {_size(sum(m.values()))}")
    lines += [f"warning: {w}" for w in warnings]
    lines.append("dry run passed: the run can start as configured (nothing was written)")
    print("\n".join(lines), file=out or sys.stdout)
