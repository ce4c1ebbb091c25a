"""torch.distributed for data parallelism, launched by torchrun. No custom cluster code.

    torchrun --nproc_per_node 2 -m gspo train ...            (2 CPU processes, gloo)
    torchrun --nnodes 2 --node_rank R --rdzv_endpoint HOST:PORT --nproc_per_node 8 -m gspo train

A single process without torchrun is the default and needs no process group. Each rank samples
the groups of its own share of the step's prompts (whole groups stay on one rank, so group
advantages need no communication); the trainer normalises every loss by the GLOBAL count of
sequences (or tokens) in the minibatch and scales it by the world size, so that the gradient
average over ranks equals the full-batch gradient. Metrics are reduced as sums over ranks.

Two ways to hold the model (`train.data_parallel`):

    fsdp  FSDP2: `fully_shard` on every decoder layer, then on the Policy wrapper as the root
          (embeddings, final norm and the LM head, tied or not, form the root's group). Each
          rank holds 1/N of the parameters, gradients and AdamW state. Rollouts and evaluation
          run on a full, unsharded copy of the weights that is refreshed after every update
          (as a vLLM engine would hold its own copy), so decoding needs no collectives. Every
          forward of the sharded model is a collective: Policy makes all ranks take the same
          path through the decoder (see `sync_max`).
    ddp   DistributedDataParallel: every rank holds the whole model; the rollout engine
          shares it.

Checkpoints are written by rank 0 in the single-process format: the weights gathered into one
Hugging Face state dict, the optimiser state gathered and keyed by parameter index as
`optimizer.state_dict()` keys it; so a run resumes on any number of ranks, in either mode.
"""

from __future__ import annotations

import faulthandler
import gc
import os
from contextlib import contextmanager, nullcontext
from datetime import timedelta
from typing import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from gspo.errors import ConfigError
from gspo.signals import signal_defaults


@dataclass(frozen=True)
class Dist:
    rank: int = 0
    world: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")  # where this rank trains (and communicates)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world > 1

    def sum(self, values: list[float]) -> list[float]:
        """Element-wise sum over ranks (float64, so counts stay exact)."""
        return self._reduce(values, dist.ReduceOp.SUM)

    def max(self, values: list[float]) -> list[float]:
        """Element-wise max over ranks."""
        return self._reduce(values, dist.ReduceOp.MAX)

    def min_max(self, lo: float, hi: float) -> tuple[float, float]:
        lo, neg_hi = self._reduce([lo, -hi], dist.ReduceOp.MIN)
        return lo, -neg_hi

    def _reduce(self, values: list[float], op) -> list[float]:
        if not self.enabled:
            return [float(v) for v in values]
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=op)
        return t.tolist()

    def barrier(self) -> None:
        if self.enabled:
            dist.barrier()


def resolve_device(spec: str, local_rank: int = 0) -> torch.device:
    """'auto' = this rank's GPU (cuda:LOCAL_RANK) when CUDA is available, else the CPU; 'cuda'
    = cuda:LOCAL_RANK; or an explicit 'cpu' / 'cuda:N'."""
    if spec == "auto":
        spec = "cuda" if torch.cuda.is_available() else "cpu"
    if spec == "cuda" and torch.cuda.is_available():
        # one GPU per rank; a launcher may also show each rank only its own GPU
        spec = f"cuda:{local_rank % torch.cuda.device_count()}"
    try:
        device = torch.device(spec)
    except RuntimeError:
        raise ConfigError(f"train.device '{spec}' is not a device; use auto, cpu, cuda or "
                          f"cuda:N") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"train.device={spec} but this torch ({torch.__version__}) sees "
                              f"no CUDA device; use train.device=cpu")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ConfigError(f"train.device={spec}, but only {torch.cuda.device_count()} "
                              f"CUDA device(s) are visible")
        torch.cuda.set_device(device)
    elif device.type != "cpu":
        raise ConfigError(f"train.device '{spec}': only cpu and cuda are supported")
    return device


