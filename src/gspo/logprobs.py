"""Per-token log-probs of responses, the quantity every objective is a function of.

- `token_logprobs` / `logprobs_from_hidden`: log pi(y_t | x, y_<t) of the response tokens without
  ever materialising the (B, L, V) logits: the output embedding is applied in chunks of positions
  and, in the backward pass, each chunk is recomputed and turned into its own gradient in place
  (`_ChunkedLogProbs`), so peak memory holds about one chunk of logits, not the whole batch.
- `decoder_hidden`: rows that share a prompt (the G responses of a group) run the prompt through
  the decoder once.

What is left out: logit soft-capping / logit scaling of models that have them (Gemma-2, Cohere,
Granite, Falcon-H1): `token_logprobs` applies the plain output embedding, which is what Qwen3,
Llama and Mistral do; `logit_transform` names such a model's setting, and training refuses it.
"""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from gspo.moe import token_weights


# config fields by which a model's forward changes its logits after the output embedding, and
# the value that changes nothing
LOGIT_TRANSFORMS = {"final_logit_softcapping": None, "logit_scale": 1.0,
                    "logits_scaling": 1.0, "lm_head_multiplier": 1.0}


def logit_transform(config) -> str | None:
    """`field=value` where the model's config transforms its logits in a way token_logprobs
    does not (see the module's docstring), else None."""
    for field, neutral in LOGIT_TRANSFORMS.items():
        value = getattr(config, field, neutral)
        if value is not None and value != neutral:
            return f"{field}={value}"
    return None


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions that skip left padding: the first real token of each row is position 0."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)  # (B, L)


