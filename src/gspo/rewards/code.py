"""Code reward: run the program in a completion against a task's tests in the sandbox.

A row's tests come in the formats the code-RL community uses and are read into stdin tests and
call tests by `normalize_tests` (gspo.rewards.code_tests, which the data loader shares without
importing the sandbox). A stdin test passes when the whitespace-separated tokens of stdout equal
the expected ones (integers exactly, other numbers within 1e-6). A call test passes when the
returned value equals the expected one (JSON round trip; numbers as for stdin; APPS's `[value]`
wrapping of an expected value is accepted). The program is the last fenced code block of the
completion (```python preferred), or the whole completion when it has no fence.

Each test runs in a fresh sandbox (`gspo.sandbox`), all tests of a completion in parallel.
Score: 1.0 when every test passes (mode 'all', which stops at the first failure) or the
fraction passing (mode 'fraction'), plus `format_weight` when the completion has a fenced code
block. Left out: special checkers (problems with several correct outputs), and interactive
problems. Call-based tests run the model's code in the same process as the harness that
reports the result, so a program could forge that report; stdin tests compare in the parent.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import threading
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import dataclass, replace
from typing import Any

from gspo.errors import ConfigError
from gspo.rewards.code_tests import normalize_tests
from gspo.sandbox import Limits, RunResult, Sandbox

log = logging.getLogger(__name__)

MODES = ("all", "fraction")
_FENCE = re.compile(r"```([A-Za-z0-9_+-]*)[ \t]*\r?\n(.*?)```", re.DOTALL)  # \r\n: CRLF text

# Runs the solution's function with stdout captured, then prints the result as a last JSON line.
CALL_HARNESS = '''\
import contextlib, io, json, sys

def _main():
    with open("call.json") as f:
        spec = json.load(f)
    with open("solution.py") as f:
        source = f.read()
    namespace = {"__name__": "__solution__"}
    with contextlib.redirect_stdout(io.StringIO()):
        exec(compile(source, "solution.py", "exec"), namespace)
        fn = namespace.get(spec["fn_name"])
        if fn is None and isinstance(namespace.get("Solution"), type):
            fn = getattr(namespace["Solution"](), spec["fn_name"], None)
        if fn is None:
            raise SystemExit("no function or Solution method named %r" % spec["fn_name"])
        result = fn(*spec["args"])
    sys.stdout.write("\\n" + json.dumps({"result": result}, default=repr) + "\\n")

_main()
'''


# ---------------------------------------------------------------------------------------------
# programs and outputs


def extract_code(completion: str) -> str | None:
    """The last ```python block, else the last fenced block, else the whole text (None if
    empty)."""
    if not isinstance(completion, str):
        return None
    blocks = _FENCE.findall(completion)
    if blocks:
        py = [body for lang, body in blocks if lang.lower() in ("python", "py", "python3")]
        return (py or [body for _, body in blocks])[-1]
    return completion if completion.strip() else None


def _tokens_match(a: str, b: str) -> bool:
    if a == b:
        return True
    try:  # integers exactly: within 1e-6 relative, 1000000008 would pass for 1000000007
        return int(a) == int(b)
    except ValueError:
        pass
    try:
        x, y = float(a), float(b)
    except ValueError:
        return False
    return math.isclose(x, y, rel_tol=1e-6, abs_tol=1e-6)


def outputs_match(got: str, expected: str) -> bool:
    """Token-wise equality of two outputs: integers exactly, other numbers within 1e-6 (absolute
    or relative, the usual CodeForces check for real numbers)."""
    g, e = got.split(), expected.split()
    return len(g) == len(e) and all(_tokens_match(x, y) for x, y in zip(g, e, strict=True))


def values_match(got: Any, expected: Any) -> bool:
    """Equality of a returned value and the expected one after a JSON round trip."""
    if isinstance(got, bool) or isinstance(expected, bool):
        return got == expected
    if isinstance(got, int) and isinstance(expected, int):
        return got == expected  # exactly, as for stdin tokens
    if isinstance(got, (int, float)) and isinstance(expected, (int, float)):
        return math.isclose(got, expected, rel_tol=1e-6, abs_tol=1e-6)
    if isinstance(got, list) and isinstance(expected, list):
        return len(got) == len(expected) and all(map(values_match, got, expected))
    if isinstance(got, dict) and isinstance(expected, dict):
        return got.keys() == expected.keys() and all(values_match(got[k], expected[k])
                                                      for k in got)
    return got == expected


# ---------------------------------------------------------------------------------------------
# running


@dataclass
class TestOutcome:
    """status: passed | wrong | error | timeout | output_limit | memory_limit | setup_error |
    no_code."""

    passed: bool
    status: str
    detail: str = ""


def _judge(test: dict, r: RunResult) -> TestOutcome:
    if not r.ok:
        return TestOutcome(False, r.status, r.stderr.decode(errors="replace")[-300:])
    out = r.stdout.decode(errors="replace")
    if test["kind"] == "stdin":
        ok = outputs_match(out, test["output"])
        return TestOutcome(ok, "passed" if ok else "wrong", "" if ok else out[-300:])
    lines = [line for line in out.splitlines() if line.strip()]
    try:
        got = json.loads(lines[-1])["result"]
    except (IndexError, ValueError, KeyError, TypeError):
        return TestOutcome(False, "error", "the harness reported no result")
    exp = test["expected"]
    ok = values_match(got, exp) or (isinstance(exp, list) and len(exp) == 1
                                    and values_match(got, exp[0]))
    return TestOutcome(ok, "passed" if ok else "wrong", "" if ok else repr(got)[:300])


class CodeReward:
    """`f(completion, tests, fn_name=None, **_) -> float` over a shared sandbox and pool.

    mode: 'all' (1 when every test passes) or 'fraction'; format_weight: added when the
    completion has a fenced code block; limits: per test run; workers: parallel runs (default
    the number of CPUs), which is also how many completions `gspo.data.score` scores at once.
    `close()` shuts the pool (a later call starts a new one).
    """

    def __init__(self, mode: str = "all", format_weight: float = 0.0,
                 limits: Limits | None = None, workers: int | None = None,
                 python: str | None = None, sandbox: Sandbox | None = None):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        self.mode, self.format_weight = mode, format_weight
        self.sandbox = sandbox or Sandbox(limits or Limits(wall_s=5.0, cpu_s=5.0), python)
        self.workers = workers or os.cpu_count() or 1
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self._checked = False
        self.__name__ = "code_reward"

    def with_format_weight(self, format_weight: float) -> "CodeReward":
        """The same reward (its sandbox shared) with another format bonus (0: correctness only,
        as held-out evaluation scores)."""
        return CodeReward(self.mode, format_weight, workers=self.workers, sandbox=self.sandbox)

    def check(self) -> None:
        """Raise ConfigError when this machine's sandbox cannot run a trivial program (a
        missing interpreter, no permission to start one): every reward would be 0 otherwise."""
        c = self.sandbox.containment()
        if not c.get("runs"):
            raise ConfigError(f"the code sandbox cannot run programs with {c.get('python')}: "
                              f"{(c.get('error') or 'no output').strip().splitlines()[-1]}; "
                              f"set data.code_python to a Python interpreter that every user "
                              f"may execute (e.g. /usr/bin/python3)")

    def _executor(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.workers, thread_name_prefix="gspo-sandbox")
            if not self._checked:
                self._checked = True
                _log_containment(self.sandbox.containment())
            return self._pool

    def _run_one(self, code: str, test: dict) -> TestOutcome:
        sb, lim = self.sandbox, self._limits(test)
        if test["kind"] == "stdin":
            r = sb.run({"main.py": code}, [sb.python, "-I", "-B", "main.py"], test["input"],
                       lim)
        else:
            spec = json.dumps({"fn_name": test["fn_name"], "args": test["args"]})
            r = sb.run({"harness.py": CALL_HARNESS, "solution.py": code, "call.json": spec},
                       [sb.python, "-I", "-B", "harness.py"], limits=lim)
        return _judge(test, r)

    def _limits(self, test: dict) -> Limits:
        """The sandbox's limits, with room on stdout for twice the expected output: a right
        program whose output is longer than the cap would be killed ('output_limit')."""
        expected = (test["output"] if test["kind"] == "stdin"
                    else json.dumps(test["expected"], default=repr))
        need = 2 * len(expected.encode()) + 4096
        lim = self.sandbox.limits
        return lim if need <= lim.stdout_bytes else replace(lim, stdout_bytes=need)

    def run_tests(self, completion: str, tests: Any, fn_name: str | None = None
                  ) -> list[TestOutcome]:
        """One outcome per test; in mode 'all', tests not started after a failure are
        skipped (status 'not_run')."""
        tests = normalize_tests(tests, fn_name)
        code = extract_code(completion)
        if code is None:
            return [TestOutcome(False, "no_code") for _ in tests]
        pool = self._executor()
        futures = {pool.submit(self._run_one, code, t): i for i, t in enumerate(tests)}
        outcomes: list[TestOutcome | None] = [None] * len(tests)
        pending = set(futures)
        while pending:
            done, pending = wait(pending, return_when=FIRST_COMPLETED)
            for f in done:
                outcomes[futures[f]] = f.result()
            if self.mode == "all" and any(o is not None and not o.passed for o in outcomes):
                for f in pending:
                    f.cancel()
                wait(pending)
                break
        return [o or TestOutcome(False, "not_run") for o in outcomes]

    def __call__(self, completion: str, tests: Any = None, fn_name: str | None = None,
                 **_: Any) -> float:
        if tests is None:
            raise ValueError("the code reward needs the row's tests")
        outcomes = self.run_tests(completion, tests, fn_name)
        passed = sum(o.passed for o in outcomes)
        score = passed / len(outcomes) if self.mode == "fraction" else float(
            passed == len(outcomes))
        has_fence = isinstance(completion, str) and bool(_FENCE.search(completion))
        return score + self.format_weight * has_fence

    def close(self) -> None:
        with self._lock:
            if self._pool is not None:
                self._pool.shutdown(wait=True, cancel_futures=True)
                self._pool = None


def _log_containment(c: dict) -> None:
    layers = [k for k in ("netns", "mountns", "pidns") if c.get(k)]
    msg = (f"code sandbox: {', '.join(layers) or 'no namespaces'}, uid {c.get('uid')}"
           f"{' (user namespace)' if c.get('userns') else ''}, python {c.get('python')}")
    if not c.get("runs"):
        log.error("%s: a trivial program fails to run: %s", msg, c.get("error"))
    elif len(layers) < 3 or c.get("uid") == 0:
        log.warning("%s: weaker containment than intended (see gspo.sandbox)", msg)
    else:
        log.info("%s", msg)


code_reward = CodeReward()
"""The default code reward: mode 'all', 5 s per test
(`data.reward=gspo.rewards.code:code_reward`)."""
