"""The `hf` rollout engine: a lean batched decode loop over a transformers causal LM.

Left-padded prompts, temperature, top-p, per-row stop at the stop tokens, and one uniform per
(row, step) drawn up front from a seeded `torch.Generator`, so the same seed gives the same
rollouts. Its fast path (`FastDecoder`) runs each distinct prompt's prefill once, decodes on a
preallocated KV cache with a lean per-step forward, and drops finished rows from the batch.

An engine sees token ids only: no text, no rewards, no optimiser. What is left out: top-k,
repetition penalties, stop strings, and continuous batching (no new rows join a running batch).
"""

from __future__ import annotations

import copy
import inspect
from typing import Callable, Iterable

import torch
from transformers import DynamicCache

from gspo.engines.base import (EngineSettings, Rollouts, SamplingParams, left_pad,
                               stop_token_ids)
from gspo.engines.fast_decoder import FastDecoder
from gspo.logprobs import cache_kwarg, position_ids_from_mask
from gspo.weights import copy_weights_


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
    logits: torch.Tensor, params: SamplingParams, u: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row from logits (B, V) by inverse CDF at uniforms u (B,) in [0, 1).

    Returns tokens (B,) and their log-probs (B,). A row's token depends on its own logits and
    u alone, never on the other rows, so dropping finished rows from the batch changes nothing.
    """
    z = logits.float()
    if params.temperature == 0:
        token = z.argmax(-1)  # (B,)
    else:
        z = z / params.temperature
    lse = torch.logsumexp(z, dim=-1)  # (B,), before top-p: see Rollouts
    if params.temperature != 0:
        kept = top_p_filter(z, params.top_p)
        cdf = (kept - kept.max(-1, keepdim=True).values).exp_().cumsum_(-1)  # (B, V)
        # the first token whose cumulative mass exceeds u * total; zero-mass tokens never are
        token = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True).squeeze(-1)
        token = token.clamp_(max=z.shape[-1] - 1)
    return token, z.gather(-1, token[:, None]).squeeze(-1) - lse


def has_hooks(model: torch.nn.Module) -> bool:
    """Whether forward hooks watch the model's modules (e.g. MoE routing recorders), which expect
    every forward to see the whole batch: then no row is shared or dropped. Global module hooks
    (profilers, FLOP counters) do not count, nor do transformers' own output-capturing hooks,
    which stay on a model once a forward asked for router logits or attentions
    (output_router_logits=true in a MoE config) and collect each forward's outputs, whatever
    rows it holds."""
    return any(getattr(hook, "__module__", None) != "transformers.utils.output_capturing"
               for m in model.modules()
               for hook in (*m._forward_hooks.values(), *m._forward_pre_hooks.values()))


class HFEngine:
    """Rollouts from a transformers causal LM, by default the very module the trainer updates.

    `fast` (default): where the architecture is one `FastDecoder` knows (Qwen3, Qwen3-MoE,
    Qwen2, Llama, Mistral with full attention and static RoPE), run each distinct prompt's
    prefill once, decode with a preallocated KV cache and a lean per-step forward, and drop
    finished rows from the batch. Same tokens and log-probs as the plain loop (`fast=False`: one
    transformers forward per step over every row, with a growing `DynamicCache`).
    """

    records_routing = True  # the sampler is a torch module: its routers can be hooked
    single_process = False
    requires = None
    tensor_parallel = False
    logp_before_top_p = True

    @classmethod
    def settings(cls, rollout, routing_replay: bool = False) -> EngineSettings:
        """No rollout.* settings of its own; it shares the trainer's weights where it can, and
        its KV cache grows with the batch."""
        return EngineSettings(own_copy=False, kv_cache=True)

    def __init__(self, model, eos_token_ids: list[int] | None = None, pad_token_id: int | None = None,
                 fast: bool = True):
        self.model = model
        self.eos_token_ids = list(eos_token_ids) if eos_token_ids is not None else stop_token_ids(model)
        pad = pad_token_id if pad_token_id is not None else model.config.pad_token_id
        self.pad_token_id = pad if pad is not None else self.eos_token_ids[0]
        self.fast = fast
        # called before each forward of a decode (the asynchronous sampler's `CoreShare` takes
        # its thread count there): a plain attribute, not a module hook, which would turn off
        # the fast decoder's shared prefill (see has_hooks)
        self.on_step: Callable[[], None] | None = None
        self._cache_kwarg = cache_kwarg(model)
        params = inspect.signature(model.forward).parameters
        self._keep_kwarg = {"logits_to_keep": 1} if "logits_to_keep" in params else {}

    @classmethod
    def from_model(cls, model, tokenizer, *, dtype: str = "float32", seed: int = 0,
                   own_copy: bool = False) -> "HFEngine":
        """Shares the training model unless it samples in another dtype or needs its own copy
        (the training model is about to be sharded)."""
        shared = getattr(torch, dtype) == next(model.parameters()).dtype and not own_copy
        sampler = model if shared else copy.deepcopy(model).to(getattr(torch, dtype))
        return cls(sampler, eos_token_ids=stop_token_ids(model, tokenizer),
                   pad_token_id=tokenizer.pad_token_id)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy each tensor in, unless it already is this model's own (the default setup)."""
        copy_weights_(self.model, weights)

    def sleep(self) -> None:
        """Nothing to give back: the engine samples from the trainer's model or its own copy."""

    def close(self) -> None:
        """Nothing to release: the sampler is a plain module."""

    def generate(self, prompts: list[list[int]], n: int, params: SamplingParams, seed: int) -> Rollouts:
        """n samples per prompt, prompt-major; eval mode during decoding, the previous mode after."""
        if any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.inference_mode():
                rows = [p for p in prompts for _ in range(n)]
                if self.fast and FastDecoder.supports(self.model):
                    rollouts = self._decode_fast(rows, params, seed)
                else:
                    rollouts = self._decode(rows, params, seed)
        finally:
            self.model.train(was_training)
        # Inference tensors cannot be saved for backward; plain copies can enter the training graph.
        return Rollouts(**{k: v.clone() for k, v in vars(rollouts).items() if v is not None})

    def _forward(self, ids, mask, cache):
        if self.on_step is not None:
            self.on_step()
        out = self.model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=position_ids_from_mask(mask)[:, -ids.shape[1] :],
            use_cache=True,
            **{self._cache_kwarg: cache},
            **self._keep_kwarg,
        )
        return out.logits[:, -1]  # (B, V): the next-token logits

    def _start(self, prompts: list[list[int]], params: SamplingParams, seed: int):
        device = next(self.model.parameters()).device
        prompt_ids, prompt_mask = (t.to(device) for t in left_pad(prompts, self.pad_token_id))
        generator = torch.Generator(device=device).manual_seed(seed)
        # one uniform per (row, step), drawn up front: a row's samples never depend on the others
        u = torch.rand((len(prompts), params.max_new_tokens), generator=generator, device=device)
        return prompt_ids, prompt_mask, u, torch.tensor(self.eos_token_ids, device=device)

    def _decode(self, prompts: list[list[int]], params: SamplingParams, seed: int) -> Rollouts:
        """The plain loop: a transformers forward per step over every row."""
        prompt_ids, prompt_mask, u, eos = self._start(prompts, params, seed)
        cache = DynamicCache(config=self.model.config)
        mask = prompt_mask  # (B, Lp + t), grows by one column per step
        logits = self._forward(prompt_ids, mask, cache)  # (B, V)
        alive = torch.ones(len(prompts), dtype=torch.bool, device=u.device)  # (B,)
        tokens, logps, masks = [], [], []
        for step in range(params.max_new_tokens):
            token, logp = sample_next(logits, params, u[:, step])
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

    def _decode_fast(self, prompts: list[list[int]], params: SamplingParams, seed: int) -> Rollouts:
        """Shared prefill, static KV cache, lean steps, finished rows dropped (see the class)."""
        prompt_ids, prompt_mask, u, eos = self._start(prompts, params, seed)
        B, Lp = prompt_ids.shape
        T_max = params.max_new_tokens
        hooked = has_hooks(self.model)  # hooks must see every row in every forward
        # ---- prefill, once per distinct prompt
        first, inverse = _distinct_rows(prompts, hooked, prompt_ids.device)
        cache = DynamicCache(config=self.model.config)
        logits = self._forward(prompt_ids[first], prompt_mask[first], cache)[inverse]  # (B, V)
        dec = FastDecoder(self.model, cache, inverse, prompt_mask, T_max, fuse=not hooked)
        # ---- decode: `rows` are the batch rows still computed, in the order of dec's cache
        rows = torch.arange(B, device=u.device)  # (A,)
        alive = torch.ones(B, dtype=torch.bool, device=u.device)  # (A,)
        pos = prompt_mask.sum(-1)  # (A,) position of the next token of each row
        out_ids = torch.full((B, T_max), self.pad_token_id, dtype=torch.long, device=u.device)
        out_logp = torch.zeros(B, T_max, device=u.device)
        out_mask = torch.zeros(B, T_max, dtype=torch.bool, device=u.device)
        T = T_max
        for step in range(T_max):
            token, logp = sample_next(logits, params, u[rows, step])
            out_ids[rows, step] = token.masked_fill(~alive, self.pad_token_id)
            out_logp[rows, step] = logp.masked_fill(~alive, 0.0)
            out_mask[rows, step] = alive  # the eos token itself is still part of the response
            alive &= ~torch.isin(token, eos)
            n_alive = int(alive.sum())
            if n_alive == 0 or step == T_max - 1:
                T = step + 1
                break
            if not hooked and n_alive <= 0.75 * len(rows):  # drop the finished rows
                keep = alive.nonzero().squeeze(1)
                rows, token, pos, alive = rows[keep], token[keep], pos[keep], alive[keep]
                dec.keep(keep)
            if self.on_step is not None:
                self.on_step()
            logits = dec.step(token, pos, Lp + step)
            pos = pos + 1
        return Rollouts(
            prompt_ids=prompt_ids,
            prompt_mask=prompt_mask,
            response_ids=out_ids[:, :T],  # (B, T)
            response_mask=out_mask[:, :T].float(),  # (B, T)
            logp=out_logp[:, :T],  # (B, T)
        )


def _distinct_rows(prompts: list[list[int]], hooked: bool, device):
    """(first, inverse): a row per distinct prompt, and each row's prompt; identity when hooked."""
    if hooked:
        idx = torch.arange(len(prompts), device=device)
        return idx, idx
    seen: dict[tuple, int] = {}
    first, inverse = [], []
    for i, p in enumerate(prompts):
        key = tuple(p)
        if key not in seen:
            seen[key] = len(first)
            first.append(i)
        inverse.append(seen[key])
    return torch.tensor(first, device=device), torch.tensor(inverse, device=device)

