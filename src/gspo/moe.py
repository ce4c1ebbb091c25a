"""Mixture-of-Experts support: Routing Replay and expert-activation volatility.

After a gradient step the experts a token is routed to can change (the paper measured about
10% of activated experts changing per update on Qwen3-30B-A3B-Base). Token-level ratios (GRPO)
then compare likelihoods computed by different sub-networks; **Routing Replay** removes that by
caching the experts chosen under pi_old and forcing them when pi_theta is computed. GSPO does
not need it; we implement it so that the claim can be measured.

Works with any router that follows transformers' Qwen3-MoE pattern: a module whose forward
maps hidden states (N, H) to ``(router_logits (N, E), topk_weights (N, k), topk_indices (N, k))``
and that has ``top_k`` and ``num_experts`` attributes (optionally ``norm_topk_prob``). A dense
model has no such module, gets no hook and is left untouched.

Replay keeps the router learning: the forced experts' weights are recomputed from the current
router logits, softmax over all experts gathered at the recorded indices (and renormalised over
the k chosen when the router does so), so gradients still reach the router.
"""

from __future__ import annotations

import contextlib
from contextvars import ContextVar
from typing import Iterator

import torch
from torch import Tensor, nn


def find_routers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, module) of every top-k router, in layer order."""
    return [(name, m) for name, m in model.named_modules()
            if hasattr(m, "top_k") and hasattr(m, "num_experts") and
            isinstance(getattr(m, "weight", None), Tensor) and m.weight.dim() == 2]


def is_moe(model: nn.Module) -> bool:
    return bool(find_routers(model))


class RoutingRecorder:
    """Forward hooks on every router that record or replay the chosen experts per row.

    A forward over rows ``rows`` of the rollout batch sees its router input flattened to
    (len(rows) * L, H); recordings are kept per row as (B, L, k) so that a later forward over any
    subset of rows, in any order, replays exactly the experts those tokens had.
    """

    def __init__(self, model: nn.Module):
        self.routers = find_routers(model)
        self.stores: dict[str, list[Tensor]] = {}
        self._mode: str | None = None
        self._rows: Tensor | None = None
        self._store = ""
        self._handles: list = []  # the routers' hooks, there only while active

    def close(self) -> None:
        _remove(self._handles)

    @contextlib.contextmanager
    def _active(self, mode: str, rows: Tensor, store: str) -> Iterator[None]:
        # hooks only while active: the hf engine's fast decoder shares prompts and drops
        # finished rows unless a hook watches the model (a shared model samples between uses)
        if self._mode is not None:
            raise RuntimeError("routing recorder is already active")
        self._mode, self._rows, self._store = mode, rows, store
        # first among the routers' hooks: the others see the experts replay forces
        self._handles = [m.register_forward_hook(self._hook(i), prepend=True)
                         for i, (_, m) in enumerate(self.routers)]
        try:
            yield
        finally:
            self._mode, self._rows = None, None
            _remove(self._handles)

    def record(self, rows: Tensor, store: str = "old"):
        """Within this context, forwards over batch rows `rows` record their routing."""
        return self._active("record", rows, store)

    def replay(self, rows: Tensor, store: str = "old"):
        """Within this context, forwards over batch rows `rows` use the recorded routing."""
        return self._active("replay", rows, store)

    def indices(self, store: str = "old") -> list[Tensor]:
        """Recorded top-k indices, one (B, L, k) tensor per router."""
        return self.stores[store]

    @contextlib.contextmanager
    def record_stream(self, n_rows: int) -> Iterator[None]:
        """Record routing of a decode loop: a prefill over (n_rows, Lp) then one call per
        generated position; `finish_stream` stitches the calls into (n_rows, L, k)."""
        self._chunks: list[list[Tensor]] = [[] for _ in self.routers]
        with self._active("stream", torch.arange(n_rows), ""):
            yield

    def finish_stream(self, store: str, seq_len: int) -> None:
        """Keep the first seq_len recorded positions of each row as `store`."""
        out = []
        for layer, chunks in enumerate(self._chunks):
            idx = torch.cat(chunks, dim=1)  # (B, L_recorded, k)
            if idx.shape[1] < seq_len:
                raise RuntimeError(f"the engine's forwards covered {idx.shape[1]} positions of "
                                   f"layer {layer}, fewer than the {seq_len} to replay")
            out.append(idx[:, :seq_len].contiguous())
        self.stores[store] = out
        self._chunks = []

    def _hook(self, layer: int):
        def hook(module: nn.Module, args, output):
            if self._mode is None:
                return None
            logits, weights, idx = output
            b = len(self._rows)
            if self._mode == "stream":
                if idx.shape[0] % b:
                    raise RuntimeError(f"router saw {idx.shape[0]} tokens, not a multiple of the "
                                       f"{b} rollout rows: this engine does not decode all rows "
                                       f"together, so its routing cannot be recorded")
                self._chunks[layer].append(idx.detach().view(b, -1, idx.shape[-1]))
                return None
            if self._mode == "record":
                self._write(layer, idx.detach().view(b, -1, idx.shape[-1]))
                return None
            forced = self._forced(layer, idx.view(b, -1, idx.shape[-1])).reshape(idx.shape)
            probs = torch.softmax(logits, dim=-1, dtype=torch.float)  # (N, E)
            w = probs.gather(-1, forced)  # (N, k), differentiable w.r.t. the router
            if getattr(module, "norm_topk_prob", False):
                w = w / w.sum(-1, keepdim=True)
            return logits, w.to(weights.dtype), forced
        return hook

    # A forward may cover fewer positions than the store (token_logprobs drops the columns past
    # its micro-batch's longest response) or more (a sharded model computes columns up to
    # another rank's longest): the positions it covers are always a prefix of the row's, and
    # past the store's end they are padding, which keeps its free routing.
    def _write(self, layer: int, idx: Tensor) -> None:
        if self._store not in self.stores:
            raise RuntimeError(f"call allocate({self._store!r}, n_rows, seq_len) before recording")
        store = self.stores[self._store][layer]
        n = min(idx.shape[1], store.shape[1])
        store[self._rows, :n] = idx[:, :n]

    def _forced(self, layer: int, free: Tensor) -> Tensor:
        """(b, L, k): the recorded experts of this forward's rows, its own past the store."""
        recorded = self.stores[self._store][layer][self._rows]  # (b, L_store, k)
        if recorded.shape[1] == free.shape[1]:
            return recorded
        n = min(free.shape[1], recorded.shape[1])
        return torch.cat([recorded[:, :n], free[:, n:]], dim=1)

    def allocate(self, store: str, n_rows: int, seq_len: int) -> None:
        """Make room for (n_rows, seq_len, k) recorded indices per router."""
        self.stores[store] = [torch.zeros(n_rows, seq_len, m.top_k, dtype=torch.long,
                                          device=m.weight.device) for _, m in self.routers]


