"""What one training run holds (`Run`, built once by gspo.trainer.build_run) and what it
returns (`Summary`). The trainer, the step (gspo.step) and callbacks all work on a Run."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
import transformers

from gspo.async_rollouts import AsyncSampler
from gspo.callbacks import Callbacks
from gspo.config import Config
from gspo.distributed import Dist, Policy, iter_weights
from gspo.engines import RolloutEngine
from gspo.lora import is_lora, merged_weights
from gspo.moe import MoeRouting, NoRouting
from gspo.rewards import RewardFn


@dataclass
class Summary:
    run_dir: Path
    start_accuracy: float | None
    final_accuracy: float | None
    warmup_s: float
    rl_s: float
    peak_rss_mb: float
    steps: int


@dataclass(kw_only=True)
class Run:
    """Everything one training run holds, built once by :func:`build_run`."""
    cfg: Config
    run_dir: Path
    dist: Dist                               # rank / world size (1 without torchrun)
    model: torch.nn.Module                   # this rank's training model (sharded under FSDP2)
    policy: torch.nn.Module                  # the model's log-prob forward: DDP / FSDP2 on >1 rank
    tokenizer: transformers.PreTrainedTokenizerBase
    engine: RolloutEngine
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    train_rows: list[dict]
    eval_rows: list[dict]
    reward_fn: RewardFn
    eval_reward_fn: RewardFn                 # held-out evaluation's: reward_fn without its format
                                             # bonus (gspo.data.correctness_only)
    solution: Callable[[dict], str]          # a row's worked answer, for the warm-up
    ref_policy: Policy | None                # pi_ref, unsharded, when algorithm.beta > 0
    routing: MoeRouting | NoRouting          # record / replay / measure MoE routing
    gen: torch.Generator                     # minibatch shuffling
    scaler: torch.amp.GradScaler | None      # fp16-mixed's dynamic loss scale
    micro: int                               # rows per forward (algorithm.micro_batch_size),
                                             # unless train.max_tokens_per_micro packs them
    checkpoint: Path | None                  # the checkpoint resumed from
    state: dict                              # its training state (step, accuracies, RNG)
    record: dict                             # what the run is (gspo.runrecord), saved with each
                                             # checkpoint
    sampler: AsyncSampler | None = None      # rollout.max_staleness >= 1
    threads: int | None = None               # torch's threads before the sampler halved them
    callbacks: Callbacks = field(default_factory=Callbacks)  # observers (gspo.callbacks)
    warmup_s: float = 0.0
    reward_window: list = field(default_factory=list)  # (completions, failures) of recent steps
    constant_reward_steps: int = 0           # consecutive steps whose rewards were all equal
    warned: set = field(default_factory=set)  # what the run has said once already

    @property
    def start_step(self) -> int:
        return int(self.state.get("step", 0))


def policy_weights(policy, model):
    """(name, tensor) of the policy as a plain model, for the rollout engine and pi_ref: LoRA's
    merged weights, else the model's own (gathered one at a time when sharded)."""
    return merged_weights(model) if is_lora(model) else iter_weights(policy, model)