def init_distributed(device: str = "auto", timeout_s: float = 600.0) -> Dist:
    """Join the process group torchrun describes in the environment, NCCL when this rank
    trains on a GPU and gloo on the CPU; without torchrun, a single-process Dist.

    `timeout_s` bounds every collective and the join itself: a rank that waits longer for the
    others (one crashed, or took another path) raises instead of hanging, and torchrun then
    stops the rest. torch's own defaults (30 min for gloo) would hold a job that long."""
    world = launch_world()
    local_rank = int(os.environ.get("LOCAL_RANK", "0")) if world > 1 else 0
    dev = resolve_device(device, local_rank)
    if world <= 1:
        return Dist(device=dev)
    if not dist.is_initialized():
        with signal_defaults():  # the join returns to Python only when all came, or timed out
            dist.init_process_group("nccl" if dev.type == "cuda" else "gloo",
                                    timeout=timedelta(seconds=timeout_s))
    return Dist(dist.get_rank(), dist.get_world_size(), local_rank, dev)


TORCHRUN_ENV = ("RANK", "MASTER_ADDR", "MASTER_PORT")
"""what torchrun sets beside WORLD_SIZE, and joining its process group (env://) reads"""


def launch_world(planned: bool = False) -> int:
    """WORLD_SIZE, 1 without it; a ConfigError when it cannot be joined: not a number of ranks,
    or above 1 without the rest of torchrun's environment (a WORLD_SIZE left exported and
    `gspo train` run without torchrun), where torch would raise a traceback about env://.
    planned: a dry run planning a launch, for which WORLD_SIZE alone says the ranks."""
    value = os.environ.get("WORLD_SIZE", "1")
    try:
        world = int(value)
    except ValueError:
        world = 0
    if planned and world < 1:
        raise ConfigError(f"WORLD_SIZE={value!r} is not a number of ranks (torchrun sets it); "
                          f"unset it, or pass --world-size N")
    missing = [] if planned else [k for k in TORCHRUN_ENV if not os.environ.get(k)]
    if world < 1 or (world > 1 and missing):
        what = ("is not a number of ranks" if world < 1 else
                f"is set but {', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not")
        raise ConfigError(f"WORLD_SIZE={value if world else repr(value)} {what}: torchrun sets "
                          f"them all for each rank it starts (torchrun --nproc_per_node N -m "
                          f"gspo train ...); unset WORLD_SIZE to train in one process")
    return world


# what gloo / NCCL / the TCP store say when a peer is gone or a collective outlived its timeout
_PEER_FAILURES = ("Timed out waiting", "timed out", "Connection closed by peer",
                  "Connection reset by peer", "Broken pipe", "NCCL")


def collective_failure(err: BaseException, timeout_s: float) -> str | None:
    """One line for an error raised inside a collective under torchrun, or None when `err` is
    not one (then it is a bug of its own and keeps its traceback)."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    text = str(err).strip()
    if not (isinstance(err, dist.DistError) or any(p in text for p in _PEER_FAILURES)):
        return None
    first = (text.splitlines() or [type(err).__name__])[0][:240]
    return (f"rank {dist.get_rank()}: a collective failed ({first}): another rank crashed or "
            f"stopped answering (its own error, if any, is printed above), or this one waited "
            f"longer than train.dist_timeout_s={timeout_s:g}")


SHUTDOWN_TIMEOUT_S = 60.0


def shutdown(wait: bool = True, timeout_s: float = SHUTDOWN_TIMEOUT_S) -> None:
    """Leave the process group torchrun set up (a no-op without one).

    wait: meet the other ranks first (after a finished run), so that none tears its
    communicator down while another still uses it; after an error, do not (another rank may
    never arrive). destroy_process_group itself hangs now and then (pytorch#75097, seen here
    as a 2-rank gloo test stuck past its 300 s limit), and torchrun then waits on that rank
    forever: past `timeout_s` this process prints every thread's stack and exits with status 1
    instead (faulthandler's watchdog runs without the GIL, so it fires even when the hung call
    holds it)."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    # what only a reference cycle still holds (a model's DDP wrapper, a collective's work) is
    # freed now, while the group and the interpreter are whole: freed during interpreter exit,
    # gloo's teardown can abort the process (pytorch#190489); bounded, as a finaliser may wait
    # on a peer that is gone
    faulthandler.dump_traceback_later(timeout_s, exit=True)
    try:
        gc.collect()
    finally:
        faulthandler.cancel_dump_traceback_later()
    if wait:
        dist.barrier()  # bounded by the process group's timeout
    faulthandler.dump_traceback_later(timeout_s, exit=True)
    try:
        dist.destroy_process_group()
    finally:
        faulthandler.cancel_dump_traceback_later()