# what each token of the decoder forward now running counts for in the routers' load: the
# forward's caller (gspo.logprobs.decoder_hidden) sets it; per thread (a sampler's thread
# runs forwards of its own)
_TOKEN_WEIGHTS: ContextVar[Tensor | None] = ContextVar("gspo_router_token_weights", default=None)


@contextlib.contextmanager
def token_weights(weights: Tensor) -> Iterator[None]:
    """The decoder forwards inside count their tokens (b, s) with these weights in the
    routers' load: a real token's 1, padding's 0, and a shared prompt's token the number of
    rows whose forward it stands for."""
    token = _TOKEN_WEIGHTS.set(weights)
    try:
        yield
    finally:
        _TOKEN_WEIGHTS.reset(token)


class RouterLoad:
    """The router load-balancing loss (Switch Transformer's, eqs. 4-6) of the forwards inside
    `collect()`, as transformers' `load_balancing_loss_func` computes a MoE model's `aux_loss`
    over a batch (output_router_logits=true):

        aux = E * sum_e f_e * P_e

    f_e the share of the top-k assignments that go to expert e and P_e the mean router
    probability of e, both over the real tokens of every MoE layer together (weighted by
    `token_weights`). Gradients flow to the routers through P_e. The experts counted are the
    router's own top-k (under Routing Replay too, which forces others for the forward)."""

    def __init__(self, model: nn.Module):
        self.routers = find_routers(model)
        self.num_experts = self.routers[0][1].num_experts
        self._acc: dict | None = None  # the current collect()'s sums
        self.last: dict | None = None  # the last one's
        self._handles: list = []  # the routers' hooks, there only while collecting

    @contextlib.contextmanager
    def collect(self) -> Iterator["RouterLoad"]:
        """Within: the routers' load of the forwards accumulates; `loss()` gives its aux loss."""
        if self._acc is not None:
            raise RuntimeError("router load is already being collected")
        E, device = self.num_experts, self.routers[0][1].weight.device
        self._acc = {"counts": torch.zeros(E, device=device), "probs": 0.0,
                     "total": torch.zeros((), device=device)}
        self._handles = [m.register_forward_hook(self._hook) for _, m in self.routers]
        try:
            yield self
        finally:
            self.last, self._acc = self._acc, None
            _remove(self._handles)

    def loss(self) -> Tensor:
        """The aux loss of the forwards of the current `collect()`, or of the last one (a
        scalar, differentiable w.r.t. the routers)."""
        acc = self._acc if self._acc is not None else self.last
        total = acc["total"].clamp_min(1.0)
        return self.num_experts * torch.sum(acc["counts"] / total * (acc["probs"] / total))

    def _hook(self, module: nn.Module, args, output) -> None:
        acc = self._acc
        if acc is None:
            return None
        w = _TOKEN_WEIGHTS.get()
        logits = output[0]  # (N, E)
        if w is None or w.numel() != logits.shape[0]:
            raise RuntimeError(f"a router saw {logits.shape[0]} tokens with "
                               f"{'no' if w is None else w.numel()} token weights: the router "
                               f"load is collected only in gspo's decoder forwards")
        w = w.reshape(-1).to(torch.float32)
        probs = torch.softmax(logits.float(), dim=-1)  # (N, E)
        top = torch.topk(probs.detach(), module.top_k, dim=-1).indices  # (N, k)
        acc["counts"].scatter_add_(0, top.reshape(-1), w.repeat_interleave(module.top_k))
        acc["probs"] = acc["probs"] + (probs * w[:, None]).sum(0)  # (E,)
        acc["total"] += w.sum()
        return None

    def close(self) -> None:
        _remove(self._handles)


