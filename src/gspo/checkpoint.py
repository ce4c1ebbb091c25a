"""Checkpoints: a Hugging Face model directory plus the state an exact resume needs.

A checkpoint is `run_dir/checkpoints/step_{step:06d}/` holding

    model.safetensors (or shards + index), config.json, generation_config.json
    tokenizer files                       -> loadable by plain `from_pretrained`
    trainer_state.pt                      -> optimizer, scheduler, trainer dict, RNG states
    reference.pt (only with a KL penalty) -> pi_ref's weights, the policy RL started from
    manifest.json                         -> size and SHA-256 of every other file, written last

Writes are atomic: everything goes into a hidden temp dir next to the final one, is fsynced,
then renamed into place, so a directory named `step_*` is always complete. A crash leaves at
worst a hidden `.tmp-*` / `.trash-*` / `.old-*` dir, which the next save cleans up (an `.old-*`
dir is a finished checkpoint moved aside while the same step was re-saved; it is renamed back
if the re-save never landed). `checkpoints/latest` names the most recently written checkpoint.

Reads are verified: `latest_checkpoint(run_dir, verify=True)` (what a resume uses) checks every
file against the manifest and falls back to the newest intact checkpoint, saying which and why
(a truncated file, a flipped byte, a deleted one); a checkpoint without a manifest is checked
for what can be seen without it (a torch or safetensors file cut short). A save that fails (disk full, permissions)
raises one TrainingError naming the directory and the space needed, and leaves the earlier
checkpoints as they were.

Scope: the caller passes full (unsharded) state, on one process. Under FSDP, rank 0 passes
the gathered weights and optimizer state (`weights=`, `optimizer_state=`; see
gspo.distributed.full_weights / full_optimizer_state), in the same layout one process writes.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pickle
import random
import re
import shutil
import zipfile
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from safetensors import SafetensorError

from gspo.errors import TrainingError, first_line
from gspo.precision import dtype_name
from gspo.weights import untied_missing

log = logging.getLogger(__name__)

CHECKPOINTS_DIR = "checkpoints"
LATEST_FILE = "latest"
STATE_FILE = "trainer_state.pt"
REFERENCE_FILE = "reference.pt"
MANIFEST_FILE = "manifest.json"
FORMAT_VERSION = 1
_STEP_RE = re.compile(r"^step_(\d+)$")
_HIDDEN_PREFIXES = (".tmp-", ".trash-", ".old-")


# ---------------------------------------------------------------------------- save


def _weights_dtype(weights: dict[str, torch.Tensor]) -> torch.dtype | None:
    return next((t.dtype for t in weights.values() if t.is_floating_point()), None)


def _set_config_dtype(directory: Path, dtype: torch.dtype) -> None:
    """config.json's dtype as the saved weights have it (LoRA on a bf16 base saves float32
    merged weights; from_pretrained loads in config.json's dtype)."""
    path = directory / "config.json"
    if not path.is_file():
        return
    config = json.loads(path.read_text())
    config["dtype"] = dtype_name(dtype)
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def save_checkpoint(
    run_dir: str | os.PathLike,
    step: int,
    model,
    tokenizer,
    optimizer: torch.optim.Optimizer | None,
    scheduler: Any | None,
    trainer_state: dict,
    keep_last: int = 3,
    weights: dict[str, torch.Tensor] | None = None,
    optimizer_state: dict | None = None,
    reference: dict[str, torch.Tensor] | None = None,
    extra: Callable[[Path], None] | None = None,
) -> Path:
    """Write checkpoint `step` atomically, point `latest` at it, prune old ones; return its path.

    `trainer_state` holds what the loop needs to continue (step, data position, ...): values
    must be JSON-like Python types or tensors, because loading uses torch.load(weights_only=True).
    `tokenizer`, `optimizer` and `scheduler` may be None (e.g. a weights-only final save).
    `keep_last <= 0` keeps every checkpoint; the one just written is never pruned.
    `weights` / `optimizer_state` replace model.state_dict() / optimizer.state_dict() (a
    sharded model's gathered state). `reference`: pi_ref's state dict, kept for a resume.
    `extra(dir)` writes more files (e.g. a LoRA adapter) into the checkpoint before it is
    published, so they are part of the atomic write.
    """
    ckpts = Path(run_dir) / CHECKPOINTS_DIR
    ckpts.mkdir(parents=True, exist_ok=True)
    _clean_stale(ckpts)
    name = f"step_{step:06d}"
    tmp = ckpts / f".tmp-{name}-{os.getpid()}"
    try:
        tmp.mkdir()
        # save_pretrained empties `weights` as it writes: the dtype first
        dtype = None if weights is None else _weights_dtype(weights)
        model.save_pretrained(tmp, **({"state_dict": weights} if weights is not None else {}))
        if dtype is not None:  # config.json names the model's dtype, not the weights'
            _set_config_dtype(tmp, dtype)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        if optimizer_state is None and optimizer is not None:
            optimizer_state = optimizer.state_dict()
        torch.save(_trainer_payload(step, optimizer_state, scheduler, trainer_state),
                   tmp / STATE_FILE)
        if reference is not None:
            torch.save(reference, tmp / REFERENCE_FILE)
        if extra is not None:
            extra(tmp)
        _write_manifest(tmp)
        _fsync_tree(tmp)
        final = _publish(tmp, ckpts / name)
    except (OSError, RuntimeError, SafetensorError) as e:  # disk full, permissions (torch and
        # safetensors report ENOSPC in their own exception types)
        shutil.rmtree(tmp, ignore_errors=True)
        raise TrainingError(f"could not write checkpoint {name} in {ckpts} "
                            f"({str(e).splitlines()[0][:200]}); it needs about "
                            f"{_needed_mb(ckpts, model):.0f} MB and {_free_mb(ckpts):.0f} MB are "
                            f"free there; the earlier checkpoints are intact") from e
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    write_text_atomic(ckpts / LATEST_FILE, name + "\n")
    _prune(ckpts, keep=final, keep_last=keep_last)
    return final


