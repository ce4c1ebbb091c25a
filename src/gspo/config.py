"""Typed run configuration: nested dataclasses, YAML files and dotted CLI overrides.

Every field carries its help text and declares what it allows (choices, bounds), which
``gspo train --help`` prints after the help. A config is validated once, at start-up, by
:func:`resolve`: one pass over the declarations, then the rules relating fields to each other;
any problem raises :class:`ConfigError` with one line naming the field and the fix, which the CLI
prints before exiting with status 2.
"""

from __future__ import annotations

import dataclasses
import logging
import operator
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

import yaml


from gspo.errors import ConfigError  # noqa: F401  (raised here; defined with the other user errors)


def _f(default: Any, help: str, *, choices: tuple | Callable[[], Any] | None = None,
       gt: float | None = None, ge: float | None = None, lt: float | None = None,
       le: float | None = None, when: Callable[[Any], bool] | None = None, why: str = "") -> Any:
    """A dataclass field with a default, its help text and the values it allows.

    choices: the allowed values, or a zero-argument callable returning them (a registry, read
    when the config is checked rather than when this module is imported); for a list field each
    entry must be one. gt / ge / lt / le: bounds (>, >=, <, <=); a lower and an upper bound make
    an interval such as (0, 1]. when(section): the field is checked only where this holds, for a
    setting that only means something with another one (the LoRA fields with LoRA on). why: the
    reason behind a bound, added to its error. :func:`resolve` checks them all in one pass.
    """
    metadata = {"help": help, "choices": choices, "gt": gt, "ge": ge, "lt": lt, "le": le,
                "when": when, "why": why}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=metadata)
    return field(default=default, metadata=metadata)


DAY = 86_400  # seconds: the longest timeout (a timer given inf, or 1e10 s, overflows)
LONGEST_WAIT = "a day at most"


def _task_names() -> tuple[str, ...]:
    """data.task's names (and the built-in rewards'): the task registry's, read when the config
    is checked, so that a task added with gspo.register_task is one (gspo.tasks loads no
    torch)."""
    from gspo.tasks import TASKS

    return tuple(TASKS)


def _tracker_names() -> tuple[str, ...]:
    from gspo.trackers import TRACKERS  # no torch: config stays light to import

    return tuple(TRACKERS)


def _lora_on(m: ModelConfig) -> bool:
    return bool(m.lora_rank)


def _arithmetic(d: DataConfig) -> bool:
    return d.task == "arithmetic"


def _generated(d: DataConfig) -> bool:  # the task makes its rows rather than reading data.path
    from gspo.tasks import TASKS

    task = TASKS.get(d.task)
    return task is not None and task.make_rows is not None


def _filtering(r: RolloutConfig) -> bool:
    return r.filter_groups


def _holds_out(d: DataConfig) -> bool:  # data.n_eval rows are generated or held out of data.path
    return _generated(d) or not d.eval_path