def _remove(handles: list) -> None:
    for h in handles:
        h.remove()
    handles.clear()


def expert_volatility(old: list[Tensor], new: list[Tensor], mask: Tensor) -> dict[str, float]:
    """How much routing changed between two recordings of the same tokens.

    old, new: one (B, L, k) tensor of expert indices per layer; mask (B, L) marks the tokens
    that count (the response tokens). Returns
        volatility        fraction of activated experts (token, layer, slot) not activated
                          again: 1 - |old ∩ new| / k, averaged over (token, layer)
        changed_frac      fraction of (token, layer) whose expert set differs at all
    """
    if not old:
        return {}
    sel = mask > 0
    changed, kept_frac = [], []
    for o, n in zip(old, new, strict=True):
        o, n = o[sel], n[sel]  # (N, k)
        hits = (o[:, :, None] == n[:, None, :]).any(-1).float()  # (N, k): old expert kept?
        kept_frac.append(hits.mean(-1))
        changed.append((hits.sum(-1) < o.shape[-1]).float())
    return {"volatility": float(1 - torch.cat(kept_frac).mean()),
            "changed_frac": float(torch.cat(changed).mean())}


def expert_counts(indices: list[Tensor], mask: Tensor, num_experts: int) -> Tensor:
    """(layers, E) how many masked tokens each layer routed to each expert (over the k slots);
    counts add up across ranks, the summary of load_stats does not."""
    sel = mask > 0
    return torch.stack([torch.bincount(idx[sel].flatten(), minlength=num_experts).float()
                        for idx in indices])


