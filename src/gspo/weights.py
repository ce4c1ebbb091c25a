"""Weight helpers shared by engines and checkpoints: tied aliases and in-place copies."""

from __future__ import annotations

from typing import Iterable, Iterator

import torch


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


def untied_missing(model, missing: set[str], expected: dict | None = None) -> set[str]:
    """The missing keys that do not share storage with a present key (i.e. truly missing)."""
    if not missing:
        return set()
    expected = expected if expected is not None else model.state_dict()
    present = {expected[k].data_ptr() for k in expected if k not in missing}
    return {k for k in missing if expected[k].data_ptr() not in present}


class CheckpointFormat:
    """Turns (name, tensor) pairs of a transformers model in memory into the names and layout
    its checkpoint files use, as `save_pretrained` writes them: transformers 5 fuses some
    weights when it loads (e.g. a Qwen3-MoE layer's experts into one `experts.gate_up_proj`
    tensor) and splits them back when it saves. Engines that load checkpoints (vLLM) want the
    saved layout. One tensor at a time; names that need no conversion are remembered."""

    def __init__(self, model):
        self.model = model
        self._plain: set[str] = set()
        try:
            from transformers.core_model_loading import revert_weight_conversion
        except ImportError:  # transformers < 5: memory and checkpoint layouts are the same
            revert_weight_conversion = None
        self._revert = revert_weight_conversion

    def __call__(self, weights: Iterable[tuple[str, torch.Tensor]]
                 ) -> Iterator[tuple[str, torch.Tensor]]:
        for name, t in weights:
            if self._revert is None or name in self._plain:
                yield name, t
                continue
            out = self._revert(self.model, {name: t})
            if list(out) == [name]:
                self._plain.add(name)
            yield from out.items()