class Policy(torch.nn.Module):
    """The trainable forward, per-token log-probs of the responses, as one module: DDP wraps
    it, or FSDP2 makes it the root, so that every call the trainer makes (update, pi_old, MoE
    routing) runs through the wrapper's hooks.

    sync_max: set when the model is sharded; token_logprobs then agrees with the other ranks
    on how many response columns to compute and whether prompts are shared, because a sharded
    layer's forward is a collective and every rank must make the same sequence of calls.
    """

    def __init__(self, model: torch.nn.Module, compute_dtype: torch.dtype | None = None):
        super().__init__()
        self.model = model
        self.sync_max = None
        # mixed precision by autocast (one process, DDP): the matmuls' dtype; None = the
        # weights' own (float32, bf16-true, or FSDP2's MixedPrecisionPolicy, which casts them)
        self.compute_dtype = compute_dtype
        # names of tied aliases (e.g. lm_head.weight = embed_tokens.weight), found while the
        # tensors are still plain: a gathered state dict lists them as separate copies
        seen, self.aliases = set(), set()
        for k, v in model.state_dict(keep_vars=True).items():
            (self.aliases.add(k) if v.data_ptr() in seen else seen.add(v.data_ptr()))

    def forward(self, input_ids, attention_mask, n_response: int, temperature: float = 1.0,
                chunk_size: int = 1024, with_entropy: bool = False, share_prompts: bool = True):
        from gspo.logprobs import token_logprobs
        with (torch.autocast(input_ids.device.type, dtype=self.compute_dtype)
              if self.compute_dtype is not None else nullcontext()):
            return token_logprobs(self.model, input_ids, attention_mask, n_response, temperature,
                                  chunk_size, with_entropy, share_prompts=share_prompts,
                                  sync_max=self.sync_max)


def fsdp_available() -> bool:
    try:
        from torch.distributed.fsdp import fully_shard  # noqa: F401  (torch >= 2.6)
    except ImportError:
        return False
    return True


def wrap_policy(model: torch.nn.Module, d: Dist, mode: str = "ddp",
                compute_dtype: torch.dtype | None = None) -> Policy | torch.nn.Module:
    """Policy(model); on several ranks sharded with FSDP2 (mode "fsdp") or inside DDP.

    compute_dtype: mixed precision's matmul dtype (None: the weights' own). One process and
    DDP: autocast in Policy.forward. FSDP2: a MixedPrecisionPolicy, parameters gathered in
    compute_dtype and gradients reduce-scattered in float32 into the float32 shards.
    Under FSDP2 the parameters become DTensor shards in place: build the optimiser after this.
    """
    policy = Policy(model, compute_dtype if mode != "fsdp" or not d.enabled else None)
    if not d.enabled:
        return policy
    if mode == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        mesh = init_device_mesh(d.device.type, (d.world,))
        mp = (MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
              if compute_dtype is not None else MixedPrecisionPolicy())
        for layer in model.get_decoder().layers:
            fully_shard(layer, mesh=mesh, mp_policy=mp)
        fully_shard(policy, mesh=mesh, mp_policy=mp)
        # a parameter no token of this rank used (an idle expert) still joins the reduce-scatter
        policy.set_reduce_scatter_unused_params(True)
        policy.sync_max = lambda values: [int(v) for v in d.max(values)]
        return policy
    ids = [d.device.index] if d.device.type == "cuda" else None
    return torch.nn.parallel.DistributedDataParallel(policy, device_ids=ids, broadcast_buffers=False)


def broadcast_weights(model: torch.nn.Module, d: Dist) -> None:
    """Give every rank rank 0's weights (FSDP2 does not broadcast, and a warm-up on a GPU need
    not be bit-identical across ranks); call before taking copies of the model."""
    if d.enabled:
        with torch.no_grad():
            for t in model.state_dict().values():
                dist.broadcast(t, src=0)