def load_summary(counts: Tensor) -> dict[str, float]:
    """load_max / load_min / load_cv (see load_stats) from (layers, E) expert counts."""
    frac = counts / counts.sum(-1, keepdim=True)  # (layers, E)
    rel = frac * counts.shape[-1]
    cv = frac.std(-1) / frac.mean(-1)
    return {"load_max": float(rel.max()), "load_min": float(rel.min()), "load_cv": float(cv.mean())}


def load_stats(indices: list[Tensor], mask: Tensor, num_experts: int) -> dict[str, float]:
    """Router load balance over the masked tokens: per-layer expert load, summarised.

        load_max   max over layers and experts of (load fraction) / (ideal 1/E)
        load_min   min of the same (0 = an expert no masked token used)
        load_cv    coefficient of variation of the per-expert load, mean over layers
    """
    if not indices:
        return {}
    return load_summary(expert_counts(indices, mask, num_experts))


class MoeRouting:
    """Everything the trainer does with MoE routing in an RL step, behind five calls.

        sampling / sampled   around the rollout: when Routing Replay takes pi_old from the
                             engine (old_logprobs=rollout), record the experts the engine's own
                             forwards chose while it sampled; or take the experts an engine
                             reports itself (R3, vLLM's recorded routing, `Rollouts.routing`)
        recording            around pi_old's recompute: record the experts it chose, or with
                             R3 force the engine's
        replaying            around each update forward (algorithm.routing_replay): force them
        balancing            around each update forward: collect the routers' load for the
                             load-balancing loss (algorithm.router_aux_loss_coef)
        step_metrics         after the update: router load under pi_old and expert volatility,
                             the same tokens routed again by the updated policy

    `NoRouting` answers the same calls for a dense model and does nothing.
    """

    def __init__(self, model: nn.Module, replay: bool = False,
                 engine_model: nn.Module | None = None, aux_coef: float = 0.0):
        self.recorder = RoutingRecorder(model)
        self.replays = replay
        # the router load-balancing loss's weight, and its collector (None at 0)
        self.aux_coef = aux_coef
        self.load = RouterLoad(model) if aux_coef > 0 else None
        # pi_old's routing recorded from the engine's forwards while it samples
        self.engine_recorder = RoutingRecorder(engine_model) if engine_model is not None else None
        self.from_engine = False  # this step's pi_old routing is the one the engine reported

    def sampling(self, n_rows: int):
        if self.engine_recorder is None:
            return contextlib.nullcontext()
        return self.engine_recorder.record_stream(n_rows)

    def sampled(self, seq_len: int, routing: list[Tensor] | None = None) -> None:
        """After the rollout: the engine's routing, if recorded here or reported by the engine
        (`routing`: per layer (B, seq_len, k)), becomes pi_old's."""
        self.from_engine = False
        if self.engine_recorder is not None:
            self.engine_recorder.finish_stream("old", seq_len)
            self.recorder.stores["old"] = self.engine_recorder.stores["old"]
        elif routing is not None and self.replays:
            if len(routing) != len(self.recorder.routers) or routing[0].shape[1] != seq_len:
                raise RuntimeError(f"the engine reported routing of {len(routing)} layers x "
                                   f"{routing[0].shape[1]} positions; the policy has "
                                   f"{len(self.recorder.routers)} MoE layers and {seq_len} "
                                   f"positions to replay")
            self.recorder.stores["old"] = [x.to(self.recorder.routers[0][1].weight.device)
                                           for x in routing]
            self.from_engine = True

    def recording(self, n_rows: int, seq_len: int):
        """A `rows -> context manager` under which forwards over those rows record pi_old's
        routing, for (n_rows, seq_len) decoder positions; None when pi_old's routing is the
        engine's, recorded as it sampled; with R3 (routing the engine reported) a context that
        forces the engine's experts, so pi_old is the sampler's sub-network."""
        if self.from_engine:
            return self.recorder.replay
        if self.engine_recorder is not None:
            return None
        self.recorder.allocate("old", n_rows, seq_len)
        return self.recorder.record

    def replaying(self, rows: Tensor):
        if not self.replays:
            return contextlib.nullcontext()
        return self.recorder.replay(rows)

    def balancing(self):
        """Around an update forward: a context giving the RouterLoad that collects its routers'
        load (None when the load-balancing loss is off)."""
        return self.load.collect() if self.load is not None else contextlib.nullcontext()

    def step_metrics(self, forward, response_mask: Tensor, seq_len: int, d) -> dict[str, float]:
        """`forward(route)` runs the updated policy over the step's rows under `route` (as
        `recording` returns it); response_mask (B, T) marks the response tokens, which sit at
        the end of the seq_len decoder positions. Over the ranks of `d`: volatility weighted by tokens,
        the load from expert counts summed. Empty when pi_old's routing was not recorded
        (old_logprobs=rollout without Routing Replay, except on its mismatch_every steps: no
        training forward ran under pi_old)."""
        from gspo.metrics import WeightedMean  # light; keeps moe importable on its own
        if "old" not in self.recorder.stores:
            return {}
        n_rows = response_mask.shape[0]
        self.recorder.allocate("new", n_rows, seq_len)
        forward(lambda rows: self.recorder.record(rows, store="new"))
        # position j of the decoder input predicts token j + 1: response tokens sit at the end
        mask = torch.zeros(n_rows, seq_len, device=response_mask.device)
        mask[:, -response_mask.shape[1]:] = response_mask
        old, new = self.recorder.indices("old"), self.recorder.indices("new")
        m = WeightedMean()
        for k, v in expert_volatility(old, new, mask).items():
            m.add(k, v, float(mask.sum()))
        num_experts = self.recorder.routers[0][1].num_experts
        counts = expert_counts(old, mask, num_experts)  # (layers, E)
        counts = torch.tensor(d.sum(counts.flatten().tolist())).view(counts.shape)
        stats = {**m.result(d), **load_summary(counts)}
        del self.recorder.stores["old"], self.recorder.stores["new"]
        return {f"moe/{k}": v for k, v in stats.items()}

    def close(self) -> None:
        self.recorder.close()
        if self.engine_recorder is not None:
            self.engine_recorder.close()
        if self.load is not None:
            self.load.close()


