"""The tests of a code row: the formats the code-RL community uses, read into two kinds.

    {"kind": "stdin", "input": "1 2\\n", "output": "3\\n"}              CodeForces / LiveCodeBench
    {"kind": "call", "fn_name": "add", "args": [1, 2], "expected": 3}  LeetCode / APPS call-based

Accepted on input: a list of such dicts (also LiveCodeBench's {"input", "output", "testtype":
"stdin" | "functional"}, where a functional input holds one JSON value per line), or an APPS /
TACO mapping {"inputs": [...], "outputs": [...], "fn_name"?: "..."}; either may be a JSON
string.

Pure parsing, apart from the code reward (gspo.rewards.code) that runs the tests: the data
loader checks every row's tests with it and must not pay for importing the sandbox.
"""

from __future__ import annotations

import json
from typing import Any


def normalize_tests(raw: Any, fn_name: str | None = None) -> list[dict]:
    """The canonical test list of `raw` (see the module docstring); ValueError when malformed."""
    if isinstance(raw, (str, bytes)):
        try:
            raw = json.loads(raw)
        except ValueError as e:
            raise ValueError(f"tests are a string but not JSON ({e})") from None
    if isinstance(raw, dict):
        if not isinstance(raw.get("inputs"), list) or not isinstance(raw.get("outputs"), list):
            raise ValueError("a tests mapping needs 'inputs' and 'outputs' lists (APPS style)")
        if len(raw["inputs"]) != len(raw["outputs"]):
            raise ValueError(f"{len(raw['inputs'])} inputs but {len(raw['outputs'])} outputs")
        fn_name = raw.get("fn_name") or fn_name
        raw = [{"input": i, "output": o}
               for i, o in zip(raw["inputs"], raw["outputs"], strict=True)]
    if not isinstance(raw, list) or not raw:
        raise ValueError("tests must be a non-empty list of {input, output} tests or an "
                         "{inputs, outputs} mapping")
    return [_one_test(t, fn_name, i) for i, t in enumerate(raw)]


def _one_test(t: Any, fn_name: str | None, i: int) -> dict:
    if not isinstance(t, dict):
        raise ValueError(f"test {i} is a {type(t).__name__}, not a mapping")
    kind = t.get("kind") or t.get("testtype")
    fn = t.get("fn_name") or fn_name
    if kind in ("call", "functional") or (kind is None and fn):
        if not fn:
            raise ValueError(f"test {i} is call-based but names no fn_name")
        if "args" in t:
            args, expected = t["args"], t.get("expected")
        elif "input" in t and "output" in t:
            args, expected = _call_args(t["input"]), _json_or_text(t["output"])
        else:
            raise ValueError(f"test {i} needs 'args' and 'expected' (or 'input' and 'output')")
        return {"kind": "call", "fn_name": str(fn),
                "args": list(args) if isinstance(args, (list, tuple)) else [args],
                "expected": expected}
    if kind not in (None, "stdin"):
        raise ValueError(f"test {i} has unknown kind {kind!r} (stdin | call | functional)")
    if "input" not in t or "output" not in t:
        raise ValueError(f"test {i} needs 'input' and 'output'")
    inp, out = (_text(t[k]) for k in ("input", "output"))
    if inp is None or out is None:
        raise ValueError(f"test {i}: input and output must be text")
    return {"kind": "stdin", "input": inp, "output": out}


def _text(v: Any) -> str | None:
    if isinstance(v, list) and all(isinstance(x, str) for x in v):
        return "\n".join(v)
    return v if isinstance(v, str) else None


def _json_or_text(v: Any) -> Any:
    if isinstance(v, str):
        try:
            return json.loads(v)
        except ValueError:
            return v
    return v


def _call_args(inp: Any) -> list:
    if isinstance(inp, str):  # LiveCodeBench functional: one JSON value per argument line
        return [_json_or_text(line) for line in inp.splitlines() if line.strip()]
    return inp if isinstance(inp, list) else [inp]
