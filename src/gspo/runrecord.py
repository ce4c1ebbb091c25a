"""What a run was, beyond its config.yaml, and the resume that would change it.

config.yaml holds the settings, but it cannot hold a reward or rows given from Python, and it
can be deleted or edited between a stop and a resume. So every checkpoint carries `run.json`
(inside the atomic write, covered by its manifest):

    config        the resolved config the checkpoint was trained with
    reward        the reward's identity: data.reward ('module:function', 'file.py:function'), the
                  task's own reward by the task's name, or a Python callable's
                  'module:qualified_name' (several joined by '+')
    reward_from   'config' or 'python' (train(..., reward_fn=...))
    reward_models each reward model's path (data.reward=model:PATH) -> SHA-256 of its files
    train_data    'config' (data.path or a generated task) or 'python' (train_data=...);
    eval_data     the same for the held-out rows
    rows          how many training / held-out rows, and the SHA-256 of both lists
    versions      the software it was trained with: Python, gspo, torch, transformers (and
                  vLLM where the run imported it); a resume under others is said, not refused

A resume (and `gspo train --dry-run --resume`) compares itself with the checkpoint it starts
from and refuses, in one line naming the field and how to start a new run instead:
a change of FROZEN (the model's shape, the objective, where the data come from, the reward's
settings), a different reward (a reward model whose files changed too), different rows (a
changed data file, data.n_eval, data.prompt_template, ...), and train.steps below the steps
already done. A checkpoint
written before run.json existed is checked against config.yaml; with neither, the resume needs
--config to say what the run was.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import platform
import sys
from pathlib import Path
from typing import Any

from gspo.config import Config, load_config, to_dict
from gspo.errors import TrainingError

log = logging.getLogger(__name__)

RUN_FILE = "run.json"
FORMAT = 1

FROZEN = ("model.name_or_path", "model.hidden_size", "model.num_layers", "model.num_heads",
          "model.num_kv_heads", "model.intermediate_size", "model.num_experts",
          "model.num_experts_per_tok", "model.moe_intermediate_size", "model.lora_rank",
          "model.lora_target_modules", "model.lora_alpha",
          "algorithm.name", "algorithm.aggregation", "algorithm.advantage_scale",
          "data.task", "data.path", "data.eval_path", "data.system_prompt",
          "data.reward_mode", "data.format_weight")
"""What a resume cannot change: the model's shape and the LoRA adapter's scale (the checkpoint
would not fit it, or would compute another function); the objective: its name (its presets,
e.g. the clip range, were resolved into the saved config), how the loss is aggregated and how
advantages are normalised; where the prompts come from (the held-out split is drawn from them)
and the system turn they are shown with, which the rows' fingerprint does not cover; and the
settings of the reward itself (the code reward's all-or-fraction, the format bonus), which its
identity does not. What only tunes how the run gets there (learning rate, clip range, KL weight,
timeouts, precision, engine) may change."""


def reward_identity(d, reward_fn=None) -> tuple[str, str]:
    """(identity, 'config' | 'python') of the reward a run scores with: data.reward, the task's
    name for its own reward, or a Python callable's 'module:qualified_name'."""
    if reward_fn is None:
        return d.reward or d.task, "config"
    fns = list(reward_fn) if isinstance(reward_fn, (list, tuple)) else [reward_fn]
    return "+".join(_callable_name(f) for f in fns), "python"


def reward_models(d, reward_fn=None) -> dict[str, str | None]:
    """Each reward model data.reward names (model:PATH) -> the SHA-256 of its files (None where
    no copy is on this machine: a hub id not yet downloaded)."""
    from gspo.rewards import reward_model_paths

    paths = reward_model_paths(d.reward) if reward_fn is None else []
    if not paths:
        return {}
    from gspo.rewards.model import fingerprint  # torch: only for a run that has one
    return {path: fingerprint(path) for path in paths}


def _callable_name(f) -> str:
    target = f if hasattr(f, "__qualname__") else type(f)  # a callable object: its class
    return f"{getattr(target, '__module__', '?')}:{target.__qualname__}"


def rows_fingerprint(train_rows: list[dict], eval_rows: list[dict]) -> str:
    """SHA-256 of both row lists as canonical JSON (a value JSON cannot hold, as its repr)."""
    h = hashlib.sha256()
    for rows in (train_rows, eval_rows):
        for row in rows:
            h.update(json.dumps(row, sort_keys=True, default=repr).encode())
            h.update(b"\n")
        h.update(b"\x00")
    return h.hexdigest()


def make_record(cfg: Config, reward_fn, train_data, eval_data, train_rows: list[dict],
                eval_rows: list[dict]) -> dict:
    """The run.json of a run built from `cfg` and these Python objects (None where the config
    names them) and rows."""
    reward, reward_from = reward_identity(cfg.data, reward_fn)
    return {"format": FORMAT, "config": to_dict(cfg), "reward": reward,
            "reward_from": reward_from, "reward_models": reward_models(cfg.data, reward_fn),
            "train_data": "config" if train_data is None else "python",
            "eval_data": "config" if eval_data is None else "python",
            "rows": {"train": len(train_rows), "eval": len(eval_rows),
                     "sha256": rows_fingerprint(train_rows, eval_rows)},
            "versions": versions()}


IMPORTED_LIBRARIES = ("peft", "vllm")
"""libraries whose version run.json records where the run imported them (LoRA, an engine)"""


def versions() -> dict[str, str]:
    """The software this process trains with: Python, gspo, torch, transformers, and each of
    IMPORTED_LIBRARIES the run imported."""
    import torch
    import transformers

    import gspo
    out = {"python": platform.python_version(), "gspo": gspo.__version__,
           "torch": torch.__version__, "transformers": transformers.__version__}
    for name in IMPORTED_LIBRARIES:
        module = sys.modules.get(name)
        if module is not None:
            out[name] = str(getattr(module, "__version__", "unknown"))
    return out


def write_record(ckpt_dir: Path, record: dict) -> None:
    (Path(ckpt_dir) / RUN_FILE).write_text(json.dumps(record, indent=1) + "\n")


def read_record(ckpt_dir: Path | None) -> dict | None:
    """The checkpoint's run.json, or None for a checkpoint written before it existed."""
    if ckpt_dir is None or not (Path(ckpt_dir) / RUN_FILE).is_file():
        return None
    try:
        record = json.loads((Path(ckpt_dir) / RUN_FILE).read_text())
    except (OSError, ValueError) as e:
        raise TrainingError(f"{Path(ckpt_dir) / RUN_FILE} is unreadable ({e}); restore it from "
                            f"a copy or start a new run") from None
    if not isinstance(record, dict) or record.get("format") != FORMAT:
        raise TrainingError(f"{Path(ckpt_dir) / RUN_FILE} is not a run record this gspo reads "
                            f"(format {record.get('format') if isinstance(record, dict) else '?'})")
    return record


def saved_config(run_dir: Path, record: dict | None, overrides: list[str] = ()) -> Config:
    """The config the run was trained with (the checkpoint's record, else config.yaml), with
    `overrides` applied: what `gspo train --resume DIR` runs with."""
    if record is not None:
        return load_config(None, overrides, base=record["config"])
    if (run_dir / "config.yaml").is_file():
        return load_config(run_dir / "config.yaml", overrides)
    raise TrainingError(f"--resume {run_dir}: config.yaml is missing and its checkpoints "
                        f"predate {RUN_FILE}, so nothing says what the run was; pass its config "
                        f"with --resume {run_dir} --config FILE")


def _get(c: Config | dict, key: str) -> Any:
    """The value of `key` in a config, or in a saved one (a dict: a field that an older gspo
    did not save reads as its default, which is what that gspo trained with)."""
    section, name = key.split(".")
    if isinstance(c, dict):
        if name not in c.get(section, {}):
            return getattr(getattr(Config(), section), name)
        return c[section][name]
    return getattr(getattr(c, section), name)


def _applies(cfg: Config, key: str) -> bool:
    """Whether `key` means anything in `cfg`: a field declared `when=` another setting (e.g.
    model.lora_alpha, with LoRA on) does not where that does not hold."""
    section, name = key.split(".")
    obj = getattr(cfg, section)
    when = next(f.metadata.get("when") for f in dataclasses.fields(obj) if f.name == name)
    return when is None or when(obj)


def _show(value: Any) -> str:
    return "''" if value == "" else str(value)


def check_resume(cfg: Config, run_dir: Path, ckpt: Path, reward_fn=None, train_data=None,
                 eval_data=None) -> dict | None:
    """Refuse a resume from `ckpt` that changes what the run was: FROZEN, the reward, where the
    rows come from, or train.steps below the steps done. Returns the checkpoint's record (None
    for an old checkpoint, then checked against config.yaml's FROZEN fields alone)."""
    record = read_record(ckpt)
    if record is not None:
        saved: Config | dict | None = record["config"]
    elif (run_dir / "config.yaml").is_file():
        saved = load_config(run_dir / "config.yaml")
    else:
        saved = None  # an old checkpoint whose config.yaml is gone: the weights' shape still is
    where = f"--resume {run_dir}"
    new_run = "start a new run with --output-dir for that"
    for what, given in (("train_data", train_data), ("eval_data", eval_data)):
        if record is not None and record[what] == "python" and given is None:
            raise TrainingError(f"{where}: the run was trained on {what} rows given from Python, "
                                f"which config.yaml cannot hold; resume it from Python with "
                                f"train(cfg, {str(run_dir)!r}, resume=True, {what}=<the same "
                                f"rows>), or {new_run}")
    if saved is not None:
        changed = [f"{k}={_show(_get(cfg, k))} (trained with {_show(_get(saved, k))})"
                   for k in FROZEN if _get(cfg, k) != _get(saved, k) and _applies(cfg, k)]
        if changed:
            raise TrainingError(f"{where} cannot change {', '.join(changed)}: {new_run}")
    done = int(ckpt.name.rsplit("_", 1)[1])
    if cfg.train.steps < done:
        raise TrainingError(f"{where}: train.steps={cfg.train.steps} but the run has done {done} "
                            f"RL steps ({ckpt.name}); pass train.steps above {done} to train "
                            f"further, or use its checkpoint as it is")
    if record is None:
        return None
    reward, reward_from = reward_identity(cfg.data, reward_fn)
    if reward != record["reward"]:
        def said(name, source):
            return (f"{name} given from Python" if source == "python" else
                    f"data.reward={name}" if ":" in name or "+" in name
                    else f"the {name} task's own reward")
        fix = ("resume it from Python with train(..., resume=True, reward_fn=<it>)"
               + (f" or set data.reward={record['reward']}" if ":" in record["reward"]
                  and not record["reward"].startswith("__main__:") else "")
               if record["reward_from"] == "python" else "set data.reward back")
        raise TrainingError(f"{where} cannot change the reward to "
                            f"{said(reward, reward_from)} (trained with "
                            f"{said(record['reward'], record['reward_from'])}): {fix}, or "
                            f"{new_run}")
    for path, now in reward_models(cfg.data, reward_fn).items():
        then = record.get("reward_models", {}).get(path)
        if now and then and now != then:
            raise TrainingError(f"{where}: the reward model {path} is not the one the run was "
                                f"trained with (its files' SHA-256 is {now[:12]}..., was "
                                f"{then[:12]}...); restore it, or {new_run}")
    then, now = record.get("versions", {}), versions()
    moved = [f"{k} {then[k]} -> {now[k]}" for k in now if k in then and then[k] != now[k]]
    if moved:  # kernels and defaults may differ: the run goes on, not bit for bit
        log.warning("%s: resuming a run trained with other software (%s): it continues, but "
                    "need not match, bit for bit, a run that was never stopped", where,
                    ", ".join(moved))
    return record


def check_rows(record: dict | None, cfg: Config, run_dir: Path, train_rows: list[dict],
               eval_rows: list[dict]) -> None:
    """Refuse a resume whose training or held-out rows differ from those the run was trained
    with, naming the data.* settings that changed where any did."""
    if record is None:
        return
    rows = record["rows"]
    if rows_fingerprint(train_rows, eval_rows) == rows["sha256"]:
        return
    saved = record["config"]["data"]
    now = to_dict(cfg)["data"]
    changed = [f"data.{k}={_show(now[k])} (trained with {_show(saved.get(k))})" for k in now
               if saved.get(k) != now[k]]
    why = (", ".join(changed) if changed else
           "the rows given from Python differ" if "python" in (record["train_data"],
                                                                record["eval_data"])
           else "the data file's contents changed")
    raise TrainingError(f"--resume {run_dir}: the training / held-out rows differ from the "
                        f"{rows['train']} / {rows['eval']} the run was trained with "
                        f"({len(train_rows)} / {len(eval_rows)} now; {why}); resume with the "
                        f"same data, or start a new run with --output-dir for that")
