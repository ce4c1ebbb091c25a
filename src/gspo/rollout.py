"""Rollout engines: sample n responses per prompt and return token ids with their log-probs.

What is here:

- `SamplingParams`, `Rollouts` (the batch every engine returns) and the `RolloutEngine` Protocol.
- `HFEngine`: a lean batched decode loop over a transformers causal LM: left-padded prompts,
  temperature, top-p, per-row stop at eos, and one uniform per (row, step) drawn up front from a
  seeded `torch.Generator`, so the same seed gives the same rollouts. Its fast path
  (`FastDecoder`) runs each distinct prompt's prefill once, decodes on a preallocated KV cache
  with a lean per-step forward, and drops finished rows from the batch.

An engine sees token ids only: no text, no rewards, no optimiser. What is left out: top-k,
repetition penalties, stop strings, and continuous batching (no new rows join a running batch).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Iterable, Protocol

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from gspo.checkpoint import untied_missing
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

    def to(self, device: torch.device) -> "Rollouts":
        """The same rollouts on `device` (self when already there)."""
        if self.response_ids.device == torch.device(device):
            return self
        return Rollouts(**{k: v.to(device) for k, v in vars(self).items()})


class RolloutEngine(Protocol):
    """Anything that samples responses to token-id prompts and can take new policy weights."""

    def generate(self, prompts: list[list[int]], n: int, params: SamplingParams, seed: int) -> Rollouts:
        """n samples per prompt, prompt-major; the same seed gives the same rollouts."""
        ...

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Make the sampler's policy equal to these (name, tensor) pairs, transformers' names;
        consumed one at a time, so a producer may gather each tensor only when it is asked."""
        ...


