"""Reward functions: plain callables `f(completion: str, **row_fields) -> float`.

Built in: `gspo.rewards.math` (math-verify equivalence of the final answer) and
`gspo.rewards.code` (the program run against the row's tests in the sandbox). A user's own is
named in the config as `data.reward=module:function` (or `path/to/file.py:function`) and loaded
by `load_reward`; `data.reward=model:PATH` scores with a sequence-classification reward model
(`gspo.rewards.model`, a batched reward). `data.reward` may add several, each with an optional
weight: `math+0.5*model:PATH` (see `parse_reward_spec`). Training and evaluation both score
through `gspo.data.score`, where a reward that raises or returns a non-finite value counts 0 and
is logged, never killing the run. A reward that holds resources (the code reward's thread pool,
the math reward's helper process) has a `close()`; `close_reward` calls it when the run or the
evaluation ends.

The submodules are imported lazily: the math-verify helper process imports this package and
should not pay for the sandbox.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
from math import isfinite  # not `import math`: the submodule gspo.rewards.math takes that name
import re
from pathlib import Path
from typing import Callable

from gspo.errors import ConfigError

log = logging.getLogger(__name__)

RewardFn = Callable[..., float]
"""A reward: `f(completion: str, **row_fields) -> float`, called with one completion and every
field of its row but the prompt (e.g. `answer=` or `tests=`), so it declares the fields it reads
and takes `**_` for the rest. Any callable object will do; one with a `close()` is closed by
`close_reward`. An alias rather than a Protocol: each reward names its own fields, which no
one signature could spell."""


MODEL_PREFIX = "model:"
"""data.reward=model:PATH: a reward model (gspo.rewards.model) rather than module:function."""

_WEIGHTED = re.compile(r"\s*([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE]-?\d+)?)\s*\*\s*(.*)", re.S)


def parse_reward_spec(spec: str) -> list[tuple[float, str]]:
    """data.reward as (weight, name) parts: 'math+0.5*model:PATH' -> [(1.0, 'math'), (0.5,
    'model:PATH')]. Parts are separated by '+' and summed, each optionally 'WEIGHT*' first (a
    plain decimal, negative for a penalty); a name is a task's, 'module:function',
    'file.py:function' or 'model:PATH' (so none of them may hold a '+')."""
    parts = []
    for text in spec.split("+"):
        match = _WEIGHTED.fullmatch(text)
        weight, name = (float(match[1]), match[2].strip()) if match else (1.0, text.strip())
        if not name:
            raise ConfigError(f"data.reward '{spec}' has an empty part; write rewards to add as "
                              f"'math+model:PATH' or with weights '1*math+0.5*model:PATH'")
        if not isfinite(weight):
            raise ConfigError(f"data.reward '{spec}': the weight of {name} must be a finite "
                              f"number")
        parts.append((weight, name))
    return parts


def reward_model_paths(spec: str) -> list[str]:
    """The PATH of each 'model:PATH' part of data.reward."""
    return [name[len(MODEL_PREFIX):] for _, name in parse_reward_spec(spec)
            if name.startswith(MODEL_PREFIX)] if spec else []


def load_reward(spec: str) -> RewardFn:
    """The callable named by 'package.module:function' or 'path/to/file.py:function'."""
    module_name, sep, attr = spec.rpartition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(f"data.reward '{spec}' must look like 'module:function' or "
                          f"'path/to/file.py:function'")
    try:
        if module_name.endswith(".py"):
            path = Path(module_name).expanduser()
            if not path.is_file():
                raise ConfigError(f"data.reward '{spec}': file '{path}' not found")
            module_spec = importlib.util.spec_from_file_location(f"gspo_user_reward_{path.stem}",
                                                                 path)
            module = importlib.util.module_from_spec(module_spec)
            module_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(module_name)
    except ConfigError:
        raise
    # an ImportError, or the module failing at import; a script's sys.exit too, which would
    # otherwise end gspo with no error line
    except (Exception, SystemExit) as e:
        why = e.code if isinstance(e, SystemExit) else e  # sys.exit() says nothing: its None
        raise ConfigError(f"data.reward '{spec}': cannot import '{module_name}' "
                          f"({type(e).__name__}: {why}){_import_hint(e, module_name, attr)}"
                          ) from None
    fn = getattr(module, attr, None)
    if fn is None:
        raise ConfigError(f"data.reward '{spec}': '{module_name}' has no attribute '{attr}'")
    if not callable(fn):
        raise ConfigError(f"data.reward '{spec}': '{attr}' is a {type(fn).__name__}, not a "
                          f"callable f(completion, **row_fields) -> float")
    return fn


def _import_hint(e: BaseException, module_name: str, attr: str) -> str:
    """The fix for a reward module that failed at import, where gspo can tell it: a script that
    exits, or a module that is not on the path (a file in the working directory, which the
    `gspo` command does not import from)."""
    if isinstance(e, SystemExit):
        return ("; a reward module must not exit when imported (put a script's code under "
                "if __name__ == '__main__':)")
    missing = isinstance(e, ModuleNotFoundError) and e.name is not None and (
        module_name == e.name or module_name.startswith(e.name + "."))
    if not missing:  # a package the module itself imports: its own error says which
        return ""
    file = Path(*module_name.split(".")).with_suffix(".py")
    if file.is_file():
        return (f"; {file} is in the current directory, which is not on the import path: write "
                f"data.reward={file}:{attr}, or set PYTHONPATH=. to import from it")
    return (f"; name the file instead, data.reward=path/to/file.py:{attr}, or add its "
            f"directory to PYTHONPATH")


def close_reward(fn) -> None:
    """Release what a reward holds: `fn.close()` where it has one, for a list of rewards each
    one's. A plain function has nothing to close. The built-in rewards start their pool or
    helper again if called after it. Never raises: it runs in `finally` blocks, where a failing
    close would hide the error that ended the run, so a failure is logged instead."""
    for f in fn if isinstance(fn, (list, tuple)) else [fn]:
        close = getattr(f, "close", None)
        if not callable(close):
            continue
        try:
            close()
        except Exception as e:  # noqa: BLE001 - a user's reward; the others still get closed
            log.warning("closing reward %s failed: %s: %s",
                        getattr(f, "__name__", type(f).__name__), type(e).__name__, e)