@dataclass
class ModelConfig:
    name_or_path: str = _f("tiny-qwen3", "'tiny-qwen3' or 'tiny-qwen3-moe' (built locally, "
                           "offline) or a local directory / hub id of any Hugging Face causal LM")
    hidden_size: int = _f(128, "tiny model only: hidden size", gt=0)
    num_layers: int = _f(2, "tiny model only: number of decoder layers", gt=0)
    num_heads: int = _f(4, "tiny model only: attention heads", gt=0)
    num_kv_heads: int = _f(2, "tiny model only: key/value heads (GQA)", gt=0)
    intermediate_size: int = _f(512, "tiny model only: MLP width", gt=0)
    num_experts: int = _f(8, "tiny MoE only: experts per layer", gt=0)
    num_experts_per_tok: int = _f(2, "tiny MoE only: experts activated per token (top-k)",
                                  gt=0)
    moe_intermediate_size: int = _f(128, "tiny MoE only: width of each expert's MLP", gt=0)
    dtype: str = _f("float32", "retired: the training precision is train.precision "
                    "(model.dtype=bfloat16 is read as train.precision=bf16-true)",
                    choices=("float32", "bfloat16", "float16"))
    logprob_chunk_size: int = _f(1024, "positions per chunk when computing log-probs "
                                 "(bounds the (chunk, V) logits held at once)", gt=0)
    lora_rank: int = _f(0, "LoRA (through peft): rank of the adapters; 0 = train every weight",
                        ge=0)
    lora_alpha: float = _f(32.0, "LoRA: scale numerator, the update is (alpha / rank) B A",
                           gt=0, when=_lora_on)
    lora_dropout: float = _f(0.0, "LoRA: dropout on the adapters' input (0 keeps pi_old's "
                             "recompute and the update's forward identical)",
                             ge=0, lt=1, when=_lora_on)
    lora_target_modules: list = _f(["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                    "up_proj", "down_proj"],
                                   "LoRA: names of the linear layers that get adapters")


@dataclass
class DataConfig:
    task: str = _f("arithmetic", "prompt source: 'arithmetic' (the synthetic default), 'math' "
                   "(answers checked with math-verify) or 'code' (programs run against tests "
                   "in a sandbox), the last two read from data.path", choices=_task_names)
    digits: int = _f(2, "arithmetic: maximum number of digits of each operand", gt=0,
                     when=_arithmetic)
    operations: str = _f("+", "arithmetic: operators to draw from, e.g. '+' or '+-'")
    n_train: int = _f(8000, "arithmetic: number of training prompts generated", gt=0,
                      when=_generated)
    n_eval: int = _f(200, "held-out prompts: arithmetic generates them (disjoint from training); "
                     "math/code without data.eval_path hold out this many rows of data.path",
                     gt=0, when=_holds_out)
    seed: int = _f(1234, "seed of the task generator and of the math/code held-out split")
    path: str = _f("", "math/code: training prompts, a .jsonl, .json, .parquet or .csv file, "
                   "a `datasets` directory (save_to_disk, or a hub dataset's layout) or a hub "
                   "dataset id read with datasets.load_dataset, e.g. openai/gsm8k")
    eval_path: str = _f("", "math/code: held-out prompts in the same forms (default: "
                        "data.n_eval rows held out of data.path)")
    subset: str = _f("", "hub dataset: its configuration (subset), e.g. 'main' for openai/gsm8k")
    split: str = _f("train", "split of data.path (a hub dataset or a saved DatasetDict)")
    eval_split: str = _f("", "split of data.eval_path ('' = data.split), e.g. 'test'")
    max_rows: int = _f(0, "math/code: read at most this many rows of each file (0 = all)",
                       ge=0)
    prompt_field: str = _f("prompt", "field holding the prompt (the user turn of the chat "
                           "template), e.g. 'question' for GSM8K, 'problem' for MATH")
    answer_field: str = _f("answer", "math: field holding the reference answer (bare, "
                           "\\boxed{}, or a GSM8K solution ending '#### 42')")
    tests_field: str = _f("tests", "code: field holding the tests: [{input, output}] "
                          "(stdin/stdout), call-based {fn_name, args, expected}, LiveCodeBench "
                          "or APPS {inputs, outputs, fn_name} format, or JSON text of these")
    fn_name_field: str = _f("fn_name", "code: field naming the function call-based tests call "
                            "(when the tests do not name it)")
    solution_field: str = _f("", "field holding a worked solution for the supervised warm-up; "
                             "without one set warmup.steps=0")
    system_prompt: str = _f("", "system turn of the chat template ('' = none)")
    prompt_template: str = _f("{prompt}", "user turn, with {prompt} replaced by the prompt field, "
                              "e.g. '{prompt} Put the final answer in \\boxed{}.'")
    on_bad_row: str = _f("fail", "a malformed row: 'fail' (stop, naming file, row and field) or "
                         "'skip' (leave it out, counted and logged)", choices=("fail", "skip"))
    reward: str = _f("", "reward function: '' = the task's own, a built-in name (arithmetic, "
                     "math, code), 'module:function' / 'file.py:function' of your own, called "
                     "f(completion, **row_fields) -> float, or 'model:PATH', a reward model "
                     "(a sequence-classification checkpoint: directory or hub id) scoring "
                     "prompt + completion; several add up, each with an optional weight: "
                     "'math+0.5*model:PATH'")
    reward_device: str = _f("cpu", "reward models: the device they score on: cpu, cuda (this "
                            "rank's GPU), cuda:N or auto")
    reward_batch_size: int = _f(16, "reward models: completions scored per forward pass", gt=0)
    reward_dtype: str = _f("auto", "reward models: the dtype they score in; auto = bfloat16 on "
                           "a GPU that has it, else float32",
                           choices=("auto", "float32", "bfloat16", "float16"))
    reward_mode: str = _f("all", "code: 'all' (1 when every test passes) or 'fraction' (the "
                          "fraction of tests passing)", choices=("all", "fraction"))
    format_weight: float = _f(0.0, "math/code: training bonus for a well-formed answer (a "
                              "\\boxed{} answer / a fenced code block); held-out accuracy "
                              "scores correctness only", ge=0, lt=1,
                              why="so that a well-formed wrong answer never counts as solved")
    reward_timeout: float = _f(5.0, "math: seconds math-verify may spend on one completion "
                               "before it scores 0 (a failed call, counted in reward/failures)",
                               gt=0, le=DAY, why=LONGEST_WAIT)
    reward_fn_timeout: float = _f(60.0, "any reward: seconds one call may take before it fails "
                                  "(scored 0 and counted; the call is abandoned); 0 = no limit",
                                  ge=0, le=DAY, why=LONGEST_WAIT + "; 0 = no limit")
    max_reward_failures: float = _f(0.5, "stop the run when more than this fraction of the "
                                    "completions of the last 10 RL steps failed to score (and "
                                    "at once when all of the first step's did); 1 = never",
                                    ge=0, le=1)
    code_timeout: float = _f(5.0, "code: wall-clock and CPU seconds of one test run", gt=0,
                             le=DAY, why=LONGEST_WAIT)
    code_memory_mb: int = _f(1024, "code: memory of one test run, all its processes together "
                             "(see gspo.sandbox)", gt=0)
    code_workers: int = _f(0, "code: test runs in parallel (0 = the number of CPUs)", ge=0)
    code_python: str = _f("", "code: interpreter the sandboxed programs run under ('' = the "
                          "system python3, which an unprivileged uid can execute)")


@dataclass
class RolloutConfig:
    engine: str = _f("hf", "rollout engine: 'hf' (batched decode with KV cache) or 'vllm' "
                     "(GPU, `pip install gspo[vllm]`)")
    dtype: str = _f("auto", "precision the rollout engine samples in: 'auto' = the dtype "
                    "train.precision computes in (float32 for fp32, bfloat16 for bf16-mixed)",
                    choices=("auto", "float32", "bfloat16", "float16"))
    max_staleness: int = _f(0, "asynchronous rollouts: the engine samples the next step's "
                            "rollouts in a background thread while the trainer updates, from "
                            "weights at most this many updates old (rollout/staleness); 0 = "
                            "sample, then update (synchronous)", ge=0)
    sampler_threads: int = _f(0, "max_staleness >= 1 on the CPU: torch threads of the sampler's "
                              "thread; 0 = half of torch's, the trainer keeping the other half; "
                              "n = n, the trainer keeping all of torch's (oversubscribed where "
                              "the two exceed the cores)", ge=0)
    share_cores: bool = _f(True, "max_staleness >= 1 on the CPU: while one thread waits for the "
                           "other (the sampler for new weights, the trainer for a batch), the "
                           "other computes with all of torch's threads; false = fixed shares "
                           "(sampler_threads), slower, but a run whose every bit is independent "
                           "of the threads' timing (a kernel's last bits can depend on its "
                           "thread count)")
    sampler_recomputes: bool = _f(True, "max_staleness >= 1 with algorithm.old_logprobs="
                                  "recompute: the sampler's thread recomputes pi_old on its own "
                                  "copy of the weights, loaded with the current ones, while the "
                                  "trainer updates (the first minibatch takes pi_old from its own "
                                  "forward: its ratio is exactly 1); on the CPU, where the engine "
                                  "samples from a copy in the weights' dtype, one process or DDP, "
                                  "dense, without LoRA; false: the trainer recomputes before its "
                                  "updates")
    tensor_parallel_size: int = _f(1, "vllm only: GPUs (ranks of one node) that share one vLLM "
                                   "engine under torchrun; 1 = one engine per rank", ge=1)
    vllm_sleep: bool = _f(False, "vllm only, GPU only: vLLM discards its weights and KV cache "
                          "(sleep level 2) while the trainer scores and updates, and is woken by "
                          "the next weight push; for when training and vLLM do not both fit")
    vllm_gpu_memory_utilization: float = _f(0.3, "vllm only: fraction of GPU memory for vLLM "
                                            "(colocated with training)")
    group_size: int = _f(8, "G: responses sampled per prompt", ge=2,
                         why="group advantages need at least 2 responses per prompt; with 1, "
                             "every advantage and gradient is 0")
    prompts_per_step: int = _f(32, "prompts per RL step; the rollout batch is prompts_per_step*G",
                               gt=0)
    temperature: float = _f(1.0, "sampling temperature (also applied to the training log-probs)",
                            gt=0)
    top_p: float = _f(1.0, "nucleus sampling threshold", gt=0, le=1)
    max_new_tokens: int = _f(8, "maximum response length in tokens", gt=0)
    filter_groups: bool = _f(False, "DAPO's dynamic sampling (verl's algorithm.filter_groups): "
                             "drop the groups whose G rewards are all equal (zero advantage) "
                             "and sample more prompts, in up to filter_max_rounds extra rounds, "
                             "until prompts_per_step groups whose rewards vary fill the step "
                             "(each rank its own share); slots still empty then keep dropped "
                             "groups, so the step's shape never changes "
                             "(rollout/filled_groups)")
    filter_max_rounds: int = _f(4, "filter_groups: extra sampling rounds per step at most, each "
                                "of up to prompts_per_step prompts (per rank its share): a step "
                                "samples at most (1 + this) x prompts_per_step groups", ge=1,
                                when=_filtering)


@dataclass
class AlgorithmConfig:
    name: str = _f("gspo", "objective: gspo | gspo_token | grpo (`algorithm=NAME` for short)")
    eps_low: float | None = _f(None, "lower clip range; default from the preset "
                               "(gspo 3e-4, grpo 0.2)", ge=0)
    eps_high: float | None = _f(None, "upper clip range; default from the preset "
                                "(gspo 4e-4, grpo 0.27)", ge=0)
    aggregation: str | None = _f(None, "grpo loss aggregation: seq-mean-token-mean | "
                                 "token-mean | seq-mean-token-sum-norm")
    advantage_scale: str = _f("group", "advantage normaliser: group | batch | none (Dr.GRPO)")
    minibatches: int = _f(4, "optimiser steps per rollout batch (the paper: 4)", gt=0)
    micro_batch_size: int = _f(0, "sequences per forward/backward (0 = the whole minibatch); "
                               "gradients accumulate with global denominators (not used when "
                               "train.max_tokens_per_micro packs micro-batches by tokens)", ge=0)
    beta: float = _f(0.0, "KL penalty to the initial policy (k3); 0 = off, as in the paper",
                     ge=0)
    old_logprobs: str = _f("recompute", "pi_old from 'recompute' (a training-engine forward "
                           "pass) or 'rollout' (the sampler's own log-probs; no recompute pass)",
                           choices=("recompute", "rollout"))
    mismatch_every: int = _f(10, "with old_logprobs=rollout, also recompute every N steps just "
                             "to log mismatch/* (0 = never)", ge=0)
    is_correction: str = _f("none", "off-policy correction between the rollout engine's "
                            "likelihoods and the trainer's: truncate (weights capped at is_cap: "
                            "TIS) | mask (terms whose weight is outside [is_floor, is_cap] "
                            "leave the loss) | none", choices=("none", "truncate", "mask"))
    is_level: str = _f("sequence", "the correction's weight per token (needs per-token "
                       "advantages: gspo_token, grpo) | sequence (the product over the "
                       "response) | geometric (its per-token geometric mean)",
                       choices=("token", "sequence", "geometric"))
    is_cap: float = _f(2.0, "upper bound of the correction's weights", gt=0)
    is_floor: float = _f(0.0, "lower bound: truncate raises smaller weights to it, mask drops "
                         "their terms (0 = none)", ge=0)
    tis: str = _f("none", "retired alias: tis=L is is_correction=truncate with is_level=L",
                  choices=("none", "token", "sequence"))
    tis_cap: float = _f(2.0, "retired alias of is_cap (with tis)", gt=0)
    routing_replay: bool = _f(False, "MoE: record the experts chosen under pi_old and force "
                              "them when computing pi_theta (GRPO needs it, GSPO should not)")
    router_aux_loss_coef: float | None = _f(None, "MoE: weight of the router load-balancing "
                                            "loss (Switch Transformer's, transformers' "
                                            "aux_loss) added to each update's loss; unset = "
                                            "the model config's router_aux_loss_coef where its "
                                            "output_router_logits is true (as transformers and "
                                            "TRL apply it), else 0", ge=0)
    overlong: str = _f("none", "responses cut at rollout.max_new_tokens: none | mask (they "
                       "leave the loss, DAPO's overlong filtering) | soft_penalty (DAPO's length "
                       "penalty: from 0 to -overlong_penalty over the last overlong_buffer "
                       "tokens of the budget, added to the reward)",
                       choices=("none", "mask", "soft_penalty"))
    overlong_buffer: int = _f(0, "soft_penalty: the tokens before rollout.max_new_tokens over "
                              "which the penalty grows (0 = a quarter of max_new_tokens)", ge=0)
    overlong_penalty: float = _f(1.0, "soft_penalty: the penalty at max_new_tokens", ge=0)


@dataclass
class OptimConfig:
    lr: float = _f(1e-4, "AdamW learning rate of the RL phase", gt=0)
    weight_decay: float = _f(0.0, "AdamW weight decay", ge=0)
    betas: list = _f([0.9, 0.999], "AdamW betas")
    grad_clip: float = _f(1.0, "max global gradient norm (0 = no clipping)", ge=0)
    warmup_steps: int = _f(0, "linear learning-rate warm-up, in optimiser steps", ge=0)


@dataclass
class WarmupConfig:
    steps: int = _f(300, "supervised warm-up steps before RL (0 for a pretrained model)",
                    ge=0)
    lr: float = _f(1e-3, "warm-up AdamW learning rate", gt=0)
    batch_size: int = _f(64, "warm-up examples per step", gt=0)


@dataclass
class TrainConfig:
    steps: int = _f(400, "RL steps (one rollout batch each)", ge=0)
    seed: int = _f(0, "seed of model init, sampling and data order")
    eval_every: int = _f(50, "held-out evaluation every N RL steps (and at step 0); 0 = never",
                         ge=0)
    eval_k: int = _f(4, "samples per held-out problem (accuracy is avg@k)", gt=0)
    eval_temperature: float = _f(1.0, "sampling temperature of the evaluation", ge=0)
    save_every: int = _f(100, "checkpoint every N RL steps (and at the end); 0 = only the end",
                         ge=0)
    keep_last: int = _f(2, "checkpoints kept (older ones are deleted); 0 = keep every one",
                        ge=0)
    report_to: list | str = _f([], "experiment trackers to log to besides metrics.jsonl "
                               "(always written), e.g. [wandb, tensorboard] (`pip install "
                               "gspo[trackers]`)", choices=_tracker_names)
    project: str = _f("gspo", "trackers: the project (wandb, Trackio) or experiment (MLflow) "
                      "the run is logged under; the run's name is its directory's name")
    tensorboard: bool = _f(False, "deprecated: true is train.report_to=[tensorboard]")
    progress: bool = _f(True, "show a progress bar")
    precision: str = _f("fp32", "'fp32'; 'bf16-mixed' (float32 master weights and AdamW "
                        "state, bfloat16 matmuls, float32 log-probs and losses: what TRL's "
                        "bf16=True and verl do), 'fp16-mixed' (the same in float16, with a "
                        "dynamic loss scale) or 'bf16-true' (weights and AdamW state in "
                        "bfloat16: half the memory, but updates below |w| * 2^-9 vanish)",
                        choices=("fp32", "bf16-mixed", "fp16-mixed", "bf16-true"))
    device: str = _f("auto", "where the training model runs: 'auto' (this rank's GPU, "
                     "cuda:LOCAL_RANK, when CUDA is available, else the CPU), 'cpu', 'cuda', "
                     "'cuda:N'")
    max_tokens_per_micro: int = _f(0, "micro-batches packed by tokens instead of "
                                   "algorithm.micro_batch_size rows (verl's use_dynamic_bsz / "
                                   "ppo_max_token_len_per_gpu): each forward/backward of the "
                                   "update, pi_old and pi_ref computes at most this many tokens, "
                                   "rows x (prompt width + its longest response), rows sorted "
                                   "by length so that short responses go many to a forward (a "
                                   "row over the budget goes alone); the gradient is the same. "
                                   "Use it when response lengths vary widely, to bound "
                                   "activation memory by tokens without padding every "
                                   "micro-batch to the longest response. 0 = fixed-size "
                                   "micro-batches", ge=0)
    data_parallel: str = _f("auto", "under torchrun: 'fsdp' (FSDP2, parameters, gradients and "
                            "optimiser state sharded over ranks), 'ddp' (every rank holds the "
                            "whole model), or 'auto' = fsdp where this torch has fully_shard",
                            choices=("auto", "fsdp", "ddp"))
    dist_timeout_s: float = _f(600.0, "under torchrun: seconds a rank waits in a collective (or "
                               "for the others to join) before every rank stops with an error "
                               "instead of hanging; raise it if one rank's checkpoint write or "
                               "evaluation is slower than that", gt=0, le=DAY,
                               why=LONGEST_WAIT)


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    warmup: WarmupConfig = field(default_factory=WarmupConfig)
    train: TrainConfig = field(default_factory=TrainConfig)


# --------------------------------------------------------------------------------------------
# building a config from YAML and overrides


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _hint_at(key: str) -> Any:
    """The type hint of the field `key` (a.b) names, None where it names none."""
    cls = Config
    *sections, name = key.split(".")
    for section in sections:
        hint = _hints(cls).get(section)
        if not (isinstance(hint, type) and dataclasses.is_dataclass(hint)):
            return None
        cls = hint
    return _hints(cls).get(name) if dataclasses.is_dataclass(cls) else None


def _coerce(value: Any, hint: Any, key: str) -> Any:
    """Check value against a field's type hint, converting only the lossless int -> float."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(hint)
        if value is None and type(None) in args:
            return None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, key)
            except ConfigError:
                pass
        raise ConfigError(f"{key}: expected {hint}, got {value!r}")
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint is float and isinstance(value, str):  # YAML 1.1 reads '1e-3' as a string
        try:
            return float(value)
        except ValueError:
            pass
    if hint is list or origin is list:
        if isinstance(value, (list, tuple)):
            return list(value)
        raise ConfigError(f"{key}: expected a list ([a, b, ...]), got {value!r}")
    want = origin or hint
    if not isinstance(value, want) or (want is int and isinstance(value, bool)):
        raise ConfigError(f"{key}: expected {getattr(want, '__name__', want)}, "
                          f"got {type(value).__name__} {value!r}")
    return value


def _apply(obj: Any, key_path: list[str], value: Any, full_key: str) -> None:
    names = [f.name for f in dataclasses.fields(obj)]
    head = key_path[0]
    if head not in names:
        raise ConfigError(f"unknown config key '{full_key}'; valid keys under "
                          f"'{'.'.join(full_key.split('.')[:-len(key_path)]) or 'top level'}': "
                          f"{', '.join(names)}")
    current = getattr(obj, head)
    if dataclasses.is_dataclass(current):
        if len(key_path) == 1:
            if isinstance(value, dict):
                for k, v in value.items():
                    _apply(current, [str(k)], v, f"{full_key}.{k}")
                return
            raise ConfigError(f"'{full_key}' is a section; set one of its keys, e.g. "
                              f"{full_key}.{dataclasses.fields(current)[0].name}=...")
        _apply(current, key_path[1:], value, full_key)
        return
    if len(key_path) > 1:
        raise ConfigError(f"unknown config key '{full_key}': '{head}' is not a section")
    setattr(obj, head, _coerce(value, _hints(type(obj))[head], full_key))


def parse_override(text: str) -> tuple[str, Any]:
    """'a.b=value' -> ('a.b', value) with value parsed as YAML (numbers, bools, lists...),
    except for a text field, which takes the text as typed ("data.system_prompt=Note: be
    brief" is not a mapping, "=no" not a bool) unless it is quoted."""
    if "=" not in text:
        raise ConfigError(f"override '{text}' must look like key.sub=value")
    key, raw = text.split("=", 1)
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    quoted = raw.strip()[:1] in ("'", '"') and isinstance(value, str)
    if _hint_at(key.strip()) is str and not quoted:
        value = raw.strip()
    if key == "algorithm" and isinstance(value, str):  # the preset shorthand
        key = "algorithm.name"
    return key.strip(), value


def load_config(path: str | Path | None = None, overrides: list[str] = (),
                base: Mapping[str, Any] | None = None) -> Config:
    """Defaults, then a YAML file (or `base`, the same sections as a dict: a config saved with
    a checkpoint), then `key.sub=value` overrides; resolved and validated."""
    cfg = Config()
    if base is not None:
        for k, v in base.items():
            _apply(cfg, [str(k)], v, str(k))
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file '{path}' not found")
        try:
            # bytes: PyYAML decodes UTF-8, or UTF-16 by its BOM, and says where it cannot
            data = yaml.safe_load(path.read_bytes()) or {}
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
            what = getattr(e, "problem", None) or str(e).splitlines()[0]
            tabs = " (YAML indents with spaces, not tabs)" if "\\t" in what else ""
            if isinstance(e, yaml.reader.ReaderError) and e.encoding != "unicode":  # undecodable
                what = (f"byte {e.character:#04x} at offset {e.position} is not {e.encoding} "
                        f"text ({e.reason}); save the file as UTF-8")
            raise ConfigError(f"config file '{path}' is not valid YAML{where}: {what}{tabs}"
                              ) from None
        if not isinstance(data, dict):
            raise ConfigError(f"config file '{path}' must hold a mapping of sections")
        if isinstance(data.get("algorithm"), str):
            data["algorithm"] = {"name": data["algorithm"]}
        for k, v in data.items():
            if v is None and dataclasses.is_dataclass(getattr(cfg, str(k), None)):
                continue  # an empty section ("model:" with nothing under it) sets nothing
            _apply(cfg, str(k).split("."), v, str(k))  # "train.steps: 2" as train: {steps: 2}
    for text in overrides:
        key, value = parse_override(text)
        _apply(cfg, key.split("."), value, key)
    return resolve(cfg)


_BOUNDS = {"gt": (operator.gt, ">"), "ge": (operator.ge, ">="), "lt": (operator.lt, "<"),
           "le": (operator.le, "<=")}


def _names(choices: tuple | Callable[[], Any]) -> tuple:
    return tuple(choices() if callable(choices) else choices)


def allowed(meta: Mapping[str, Any]) -> str:
    """What a field's metadata allows, as --help and its error show it: 'a | b | c', '> 0' or
    'in (0, 1]'; '' when it declares nothing."""
    if meta.get("choices") is not None:
        return " | ".join(map(str, _names(meta["choices"])))
    bounds = [(op, meta[op]) for op in _BOUNDS if meta.get(op) is not None]
    if len(bounds) == 2:  # a lower and an upper bound: an interval, ( ] for open / closed ends
        (low_op, low), (high_op, high) = bounds
        return f"in {'(' if low_op == 'gt' else '['}{low}, {high}{')' if high_op == 'lt' else ']'}"
    return " and ".join(f"{_BOUNDS[op][1]} {bound}" for op, bound in bounds)


def check_value(key: str, value: Any, meta: Mapping[str, Any]) -> None:
    """Raise ConfigError, in the one format of every such error, unless value is one of meta's
    choices (each entry, for a list) and within its bounds. None (left to a preset) passes."""
    if value is None:
        return
    if meta.get("choices") is not None:
        names = _names(meta["choices"])
        bad = [v for v in (value if isinstance(value, list) else [value]) if v not in names]
        if not bad:
            return
        value, what = bad[0], "one of " + allowed(meta)
    else:
        bounds = [(test, meta[op]) for op, (test, _) in _BOUNDS.items() if meta.get(op) is not None]
        if all(test(value, bound) for test, bound in bounds):  # NaN fails: every test is False
            return
        what = allowed(meta)
    why = f" ({meta['why']})" if meta.get("why") else ""
    raise ConfigError(f"{key} must be {what}, got {value!r}{why}")


def check_fields(cfg: Config) -> None:
    """The one pass over every section's fields that checks the choices and bounds they declare
    (a field whose `when` does not hold is skipped)."""
    for section in dataclasses.fields(cfg):
        obj = getattr(cfg, section.name)
        for f in dataclasses.fields(obj):
            when = f.metadata.get("when")
            if when is None or when(obj):
                check_value(f"{section.name}.{f.name}", getattr(obj, f.name), f.metadata)


def _check_choice(key: str, value: Any, names: Any) -> None:
    """A choice among names only known with torch imported (the objective and engine registries,
    which config.py must not import at module level), in check_fields' format."""
    check_value(key, value, {"choices": tuple(names)})


def resolve(cfg: Config) -> Config:
    """Fill preset defaults, check every field's declared choices and bounds in one pass, then
    the rules that relate fields to each other."""
    from gspo.objectives import AGGREGATIONS, OBJECTIVES, ADVANTAGE_SCALES

    a, r = cfg.algorithm, cfg.rollout
    _check_choice("algorithm.name", a.name, OBJECTIVES)
    spec = OBJECTIVES[a.name]  # the paper's defaults live in the objective's registry entry
    a.eps_low = spec.eps_low if a.eps_low is None else a.eps_low
    a.eps_high = spec.eps_high if a.eps_high is None else a.eps_high
    a.aggregation = spec.aggregations[0] if a.aggregation is None else a.aggregation
    check_fields(cfg)
    _check_choice("algorithm.aggregation", a.aggregation, AGGREGATIONS)
    if a.aggregation not in spec.aggregations:
        raise ConfigError(f"algorithm.aggregation '{a.aggregation}' does not apply to {a.name}, "
                          f"which takes {', '.join(spec.aggregations)}")
    _check_choice("algorithm.advantage_scale", a.advantage_scale, ADVANTAGE_SCALES)
    from gspo.engines import ENGINES  # the registry a new engine is added to
    _check_choice("rollout.engine", r.engine, sorted(ENGINES))
    m = cfg.model
    if m.name_or_path.startswith("tiny-qwen3") and (m.num_heads % m.num_kv_heads
                                                   or m.hidden_size % m.num_heads):
        raise ConfigError(f"the tiny model's model.num_heads={m.num_heads} must be a multiple "
                          f"of model.num_kv_heads={m.num_kv_heads} (heads share key/value "
                          f"heads in equal groups) and divide model.hidden_size="
                          f"{m.hidden_size}")
    if m.lora_rank and (not m.lora_target_modules
                        or not all(isinstance(x, str) for x in m.lora_target_modules)):
        raise ConfigError(f"model.lora_target_modules must be a non-empty list of layer "
                          f"names, e.g. [q_proj, v_proj]; got {m.lora_target_modules!r}")
    batch = r.prompts_per_step * r.group_size
    if batch % a.minibatches:
        raise ConfigError(f"rollout batch {batch} (prompts_per_step {r.prompts_per_step} x "
                          f"group_size {r.group_size}) is not divisible by algorithm.minibatches "
                          f"{a.minibatches}")
    _fold_tis(a)
    if r.filter_groups and a.routing_replay and a.old_logprobs == "rollout":
        raise ConfigError("rollout.filter_groups does not run with algorithm.routing_replay and "
                          "algorithm.old_logprobs=rollout yet (pi_old's routing is recorded as "
                          "the engine samples, one round at a time); set "
                          "algorithm.old_logprobs=recompute")
    if a.overlong == "soft_penalty" and a.overlong_buffer >= r.max_new_tokens:
        raise ConfigError(f"algorithm.overlong_buffer={a.overlong_buffer} must be below "
                          f"rollout.max_new_tokens={r.max_new_tokens} (the penalty starts that "
                          f"many tokens before the budget ends)")
    if a.overlong == "soft_penalty" and not a.overlong_buffer and r.max_new_tokens < 4:
        fix = (f"set algorithm.overlong_buffer between 1 and {r.max_new_tokens - 1}, or "
               if r.max_new_tokens > 1 else "")
        raise ConfigError(f"algorithm.overlong=soft_penalty's default buffer, a quarter of "
                          f"rollout.max_new_tokens={r.max_new_tokens}, is 0 tokens: {fix}"
                          f"raise rollout.max_new_tokens to 4 or more")
    if a.is_correction != "none" and a.is_level == "token" and not spec.token_advantages:
        raise ConfigError(f"algorithm.is_level=token gives per-token weights, but {a.name} has "
                          f"one advantage per sequence; use is_level=sequence or geometric, or "
                          f"algorithm=gspo_token")
    if a.is_correction != "none" and a.is_floor >= a.is_cap:
        raise ConfigError(f"algorithm.is_floor={a.is_floor} must be below algorithm.is_cap="
                          f"{a.is_cap}")
    betas = cfg.optim.betas
    if (not isinstance(betas, (list, tuple)) or len(betas) != 2
            or not all(isinstance(b, (int, float)) and 0 <= b < 1 for b in betas)):
        raise ConfigError(f"optim.betas must be two numbers in [0, 1), e.g. [0.9, 0.999]; got "
                          f"{betas}")
    _check_precision(cfg)
    _check_trackers(cfg.train)
    _check_data(cfg.data)
    return cfg


def _check_precision(cfg: Config) -> None:
    """Fold the retired model.dtype into train.precision (so the saved config says it once)."""
    m, t = cfg.model, cfg.train
    if m.dtype == "float16":
        raise ConfigError("model.dtype=float16 is retired (float16 weights cannot be trained "
                          "without float32 master weights); use train.precision=fp16-mixed")
    if m.dtype == "bfloat16":
        if t.precision not in ("fp32", "bf16-true"):
            raise ConfigError(f"model.dtype=bfloat16 (retired: bf16 weights) contradicts "
                              f"train.precision={t.precision}; drop model.dtype")
        logging.getLogger(__name__).warning(
            "model.dtype=bfloat16 is retired: read as train.precision=bf16-true (bf16 weights "
            "and AdamW state); train.precision=bf16-mixed keeps float32 master weights")
        t.precision = "bf16-true"
    m.dtype = "float32"


def _fold_tis(a: AlgorithmConfig) -> None:
    """Fold the retired algorithm.tis / tis_cap into is_correction / is_level / is_cap (so the
    saved config says it once)."""
    if a.tis == "none":
        return
    if a.is_correction != "none" and (a.is_correction, a.is_level) != ("truncate", a.tis):
        raise ConfigError(f"algorithm.tis={a.tis} (retired: is_correction=truncate, is_level="
                          f"{a.tis}) contradicts algorithm.is_correction={a.is_correction} "
                          f"with is_level={a.is_level}; drop algorithm.tis")
    a.is_correction, a.is_level, a.is_cap, a.tis = "truncate", a.tis, a.tis_cap, "none"


def _check_trackers(t: TrainConfig) -> None:
    """Fold the deprecated train.tensorboard into train.report_to (so the saved config names
    each tracker once); check_fields has checked the names."""
    names = [t.report_to] if isinstance(t.report_to, str) else t.report_to
    t.report_to = list(dict.fromkeys(names + ["tensorboard"] * t.tensorboard))
    t.tensorboard = False
    if not t.project:
        raise ConfigError("train.project must name the trackers' project, e.g. gspo")


def _check_data(d: DataConfig) -> None:
    from gspo.tasks import file_tasks, get_task  # the registry (no torch behind it)

    task = get_task(d.task)
    if task.make_rows is not None and (d.path or d.eval_path):
        raise ConfigError(f"data.path is set but data.task is '{d.task}'; set "
                          f"{' or '.join(f'data.task={n}' for n in file_tasks())} to train on "
                          f"a file")
    if d.task == "arithmetic":
        if not d.operations or set(d.operations) - set("+-*"):
            raise ConfigError(f"data.operations '{d.operations}' must be made of + - *")
        distinct = 10 ** (2 * d.digits) * len(set(d.operations))
        if d.n_train + d.n_eval > distinct:
            raise ConfigError(f"data.n_train + data.n_eval = {d.n_train + d.n_eval} exceeds the "
                              f"{distinct} distinct problems with data.digits={d.digits}; "
                              f"lower them")
    if task.make_rows is None:
        # data.path may be empty here: Python rows given to gspo.train take its place, and
        # build_task says what to set when neither is given
        from gspo.hub import looks_like_hub_id
        for key in ("path", "eval_path"):
            value = getattr(d, key)
            if value and not Path(value).expanduser().exists() and not looks_like_hub_id(value):
                raise ConfigError(f"data.{key} '{value}' not found: it is neither an existing "
                                  f"file or directory nor a hub dataset id like openai/gsm8k")
        for key in ("prompt_field", task.setting(d)):
            if key and not getattr(d, key):
                raise ConfigError(f"data.{key} must name a field of the data file")
    if "{prompt}" not in d.prompt_template:
        raise ConfigError(f"data.prompt_template '{d.prompt_template}' must contain {{prompt}}")
    if d.reward:
        _check_reward(d)


def _check_reward(d: DataConfig) -> None:
    """data.reward's parts and a reward model's path and device; what needs transformers (the
    checkpoint is a 1-label classifier) is checked when the reward is built."""
    from gspo.hub import looks_like_hub_id
    from gspo.rewards import MODEL_PREFIX, parse_reward_spec

    for _, name in parse_reward_spec(d.reward):
        if name.startswith(MODEL_PREFIX):
            path = name[len(MODEL_PREFIX):]
            if not Path(path).expanduser().exists() and not looks_like_hub_id(path):
                raise ConfigError(f"data.reward {name}: '{path}' not found; give the directory "
                                  f"a sequence-classification reward model and its tokenizer "
                                  f"were saved to, or a hub model id (a Python module named "
                                  f"'model' is given by its file: path/to/model.py:function)")
            if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", d.reward_device):
                raise ConfigError(f"data.reward_device must be cpu, cuda, cuda:N or auto, got "
                                  f"{d.reward_device!r}")
        elif name not in _task_names() and ":" not in name:
            raise ConfigError(f"data.reward '{name}' must be 'module:function', "
                              f"'file.py:function', 'model:PATH' or a built-in: "
                              f"{', '.join(_task_names())}")


def to_dict(cfg: Config) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def save_config(cfg: Config, path: Path) -> None:
    path.write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))


def help_text() -> str:
    """Every field with its default, help and what it allows, grouped by section."""
    lines = []
    for section in dataclasses.fields(Config):
        lines.append(f"  {section.name}:")
        for f in dataclasses.fields(section.default_factory()):
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            values = allowed(f.metadata)
            lines.append(f"    {section.name}.{f.name}={default!r}\n        {f.metadata['help']}"
                         + (f"  [{values}]" if values else ""))
    return "\n".join(lines)