def _trainer_payload(step: int, optimizer_state: dict | None, scheduler, trainer_state: dict
                     ) -> dict:
    """Everything besides the weights that a resume needs, as torch.load(weights_only) types."""
    return {
        "format_version": FORMAT_VERSION,
        "step": step,
        "optimizer": optimizer_state,
        "scheduler": scheduler.state_dict() if scheduler is not None else None,
        "trainer_state": dict(trainer_state),
        "rng": _get_rng_state(),
    }


def _write_manifest(d: Path) -> None:
    files = sorted(p for p in d.rglob("*") if p.is_file() and p.name != MANIFEST_FILE)
    entries = {str(p.relative_to(d)): {"bytes": p.stat().st_size, "sha256": _sha256(p)}
               for p in files}
    (d / MANIFEST_FILE).write_text(json.dumps({"files": entries}, indent=1) + "\n")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def damage(d: Path) -> str | None:
    """What is wrong with checkpoint `d`, or None when every file matches its manifest. A
    checkpoint without one (written before manifests existed, or its manifest lost) is checked
    for what can be seen without it (`unreadable`)."""
    if not _is_complete(d):
        return "config, weights or trainer state missing"
    manifest = d / MANIFEST_FILE
    if not manifest.is_file():
        return unreadable(d)
    try:
        entries = json.loads(manifest.read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return f"{MANIFEST_FILE} is unreadable"
    for rel, entry in entries.items():
        path = d / rel
        if not path.is_file():
            return f"{rel} is missing"
        size = path.stat().st_size
        if size != entry["bytes"]:
            return f"{rel} has {size} bytes where {entry['bytes']} were written"
        if _sha256(path) != entry["sha256"]:
            return f"{rel} does not match the checksum it was written with"
    return None


def unreadable(d: Path) -> str | None:
    """What of checkpoint `d` cannot be read, without a manifest to check it against: a torch
    file (trainer_state.pt, reference.pt) whose zip directory, at its end, is gone (truncated),
    or a safetensors file shorter or longer than its header says, or whose header safetensors
    cannot read. A flipped byte inside a file only the manifest's hash finds."""
    for name in (STATE_FILE, REFERENCE_FILE):
        path = d / name
        if path.is_file() and not _zip_readable(path):
            return f"{name} is unreadable (truncated, or not written by torch.save)"
    index = d / "model.safetensors.index.json"
    try:
        shards = (sorted(set(json.loads(index.read_text())["weight_map"].values()))
                  if index.is_file() else ["model.safetensors"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return f"{index.name} is unreadable"
    for shard in shards:
        if not (d / shard).is_file():
            return f"{shard} is missing"
        if not _safetensors_whole(d / shard):
            return f"{shard} is unreadable (its size is not the one its header gives)"
        problem = _safetensors_header_problem(d / shard)
        if problem is not None:
            return f"{shard} is unreadable ({problem})"
    return None


def _zip_readable(path: Path) -> bool:
    """Whether `path` opens as a zip archive, as every torch.save file since torch 1.6 is."""
    try:
        with zipfile.ZipFile(path) as z:
            z.infolist()
        return True
    except (zipfile.BadZipFile, OSError, ValueError, EOFError):
        return False


def _safetensors_whole(path: Path) -> bool:
    """Whether a safetensors file is as long as its header says: 8 bytes of header length, the
    JSON header, then the tensors' data up to the largest end offset."""
    try:
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            size = path.stat().st_size
            if n <= 0 or 8 + n > size:
                return False
            header = json.loads(f.read(n))
        end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"),
                  default=0)
        return size == 8 + n + end
    except (OSError, ValueError, KeyError, TypeError, IndexError, AttributeError):
        return False


def _safetensors_header_problem(path: Path) -> str | None:
    """What safetensors itself finds wrong with the header of a file whose size is right (a
    dtype or offsets it cannot read), or None; the tensors' data are not read."""
    from safetensors import safe_open

    try:
        with safe_open(path, "pt") as f:
            f.keys()
        return None
    except (SafetensorError, OSError) as e:
        return first_line(e, 200)


def _needed_mb(ckpts: Path, model) -> float:
    """The size of the newest finished checkpoint, else weights plus AdamW's two moments."""
    done = _complete_checkpoints(ckpts) if ckpts.is_dir() else []
    if done:
        return sum(p.stat().st_size for p in done[-1].rglob("*") if p.is_file()) / 2**20
    return 3 * sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20


def _free_mb(path: Path) -> float:
    try:
        return shutil.disk_usage(path).free / 2**20
    except OSError:
        return float("nan")


def _publish(tmp: Path, final: Path) -> Path:
    """Rename the finished temp dir to its final name (moving an existing same-step dir aside).

    os.replace cannot overwrite a non-empty dir, so a re-save of the same step first renames the
    old one to `.old-*`; a crash between the two renames is repaired by `_clean_stale`.
    """
    old = None
    if final.exists():
        old = final.with_name(f".old-{final.name}-{os.getpid()}")
        os.replace(final, old)
    os.replace(tmp, final)
    _fsync_dir(final.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return final


def _prune(ckpts: Path, keep: Path, keep_last: int) -> None:
    """Delete all but the newest `keep_last` complete checkpoints, always keeping `keep`.

    Each victim is renamed to `.trash-*` before deletion so a crash mid-delete never leaves a
    partial dir under a `step_*` name.
    """
    if keep_last <= 0:
        return
    others = [d for d in _complete_checkpoints(ckpts) if d.name != keep.name]
    for victim in others[: max(0, len(others) - (keep_last - 1))]:
        trash = victim.with_name(f".trash-{victim.name}-{os.getpid()}")
        os.replace(victim, trash)
        shutil.rmtree(trash, ignore_errors=True)


def _clean_stale(ckpts: Path) -> None:
    """Remove leftovers of crashed saves; restore an `.old-*` dir whose re-save never landed."""
    restore_moved_aside(ckpts.parent)
    for entry in ckpts.iterdir():
        if entry.is_file() and entry.name.startswith(f".{LATEST_FILE}.tmp-"):
            entry.unlink(missing_ok=True)  # a `latest` rewrite that never got renamed
            continue
        if entry.is_dir() and entry.name.startswith(_HIDDEN_PREFIXES):
            shutil.rmtree(entry, ignore_errors=True)


def restore_moved_aside(run_dir: str | os.PathLike) -> None:
    """Rename back each finished checkpoint that a re-save of its step moved aside (`.old-*`)
    and never replaced (a kill between `_publish`'s two renames): until then no resume sees
    it (the run's only checkpoint: "no finished checkpoint"). A resume calls this under the
    run's lock, before it looks for its checkpoint."""
    ckpts = Path(run_dir) / CHECKPOINTS_DIR
    if not ckpts.is_dir():
        return
    for entry in ckpts.iterdir():
        if entry.is_dir() and entry.name.startswith(".old-"):
            original = ckpts / entry.name[len(".old-") :].rsplit("-", 1)[0]
            if not original.exists():
                os.replace(entry, original)


def write_text_atomic(path: Path, text: str) -> None:
    """Write a small file via temp file + fsync + rename, so readers see old or new, never half."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _fsync_tree(root: Path) -> None:
    """fsync every file and dir under `root`, so the rename publishes data that is on disk."""
    for dirpath, _, filenames in os.walk(root):
        for fn in filenames:
            with open(os.path.join(dirpath, fn), "rb") as f:
                os.fsync(f.fileno())
        _fsync_dir(Path(dirpath))


def _fsync_dir(path: Path) -> None:
    """fsync a directory entry table (a no-op where the OS does not allow it, e.g. Windows)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


# ---------------------------------------------------------------------------- find


def is_step_dir(path: Path) -> bool:
    """Whether `path` is named as a checkpoint (step_N)."""
    return bool(_STEP_RE.match(path.name))


def latest_checkpoint(path: str | os.PathLike, verify: bool = False) -> Path | None:
    """Newest complete checkpoint under a run dir, its checkpoints dir, or a checkpoint dir.

    "Newest" is the one `latest` names (the last written, which matters after resuming from an
    earlier step); if that is missing or incomplete, the highest complete step. Temp dirs are
    never returned. None when there is no complete checkpoint.

    verify: check the files against their manifests; a damaged checkpoint is reported (one
    warning) and the next older one is tried; TrainingError when none is intact.
    """
    path = Path(path)
    if is_step_dir(path):
        candidates = [path] if _is_complete(path) else []
    else:
        ckpts = path / CHECKPOINTS_DIR if (path / CHECKPOINTS_DIR).is_dir() else path
        if not ckpts.is_dir():
            return None
        candidates = _complete_checkpoints(ckpts)[::-1]
        pointer = ckpts / LATEST_FILE
        if pointer.is_file():
            named = ckpts / pointer.read_text().strip()
            if named in candidates:
                candidates.remove(named)
                candidates.insert(0, named)
    if not verify:
        return candidates[0] if candidates else None
    damaged = []
    for ckpt in candidates:
        problem = damage(ckpt)
        if problem is None:
            if damaged:
                log.warning("resuming from %s, the newest intact checkpoint", ckpt.name)
            return ckpt
        log.warning("checkpoint %s is damaged (%s); trying the one before it", ckpt, problem)
        damaged.append(f"{ckpt.name}: {problem}")
    if damaged:
        raise TrainingError(f"no intact checkpoint in {path}: {'; '.join(damaged)}; start a new "
                            f"run (or restore the files)")
    return None


def _complete_checkpoints(ckpts: Path) -> list[Path]:
    """Complete `step_*` dirs in `ckpts`, oldest step first."""
    found = [d for d in ckpts.iterdir() if is_step_dir(d) and _is_complete(d)]
    return sorted(found, key=lambda d: int(_STEP_RE.match(d.name).group(1)))


def _is_complete(d: Path) -> bool:
    """True when `d` holds config, weights and trainer state (guards against hand-made dirs)."""
    weights = ("model.safetensors", "model.safetensors.index.json")
    has_weights = any((d / name).is_file() for name in weights)
    return has_weights and (d / "config.json").is_file() and (d / STATE_FILE).is_file()


# ---------------------------------------------------------------------------- load


def load_checkpoint(
    ckpt_dir: str | os.PathLike,
    model,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Any | None = None,
    restore_rng: bool = True,
    load_weights: bool = True,
) -> dict:
    """Load weights, optimizer, scheduler and RNG states from `ckpt_dir`; return trainer_state.

    The returned dict is the `trainer_state` passed to `save_checkpoint`, with "step" filled in
    if it was absent. Pass `restore_rng=False` to load for evaluation without touching RNGs,
    and `load_weights=False` to leave the model as it is (LoRA restores its adapter instead).
    """
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.is_dir():
        raise FileNotFoundError(f"checkpoint dir not found: {ckpt_dir}")
    if not _is_complete(ckpt_dir):
        raise ValueError(
            f"incomplete checkpoint (need config.json, model.safetensors and {STATE_FILE}): "
            f"{ckpt_dir}; to resume a run, pass latest_checkpoint(run_dir)"
        )
    payload = _torch_load(ckpt_dir / STATE_FILE)
    if load_weights:
        _load_weights(ckpt_dir, model)
    if optimizer is not None:
        _load_component(optimizer, payload.get("optimizer"), "optimizer", ckpt_dir)
    if scheduler is not None:
        _load_component(scheduler, payload.get("scheduler"), "scheduler", ckpt_dir)
    if restore_rng:
        _set_rng_state(payload["rng"])
    state = dict(payload["trainer_state"])
    state.setdefault("step", payload["step"])
    return state


def read_reference(ckpt_dir: str | os.PathLike) -> dict[str, torch.Tensor] | None:
    """pi_ref's weights saved with the checkpoint, or None when it holds none."""
    path = Path(ckpt_dir) / REFERENCE_FILE
    return _torch_load(path) if path.is_file() else None


def read_training_state(ckpt_dir: str | os.PathLike) -> tuple[dict, dict]:
    """The optimizer and scheduler state dicts a checkpoint holds, for a caller that builds its
    optimiser after loading the weights (a sharded model: see gspo.distributed)."""
    payload = _torch_load(Path(ckpt_dir) / STATE_FILE)
    for what in ("optimizer", "scheduler"):
        if payload.get(what) is None:
            raise ValueError(f"checkpoint {ckpt_dir} has no {what} state (saved with {what}=None)")
    return payload["optimizer"], payload["scheduler"]


def _torch_load(path: Path):
    """A checkpoint's torch file; one that cannot be read (damaged after a resume checked it, or
    loaded without that check) is a TrainingError naming it."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except (RuntimeError, EOFError, pickle.UnpicklingError) as e:
        raise _damaged(path, e) from e


def _damaged(path: Path, e: BaseException) -> TrainingError:
    """A checkpoint file that cannot be read, named with what the reader said and the fix."""
    return TrainingError(f"{path} cannot be read ({first_line(e, 200)}): the checkpoint is damaged; "
                         f"restore the file, or move {path.parent} aside to resume from the "
                         f"checkpoint before it")


def _load_component(obj, state_dict: dict | None, what: str, ckpt_dir: Path) -> None:
    """Load an optimizer/scheduler state, failing clearly if the checkpoint saved none."""
    if state_dict is None:
        raise ValueError(f"checkpoint {ckpt_dir} has no {what} state (saved with {what}=None)")
    obj.load_state_dict(state_dict)


def _load_weights(ckpt_dir: Path, model) -> None:
    """Copy the checkpoint's weights into `model` in place.

    Fast path: the safetensors keys are the model's own state_dict keys, less tied aliases such
    as lm_head.weight. When they are not (transformers v5 fuses e.g. Qwen3-MoE experts in memory
    but saves them per expert), let transformers convert by building a fresh model with
    `from_pretrained` and copying its state; that costs a second copy of the weights in memory.
    """
    state = _read_safetensors(ckpt_dir)
    if not _keys_match(model, state):
        state = _state_via_from_pretrained(ckpt_dir, model)
    result = model.load_state_dict(state, strict=False)
    untied = untied_missing(model, set(result.missing_keys))
    if result.unexpected_keys or untied:
        raise ValueError(
            f"checkpoint {ckpt_dir} does not match the model: missing {sorted(untied)[:5]}, "
            f"unexpected {sorted(result.unexpected_keys)[:5]}"
        )


def _read_safetensors(ckpt_dir: Path) -> dict[str, torch.Tensor]:
    """All tensors of a single-file or sharded (index.json) safetensors checkpoint, on CPU."""
    from safetensors.torch import load_file

    def load(path: Path) -> dict[str, torch.Tensor]:
        try:
            return load_file(path)
        except SafetensorError as e:  # damaged after a resume checked it, or never checked
            raise _damaged(path, e) from e

    index = ckpt_dir / "model.safetensors.index.json"
    if not index.is_file():
        return load(ckpt_dir / "model.safetensors")
    shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    state: dict[str, torch.Tensor] = {}
    for shard in shards:
        state.update(load(ckpt_dir / shard))
    return state


def _keys_match(model, state: dict) -> bool:
    """True when `state` has no foreign keys and lacks only tied aliases of the model's keys."""
    expected = model.state_dict()
    if set(state) - set(expected):
        return False
    return not untied_missing(model, set(expected) - set(state), expected)


def _state_via_from_pretrained(ckpt_dir: Path, model) -> dict[str, torch.Tensor]:
    """Load `ckpt_dir` with the model's own class so transformers applies its key conversions."""
    from transformers import PreTrainedModel

    if not isinstance(model, PreTrainedModel):
        raise ValueError(
            f"checkpoint {ckpt_dir} keys differ from {type(model).__name__}'s state_dict and the "
            "model is not a transformers PreTrainedModel (load before wrapping/compiling it)"
        )
    dtype = next(model.parameters()).dtype
    fresh = type(model).from_pretrained(ckpt_dir, dtype=dtype)
    return fresh.state_dict()


# ---------------------------------------------------------------------------- RNG


def _get_rng_state() -> dict:
    """Python, numpy (legacy global), torch CPU and, when present, all CUDA generator states."""
    np_state = np.random.get_state(legacy=False)
    np_state["state"] = {"key": np_state["state"]["key"].tolist(), "pos": np_state["state"]["pos"]}
    state = {"python": random.getstate(), "numpy": np_state, "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict) -> None:
    """Inverse of `_get_rng_state`; CUDA states are restored only where a GPU is present."""
    random.setstate(_as_tuples(state["python"]))
    np_state = dict(state["numpy"])
    np_state["state"] = {
        "key": np.asarray(np_state["state"]["key"], dtype=np.uint32),
        "pos": np_state["state"]["pos"],
    }
    np.random.set_state(np_state)
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"][: torch.cuda.device_count()])


def _as_tuples(x):
    """random.setstate needs tuples; be safe if a serializer handed lists back."""
    return tuple(_as_tuples(v) for v in x) if isinstance(x, (list, tuple)) else x
