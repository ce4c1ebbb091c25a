"""torch.distributed for data parallelism, launched by torchrun. No custom cluster code.

    torchrun --nproc_per_node 2 -m gspo train ...            (2 CPU processes, gloo)
    torchrun --nnodes 2 --node_rank R --rdzv_endpoint HOST:PORT --nproc_per_node 8 -m gspo train

A single process without torchrun is the default and needs no process group. Each rank samples
the groups of its own share of the step's prompts (whole groups stay on one rank, so group
advantages need no communication); the trainer normalises every loss by the GLOBAL count of
sequences (or tokens) in the minibatch and scales it by the world size, so DDP's gradient
average equals the full-batch gradient. Metrics are reduced as sums over ranks, then divided.

What is left out: FSDP2 sharding. `fully_shard` runs on this torch, but our memory-frugal
log-prob pass calls the decoder directly (bypassing the root module's forward that gathers
the shared embedding) and every rank decodes for its own number of steps, while a sharded
model needs all ranks in every forward; both need reworking before FSDP2 can replace DDP.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Dist:
    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world > 1

    def sum(self, values: list[float]) -> list[float]:
        """Element-wise sum over ranks (float64, so counts stay exact)."""
        if not self.enabled:
            return list(values)
        t = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return t.tolist()

    def min_max(self, lo: float, hi: float) -> tuple[float, float]:
        if not self.enabled:
            return lo, hi
        t = torch.tensor([lo, -hi], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return float(t[0]), -float(t[1])

    def barrier(self) -> None:
        if self.enabled:
            dist.barrier()


def init_distributed() -> Dist:
    """Join the process group torchrun describes in the environment (gloo on CPU, NCCL on
    GPU); without torchrun, a single-process Dist."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return Dist()
    if not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend)
    return Dist(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", "0")))


def shutdown(d: Dist) -> None:
    if d.enabled and dist.is_initialized():
        dist.destroy_process_group()


class Policy(torch.nn.Module):
    """The trainable forward, per-token log-probs of the responses, as one module so that DDP
    wraps the call the update pass makes (and synchronises its gradients)."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask, n_response: int, temperature: float,
                chunk_size: int, share_prompts: bool = True):
        from gspo.models import token_logprobs
        return token_logprobs(self.model, input_ids, attention_mask, n_response, temperature,
                              chunk_size, share_prompts=share_prompts)


def wrap_policy(model: torch.nn.Module, d: Dist) -> torch.nn.Module:
    """Policy(model), inside DistributedDataParallel when there are several ranks."""
    policy = Policy(model)
    if not d.enabled:
        return policy
    return torch.nn.parallel.DistributedDataParallel(policy, broadcast_buffers=False)


@contextmanager
def no_sync(policy: torch.nn.Module, skip: bool):
    """Accumulate gradients locally (no all-reduce) for all but a minibatch's last micro-batch."""
    if skip and isinstance(policy, torch.nn.parallel.DistributedDataParallel):
        with policy.no_sync():
            yield
    else:
        yield
