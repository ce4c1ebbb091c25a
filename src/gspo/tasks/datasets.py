"""Prompt rows from what users bring: JSONL, Parquet, CSV, a `datasets` directory (saved with
`save_to_disk`, or laid out as a hub dataset repository), a hub dataset id read with
`datasets.load_dataset` (`data.subset`, `data.split`), or Python rows (a list of dicts or a
`datasets.Dataset`, given to `gspo.train`).

A DataConfig maps the file's fields onto a row: `prompt_field` (the user turn, passed through
`prompt_template`), `answer_field` (math), `tests_field` (code; gspo.rewards.code_tests reads
its formats), `solution_field` (optional: the worked solution the supervised warm-up imitates)
and `fn_name_field` (code, optional: the function call-based tests call). The task (its
gspo.tasks.TaskSpec) says which field its reward reads and how to parse it. A row comes out as

    {"prompt": ..., "answer": ... | "tests": [...], "solution": ...?, <the file's other fields>}

and the reward sees every field but the prompt. A malformed row (missing or empty field,
unparsable tests, a JSONL line that is not JSON) raises DatasetError naming the file, the row
(1-based; for JSONL the line) and the field, or with `on_bad_row=skip` is counted, logged and
left out.
"""

from __future__ import annotations

import codecs
import csv
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator

from gspo.errors import ConfigError
from gspo.hub import hub_unreachable, looks_like_hub_id
from gspo.tasks.registry import get_task

log = logging.getLogger(__name__)

FORMATS = ".jsonl, .json, .parquet, .csv, or a datasets directory (save_to_disk)"
SAVED_MARKERS = ("dataset_dict.json", "state.json")  # what save_to_disk writes at the top


class DatasetError(ConfigError):
    """A data file that cannot be used; the message names the file, row and field."""


def _raw_rows(path: Path, split: str, subset: str = "") -> Iterator[tuple[int, Any]]:
    """(row number, raw row) pairs; a raw row that is not a mapping is passed on as is."""
    suffix = path.suffix.lower()
    saved = path.is_dir() and any((path / name).is_file() for name in SAVED_MARKERS)
    if path.is_dir() and not saved:  # laid out as a hub dataset repository
        yield from _hub_rows(str(path), subset, split)
        return
    if subset:
        raise DatasetError(f"data.subset={subset!r} names a configuration of a hub dataset, but "
                           f"{path} is a {'saved datasets directory' if saved else 'file'} (it "
                           f"has none); drop data.subset")
    if suffix == ".json" and not saved and _is_object_over_lines(path):
        raise DatasetError(f"{path}: one JSON object spread over several lines; a .json data "
                           f"file holds an array of rows, [{{...}}, {{...}}], or one row per "
                           f"line (JSONL)")
    if saved:
        yield from _saved_rows(path, split)
    elif suffix in (".jsonl", ".ndjson") or (suffix == ".json" and not _is_json_array(path)):
        with path.open("rb") as f:
            for lineno, line in enumerate(f, 1):
                if lineno == 1:  # a byte-order mark, as Windows editors and Excel write
                    line = line.removeprefix(codecs.BOM_UTF8)
                if line.strip():
                    try:
                        yield lineno, json.loads(line.decode("utf-8"))
                    except UnicodeDecodeError as e:
                        yield lineno, _BadRow(f"not UTF-8 text: byte {line[e.start]:#04x} at "
                                               f"column {e.start + 1}")
                    except ValueError as e:
                        yield lineno, _BadRow(f"not valid JSON ({e})")
    elif suffix == ".json":
        data = path.read_bytes()
        bom = len(codecs.BOM_UTF8) if data.startswith(codecs.BOM_UTF8) else 0
        try:
            rows = json.loads(data[bom:].decode("utf-8"))
        except UnicodeDecodeError as e:
            raise DatasetError(f"{path}: not UTF-8 text (byte {e.object[e.start]:#04x} at offset "
                               f"{bom + e.start})") from None
        except ValueError as e:
            raise DatasetError(f"{path}: not valid JSON ({e})") from None
        yield from enumerate(rows, 1)
    elif suffix == ".csv":
        # surrogateescape: a row with bytes that are not UTF-8 is reported as that row;
        # utf-8-sig: a byte-order mark (Excel's "CSV UTF-8") is not part of the first column name
        with path.open(encoding="utf-8-sig", errors="surrogateescape", newline="") as f:
            for number, row in enumerate(csv.DictReader(f), 1):
                yield number, _csv_row(row)
    elif suffix == ".parquet":
        pq = _data_extra("pyarrow.parquet", f"reading the Parquet file {path}")

        try:
            table = pq.read_table(path)
        except Exception as e:  # noqa: BLE001 - pyarrow raises several types for a bad file
            raise DatasetError(f"{path}: not a readable Parquet file ({type(e).__name__}: "
                               f"{str(e)[:200]})") from None
        yield from enumerate(table.to_pylist(), 1)
    else:
        raise DatasetError(f"{path}: unknown data format '{suffix}'; use {FORMATS}")


