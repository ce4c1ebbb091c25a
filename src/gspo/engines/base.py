"""The engine contract: what every rollout engine takes and returns.

- `SamplingParams`: how to sample; `Rollouts`: the padded batch every engine returns (`select`:
  some of its rows; `Rollouts.cat`: batches of other widths joined).
- `RolloutEngine`: the Protocol (`generate`, `load_weights`, and the capability attributes).
- `EngineSettings`: what an engine class makes of the run's rollout settings (its `settings`).
- `left_pad` / `right_pad` / `to_rollouts`: per-row lists into padded tensors.
- `stop_token_ids`: the one set of tokens that ends a response, for every engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Protocol

import torch


@dataclass
class SamplingParams:
    """How to sample each response."""

    temperature: float = 1.0
    """Softmax temperature; 0 means greedy (argmax) decoding."""
    top_p: float = 1.0
    """Nucleus sampling: sample from the smallest set of tokens whose probability reaches top_p."""
    max_new_tokens: int = 32
    """Most tokens per response, eos included."""

    def __post_init__(self):
        if not self.temperature >= 0:  # NaN too
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")


@dataclass
class Rollouts:
    """B = n_prompts * n sampled responses, laid out prompt-major: [p0s0, p0s1, ..., p1s0, ...].

    `logp` is the sampler's log-prob of each sampled token under the temperature-scaled
    distribution, softmax(logits / temperature), taken BEFORE top-p truncation: that is the
    distribution `token_logprobs(..., temperature)` recomputes, so the two agree and the
    rollout log-probs can serve as pi_old. (With top_p < 1 the tokens were drawn from the
    truncated distribution; the untruncated log-prob is the policy's likelihood we optimise.)
    For greedy decoding (temperature 0) `logp` is taken under temperature 1.
    """

    prompt_ids: torch.Tensor
    """(B, Lp) long, left-padded with the pad id."""
    prompt_mask: torch.Tensor
    """(B, Lp) long, 1 on real prompt tokens."""
    response_ids: torch.Tensor
    """(B, T) long, right-padded with the pad id after each row's eos."""
    response_mask: torch.Tensor
    """(B, T) float, 1 on every generated token up to and including eos, 0 after."""
    logp: torch.Tensor
    """(B, T) float, the sampler's log-prob of each response token (see above), 0 where masked."""
    routing: list[torch.Tensor] | None = None
    """MoE only, from an engine that reports its routing (`returns_routing`): per router layer a
    (B, Lp + T - 1, k) long tensor of the experts each decoder input position was routed to
    while sampling (position j predicts token j + 1; padding positions hold expert 0)."""

    @property
    def input_ids(self) -> torch.Tensor:
        return torch.cat([self.prompt_ids, self.response_ids], dim=1)  # (B, Lp + T)

    @property
    def attention_mask(self) -> torch.Tensor:
        return torch.cat([self.prompt_mask, self.response_mask.long()], dim=1)  # (B, Lp + T)

    @property
    def response_lengths(self) -> torch.Tensor:
        return self.response_mask.sum(-1).long()  # (B,)

    def to(self, device: torch.device) -> "Rollouts":
        """The same rollouts on `device` (self when already there)."""
        if self.response_ids.device == torch.device(device):
            return self
        moved = {k: v.to(device) for k, v in vars(self).items() if isinstance(v, torch.Tensor)}
        routing = None if self.routing is None else [x.to(device) for x in self.routing]
        return Rollouts(**moved, routing=routing)

    def select(self, rows: torch.Tensor) -> "Rollouts":
        """Rows `rows` (a long index tensor), in that order, at the same widths."""
        picked = {k: v[rows] for k, v in vars(self).items() if isinstance(v, torch.Tensor)}
        routing = None if self.routing is None else [x[rows] for x in self.routing]
        return Rollouts(**picked, routing=routing)

    @staticmethod
    def cat(parts: list["Rollouts"], pad_id: int) -> "Rollouts":
        """The rows of `parts` one after the other (each part's layout, prompt-major, kept),
        padded to the widest prompt (on the left) and response (on the right): new prompt and
        response positions hold pad_id under mask 0, log-prob 0, and routing expert 0. The
        routing of all parts or of none."""
        if not parts:
            raise ValueError("Rollouts.cat needs at least one part")
        if len({p.routing is None for p in parts}) > 1:
            raise ValueError("Rollouts.cat: some parts carry MoE routing and others do not")
        Lp = max(p.prompt_ids.shape[1] for p in parts)
        T = max(p.response_ids.shape[1] for p in parts)

        def widen(x: torch.Tensor, left: int, right: int, value) -> torch.Tensor:
            # along dim 1, the positions (F.pad lists the last dim first: routing's top-k)
            pad = (0, 0) * (x.dim() - 2) + (left, right)
            return torch.nn.functional.pad(x, pad, value=value) if left or right else x

        out = {}
        for name, value, side in (("prompt_ids", pad_id, "left"), ("prompt_mask", 0, "left"),
                                  ("response_ids", pad_id, "right"),
                                  ("response_mask", 0, "right"), ("logp", 0, "right")):
            out[name] = torch.cat([
                widen(getattr(p, name), Lp - p.prompt_ids.shape[1] if side == "left" else 0,
                      T - p.response_ids.shape[1] if side == "right" else 0, value)
                for p in parts])
        routing = None
        if parts[0].routing is not None:
            # decoder position j predicts token j + 1: Lp + T - 1 positions, the prompt's
            # padding on the left, the response's on the right
            routing = [torch.cat([widen(p.routing[layer], Lp - p.prompt_ids.shape[1],
                                        T - p.response_ids.shape[1], 0) for p in parts])
                       for layer in range(len(parts[0].routing))]
        return Rollouts(**out, routing=routing)


@dataclass(frozen=True)
class EngineSettings:
    """What an engine makes of the run's settings: the options of its `from_model`, and what
    `gspo train --dry-run` counts of its memory. Each engine class reads its own config keys in
    its `settings(rollout, routing_replay)`, so nothing outside gspo.engines reads them."""

    options: dict = field(default_factory=dict)
    """keyword options of its `from_model`"""
    own_copy: bool = False
    """whether it always holds its own copy of the weights (else only where the trainer's
    cannot be shared: FSDP shards, LoRA, another dtype)"""
    shards: int = 1
    """the ranks its copy of the weights is split over (tensor parallelism)"""
    kv_cache: bool = True
    """whether its KV cache grows with the rank's sequences (the dry run counts it at full
    length); False where it lives inside `gpu_share`"""
    gpu_share: float = 0.0
    """the fraction of a GPU's memory it reserves for itself on a GPU, its weights and KV cache
    inside (0: it allocates as it goes)"""
    sleeps: str = ""
    """where it gives back its memory from the end of sampling to the next `load_weights`
    (`sleep`), so that it cannot sample while the trainer updates: the setting that makes it
    (for messages); "" where it never sleeps"""
    memory_note: str = ""
    """what the dry run says of its memory beside its copy of the weights"""


class RolloutEngine(Protocol):
    """Anything that samples responses to token-id prompts and can take new policy weights.

    Capabilities are attributes, so the trainer asks instead of checking types."""

    records_routing: bool
    """Whether the MoE routing it samples with reaches the trainer (Routing Replay with
    old_logprobs=rollout): through hooks on `model`, an in-process torch module, or as
    `Rollouts.routing` when `returns_routing` is true (R3: vLLM's recorded experts)."""

    single_process: bool
    """Whether it runs only in a process of its own, not on the ranks of a torchrun launch."""

    requires: str | None
    """The package it imports when it starts (None: nothing beyond gspo's own dependencies);
    `gspo train --dry-run` checks for it."""

    tensor_parallel: bool
    """Whether rollout.tensor_parallel_size > 1 can split one engine over several ranks."""

    logp_before_top_p: bool
    """Whether `Rollouts.logp` is taken before top-p truncation, as the contract asks (see
    Rollouts); an engine that returns the truncated distribution's says False, and a run with
    top_p < 1 and its log-probs as pi_old is warned."""

    @classmethod
    def settings(cls, rollout, routing_replay: bool = False) -> EngineSettings:
        """Its options and memory profile from a RolloutConfig (the engine's own rollout.* keys)
        and whether Routing Replay is on; ValueError for settings it cannot take."""
        ...

    def generate(self, prompts: list[list[int]], n: int, params: SamplingParams, seed: int) -> Rollouts:
        """n samples per prompt, prompt-major; the same seed gives the same rollouts."""
        ...

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Make the sampler's policy equal to these (name, tensor) pairs, transformers' names;
        consumed one at a time, so a producer may gather each tensor only when it is asked."""
        ...

    def sleep(self) -> None:
        """Give back the accelerator memory the engine holds (weights, KV cache) until the next
        `load_weights`, which must come before the next `generate`; a no-op where there is
        nothing to give back."""
        ...

    def close(self) -> None:
        """Release what the engine holds (a vLLM engine, its temporary files); idempotent."""
        ...


def left_pad(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack token-id lists into left-padded ids (B, Lp) and mask (B, Lp)."""
    Lp = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), Lp), pad_id, dtype=torch.long)  # (B, Lp)
    mask = torch.zeros((len(prompts), Lp), dtype=torch.long)  # (B, Lp)
    for i, p in enumerate(prompts):
        if p:
            ids[i, Lp - len(p) :] = torch.tensor(p, dtype=torch.long)
            mask[i, Lp - len(p) :] = 1
    return ids, mask