def _wide(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the logits and everything after them: float32, or float64 for a float64
    model (tests that compare gradients to 1e-10)."""
    return torch.promote_types(dtype, torch.float32)


def _chunk_logits(h, weight, bias, temperature: float) -> torch.Tensor:
    # the GEMM in the operands' dtype (bf16 under mixed precision), the logits in float32
    logits = F.linear(h.to(weight.dtype), weight, bias)  # (N, V), N = chunk of positions
    logits = logits.to(_wide(logits.dtype))
    return logits.div_(temperature) if temperature != 1.0 else logits


def autocast_dtype(device: torch.device) -> torch.dtype | None:
    """The dtype autocast runs matmuls in on `device` here, or None when it is off."""
    return torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else None


def _cast(t: torch.Tensor | None, dtype: torch.dtype | None) -> torch.Tensor | None:
    return t if t is None or dtype is None else t.to(dtype)


def _chunk_stats(h, weight, bias, targets, temperature: float, with_entropy: bool):
    """logp (N,), entropy (N,) or None, and lse (N,) of one chunk of positions.

    In place where it can be: logp alone holds one (N, V) float32 block, with entropy two.
    """
    z = _chunk_logits(h, weight, bias, temperature)  # (N, V)
    z_y = z.gather(-1, targets[:, None]).squeeze(-1)  # (N,)
    m = z.amax(-1, keepdim=True)  # (N, 1)
    z.sub_(m)  # z - max, so exp cannot overflow
    if not with_entropy:
        lse = z.exp_().sum(-1).log_() + m[:, 0]  # z's block now holds exp(z - max)
        return z_y - lse, None, lse
    e = z.exp()  # (N, V), the second block
    s = e.sum(-1)  # (N,)
    lse = s.log() + m[:, 0]
    # H = lse - sum_v p_v z_v = log s - sum_v e_v (z_v - max) / s
    entropy = s.log() - e.mul_(z).sum(-1) / s
    return z_y - lse, entropy, lse


class _ChunkedLogProbs(torch.autograd.Function):
    """log softmax(h W^T + b)/tau at the targets (and the entropy), chunk by chunk, with a hand-written
    backward that recomputes each chunk's logits and turns them into the logits' gradient in
    place, so that forward and backward each hold one (chunk, V) float32 block at a time. Under
    mixed precision the weight's bf16 copy (V, H) is kept from the forward to the backward
    (`update` runs each micro-batch's backward right after its forward: one copy at a time).

        z = (h W^T + b) / tau,  p = softmax(z),  logp_y = z_y - lse(z),  H = lse - sum_v p_v z_v
        dlogp_y / dz = onehot(y) - p,  dH / dz = -p * (z - lse + H)
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature, chunk_size, with_entropy,
                compute_dtype):
        # hidden (N, H), weight (V, H), bias (V,) or None, targets (N,) long
        # compute_dtype: the GEMMs' dtype under mixed precision (the weight cast once), or None
        ctx.set_materialize_grads(False)
        w, b = _cast(weight, compute_dtype), _cast(bias, compute_dtype)
        logps, entropies, lses = [], [], []
        for start in range(0, hidden.shape[0], chunk_size):
            sl = slice(start, start + chunk_size)
            logp, ent, lse = _chunk_stats(hidden[sl], w, b, targets[sl], temperature,
                                          with_entropy)
            logps.append(logp)
            entropies.append(ent)
            lses.append(lse)
        logp, lse = torch.cat(logps), torch.cat(lses)  # (N,)
        entropy = torch.cat(entropies) if with_entropy else None
        # the weight and bias in the GEMMs' dtype, kept for the backward rather than cast again
        ctx.save_for_backward(hidden, w, b, targets, lse, entropy if with_entropy else lse)
        ctx.temperature, ctx.chunk_size = temperature, chunk_size
        ctx.dtypes = weight.dtype, None if bias is None else bias.dtype
        return logp, entropy

    @staticmethod
    def backward(ctx, g_logp, g_entropy):
        hidden, w, b, targets, lse, entropy = ctx.saved_tensors  # w, b in the forward's dtype
        tau, chunk = ctx.temperature, ctx.chunk_size
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        grad_h = torch.empty_like(hidden) if need_h else None
        acc = _wide(w.dtype)  # float32 (float64 for a float64 model)
        grad_w = grad_b = None  # summed over the chunks in float32
        for start in range(0, hidden.shape[0], chunk):
            sl = slice(start, start + chunk)
            h = hidden[sl].to(w.dtype)
            z = _chunk_logits(h, w, b, tau)  # (n, V), recomputed
            if g_entropy is None:
                p, ent_term = z.sub_(lse[sl, None]).exp_(), None  # softmax in place: one block
            else:
                p = (z - lse[sl, None]).exp_()  # a second block
                shift = (lse[sl] - entropy[sl])[:, None]  # z - lse + H = z - (lse - H)
                ent_term = z.sub_(shift).mul_(p).mul_(-g_entropy[sl, None].to(acc))
            logp_term = None
            if g_logp is not None:
                g = g_logp[sl].to(acc)[:, None]  # (n, 1)
                logp_term = p.mul_(-g).scatter_add_(-1, targets[sl, None], g)  # g * (onehot - p)
            if logp_term is None:
                grad_z = ent_term
            else:
                grad_z = logp_term if ent_term is None else logp_term.add_(ent_term)
            if tau != 1.0:
                grad_z.div_(tau)  # z = logits / tau
            if need_b:
                part = grad_z.sum(0)
                grad_b = part if grad_b is None else grad_b.add_(part)
            # both GEMMs in w's dtype, as autocast's backward runs them, from one cast of grad_z
            grad_z = grad_z.to(w.dtype)
            if need_h:
                grad_h[sl] = grad_z @ w  # (n, H)
            if need_w:
                part = grad_z.t() @ h  # (V, H)
                grad_w = part.to(acc) if grad_w is None else grad_w.add_(part)
            del z, p, ent_term, logp_term, grad_z  # free this block before the next is made
        w_dtype, b_dtype = ctx.dtypes
        return (grad_h, None if grad_w is None else grad_w.to(w_dtype),
                None if grad_b is None else grad_b.to(b_dtype), None, None, None, None, None)


def logprobs_from_hidden(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
    chunk_size: int = 1024,
    bias: torch.Tensor | None = None,
    with_entropy: bool = False,
):
    """log softmax(hidden @ weight.T + bias) / temperature) at `targets`, `chunk_size` positions at a time.

    hidden (B, T, H) are the states that predict targets (B, T); weight (V, H). Logits are computed
    in float32 per chunk and, when gradients are needed, recomputed in the backward pass, which
    turns them into their own gradient in place; so forward and backward each hold about one
    (chunk_size, V) float32 block of logits, never (B, T, V). Returns logp (B, T), and entropy
    (B, T) of the temperature-scaled distribution when `with_entropy`; both are differentiable.

    Under autocast (mixed precision) the GEMMs run in autocast's dtype, the weight cast once per
    call, and everything from the logits on in float32; with or without gradients, the same
    operations on the same dtypes, so pi_old's recompute and the update's forward agree.
    """
    B, T, H = hidden.shape
    flat_h, flat_y = hidden.reshape(B * T, H), targets.reshape(B * T)
    need_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (hidden, weight, bias))
    compute_dtype = autocast_dtype(hidden.device)
    if need_grad:
        with torch.autocast(hidden.device.type, enabled=False):  # its dtypes are explicit
            logp, entropy = _ChunkedLogProbs.apply(flat_h, weight, bias, flat_y, temperature,
                                                   chunk_size, with_entropy, compute_dtype)
    else:
        w, b = _cast(weight, compute_dtype), _cast(bias, compute_dtype)
        with torch.autocast(hidden.device.type, enabled=False):
            stats = [_chunk_stats(flat_h[s : s + chunk_size], w, b, flat_y[s : s + chunk_size],
                                  temperature, with_entropy)
                     for s in range(0, B * T, chunk_size)]
        logp = torch.cat([st[0] for st in stats])
        entropy = torch.cat([st[1] for st in stats]) if with_entropy else None
    if not with_entropy:
        return logp.reshape(B, T)  # (B, T)
    return logp.reshape(B, T), entropy.reshape(B, T)  # (B, T) each


