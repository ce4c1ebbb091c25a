"""`gspo eval`: avg@K and pass@k of a model on a math or code data file.

    gspo eval --model PATH --data FILE --task math|code [--k K] [--output FILE.jsonl]
              [--engine NAME] [data.prompt_field=question ...] [rollout.KEY=VALUE ...]

The model and its rollout engine are built by the code `gspo train` builds them with
(gspo.preflight.build_model and gspo.trainer.build_engine), from a config of the flags and the
data.* and rollout.* overrides (the engine's own settings). K responses are sampled per problem with the
engine and scored with the task's reward (format bonus off: correctness only). Reported per problem and overall: avg@K, the mean reward
over all K samples (the paper's AIME'24 avg@32), and the unbiased pass@k estimator for k = 1,
2, 4, ... up to K (a sample counts as correct when its reward is >= 1). The numbers come from
gspo.evaluation.evaluate, the code the trainer's periodic evaluation runs. The JSONL holds one
row per problem (its samples, rewards and metrics) and a last row with "id": "overall"; a table
is printed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
import time
from pathlib import Path
from typing import Sequence

from gspo.config import Config, DataConfig, load_config
from gspo.distributed import resolve_device
from gspo.engines import ENGINES, RolloutEngine, SamplingParams
from gspo.errors import ConfigError, TrainingError
from gspo.evaluation import EvalResult, evaluate, pass_at_k
from gspo.rewards import RewardFn, close_reward
from gspo.runrecord import reward_identity
from gspo.tasks import TASKS, build_reward, file_tasks
from gspo.tasks.datasets import load_rows
from gspo.preflight import build_model, setting_warnings
from gspo.trainer import build_engine

TABLE_ROWS = 50  # problems printed; the JSONL always has them all


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="gspo eval", description="avg@K and pass@k of a model on a math or code data file.",
        epilog="data.* overrides map the file's fields and set the reward, as for gspo train "
               "(gspo train --help lists them): e.g. data.prompt_field=question "
               "data.system_prompt='...' data.reward=my_module:my_reward; rollout.* overrides "
               "set the engine's own settings; the model is built or loaded as gspo train "
               "builds it (model.name_or_path: tiny-qwen3, tiny-qwen3-moe, a directory, a "
               "hub id)")
    p.add_argument("--model", required=True,
                   help="model directory or hub id (or 'tiny-qwen3' / 'tiny-qwen3-moe', randomly "
                        "initialised with --seed); a run directory (or its checkpoints/) means "
                        "its latest checkpoint")
    p.add_argument("--data", required=True, help=".jsonl, .json, .parquet, .csv, a datasets "
                   "directory or a hub dataset id (with data.subset=..., data.split=...)")
    tasks = {name: TASKS[name] for name in file_tasks()}  # a synthetic task has no file
    p.add_argument("--task", required=True, choices=list(tasks), help="the task, whose reward "
                   "scores the samples: " + "; ".join(f"{n}: {t.help}" for n, t in tasks.items()))
    p.add_argument("--k", type=int, default=4, help="samples per problem (the paper: 32)")
    p.add_argument("--output", help="JSONL file (default: eval-<task>-<time>.jsonl)")
    p.add_argument("--max-new-tokens", type=int, default=1024, help="longest response")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling threshold")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (and a tiny "
                   "model's initialisation, train.seed)")
    p.add_argument("--batch-size", type=int, default=16, help="problems per generate call "
                   "(each sampled K times)")
    p.add_argument("--limit", type=int, default=0, help="only the first N problems (0 = all)")
    p.add_argument("--dtype", default="float32", help="float32 | bfloat16 | float16: the "
                   "weights' and the sampler's (rollout.dtype)")
    p.add_argument("--engine", default=None, help="rollout engine (rollout.engine, default "
                   "as gspo train's): " + " | ".join(ENGINES) + "; its own settings are "
                   "rollout.* overrides, e.g. rollout.vllm_gpu_memory_utilization=0.8")
    p.add_argument("--device", default=None, help="cpu, cuda, ... (default: cuda if available)")
    p.add_argument("overrides", nargs="*", metavar="data.key=value",
                   help="data.* and rollout.* config overrides")
    return p


def main(argv: list[str] | None = None) -> int:
    """`gspo eval`; user errors raise GspoError, which `gspo.cli.main` prints (exit 2)."""
    args = _parser().parse_args(sys.argv[1:] if argv is None else argv)
    output = Path(args.output or f"eval-{args.task}-{time.strftime('%Y%m%d-%H%M%S')}.jsonl")
    if output.is_dir() or not output.parent.is_dir():  # before the evaluation, not after it
        raise ConfigError(f"--output {output}: must name a file in an existing directory")
    check_writable(output)
    if args.k < 1 or args.batch_size < 1 or args.limit < 0:
        raise ConfigError("--k and --batch-size must be >= 1 and --limit >= 0")
    try:
        params = SamplingParams(args.temperature, args.top_p, args.max_new_tokens)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    cfg = eval_config(args.model, args.task, args.data, args.overrides, engine=args.engine,
                      dtype=args.dtype, seed=args.seed, device=args.device)
    on_cpu = resolve_device(cfg.train.device).type == "cpu"
    for warning in setting_warnings(cfg, on_cpu, flags=FLAGS):
        print(f"warning: {warning}", file=sys.stderr)  # a --dtype this CPU runs slowly
    rows, reward_fn = load_eval_task(cfg.data, args.limit)
    try:
        engine, tokenizer = load_engine(cfg)
    except BaseException:
        close_reward(reward_fn)
        raise
    t0 = time.perf_counter()
    try:
        result = evaluate(engine, tokenizer, rows, reward_fn, args.k, params, args.seed,
                          batch_size=args.batch_size,
                          system_prompt=cfg.data.system_prompt or None,
                          reward_timeout_s=cfg.data.reward_fn_timeout or None)
    finally:
        close_reward(reward_fn)
        engine.close()
    records = report_records(result, rows, args.k)
    write_jsonl(records, output)
    samples = len(result.per_problem) * args.k
    if samples and result.reward_failures == samples:  # a 0% that measured nothing
        raise TrainingError(f"the reward {reward_identity(cfg.data)[0]} failed on every one of "
                            f"the {samples} samples (first error: {result.first_error}), so "
                            f"nothing was measured; fix the reward function (the samples are "
                            f"in {output})")
    print(format_table(records, args.k))
    print(f"\n  {len(rows)} problems x {args.k} samples in {time.perf_counter() - t0:.0f} s; "
          f"written to {output}")
    return 0


FLAGS = {"rollout.engine": "--engine", "rollout.dtype": "--dtype",
         "rollout.temperature": "--temperature", "rollout.top_p": "--top-p",
         "rollout.max_new_tokens": "--max-new-tokens"}
"""The settings `gspo eval` takes as flags, not as overrides."""


def eval_config(model: str, task: str, data: str, overrides: Sequence[str] = (), *,
                engine: str | None = None, dtype: str = "float32", seed: int = 0,
                device: str | None = None) -> Config:
    """The config `gspo eval` builds its model, engine and reward from, as `gspo train` would:
    model.name_or_path (a run directory meaning its latest checkpoint), data.task / data.path
    and data.* overrides, rollout.engine / rollout.dtype / train.seed / train.device from the
    flags, and rollout.* overrides (the engine's own settings)."""
    bad = [o for o in overrides if not o.startswith(("data.", "rollout."))]
    if bad:
        raise ConfigError(f"gspo eval takes data.* and rollout.* overrides only, got "
                          f"{' '.join(bad)}")
    flagged = [f"{o} (set with {FLAGS[key]})" for o in overrides
               if (key := o.split("=", 1)[0].strip()) in FLAGS]
    if flagged:
        raise ConfigError(f"gspo eval takes these as flags: {', '.join(flagged)}")
    # json.dumps quotes a path, so YAML reads any path as a string
    flags = [f"model.name_or_path={json.dumps(model_dir(model))}", f"data.task={task}",
             f"data.path={json.dumps(data)}", f"rollout.dtype={dtype}", f"train.seed={seed}"]
    flags += [f"rollout.engine={engine}"] * (engine is not None)
    flags += [f"train.device={json.dumps(device)}"] * (device is not None)
    try:
        cfg = load_config(overrides=[*flags, *overrides])
        resolve_device(cfg.train.device)  # a device that does not exist, said here
        return cfg
    except ConfigError as e:  # name the flag its user typed, not the key it sets
        message = str(e)
        for key, flag in (("rollout.engine", "--engine"), ("rollout.dtype", "--dtype"),
                          ("train.device", "--device")):
            message = re.sub(rf"\b{re.escape(key)}\b(?![\w.])", flag, message)
        raise ConfigError(message) from None


def load_eval_task(d: DataConfig, limit: int = 0) -> tuple[list[dict], RewardFn]:
    """(every row of data.path, or the first `limit`; the reward with the format bonus off)."""
    d = dataclasses.replace(d, format_weight=0.0)
    rows = load_rows(d.path, d)
    return rows[:limit] if limit else rows, build_reward(d)


def load_engine(cfg: Config) -> tuple[RolloutEngine, object]:
    """(the rollout engine, the tokenizer) of cfg's model, built as `gspo train` builds them
    (gspo.preflight.build_model, gspo.trainer.build_engine), for sampling only: on
    train.device, in rollout.dtype."""
    import transformers

    transformers.utils.logging.disable_progress_bar()  # no "Loading weights" bar
    model, tokenizer = build_model(cfg, resolve_device(cfg.train.device), training=False)
    return build_engine(model.eval(), tokenizer, cfg), tokenizer


def model_dir(path: str) -> str:
    """What --model names, as something from_pretrained loads: a run directory, its
    checkpoints/ or checkpoints/latest mean the latest checkpoint; a LoRA adapter alone is an
    error naming the checkpoint that holds it merged. A path that does not exist (a hub id) is
    passed on as it is."""
    from gspo.checkpoint import CHECKPOINTS_DIR, LATEST_FILE, latest_checkpoint
    from gspo.errors import ModelLoadError
    from gspo.lora import ADAPTER_DIR

    p = Path(path).expanduser()
    if not p.exists():
        return path
    if p.is_file() and p.name == LATEST_FILE and p.parent.name == CHECKPOINTS_DIR:
        p = p.parent
    if p.is_file():
        raise ModelLoadError(f"--model {path} is a file; pass a model directory (config.json and "
                             f"weights), a run directory or a hub id")
    if (p / "adapter_config.json").is_file() and not (p / "config.json").is_file():
        where = (f"the checkpoint that holds it, {p.parent}, whose weights have it merged"
                 if p.name == ADAPTER_DIR else "the model it was trained on, with the adapter "
                 "merged (peft's merge_and_unload, then save_pretrained)")
        raise ModelLoadError(f"--model {path} is a LoRA adapter alone, not a model; pass {where}")
    if (p / "config.json").is_file():
        return str(p)
    ckpt = latest_checkpoint(p)
    if ckpt is None:
        raise ModelLoadError(f"--model {path}: neither a model directory (no config.json) nor a "
                             f"run directory with a checkpoint; pass one of them or a hub id")
    print(f"evaluating {ckpt}, the latest checkpoint of {path}", file=sys.stderr)
    return str(ckpt)


def report_records(result: EvalResult, rows: Sequence[dict], k: int) -> list[dict]:
    """One record per problem, then the overall one; every record has the same metric keys."""
    ks = sorted(result.pass_at)
    records = []
    for i, (row, p) in enumerate(zip(rows, result.per_problem, strict=True)):
        rec = {"id": i, "n": k, "correct": p["correct"],
               f"avg@{k}": sum(p["rewards"]) / k,
               **{f"pass@{j}": pass_at_k(k, p["correct"], j) for j in ks},
               "prompt": row["prompt"]}
        if "answer" in row:
            rec["answer"] = row["answer"]
        records.append({**rec, "rewards": p["rewards"], "completions": p["completions"]})
    records.append({"id": "overall", "n": k, "problems": len(rows),
                    "correct": sum(p["correct"] for p in result.per_problem),
                    f"avg@{k}": result.avg_at_k,
                    **{f"pass@{j}": result.pass_at[j] for j in ks},
                    "reward_failures": result.reward_failures})
    return records


def check_writable(path: Path) -> None:
    """ConfigError unless `path` can be written (a directory without write permission, a
    read-only filesystem): said before the evaluation, whose results would otherwise be lost.
    An existing file is left as it is; a new one is not left behind."""
    existed = path.exists()
    try:
        with path.open("a"):
            pass
    except OSError as e:
        raise ConfigError(f"--output {path}: cannot write it ({e.strerror or e})") from None
    if not existed:
        path.unlink(missing_ok=True)


def write_jsonl(records: list[dict], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for rec in records:
            f.write(json.dumps(rec, default=str) + "\n")


def format_table(records: list[dict], k: int, max_rows: int = TABLE_ROWS) -> str:
    metrics = [f"avg@{k}"] + [key for key in records[-1] if key.startswith("pass@")]
    header = f"  {'problem':>7}  {'correct':>7}  " + "  ".join(f"{m:>8}" for m in metrics)
    lines = [header + "  prompt", "  " + "-" * (len(header) + 30)]
    problems = records[:-1]
    for rec in problems[:max_rows]:
        prompt = " ".join(str(rec["prompt"]).split())
        lines.append(f"  {rec['id']:>7}  {rec['correct']:>4}/{k:<2}  "
                     + "  ".join(f"{100 * rec[m]:7.1f}%" for m in metrics)
                     + f"  {prompt[:40] + ('...' if len(prompt) > 40 else '')}")
    if len(problems) > max_rows:
        lines.append(f"  ... {len(problems) - max_rows} more problems in the JSONL")
    overall = records[-1]
    lines.append("  " + "-" * (len(header) + 30))
    lines.append(f"  {'overall':>7}  {overall['correct']:>7}  "
                 + "  ".join(f"{100 * overall[m]:7.1f}%" for m in metrics)
                 + f"  {overall['problems']} problems")
    return "\n".join(lines)