def is_sharded(policy: torch.nn.Module) -> bool:
    return isinstance(policy, Policy) and policy.sync_max is not None


@contextmanager
def no_sync(policy: torch.nn.Module, skip: bool):
    """Accumulate gradients locally (no all-reduce / reduce-scatter) for all but a minibatch's
    last micro-batch."""
    if skip and isinstance(policy, torch.nn.parallel.DistributedDataParallel):
        with policy.no_sync():
            yield
    elif skip and is_sharded(policy):
        policy.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            policy.set_requires_gradient_sync(True)
    else:
        yield


def as_local(x):
    """A plain tensor from a (replicated) DTensor, e.g. clip_grad_norm_'s total norm under FSDP."""
    return x.full_tensor() if hasattr(x, "full_tensor") else x


def full_weights(policy: torch.nn.Module, model: torch.nn.Module, main_only: bool = False
                 ) -> dict[str, torch.Tensor]:
    """The model's whole state dict (model's own key names). Sharded: gathered, a collective on
    every rank; with main_only, only rank 0 receives it (CPU copies) and the others get {}."""
    if not is_sharded(policy):
        return model.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    sd = get_model_state_dict(policy, options=StateDictOptions(full_state_dict=True,
                                                               cpu_offload=main_only))
    return {k.removeprefix("model."): v for k, v in sd.items()}


def iter_weights(policy: torch.nn.Module, model: torch.nn.Module
                 ) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, whole tensor) for the rollout engine, one at a time. Sharded: each tensor is
    all-gathered when it is asked for, so the extra memory is one tensor, not a second model;
    every rank must consume the whole iterator (each step is a collective)."""
    if not is_sharded(policy):
        yield from model.state_dict().items()
        return
    for name, t in policy.state_dict().items():
        name = name.removeprefix("model.")
        if name not in policy.aliases:  # a tied weight is gathered once
            yield name, as_local(t)


def checkpoint_state(policy: torch.nn.Module, model: torch.nn.Module,
                     optimizer: torch.optim.Optimizer) -> tuple[dict | None, dict | None]:
    """(weights, optimizer state) for save_checkpoint: None, None when the model is not sharded
    (the checkpoint then reads model and optimizer itself); sharded: gathered on rank 0, tied
    aliases dropped as save_pretrained drops them. A collective: call it on every rank."""
    if not is_sharded(policy):
        return None, None
    weights = full_weights(policy, model, main_only=True)
    weights = {k: v for k, v in weights.items() if k not in policy.aliases}
    return weights, full_optimizer_state(policy, optimizer)


def full_optimizer_state(policy: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """optimizer.state_dict(), in the single-process layout (states keyed by parameter index)
    whatever the sharding; sharded: gathered on rank 0 (a collective; the others get {})."""
    if not is_sharded(policy):
        return optimizer.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
    osd = get_optimizer_state_dict(policy, optimizer, options=StateDictOptions(
        full_state_dict=True, cpu_offload=True))
    if not osd:
        return {}
    index = {name: i for i, name in enumerate(n for g in osd["param_groups"] for n in g["params"])}
    return {"state": {index[n]: v for n, v in osd["state"].items()},
            "param_groups": [{**g, "params": [index[n] for n in g["params"]]}
                             for g in osd["param_groups"]]}


def load_optimizer_state(policy: torch.nn.Module, optimizer: torch.optim.Optimizer,
                         state: dict) -> None:
    """Load a single-process optimizer.state_dict() (as checkpoints hold it) into `optimizer`,
    sharding it when the model is sharded."""
    if not is_sharded(policy):
        optimizer.load_state_dict(state)
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict
    # the optimiser's parameter order is the model's: index i <-> the i-th parameter's name
    names = [n for n, _ in policy.named_parameters()]
    by_name = {"state": {names[i]: v for i, v in state["state"].items()},
               "param_groups": [{**g, "params": [names[i] for i in g["params"]]}
                                for g in state["param_groups"]]}
    set_optimizer_state_dict(policy, optimizer, by_name,
                             options=StateDictOptions(full_state_dict=True))