def token_logprobs(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    n_response: int,
    temperature: float = 1.0,
    chunk_size: int = 1024,
    with_entropy: bool = False,
    share_prompts: bool = True,
    sync_max=None,
):
    """log pi(y_t | x, y_<t) of the last `n_response` tokens of input_ids, and optionally the entropy.

    input_ids (B, L) is a left-padded prompt followed by a right-padded response; attention_mask
    (B, L) marks real tokens. Positions are counted from each row's first real token. Values at
    masked response positions are meaningless (0 past the longest response): callers mask them.
    Gradients flow. Returns logp (B, n_response) [, entropy (B, n_response)]. share_prompts=False forces one
    plain forward over all (B, L) positions (MoE routing record/replay needs exactly that).

    sync_max (a sharded model): `list[int] -> list[int]`, the max over ranks. Every rank then
    computes the same number of columns and takes the same path through the decoder, because
    each forward of a sharded layer is a collective.
    """
    # Columns past the longest response are padding in every row: not computed, returned as 0.
    T = max(1, int(attention_mask[:, input_ids.shape[1] - n_response:].sum(-1).max()))
    share, n_out = share_prompts, n_response
    if sync_max is not None:  # decoder_hidden re-checks `share` on this rank's own prompts
        prompt_mask = attention_mask[:, :input_ids.shape[1] - n_response]
        share = share and _can_share_prompts(model, prompt_mask)
        T, unshared = sync_max([T, int(not share)])
        share = not unshared
        if T > n_response:  # another rank's responses are longer: compute masked columns too
            input_ids = F.pad(input_ids, (0, T - n_response))
            attention_mask = F.pad(attention_mask, (0, T - n_response))
            n_response = T
    cut = n_response - T
    if cut:
        input_ids, attention_mask = input_ids[:, :-cut], attention_mask[:, :-cut]
    hidden = decoder_hidden(model, input_ids, attention_mask, T, share,
                            always_split=sync_max is not None)  # (B, T, H)
    head = model.get_output_embeddings()
    out = logprobs_from_hidden(
        hidden,
        head.weight,
        input_ids[:, -T:],
        temperature=temperature,
        chunk_size=chunk_size,
        bias=getattr(head, "bias", None),
        with_entropy=with_entropy,
    )
    if cut:  # (B, n_response) again
        out = tuple(F.pad(x, (0, cut)) for x in out) if with_entropy else F.pad(out, (0, cut))
    if n_response != n_out:  # drop the columns computed only to keep step with other ranks
        out = tuple(x[:, :n_out] for x in out) if with_entropy else out[:, :n_out]
    return out


