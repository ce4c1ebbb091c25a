"""Math reward: the completion's final answer checked against the reference with math-verify.

The reference may be a bare answer (`42`, `\\frac{1}{2}`), a `\\boxed{}` answer or a whole
solution ending in one (MATH, AIME), or a GSM8K solution ending in `#### 42`. From the
completion math-verify extracts the last `\\boxed{}` answer, else the last plain final answer
("the answer is 3/4", "= 0.75"), and decides symbolic or numeric equivalence (`0.5` = `\\frac12`,
`(x+1)^2` = `x^2+2x+1`, `1,000` = `1000`).

math-verify runs in a helper process (`python -m gspo.rewards.math`), so that a pathological
completion (a 10^10^10 power, an expression sympy cannot simplify, a regex blow-up in C) costs
at most `timeout` seconds: past it the helper is killed, restarted on the next call, and the
completion scores 0. Within it math-verify's own wall-clock limits (a third of `timeout` for each
of parsing the reference, parsing the answer and comparing them) end a check too. Both kinds
count in `MathReward.timeouts`, and the call raises MathVerifyTimeout, which gspo's scoring
counts in reward/failures (with a warning) and scores 0: a machine too loaded for the budget
shows in the metrics instead of as wrong answers. Only the part of a long completion that can
hold the answer is sent: from its last `\\boxed` on, or else its last `max_chars` characters.

Score: 1.0 when equivalent, else 0.0; plus `format_weight` when the completion states its answer
in `\\boxed{...}`.
"""

from __future__ import annotations

import json
import logging
import os
import re
import selectors
import subprocess
import sys
import threading
import time
from decimal import Decimal
from pathlib import Path

log = logging.getLogger(__name__)

_BOXED = re.compile(r"\\boxed\s*\{.*\}", re.DOTALL)
_EXPONENT = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)[eE][-+]?\d{1,3}")  # 1e-05, as str(float) writes
_STARTUP_S = 120.0  # importing sympy + math-verify, on a loaded machine


def answer_window(completion: str, max_chars: int = 4096) -> str:
    """The part of a completion that can hold its final answer, at most max_chars long."""
    if len(completion) <= max_chars:
        return completion
    start = completion.rfind("\\boxed")
    if start >= 0:
        return completion[start:start + max_chars]
    return completion[-max_chars:]


def reference_text(answer) -> str:
    """The reference as math-verify parses it: after GSM8K's '####', a number in exponent
    notation written out, in $...$ unless boxed."""
    text = str(answer).strip()
    if "####" in text:
        text = text.rsplit("####", 1)[1].strip().replace(",", "")
    if _EXPONENT.fullmatch(text):  # a float reference (JSON 0.00001 is 1e-05), which
        text = format(Decimal(text), "f")  # math-verify would read as Euler's e minus 5
    if "\\boxed" in text or (text.startswith("$") and text.endswith("$")):
        return text
    return f"${text}$"


def has_boxed_answer(completion: str) -> bool:
    return isinstance(completion, str) and bool(_BOXED.search(answer_window(completion)))


class _Helper:
    """The math-verify process: one JSON request per line in, one JSON reply per line out."""

    def __init__(self):
        src = str(Path(__file__).resolve().parents[2])  # .../src, so `gspo` imports there
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            p for p in (src, os.environ.get("PYTHONPATH")) if p)}
        # Its own session: a Ctrl-C in the terminal reaches the trainer, which then closes us.
        self.proc = subprocess.Popen([sys.executable, "-m", "gspo.rewards.math"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, env=env, start_new_session=True)
        self.sel = selectors.DefaultSelector()
        self.sel.register(self.proc.stdout, selectors.EVENT_READ)
        if self._reply(_STARTUP_S) != {"ready": True}:
            self.close()
            raise RuntimeError("the math-verify helper process failed to start; is math-verify "
                               "installed (pip install -e '.[math]')?")

    def _reply(self, timeout: float) -> dict | None:
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not self.sel.select(left):
                return None
            line = self.proc.stdout.readline()
            if not line:
                return None  # the helper died
            return json.loads(line)

    def ask(self, request: dict, timeout: float) -> dict | None:
        try:
            self.proc.stdin.write((json.dumps(request) + "\n").encode())
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            return None
        return self._reply(timeout)

    def close(self) -> None:
        self.sel.close()
        self.proc.kill()
        self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout):
            f.close()