class NoRouting:
    """The routing of a dense model: nothing to record, replay or measure."""

    replays = False

    def sampling(self, n_rows: int):
        return contextlib.nullcontext()

    def sampled(self, seq_len: int, routing=None) -> None:
        pass

    def recording(self, n_rows: int, seq_len: int):
        return None

    def replaying(self, rows: Tensor):
        return contextlib.nullcontext()

    def balancing(self):
        return contextlib.nullcontext()

    def step_metrics(self, forward, response_mask, seq_len, d) -> dict[str, float]:
        return {}

    def close(self) -> None:
        pass


def routing_for(model: nn.Module, replay: bool, engine_model: nn.Module | None = None,
                aux_coef: float | None = None) -> MoeRouting | NoRouting:
    """The routing handler of a training model: MoeRouting when it has top-k routers, else
    NoRouting. replay: algorithm.routing_replay; engine_model: the rollout engine's model, when
    pi_old's routing is to be recorded as it samples; aux_coef: algorithm.router_aux_loss_coef
    (None: the model config's router_aux_loss_coef where its output_router_logits is true, as
    transformers' own forward and TRL apply it; else 0). Routing Replay, or a load-balancing
    loss, on a dense model is a ValueError."""
    if not is_moe(model):
        if replay:
            raise ValueError("algorithm.routing_replay=true needs a Mixture-of-Experts model "
                             "with top-k routers (e.g. model.name_or_path=tiny-qwen3-moe)")
        if aux_coef:
            raise ValueError(f"algorithm.router_aux_loss_coef={aux_coef:g} needs a "
                             f"Mixture-of-Experts model with top-k routers (e.g. "
                             f"model.name_or_path=tiny-qwen3-moe)")
        return NoRouting()
    if aux_coef is None:
        cfg = getattr(model, "config", None)
        aux_coef = (float(getattr(cfg, "router_aux_loss_coef", 0.0) or 0.0)
                    if getattr(cfg, "output_router_logits", False) else 0.0)
    return MoeRouting(model, replay, engine_model, aux_coef)