def decoder_hidden(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, n_response: int,
                   share_prompts: bool = True, always_split: bool = False) -> torch.Tensor:
    """The decoder's last hidden states (B, n_response, H) that predict the last n_response tokens.

    When rows share a prompt (the G responses of a group), each distinct prompt runs through the
    decoder once and its key/value cache is indexed out to its rows, through which gradients
    flow back; the responses then run on top of that cache. Same function as one forward over
    the whole (B, L) batch, fewer FLOPs: (B - distinct prompts) * prompt length fewer positions.
    always_split: take the prompt-then-response path even when every prompt is distinct (so
    that all ranks of a sharded model make the same decoder calls).
    """
    decoder = model.get_decoder()
    Lp = input_ids.shape[1] - n_response
    prompt_ids, prompt_mask = input_ids[:, :Lp], attention_mask[:, :Lp]
    share = share_prompts and _can_share_prompts(model, prompt_mask)
    groups = _prompt_groups(prompt_ids, prompt_mask) if share else None
    if groups is None and share and always_split:
        rows = torch.arange(input_ids.shape[0], device=input_ids.device)
        groups = rows, rows
    if groups is None:
        # The last token predicts nothing we score, so the decoder never sees it.
        ids, mask = input_ids[:, :-1], attention_mask[:, :-1]  # (B, L-1)
        with token_weights(mask):
            out = decoder(input_ids=ids, attention_mask=mask,
                          position_ids=position_ids_from_mask(mask))
        return out.last_hidden_state[:, -n_response:]  # position t-1 predicts token t
    first, inverse = groups  # (P,) one row per distinct prompt; (B,) each row's prompt
    kwarg = cache_kwarg(decoder)
    cache = DynamicCache(config=model.config)
    p_mask = prompt_mask[first]  # (P, Lp)
    shares = torch.bincount(inverse, minlength=len(first))  # (P,) rows per distinct prompt
    with token_weights(p_mask * shares[:, None]):  # each prompt token stands for its rows'
        out = decoder(input_ids=prompt_ids[first], attention_mask=p_mask,
                      position_ids=position_ids_from_mask(p_mask), use_cache=True,
                      **{kwarg: cache})
    last = out.last_hidden_state[:, -1:][inverse]  # (B, 1, H): the last prompt token predicts y_0
    if n_response == 1:
        return last
    if not all(type(layer) is DynamicLayer for layer in cache.layers):
        raise RuntimeError(f"unexpected cache layers {[type(x).__name__ for x in cache.layers]}")
    for layer in cache.layers:
        layer.keys, layer.values = layer.keys[inverse], layer.values[inverse]  # (B, kv, Lp, hd)
    mask = attention_mask[:, :-1]  # (B, Lp + T - 1)
    with token_weights(mask[:, Lp:]):
        out = decoder(input_ids=input_ids[:, Lp:-1], attention_mask=mask,
                      position_ids=position_ids_from_mask(mask)[:, Lp:], use_cache=True,
                      **{kwarg: cache})
    return torch.cat([last, out.last_hidden_state], dim=1)  # (B, T, H)


def cache_kwarg(module) -> str:
    """The name of `module.forward`'s KV-cache argument."""
    # transformers 5.x renamed forward's `past_key_values` to `cache` (the old name warns).
    return "cache" if "cache" in inspect.signature(module.forward).parameters else "past_key_values"


def _can_share_prompts(model, prompt_mask: torch.Tensor) -> bool:
    """Prompt sharing needs full attention in every layer and at least one real prompt token per row."""
    # the cache transformers builds for this config: a sliding window (Mistral-7B-v0.1's
    # sliding_window with no layer_types) makes sliding layers, which keep only the window
    if any(type(layer) is not DynamicLayer for layer in DynamicCache(config=model.config).layers):
        return False
    return prompt_mask.shape[1] > 0 and bool((prompt_mask[:, -1] > 0).all())


def _prompt_groups(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor):
    """(first, inverse) over rows with equal real prompt tokens, or None when all prompts differ."""
    key = torch.where(prompt_mask.bool(), prompt_ids, -1)  # what padding holds does not matter
    _, inverse = torch.unique(key, dim=0, return_inverse=True)  # (B,)
    P = int(inverse.max()) + 1
    if P == key.shape[0]:
        return None
    rows = torch.arange(key.shape[0], device=key.device)
    first = torch.full((P,), key.shape[0], dtype=torch.long, device=key.device)
    first = first.scatter_reduce(0, inverse, rows, reduce="amin")  # (P,)
    return first, inverse