def stage_seconds(timeout: float) -> int:
    """math-verify's own limit on each of its three stages (parse the reference, parse the
    answer, compare) within a `timeout`-second check: integer seconds (signal.alarm)."""
    return max(1, int(timeout // 3))


class MathVerifyTimeout(TimeoutError):
    """math-verify gave no verdict in time: gspo's scoring counts it as a failed reward call
    (reward/failures) and scores 0."""


class MathReward:
    """`f(completion, answer, **_) -> float`; see the module docstring. Thread-safe. A call
    whose every answer check ran out of time (and none matched) raises MathVerifyTimeout, which
    gspo's scoring (gspo.data.score) counts in reward/failures and scores 0; `is_correct` says
    False instead."""

    def __init__(self, timeout: float = 5.0, format_weight: float = 0.0, max_chars: int = 4096):
        self.timeout, self.format_weight, self.max_chars = timeout, format_weight, max_chars
        self._helper: _Helper | None = None
        self._lock = threading.Lock()
        self.timeouts = 0  # completions scored 0 because math-verify ran out of time
        self.__name__ = "math_reward"

    def is_correct(self, completion: str, answer) -> bool:
        return bool(self._verdict(completion, answer))

    def with_format_weight(self, format_weight: float) -> "MathReward":
        """The same reward with another format bonus (0: correctness only, as held-out
        evaluation scores)."""
        return MathReward(self.timeout, format_weight, self.max_chars)

    def _verdict(self, completion: str, answer) -> bool | None:
        """True / False, or None when math-verify ran out of time (counted in `timeouts`)."""
        if not isinstance(completion, str) or not completion.strip():
            return False
        request = {"pred": answer_window(completion, self.max_chars),
                   "gold": reference_text(answer), "timeout": self.timeout}
        with self._lock:
            if self._helper is None or self._helper.proc.poll() is not None:
                self._helper = _Helper()
            reply = self._helper.ask(request, self.timeout)
            if reply is None:  # out of time or dead: never wait for it again
                self._helper.close()
                self._helper = None
                self.timeouts += 1
                return None
        if reply.get("timed_out"):  # math-verify's own limit: the helper lives on
            self.timeouts += 1
            return None
        return bool(reply.get("correct"))

    def __call__(self, completion: str, answer="", **_) -> float:
        # a list of answers (datasets with several accepted forms): correct if any one matches
        answers = answer if isinstance(answer, (list, tuple)) else [answer]
        verdicts = []
        for a in answers:
            verdicts.append(self._verdict(completion, a))
            if verdicts[-1]:
                break
        if not any(verdicts) and None in verdicts:
            raise MathVerifyTimeout(
                f"math-verify gave no verdict within MathReward's timeout={self.timeout:g} s "
                f"(its own limit: {stage_seconds(self.timeout)} s per stage) on a "
                f"{len(completion)}-character completion: a pathological answer, or a machine "
                f"too loaded for the budget (raise data.reward_timeout)")
        score = float(any(verdicts))
        if self.format_weight:
            score += self.format_weight * has_boxed_answer(completion)
        return score

    def close(self) -> None:
        with self._lock:
            if self._helper is not None:
                self._helper.close()
                self._helper = None

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


math_reward = MathReward()
"""The default math reward (5 s per completion); `data.reward=gspo.rewards.math:math_reward`."""


# ---------------------------------------------------------------------------------------------
# the helper process


def _serve() -> None:
    """Answer {"pred", "gold", "timeout"} lines with {"correct": bool} lines until EOF."""
    import resource
    from functools import lru_cache

    logging.disable(logging.CRITICAL)  # math-verify logs whole expressions on its timeouts
    resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))  # sympy blow-ups: MemoryError
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    configs = [LatexExtractionConfig(), ExprExtractionConfig()]

    def _parse(text: str, seconds: int):
        return parse(text, extraction_config=configs, parsing_timeout=seconds)

    def timed(fn, *args, seconds: int, **kw):
        """fn's result, and whether it came back empty at its time limit: math-verify's own
        (signal, wall-clock) timeouts return an empty parse or False, like a wrong answer."""
        start = time.monotonic()
        result = fn(*args, **kw)
        return result, not result and time.monotonic() - start >= 0.95 * seconds

    class Unparsed(Exception):
        """An empty parse: not cached (one cut short by its time limit may succeed next time,
        and a cached empty reference would fail every later check at once, unreported)."""

    @lru_cache(maxsize=4096)
    def parsed_gold(text: str, seconds: int):
        gold = _parse(text, seconds)
        if not gold:
            raise Unparsed
        return gold

    def gold_cache(text: str, seconds: int):
        try:
            return parsed_gold(text, seconds)
        except Unparsed:
            return []
    # the first parse pays math-verify's lazy set-up (~0.1 s of CPU here; on a loaded machine
    # enough wall-clock to hit the first request's 1 s limit): pay it before the first request
    verify(_parse("1", 60), _parse("\\boxed{1}", 60), timeout_seconds=60)
    out = sys.stdout
    out.write(json.dumps({"ready": True}) + "\n")
    out.flush()
    for line in sys.stdin:
        req = json.loads(line)
        # math-verify's own (signal) timeouts end most slow cases gracefully, and are reported
        # (timed_out) so the parent counts them; the parent's kill is the backstop
        seconds = stage_seconds(req["timeout"])
        correct = timed_out = False
        try:
            gold, timed_out = timed(gold_cache, req["gold"], seconds, seconds=seconds)
            if gold:
                pred, timed_out = timed(_parse, req["pred"], seconds, seconds=seconds)
                if pred:
                    correct, timed_out = timed(verify, gold, pred, timeout_seconds=seconds,
                                               seconds=seconds)
        except Exception:  # noqa: BLE001 - MemoryError, RecursionError, sympy's own errors
            correct = False
        out.write(json.dumps({"correct": bool(correct), "timed_out": bool(timed_out)}) + "\n")
        out.flush()


if __name__ == "__main__":
    _serve()
