"""`FastDecoder`: the hf engine's one-token decode step for the Llama family, straight from the
model's own weights on a preallocated KV cache (see the class)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import DynamicCache


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
