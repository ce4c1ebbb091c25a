"""A vLLM rollout engine (optional extra, GPU): `pip install gspo[vllm]`.

Colocated with the trainer in the same process: vLLM holds its own copy of the weights in
`dtype`, the trainer pushes its weights after every step with `load_weights`, and each sampled
token comes back with vLLM's log-prob of it, so `algorithm.old_logprobs=rollout` can skip the
training engine's recompute pass.

Log-probs: vLLM is started with ``logprobs_mode="processed_logprobs"``, i.e. log-probs of the
distribution it actually samples from (after temperature and top-p). With top_p=1 that is the
temperature-scaled softmax that `gspo.models.token_logprobs` recomputes; with top_p < 1 vLLM's
values are renormalised over the nucleus and differ from the trainer's (the mismatch metrics show
it). What is left out: tensor parallelism (one GPU per engine), server mode.

This module imports without vLLM; constructing the engine without it raises an ImportError
that says how to install it.
"""

from __future__ import annotations

import os
import tempfile
from typing import Iterable

import torch

from gspo.engines.base import Rollouts, SamplingParams, to_rollouts


def vllm_available() -> bool:
    try:
        import vllm  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available()


class VLLMEngine:
    """RolloutEngine over a colocated `vllm.LLM` built from the trainer's model."""

    def __init__(self, model, tokenizer, dtype: str = "bfloat16",
                 gpu_memory_utilization: float = 0.3, seed: int = 0,
                 max_model_len: int | None = None):
        try:
            import vllm
        except ImportError as e:
            raise ImportError("rollout.engine=vllm needs vLLM on a CUDA machine: "
                              "pip install 'gspo[vllm]' (it brings its own CUDA torch)") from e
        # In-process engine core, so that the model's weights can be reached to update them.
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        self._dir = tempfile.TemporaryDirectory(prefix="gspo-vllm-")
        model.save_pretrained(self._dir.name)
        tokenizer.save_pretrained(self._dir.name)
        self.pad_token_id = tokenizer.pad_token_id
        self.eos_token_ids = [tokenizer.eos_token_id]
        self.llm = vllm.LLM(model=self._dir.name, dtype=dtype, seed=seed,
                            gpu_memory_utilization=gpu_memory_utilization,
                            max_model_len=max_model_len or model.config.max_position_embeddings,
                            logprobs_mode="processed_logprobs", enable_prefix_caching=True)
        self._vllm = vllm

    def _model(self):
        executor = self.llm.llm_engine.model_executor
        worker = executor.driver_worker
        worker = getattr(worker, "worker", worker)  # V1 wraps the worker once more
        return worker.model_runner.model

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Push the trainer's weights into vLLM's model (names as transformers saves them)."""
        self._model().load_weights(weights)
        self.llm.reset_prefix_cache()  # cached KV blocks were computed with the old weights

    def generate(self, prompts: list[list[int]], n: int, params: SamplingParams,
                 seed: int) -> Rollouts:
        sp = self._vllm.SamplingParams(n=n, temperature=params.temperature, top_p=params.top_p,
                                       max_tokens=params.max_new_tokens, logprobs=0, seed=seed,
                                       stop_token_ids=self.eos_token_ids)
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        responses, logps, rows_prompts = [], [], []
        for prompt, out in zip(prompts, outs, strict=True):
            for c in out.outputs:
                responses.append(list(c.token_ids))
                # logprobs=0 returns, per position, a dict holding just the sampled token
                logps.append([lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)])
                rows_prompts.append(prompt)
        return to_rollouts(rows_prompts, responses, logps, self.pad_token_id)

