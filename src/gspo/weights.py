"""Weight helpers shared by engines and checkpoints: tied aliases and in-place copies."""

from __future__ import annotations

from typing import Iterable

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
