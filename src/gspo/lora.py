"""LoRA through peft: low-rank adapters on a transformers model, trained while the base stays frozen.

    gspo train model.lora_rank=16 model.lora_alpha=32 ...

The adapters are injected in place (`peft.inject_adapter_in_model`), so the model stays a
transformers model: the log-prob kernel, generation and `save_pretrained` see the same modules
as without LoRA, and only the adapter parameters require gradients (the optimiser holds no state
for the base). The rollout engine keeps its own plain copy of the weights and is refreshed with
the merged weights W + (alpha / r) B A after every update, so it samples exactly the policy the
trainer scores, at the plain model's speed.

A checkpoint holds the merged model (plain `AutoModelForCausalLM.from_pretrained` and `gspo
eval` load it like any other) and, under `lora/`, the adapter alone in PEFT's layout
(adapter_config.json, adapter_model.safetensors): resume loads the base from
model.name_or_path and the adapter from there, which is exact, where the merged weights are not
(float rounding of W + BA).

Left out: LoRA under torchrun (the sharded / DDP paths gather whole state dicts), and QLoRA.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import torch

from gspo.errors import ConfigError

ADAPTER_DIR = "lora"
_PEFT_PREFIX = "base_model.model."  # what PeftModel.save_pretrained puts before module names


class LoraUnavailable(ConfigError, ImportError):
    """model.lora_rank > 0 without the peft package."""


def _peft():
    try:
        import peft
        from peft.tuners.lora import LoraLayer
    except ImportError as e:
        raise LoraUnavailable(f"model.lora_rank > 0 needs the peft package ({e}): "
                              f"pip install 'gspo[lora]' (or pip install peft)") from None
    return peft, LoraLayer


def add_lora(model: torch.nn.Module, rank: int, alpha: float, dropout: float,
             target_modules: list[str]) -> torch.nn.Module:
    """Inject rank-`rank` adapters into the named linear layers of `model` (in place), freeze
    everything else; B starts at zero, so the model's function is unchanged."""
    peft, _ = _peft()
    present = {name.rsplit(".", 1)[-1] for name, m in model.named_modules()
               if isinstance(m, torch.nn.Linear)}
    missing = sorted(set(target_modules) - present)
    if missing:
        raise ValueError(f"model.lora_target_modules names {missing}, which this model has no "
                         f"linear layer called; it has {sorted(present)}")
    head = model.get_output_embeddings()
    head_name = next((name for name, m in model.named_modules() if m is head), None)
    if head_name is not None and head_name.rsplit(".", 1)[-1] in target_modules:
        # token_logprobs applies the output embedding's weight itself (chunked, gspo.logprobs),
        # so an adapter there would get no gradient, and with tied embeddings the merged model
        # would carry its delta into the input embedding too
        raise ValueError(f"model.lora_target_modules names the output embedding "
                         f"{head_name!r}, which gspo's log-prob kernel applies by its weight "
                         f"alone: an adapter there would never train; leave it out of the "
                         f"targets (or train every weight, model.lora_rank=0)")
    config = peft.LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=dropout,
                             target_modules=list(target_modules), task_type="CAUSAL_LM")
    model = peft.inject_adapter_in_model(config, model)
    model.gspo_lora_config = config
    return model


def is_lora(model: torch.nn.Module) -> bool:
    return hasattr(model, "gspo_lora_config")


def merged_weights(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of the plain model the adapters amount to: the model's own key names, each
    adapted weight W + scaling * B @ A, the adapters' own tensors left out."""
    _, LoraLayer = _peft()
    deltas = {}
    for name, module in model.named_modules():
        if isinstance(module, LoraLayer):
            for adapter in module.active_adapters:
                delta = module.get_delta_weight(adapter).detach()
                deltas[f"{name}.weight"] = deltas.get(f"{name}.weight", 0) + delta
    with torch.no_grad():
        for key, t in model.state_dict().items():
            if ".lora_" in key:
                continue
            key = key.replace(".base_layer.", ".")
            # float32, whatever the base is kept in (a bf16 base under mixed precision)
            yield key, (t.float() + deltas[key].float()) if key in deltas else t.float()


def adapter_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The adapter's tensors, keyed as a PEFT adapter_model.safetensors keys them."""
    peft, _ = _peft()
    return {_PEFT_PREFIX + k: v.detach().contiguous()
            for k, v in peft.get_peft_model_state_dict(model).items()}


def save_adapter(model: torch.nn.Module, directory: Path) -> None:
    """adapter_config.json and adapter_model.safetensors, as PeftModel.save_pretrained writes
    them (so `PeftModel.from_pretrained(base, directory)` loads them too)."""
    from safetensors.torch import save_file
    directory.mkdir(parents=True, exist_ok=True)
    config = model.gspo_lora_config
    config.base_model_name_or_path = getattr(model, "name_or_path", None)
    config.save_pretrained(str(directory))
    save_file(adapter_state(model), str(directory / "adapter_model.safetensors"))


def load_adapter(model: torch.nn.Module, directory: Path) -> None:
    """Copy a saved adapter's tensors into the adapters of `model` (built with the same config)."""
    from safetensors.torch import load_file
    peft, _ = _peft()
    path = directory / "adapter_model.safetensors"
    if not path.is_file():
        raise ValueError(f"{directory.parent} was saved without LoRA (no {ADAPTER_DIR}/"
                         f"adapter_model.safetensors): resume it with model.lora_rank=0")
    saved = json.loads((directory / "adapter_config.json").read_text())
    config = model.gspo_lora_config
    if saved.get("r") != config.r or sorted(saved.get("target_modules") or []) != \
            sorted(config.target_modules):
        raise ValueError(f"{directory} holds a rank-{saved.get('r')} adapter on "
                         f"{sorted(saved.get('target_modules') or [])}; the config asks for "
                         f"rank {config.r} on {sorted(config.target_modules)}")
    state = {k.removeprefix(_PEFT_PREFIX): v for k, v in load_file(str(path)).items()}
    result = peft.set_peft_model_state_dict(model, state)
    unexpected = getattr(result, "unexpected_keys", [])
    if unexpected:
        raise ValueError(f"{path} does not match the model's adapters: {unexpected[:3]}")