def _csv_row(row: dict) -> dict | _BadRow:
    """A csv.DictReader row, or why it is malformed: bytes that are not UTF-8, or more values
    than the header has columns (DictReader files those under the key None)."""
    extra = row.pop(None, None)
    if extra is not None:
        n = len(extra)
        fix = ("remove the trailing comma" if not any(v.strip() for v in extra) else
               'quote a value that holds a comma ("1, 2"), or add the column to the header')
        return _BadRow(f"{n} more value{'s' * (n != 1)} than the header's columns "
                       f"({', '.join(map(str, row))}): {fix}")
    if any(isinstance(v, str) and any("\udc80" <= c <= "\udcff" for c in v)
           for v in row.values()):
        return _BadRow("not UTF-8 text")
    return row


def _data_extra(module: str, what: str):
    """`module`, one of the `data` extra's packages, or a DatasetError saying how to install it."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise DatasetError(f"{what} needs the {module.split('.')[0]} package ({e}): pip install "
                           f"'gspo[data]'") from None


def _is_object_over_lines(path: Path) -> bool:
    """Whether the file is a single (pretty-printed) JSON object, which read as JSONL would
    give one 'not valid JSON' per line."""
    text = path.read_bytes().removeprefix(codecs.BOM_UTF8).strip()
    if not text.startswith(b"{") or b"\n" not in text:
        return False
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:  # JSONL's several objects, or broken JSON: reported row by row
        return False


def _is_json_array(path: Path) -> bool:
    with path.open("rb") as f:
        head = f.read(4096).removeprefix(codecs.BOM_UTF8).lstrip()
    return head.startswith(b"[")


def _hub_rows(name: str, subset: str, split: str) -> Iterator[tuple[int, Any]]:
    """A dataset through `datasets.load_dataset`: a hub id, or a local directory laid out as a
    hub repository (data files, a README declaring its configurations)."""
    datasets = _data_extra("datasets", f"reading the dataset {name!r}")
    is_dir = Path(name).is_dir()
    where = None if is_dir else hub_unreachable()
    # offline mode still reads the datasets cache; without it, no route fails now, not after
    # the library's retries with back-off
    if where and where != "HF_HUB_OFFLINE is set":
        raise DatasetError(f"{name!r} is not a local file or directory, and as a hub dataset id "
                           f"it cannot be fetched: {where}; save it to disk where there is a "
                           f"network and pass that directory (or set HF_HUB_OFFLINE=1 to use a "
                           f"cached copy)")
    try:
        ds = datasets.load_dataset(name, subset or None, split=split)
    except (ValueError, OSError) as e:  # OSError: missing files, no connection
        # the library's own words say which subset or split exists, or why it is unreachable
        why = " ".join(str(e).split())[:300]
        raise DatasetError(f"dataset {name!r} (data.subset {subset or 'unset'}, split {split}): "
                           f"{type(e).__name__}: {why}"
                           + (f" ({where})" if where else "")) from None
    yield from enumerate(ds, 1)


def _saved_rows(path: Path, split: str) -> Iterator[tuple[int, Any]]:
    datasets = _data_extra("datasets", f"reading the datasets directory {path}")

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


def _field(raw: dict, name: str, what: str, setting: bool = True) -> Any:
    """raw[name], the `what` of the row; setting: DataConfig has data.<what>_field to name it."""
    if name not in raw:
        raise ValueError(f"field '{name}' ({what}) is missing; the row has "
                         f"{', '.join(map(str, raw)) or 'no fields'}"
                         + (f" (set data.{what}_field)" if setting else ""))
    value = raw[name]
    if value is None or (isinstance(value, str) and not value.strip()):
        raise ValueError(f"field '{name}' ({what}) is empty")
    return value


def map_row(raw: Any, d, task: str) -> dict:
    """One row in the trainer's shape for `task` (a gspo.tasks.TASKS name), its reward's field
    read and parsed as the task says; ValueError naming the field when it cannot be."""
    spec = get_task(task)
    if isinstance(raw, _BadRow):
        raise ValueError(raw.error)
    if not isinstance(raw, dict):
        raise ValueError(f"a row must be a mapping of fields, got {type(raw).__name__}")
    prompt = _field(raw, d.prompt_field, "prompt")
    if not isinstance(prompt, str):
        raise ValueError(f"field '{d.prompt_field}' (prompt) must be text, got "
                         f"{type(prompt).__name__}")
    column = spec.column(d)
    value = _field(raw, column, spec.field, setting=spec.setting(d) is not None)
    try:
        row = {spec.field: value if spec.parse is None else spec.parse(value, raw, d)}
    except ValueError as e:
        raise ValueError(f"field '{column}' ({spec.field}): {e}") from None
    mapped = {d.prompt_field, column, *(getattr(d, key) for key in spec.also_reads)}
    if d.solution_field:
        row["solution"] = str(_field(raw, d.solution_field, "solution"))
        mapped.add(d.solution_field)
    # The file's other fields reach custom rewards; `completion` would clash with the argument.
    extra = {k: v for k, v in raw.items() if k not in mapped and k not in ("completion", "prompt")}
    return {**extra, "prompt": d.prompt_template.replace("{prompt}", prompt), **row}


def load_rows(source: str | Path, d, task: str | None = None, split: str | None = None,
              bad_rows: list[str] | None = None) -> list[dict]:
    """Every usable row of `source` (a file, a datasets directory or a hub dataset id) under
    DataConfig `d`; task defaults to d.task, split to d.split. See `map_rows` for bad_rows."""
    path = Path(source).expanduser()
    if path.exists():
        raw = _raw_rows(path, split or d.split, d.subset)
    elif looks_like_hub_id(str(source)):
        raw, path = _hub_rows(str(source), d.subset, split or d.split), str(source)
    else:
        raise DatasetError(f"data file '{path}' not found (nor is it a hub dataset id like "
                           f"openai/gsm8k)")
    return map_rows(raw, str(path), d, task or d.task, bad_rows)


def python_rows(data: Any, what: str) -> Iterator[tuple[int, Any]]:
    """(row number, raw row) pairs of rows given from Python: a list (or any iterable) of dicts,
    or a `datasets.Dataset`."""
    if isinstance(data, (str, bytes, Path, dict)):  # a DatasetDict is a dict
        kind = "a DatasetDict (pass one split, e.g. ds['train'])" if isinstance(data, dict) else (
            f"{type(data).__name__} {str(data)[:60]!r} (for a file or hub id set data.path)")
        raise DatasetError(f"{what} must be a list of dicts or a datasets.Dataset, got {kind}")
    try:
        return enumerate(iter(data), 1)
    except TypeError:
        raise DatasetError(f"{what} must be a list of dicts or a datasets.Dataset, got "
                           f"{type(data).__name__}") from None


def map_rows(raw_rows: Iterable[tuple[int, Any]], source: str, d, task: str,
             bad_rows: list[str] | None = None) -> list[dict]:
    """The usable rows of (row number, raw row) pairs read from `source` (named in errors).

    A malformed row stops it (data.on_bad_row=fail) or is left out and counted (skip); with a
    `bad_rows` list, every malformed row's message is appended there and the row left out
    whatever on_bad_row says (the dry run names them all)."""
    rows, skipped, first_error = [], 0, None
    for number, raw in raw_rows:
        try:
            rows.append(map_row(raw, d, task))
        except ValueError as e:
            message = f"{source} row {number}: {e}"
            if bad_rows is not None:
                bad_rows.append(message)
            elif d.on_bad_row == "fail":
                raise DatasetError(f"{message} (data.on_bad_row=skip leaves such rows out)"
                                   ) from None
            skipped += 1
            first_error = first_error or message
        if d.max_rows and len(rows) >= d.max_rows:
            break
    if skipped and bad_rows is None:
        log.warning("%s: skipped %d malformed row(s); the first: %s", source, skipped, first_error)
    if not rows:
        raise DatasetError(f"{source}: no usable rows"
                           + (f" ({skipped} malformed; the first: {first_error})" if skipped
                              else ""))
    return rows
