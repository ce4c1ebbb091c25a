"""gspo: Group Sequence Policy Optimization (arXiv 2507.18071) for RL fine-tuning of LMs.

The public API, importable from the package itself (loaded on first use, so that `import gspo`
and the CLI's start stay fast):

    from gspo import load_config, train
    summary = train(load_config(overrides=["train.steps=20"]), "runs/demo")

Everything benchmarks/, experiments/ and scripts/ import is listed here (a test keeps it so);
anything else is internal and may change.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_API = {
    # configuration and the run
    "Config": "gspo.config", "load_config": "gspo.config",
    "train": "gspo.trainer", "Summary": "gspo.run", "dry_run": "gspo.dryrun",
    "Callback": "gspo.callbacks",
    # a run stepped by hand (benchmarks, notebooks): prepare, then rl_step, then close_run
    "prepare": "gspo.trainer", "rl_step": "gspo.step", "close_run": "gspo.trainer",
    # the math
    "OBJECTIVES": "gspo.objectives", "LossSpec": "gspo.objectives",
    "importance_weights": "gspo.objectives",
    "register_objective": "gspo.objectives", "group_advantages": "gspo.objectives",
    "logprobs_from_hidden": "gspo.logprobs", "token_logprobs": "gspo.logprobs",
    # models and engines
    "load_model": "gspo.models", "build_tiny_qwen3": "gspo.models",
    "build_tokenizer": "gspo.models", "fetch_model": "gspo.pretrained",
    "PRETRAINED": "gspo.pretrained",
    "ENGINES": "gspo.engines", "make_engine": "gspo.engines", "SamplingParams": "gspo.engines",
    "Rollouts": "gspo.engines", "HFEngine": "gspo.engines.hf", "left_pad": "gspo.engines",
    "stop_token_ids": "gspo.engines",
    # data, rewards, evaluation
    "encode_prompts": "gspo.data", "score": "gspo.data", "evaluate": "gspo.evaluation",
    "RewardFn": "gspo.rewards", "close_reward": "gspo.rewards", "RewardSum": "gspo.data",
    "RewardModel": "gspo.rewards.model",
    "make_splits": "gspo.tasks.arithmetic", "exact_match_reward": "gspo.tasks.arithmetic",
    "TASKS": "gspo.tasks", "TaskSpec": "gspo.tasks", "register_task": "gspo.tasks",
    "build_task": "gspo.tasks",
    "read_metrics": "gspo.logger", "WeightedMean": "gspo.metrics",
    # torchrun
    "Dist": "gspo.distributed", "Policy": "gspo.distributed",
    # errors
    "GspoError": "gspo.errors", "ConfigError": "gspo.errors", "ModelLoadError": "gspo.errors",
    "TrainingError": "gspo.errors",
}
"""public name -> the module that defines it"""

__all__ = sorted(_API)


def __getattr__(name: str):
    if name not in _API:
        raise AttributeError(f"module 'gspo' has no attribute {name!r}")
    value = getattr(importlib.import_module(_API[name]), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_API))
