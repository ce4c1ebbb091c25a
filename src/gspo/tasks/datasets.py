"""Prompt rows from the files users bring: JSONL, Parquet, CSV, or a `datasets` directory
saved with `save_to_disk`.

A DataConfig maps the file's fields onto a row: `prompt_field` (the user turn, passed through
`prompt_template`), `answer_field` (math), `tests_field` (code; see gspo.rewards.code for the
formats), `solution_field` (optional: the worked solution the supervised warm-up imitates) and
`fn_name_field` (code, optional: the function call-based tests call). A row comes out as

    {"prompt": ..., "answer": ... | "tests": [...], "solution": ...?, <the file's other fields>}

and the reward sees every field but the prompt. A malformed row (missing or empty field,
unparsable tests, a JSONL line that is not JSON) raises DatasetError naming the file, the row
(1-based; for JSONL the line) and the field, or with `on_bad_row=skip` is counted, logged and
left out.
"""

from __future__ import annotations

import csv
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from gspo.errors import ConfigError
from gspo.rewards.code import normalize_tests

log = logging.getLogger(__name__)

FORMATS = ".jsonl, .json, .parquet, .csv, or a datasets directory (save_to_disk)"


class DatasetError(ConfigError):
    """A data file that cannot be used; the message names the file, row and field."""


def _raw_rows(path: Path, split: str) -> Iterator[tuple[int, Any]]:
    """(row number, raw row) pairs; a raw row that is not a mapping is passed on as is."""
    suffix = path.suffix.lower()
    if path.is_dir():
        yield from _hf_rows(path, split)
    elif suffix in (".jsonl", ".ndjson") or (suffix == ".json" and not _is_json_array(path)):
        with path.open("rb") as f:
            for lineno, line in enumerate(f, 1):
                if line.strip():
                    try:
                        yield lineno, json.loads(line.decode("utf-8"))
                    except UnicodeDecodeError as e:
                        yield lineno, _BadRow(f"not UTF-8 text: byte {line[e.start]:#04x} at "
                                               f"column {e.start + 1}")
                    except ValueError as e:
                        yield lineno, _BadRow(f"not valid JSON ({e})")
    elif suffix == ".json":
        try:
            rows = json.loads(path.read_text(encoding="utf-8"))
        except UnicodeDecodeError as e:
            raise DatasetError(f"{path}: not UTF-8 text (byte {e.object[e.start]:#04x} at offset "
                               f"{e.start})") from None
        except ValueError as e:
            raise DatasetError(f"{path}: not valid JSON ({e})") from None
        yield from enumerate(rows, 1)
    elif suffix == ".csv":
        # surrogateescape: a row with bytes that are not UTF-8 is reported as that row
        with path.open(encoding="utf-8", errors="surrogateescape", newline="") as f:
            for number, row in enumerate(csv.DictReader(f), 1):
                bad = any(isinstance(v, str) and any("\udc80" <= c <= "\udcff" for c in v)
                          for v in row.values())
                yield number, _BadRow("not UTF-8 text") if bad else row
    elif suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            table = pq.read_table(path)
        except Exception as e:  # noqa: BLE001 - pyarrow raises several types for a bad file
            raise DatasetError(f"{path}: not a readable Parquet file ({type(e).__name__}: "
                               f"{str(e)[:200]})") from None
        yield from enumerate(table.to_pylist(), 1)
    else:
        raise DatasetError(f"{path}: unknown data format '{suffix}'; use {FORMATS}")


def _is_json_array(path: Path) -> bool:
    with path.open("rb") as f:
        head = f.read(4096).lstrip()
    return head.startswith(b"[")


def _hf_rows(path: Path, split: str) -> Iterator[tuple[int, Any]]:
    import datasets

    try:
        ds = datasets.load_from_disk(str(path))
    except FileNotFoundError as e:
        raise DatasetError(f"{path}: not a datasets directory saved with save_to_disk ({e})"
                           ) from None
    if isinstance(ds, datasets.DatasetDict):
        if split not in ds:
            raise DatasetError(f"{path}: no split '{split}' (has {', '.join(ds)}); set "
                               f"data.split")
        ds = ds[split]
    yield from enumerate(ds, 1)


@dataclass
class _BadRow:
    """A line that did not decode or parse, passed on so that the error names its row."""

    error: str


def _field(raw: dict, name: str, what: str) -> Any:
    if name not in raw:
        raise ValueError(f"field '{name}' ({what}) is missing; the row has "
                         f"{', '.join(map(str, raw)) or 'no fields'} (set data.{what}_field)")
    value = raw[name]
    if value is None or (isinstance(value, str) and not value.strip()):
        raise ValueError(f"field '{name}' ({what}) is empty")
    return value


def map_row(raw: Any, d, task: str) -> dict:
    """One row in the trainer's shape; ValueError naming the field when it cannot be."""
    if isinstance(raw, _BadRow):
        raise ValueError(raw.error)
    if not isinstance(raw, dict):
        raise ValueError(f"a row must be a mapping of fields, got {type(raw).__name__}")
    prompt = _field(raw, d.prompt_field, "prompt")
    if not isinstance(prompt, str):
        raise ValueError(f"field '{d.prompt_field}' (prompt) must be text, got "
                         f"{type(prompt).__name__}")
    mapped = {d.prompt_field}
    row = {}
    if task == "math":
        answer = _field(raw, d.answer_field, "answer")
        # several accepted forms stay a list (the math reward takes any one of them)
        row["answer"] = ([str(a).strip() for a in answer] if isinstance(answer, (list, tuple))
                         else str(answer).strip())
        mapped.add(d.answer_field)
    elif task == "code":
        fn_name = raw.get(d.fn_name_field) if d.fn_name_field else None
        try:
            row["tests"] = normalize_tests(_field(raw, d.tests_field, "tests"), fn_name or None)
        except ValueError as e:
            raise ValueError(f"field '{d.tests_field}' (tests): {e}") from None
        mapped.update({d.tests_field, d.fn_name_field})
    if d.solution_field:
        row["solution"] = str(_field(raw, d.solution_field, "solution"))
        mapped.add(d.solution_field)
    # The file's other fields reach custom rewards; `completion` would clash with the argument.
    extra = {k: v for k, v in raw.items() if k not in mapped and k not in ("completion", "prompt")}
    return {**extra, "prompt": d.prompt_template.replace("{prompt}", prompt), **row}


def load_rows(path: str | Path, d, task: str | None = None) -> list[dict]:
    """Every usable row of `path` under DataConfig `d` (task defaults to d.task)."""
    path = Path(path).expanduser()
    task = task or d.task
    if not path.exists():
        raise DatasetError(f"data file '{path}' not found")
    rows, skipped, first_error = [], 0, None
    for number, raw in _raw_rows(path, d.split):
        try:
            rows.append(map_row(raw, d, task))
        except ValueError as e:
            message = f"{path} row {number}: {e}"
            if d.on_bad_row == "fail":
                raise DatasetError(f"{message} (data.on_bad_row=skip leaves such rows out)"
                                   ) from None
            skipped += 1
            first_error = first_error or message
        if d.max_rows and len(rows) >= d.max_rows:
            break
    if skipped:
        log.warning("%s: skipped %d malformed row(s); the first: %s", path, skipped, first_error)
    if not rows:
        raise DatasetError(f"{path}: no usable rows"
                           + (f" ({skipped} malformed; the first: {first_error})" if skipped
                              else ""))
    return rows