def copy_weights_(model: torch.nn.Module, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Copy (name, tensor) pairs into `model`'s own tensors in place, one at a time (casting to
    its dtype); a tensor that already is the model's own is skipped. Every weight must be given
    once (a tied alias counts as given with the tensor it shares), with its shape."""
    own = model.state_dict()
    given = set()
    with torch.no_grad():
        for name, t in weights:
            if name not in own:
                raise KeyError(f"load_weights: '{name}' is not a weight of the "
                               f"{type(model).__name__}")
            if own[name].shape != t.shape:
                raise ValueError(f"load_weights: '{name}' has shape {tuple(t.shape)}, the model's "
                                 f"{tuple(own[name].shape)}")
            if own[name].data_ptr() != t.data_ptr():
                own[name].copy_(t)
            given.add(name)
    missing = untied_missing(model, set(own) - given, own)
    if missing:
        raise KeyError(f"load_weights: no tensor given for {sorted(missing)[:5]}")


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


def _eos_ids(model) -> list[int]:
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if eos is None:
        eos = model.config.eos_token_id
    if eos is None:
        raise ValueError("model has no eos_token_id: pass eos_token_ids to HFEngine")
    return [eos] if isinstance(eos, int) else list(eos)


def has_hooks(model: torch.nn.Module) -> bool:
    """Whether forward hooks watch the model's modules (e.g. MoE routing recorders), which expect
    every forward to see the whole batch: then no row is shared or dropped. Global module hooks
    (profilers, FLOP counters) do not count."""
    return any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


class HFEngine:
    """Rollouts from a transformers causal LM, by default the very module the trainer updates.

    `fast` (default): where the architecture is one `FastDecoder` knows (Qwen3, Qwen3-MoE,
    Qwen2, Llama, Mistral with full attention and static RoPE), run each distinct prompt's
    prefill once, decode with a preallocated KV cache and a lean per-step forward, and drop
    finished rows from the batch. Same tokens and log-probs as the plain loop (`fast=False`: one
    transformers forward per step over every row, with a growing `DynamicCache`).
    """

    def __init__(self, model, eos_token_ids: list[int] | None = None, pad_token_id: int | None = None,
                 fast: bool = True):
        self.model = model
        self.eos_token_ids = list(eos_token_ids) if eos_token_ids is not None else _eos_ids(model)
        pad = pad_token_id if pad_token_id is not None else model.config.pad_token_id
        self.pad_token_id = pad if pad is not None else self.eos_token_ids[0]
        self.fast = fast
        # transformers 5.x renamed forward's `past_key_values` to `cache` (the old name warns).
        params = inspect.signature(model.forward).parameters
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"
        self._keep_kwarg = {"logits_to_keep": 1} if "logits_to_keep" in params else {}

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy each tensor in, unless it already is this model's own (the default setup)."""
        copy_weights_(self.model, weights)

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


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class FastDecoder:
    """One-token decode steps for decoder-only transformers of the Llama family (Qwen3, Qwen3-MoE,
    Qwen2, Llama, Mistral) straight from the model's own weights, on a preallocated KV cache.

    Per layer: input RMSNorm, q/k/v projections (with Qwen3's per-head q/k norms), RoPE from a
    table built once per rollout batch, the new key/value written in place at its cache slot,
    attention of each group of query heads over its key/value head, the output projection, the
    post-attention RMSNorm and the MLP (a sparse MoE block through its own module). For a float32
    model without hooks the weights are rearranged once per batch (`_LayerPlan`): q|k|v and
    gate|up as one GEMM each, q and k normed and rotated as one tensor, the attention scale folded
    into q's norm weight. What this skips is the per-step bookkeeping of a transformers forward:
    mask construction, cache concatenation, rotary recomputation, output capture. Full attention
    and static RoPE only (`supports`); anything else decodes through the plain loop.
    """

    MODEL_TYPES = ("qwen3", "qwen3_moe", "qwen2", "llama", "mistral")

    @staticmethod
    def supports(model) -> bool:
        cfg = model.config
        if getattr(cfg, "model_type", None) not in FastDecoder.MODEL_TYPES:
            return False
        if any(t != "full_attention" for t in getattr(cfg, "layer_types", None) or []):
            return False
        if getattr(cfg, "use_sliding_window", False) or (
                cfg.model_type == "mistral" and getattr(cfg, "sliding_window", None)):
            return False
        rope = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
        if rope.get("rope_type", rope.get("type", "default")) in ("dynamic", "longrope"):
            return False
        decoder = model.get_decoder()
        return hasattr(decoder, "rotary_emb") and all(hasattr(layer, "self_attn")
                                                        for layer in decoder.layers)

    def __init__(self, model, prefill_cache: DynamicCache, inverse: torch.Tensor,
                 prompt_mask: torch.Tensor, max_new_tokens: int, fuse: bool = True):
        self.model, self.decoder = model, model.get_decoder()
        self.head = model.get_output_embeddings()
        B, Lp = prompt_mask.shape
        L = Lp + max_new_tokens
        # per layer: keys (A, kv heads, head dim, L), stored transposed so that the scores are a
        # plain (group, hd) @ (hd, S) product per row; values (A, kv heads, L, head dim)
        self.keys, self.values = [], []
        for layer in prefill_cache.layers:
            k, v = layer.keys, layer.values  # (P, kv, Lp, hd)
            K = k.new_empty((B, k.shape[1], k.shape[3], L))
            V = v.new_empty((B, v.shape[1], L, v.shape[3]))
            K[..., :Lp] = k[inverse].transpose(-1, -2)
            V[:, :, :Lp] = v[inverse]
            self.keys.append(K)
            self.values.append(V)
        dtype = self.values[0].dtype
        # additive mask over cache slots: -inf on prompt padding; response slots always count
        # (a finished row's later slots hold garbage no living row ever reads)
        self.bias = torch.zeros(B, 1, 1, L, dtype=dtype, device=prompt_mask.device)
        self.bias[:, 0, 0, :Lp].masked_fill_(prompt_mask == 0, float("-inf"))
        positions = torch.arange(L, device=prompt_mask.device)[None]  # (1, L)
        cos, sin = self.decoder.rotary_emb(self.values[0], positions)  # (1, L, hd) each
        self.cos, self.sin = cos[0], sin[0]  # (L, hd)
        # Fewer, larger kernels, prepared once per rollout batch (the weights change between
        # batches): q|k|v and gate|up as one GEMM each, Qwen3's q and k norms as one op with the
        # attention scale folded into q's weight, RoPE on q|k at once. Module hooks would miss
        # these calls, so a hooked model (fuse=False) runs its modules as they are.
        self.plans = [_LayerPlan.build(layer, dtype) if fuse else None
                      for layer in self.decoder.layers]
        half = self.sin.shape[-1] // 2
        # rotate_half(x) * sin == roll(x, hd/2) * (sin with its first half negated)
        self.sin_rolled = torch.cat([-self.sin[:, :half], self.sin[:, half:]], dim=-1)

    def keep(self, idx: torch.Tensor) -> None:
        """Keep only batch rows idx (A',) of the cache."""
        self.keys = [k[idx] for k in self.keys]
        self.values = [v[idx] for v in self.values]
        self.bias = self.bias[idx]

    def step(self, token: torch.Tensor, pos: torch.Tensor, slot: int) -> torch.Tensor:
        """Feed token (A,) at positions pos (A,), cache slot `slot`; next-token logits (A, V)."""
        h = self.decoder.embed_tokens(token[:, None])  # (A, 1, H)
        rope = (self.cos[pos][:, None, None], self.sin[pos][:, None, None],
                self.sin_rolled[pos][:, None, None])  # (A, 1, 1, hd) each
        bias = self.bias[..., : slot + 1]  # (A, 1, 1, S)
        for i, layer in enumerate(self.decoder.layers):
            if self.plans[i] is not None:
                h = self._layer_fused(self.plans[i], layer, h, rope, i, slot, bias)
            else:
                h = self._layer_modules(layer, h, rope, i, slot, bias)
        return self.head(self.decoder.norm(h))[:, 0]  # (A, V)

    def _attend(self, q, k, v, i: int, slot: int, bias, scale: float):
        """Write k, v (A, 1, kv, hd) at `slot`; attention of q (A, 1, nh, hd); returns (A, 1, nh*hd)."""
        A, hd = q.shape[0], q.shape[-1]
        K, V = self.keys[i], self.values[i]
        K[..., slot] = k[:, 0]
        V[:, :, slot] = v[:, 0]
        qg = q.reshape(A, K.shape[1], -1, hd)  # (A, kv, group, hd): query head j uses kv head j // group
        scores = torch.matmul(qg, K[..., : slot + 1])  # (A, kv, group, S)
        if scale != 1.0:
            scores = scores * scale
        probs = (scores + bias).softmax(-1, dtype=torch.float32).to(q.dtype)
        return torch.matmul(probs, V[:, :, : slot + 1]).view(A, 1, -1)  # (A, 1, nh * hd)

    def _layer_modules(self, layer, h, rope, i: int, slot: int, bias):
        attn = layer.self_attn
        A, hd = h.shape[0], attn.head_dim
        cos, sin, _ = rope
        x = layer.input_layernorm(h)  # (A, 1, H)
        q, k, v = (p(x).view(A, 1, -1, hd) for p in (attn.q_proj, attn.k_proj, attn.v_proj))
        if hasattr(attn, "q_norm"):  # Qwen3: RMSNorm over each head, before RoPE
            q, k = attn.q_norm(q), attn.k_norm(k)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        h = h + attn.o_proj(self._attend(q, k, v, i, slot, bias, attn.scaling))
        return h + layer.mlp(layer.post_attention_layernorm(h))

    def _layer_fused(self, plan: "_LayerPlan", layer, h, rope, i: int, slot: int, bias):
        A = h.shape[0]
        cos, _, sin_rolled = rope
        qkv = F.linear(plan.norm(h, plan.ln1), plan.qkv_w, plan.qkv_b)  # (A, 1, (nh + 2 kv) * hd)
        qk = qkv[..., : plan.n_qk * plan.hd].view(A, 1, plan.n_qk, plan.hd)  # q heads | k heads
        v = qkv[..., plan.n_qk * plan.hd :].view(A, 1, -1, plan.hd)
        if plan.qk_w is not None:  # Qwen3's q/k norms, the attention scale folded into q's
            qk = F.rms_norm(qk, (plan.hd,), None, plan.qk_eps) * plan.qk_w
        qk = qk * cos + qk.roll(plan.hd // 2, dims=-1) * sin_rolled  # RoPE
        q, k = qk[:, :, : plan.nh], qk[:, :, plan.nh :]
        h = h + layer.self_attn.o_proj(self._attend(q, k, v, i, slot, bias, plan.scale))
        x = plan.norm(h, plan.ln2)
        if plan.gate_up_w is None:
            return h + layer.mlp(x)
        gate, up = F.linear(x, plan.gate_up_w).chunk(2, dim=-1)
        return h + layer.mlp.down_proj(F.silu(gate) * up)


class _LayerPlan:
    """One decoder layer's weights rearranged for `FastDecoder._layer_fused` (see there)."""

    @staticmethod
    def build(layer, dtype) -> "_LayerPlan | None":
        attn, mlp = layer.self_attn, layer.mlp
        projs = [getattr(attn, n, None) for n in ("q_proj", "k_proj", "v_proj")]
        if not all(isinstance(p, torch.nn.Linear) for p in projs) or \
                len({p.bias is None for p in projs}) != 1:
            return None
        norms = [getattr(layer, n, None) for n in ("input_layernorm", "post_attention_layernorm")]
        if not all(isinstance(getattr(n, "weight", None), torch.Tensor) and _eps(n) is not None
                   for n in norms):
            return None
        plan = _LayerPlan()
        plan.hd = attn.head_dim
        plan.nh = projs[0].out_features // plan.hd
        plan.n_qk = plan.nh + projs[1].out_features // plan.hd
        plan.ln1, plan.ln2 = norms
        plan.exact_norm = dtype == torch.float32  # F.rms_norm equals HF's RMSNorm in float32
        plan.qkv_w = torch.cat([p.weight for p in projs])  # ((nh + 2 kv) * hd, H)
        plan.qkv_b = None if projs[0].bias is None else torch.cat([p.bias for p in projs])
        plan.qk_w, plan.scale = None, attn.scaling
        if hasattr(attn, "q_norm"):
            if _eps(attn.q_norm) != _eps(attn.k_norm) or not plan.exact_norm:
                return None
            plan.qk_eps = _eps(attn.q_norm)
            plan.qk_w = torch.cat([(attn.q_norm.weight * attn.scaling).expand(plan.nh, -1),
                                   attn.k_norm.weight.expand(plan.n_qk - plan.nh, -1)])
            plan.scale = 1.0
        plan.gate_up_w = None
        gate, up = getattr(mlp, "gate_proj", None), getattr(mlp, "up_proj", None)
        if (isinstance(gate, torch.nn.Linear) and isinstance(up, torch.nn.Linear) and
                gate.bias is None and up.bias is None and not hasattr(mlp, "experts") and
                type(getattr(mlp, "act_fn", None)).__name__ in ("SiLU", "SiLUActivation")):
            plan.gate_up_w = torch.cat([gate.weight, up.weight])  # (2 I, H)
        return plan

    def norm(self, x, module):
        if self.exact_norm:
            return F.rms_norm(x, (x.shape[-1],), module.weight, _eps(module))
        return module(x)


def _eps(norm) -> float | None:
    return getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