def right_pad(seqs: list[list], pad, dtype: torch.dtype = torch.long, min_len: int = 0
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack lists into right-padded values (B, T) and a float mask (B, T), T >= min_len."""
    T = max(min_len, max(len(s) for s in seqs))
    out = torch.full((len(seqs), T), pad, dtype=dtype)  # (B, T)
    mask = torch.zeros(len(seqs), T)  # (B, T)
    for i, s in enumerate(seqs):
        if s:
            out[i, :len(s)] = torch.tensor(s, dtype=dtype)
            mask[i, :len(s)] = 1
    return out, mask



def to_rollouts(prompts: list[list[int]], responses: list[list[int]], logps: list[list[float]],
                pad_id: int) -> Rollouts:
    """Pad per-row prompt / response / log-prob lists into a Rollouts batch."""
    prompt_ids, prompt_mask = left_pad(prompts, pad_id)  # (B, Lp)
    response_ids, response_mask = right_pad(responses, pad_id, min_len=1)  # (B, T)
    logp, _ = right_pad(logps, 0.0, dtype=torch.float32, min_len=1)  # (B, T)
    return Rollouts(prompt_ids, prompt_mask, response_ids, response_mask, logp)


def stop_token_ids(model, tokenizer=None) -> list[int]:
    """Every token that ends a response, for every engine: the generation config's eos ids
    (Qwen lists several, e.g. <|im_end|> and <|endoftext|>), else the model config's, and the
    tokenizer's eos."""
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if eos is None:
        eos = getattr(model.config, "eos_token_id", None)
    eos = [eos] if isinstance(eos, int) else list(eos or [])
    if tokenizer is not None and tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in eos:
        eos.append(tokenizer.eos_token_id)
    if not eos:
        raise ValueError("the model has no eos_token_id and no tokenizer eos: pass the stop "
                         "token ids to the engine")
    return eos
