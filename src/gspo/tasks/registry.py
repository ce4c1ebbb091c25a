"""The task registry: TaskSpec (what data.task=NAME trains on and how it is rewarded), TASKS,
`register_task` and `get_task`, and the three built-in tasks' entries. Apart from gspo.tasks so
that gspo.tasks.datasets, which gspo.tasks imports, can read it without an import circle.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from gspo.errors import ConfigError
from gspo.rewards import RewardFn
from gspo.tasks import arithmetic, code, math


@dataclass(frozen=True)
class TaskSpec:
    """What data.task=NAME trains on and how it is rewarded. The callables take the
    DataConfig `d` where they need settings."""

    name: str
    help: str
    """one line: how answers are scored (and where the prompts come from, if generated)"""
    make_reward: Callable[[Any], RewardFn]
    """d -> the task's own reward (used when data.reward is empty)"""
    make_rows: Callable[[Any], tuple[list[dict], list[dict]]] | None = None
    """d -> (train, held-out) rows of a synthetic task; None: rows are read from data.path (or
    given from Python), each mapped by gspo.tasks.datasets.map_row"""
    field: str = "answer"
    """the row field the reward reads; read from the column data.<field>_field names where
    DataConfig has that setting (answer_field, tests_field), else from the column `field`"""
    parse: Callable[[Any, dict, Any], Any] | None = None
    """(the column's value, the raw row, d) -> the row's `field`, ValueError when malformed;
    None keeps the value as it is"""
    also_reads: tuple[str, ...] = ()
    """DataConfig settings naming further columns `parse` reads, which are then not passed on
    as the row's other fields (code: fn_name_field)"""
    solution: Callable[[dict], str] | None = None
    """row -> the worked answer the supervised warm-up imitates; None: data.solution_field"""
    sample_answer: Callable[[dict], tuple[str, str]] | None = None
    """row -> (an answer as a model would write it, what it is): what the dry run scores where
    the rows have no worked solution; None: the row's `field` as text"""

    def setting(self, d) -> str | None:
        """The DataConfig setting that names the column holding `field` (answer_field,
        tests_field), or None where DataConfig has none: the column is then named `field`."""
        key = f"{self.field}_field"
        return key if hasattr(d, key) else None

    def column(self, d) -> str:
        """The data file's column holding `field`."""
        key = self.setting(d)
        return getattr(d, key) if key else self.field


TASKS: dict[str, TaskSpec] = {}
"""name -> TaskSpec; data.task=NAME selects one and data.reward=NAME its reward."""


def register_task(spec: TaskSpec) -> TaskSpec:
    """Make data.task=spec.name select `spec` (a new name only); returns it."""
    if not spec.name or ":" in spec.name:  # data.reward tells module:function by the colon
        raise ValueError(f"a task name must be non-empty and without ':', got {spec.name!r}")
    if spec.name in TASKS:
        raise ValueError(f"task {spec.name!r} is already registered")
    TASKS[spec.name] = spec
    return spec


def get_task(name: str) -> TaskSpec:
    """The TASKS entry `name`, or a ConfigError listing the known ones (in the config's
    format for a value outside a field's choices)."""
    if name not in TASKS:
        raise ConfigError(f"data.task must be one of {' | '.join(TASKS)}, got {name!r}")
    return TASKS[name]


def file_tasks() -> list[str]:
    """The names of the tasks whose rows are read from data.path."""
    return [name for name, spec in TASKS.items() if spec.make_rows is None]


register_task(TaskSpec("arithmetic", "generated integer arithmetic, the answer matched exactly",
                       arithmetic.reward, make_rows=arithmetic.rows, solution=arithmetic.solution))
register_task(TaskSpec("math", "final answers checked against the reference with math-verify",
                       math.reward, parse=math.parse_answer, sample_answer=math.sample_answer))
register_task(TaskSpec("code", "programs run against the row's tests in the sandbox",
                       code.reward, field="tests", parse=code.parse_tests,
                       also_reads=("fn_name_field",), sample_answer=code.sample_answer))
