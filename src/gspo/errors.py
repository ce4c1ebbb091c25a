"""The errors a user can fix. Each message is one line naming the problem and the fix; the CLI
prints it as `gspo: error: ...` and exits with status 2, without a traceback. Anything else that
escapes is a bug and keeps its traceback."""


def first_line(e: BaseException, limit: int | None = 300) -> str:
    """What an exception says, as a part of one line: its first line (its type's name when it
    says nothing), cut at `limit` characters (None: whole)."""
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:limit]


class GspoError(Exception):
    """Base of every user-fixable error gspo raises."""

    exit_code = 2  # what the CLI exits with


class ConfigError(GspoError, ValueError):
    """A broken configuration (a field, a value, a combination of fields, a data file)."""


class ModelLoadError(GspoError, ValueError):
    """A model or tokenizer that cannot be found, converted or loaded."""


class TrainingError(GspoError, RuntimeError):
    """A run that cannot start or continue as asked (run directory, resume, world size, ...)."""
