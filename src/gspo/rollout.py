"""Rollout engines: sample n responses per prompt and return token ids with their log-probs.

What is here:

- `SamplingParams`, `Rollouts` (the batch every engine returns) and the `RolloutEngine` Protocol.
- `HFEngine`: a lean batched decode loop over a transformers causal LM with a KV cache
  (`DynamicCache`), left-padded prompts, temperature, top-p, per-row stop at eos and a seeded
  `torch.Generator`, so the same seed gives the same rollouts.

An engine sees token ids only: no text, no rewards, no optimiser. What is left out: top-k,
repetition penalties, stop strings, and continuous batching (rows that finish keep their slot,
fed pad tokens, until the whole batch is done).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Protocol

import torch
from transformers import DynamicCache

from gspo.models import position_ids_from_mask


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
        if self.temperature < 0:
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

    @property
    def input_ids(self) -> torch.Tensor:
        return torch.cat([self.prompt_ids, self.response_ids], dim=1)  # (B, Lp + T)

    @property
    def attention_mask(self) -> torch.Tensor:
        return torch.cat([self.prompt_mask, self.response_mask.long()], dim=1)  # (B, Lp + T)

    @property
    def response_lengths(self) -> torch.Tensor:
        return self.response_mask.sum(-1).long()  # (B,)


class RolloutEngine(Protocol):
    """Anything that samples responses to token-id prompts and can take new policy weights."""

    def generate(self, prompts: list[list[int]], n: int, params: SamplingParams, seed: int) -> Rollouts:
        """n samples per prompt, prompt-major; the same seed gives the same rollouts."""
        ...

    def load_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Make the sampler's policy equal to these weights."""
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


def top_p_filter(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Set to -inf the logits outside the nucleus; the most likely token is always kept."""
    if top_p >= 1.0:
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)  # (B, V)
    probs = sorted_logits.softmax(dim=-1)
    # Drop a token when the tokens before it already reach top_p.
    drop_sorted = (probs.cumsum(-1) - probs) >= top_p  # (B, V)
    drop = drop_sorted.scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def sample_next(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row from logits (B, V); return tokens (B,) and their log-probs (B,)."""
    logits = logits.float()
    if params.temperature == 0:
        token = logits.argmax(-1)  # (B,)
        logp_all = logits.log_softmax(-1)
    else:
        logits = logits / params.temperature
        logp_all = logits.log_softmax(-1)  # (B, V), before top-p: see Rollouts
        probs = top_p_filter(logits, params.top_p).softmax(-1)
        token = torch.multinomial(probs, 1, generator=generator).squeeze(-1)  # (B,)
    return token, logp_all.gather(-1, token[:, None]).squeeze(-1)


def _eos_ids(model) -> list[int]:
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if eos is None:
        eos = model.config.eos_token_id
    if eos is None:
        raise ValueError("model has no eos_token_id: pass eos_token_ids to HFEngine")
    return [eos] if isinstance(eos, int) else list(eos)


class HFEngine:
    """Rollouts from a transformers causal LM, by default the very module the trainer updates."""

    def __init__(self, model, eos_token_ids: list[int] | None = None, pad_token_id: int | None = None):
        self.model = model
        self.eos_token_ids = list(eos_token_ids) if eos_token_ids is not None else _eos_ids(model)
        pad = pad_token_id if pad_token_id is not None else model.config.pad_token_id
        self.pad_token_id = pad if pad is not None else self.eos_token_ids[0]
        # transformers 5.x renamed forward's `past_key_values` to `cache` (the old name warns).
        params = inspect.signature(model.forward).parameters
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"
        self._keep_kwarg = {"logits_to_keep": 1} if "logits_to_keep" in params else {}

    def load_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Copy weights in, unless they already are this model's own tensors (the default setup)."""
        own = self.model.state_dict()
        if all(k in own and own[k].data_ptr() == v.data_ptr() for k, v in state_dict.items()):
            return
        self.model.load_state_dict(state_dict)

    def generate(self, prompts: list[list[int]], n: int, params: SamplingParams, seed: int) -> Rollouts:
        """n samples per prompt, prompt-major; eval mode during decoding, the previous mode after."""
        if any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.inference_mode():
                rollouts = self._decode([p for p in prompts for _ in range(n)], params, seed)
        finally:
            self.model.train(was_training)
        # Inference tensors cannot be saved for backward; plain copies can enter the training graph.
        return Rollouts(**{k: v.clone() for k, v in vars(rollouts).items()})

    def _forward(self, ids, mask, cache):
        out = self.model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=position_ids_from_mask(mask)[:, -ids.shape[1] :],
            use_cache=True,
            **{self._cache_kwarg: cache},
            **self._keep_kwarg,
        )
        return out.logits[:, -1]  # (B, V): the next-token logits

    def _decode(self, prompts: list[list[int]], params: SamplingParams, seed: int) -> Rollouts:
        device = next(self.model.parameters()).device
        prompt_ids, prompt_mask = (t.to(device) for t in left_pad(prompts, self.pad_token_id))
        generator = torch.Generator(device=device).manual_seed(seed)
        eos = torch.tensor(self.eos_token_ids, device=device)
        cache = DynamicCache(config=self.model.config)

        mask = prompt_mask  # (B, Lp + t), grows by one column per step
        logits = self._forward(prompt_ids, mask, cache)  # (B, V)
        alive = torch.ones(len(prompts), dtype=torch.bool, device=device)  # (B,)
        tokens, logps, masks = [], [], []
        for step in range(params.max_new_tokens):
            token, logp = sample_next(logits, params, generator)
            token = token.masked_fill(~alive, self.pad_token_id)
            tokens.append(token)
            logps.append(logp.masked_fill(~alive, 0.0))
            masks.append(alive.clone())  # the eos token itself is still part of the response
            alive &= ~torch.isin(token, eos)
            if not alive.any() or step == params.max_new_tokens - 1:
                break
            mask = torch.cat([mask, masks[-1].long()[:, None]], dim=1)
            logits = self._forward(token[:, None], mask, cache)

        return Rollouts(
            prompt_ids=prompt_ids,
            prompt_mask=prompt_mask,
            response_ids=torch.stack(tokens, dim=1),  # (B, T)
            response_mask=torch.stack(masks, dim=1).float(),  # (B, T)
            logp=torch.stack(logps, dim=1),  # (B, T)
        )
