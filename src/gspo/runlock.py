"""One writer per run directory: `gspo train` holds an exclusive lock on `RUN/.lock` while it runs.

Two runs writing one directory interleave metrics rows and delete each other's half-written
checkpoints, and the next resume then fails. The lock is `fcntl.flock` on a file that stays in
the directory: the kernel releases it when its process ends in any way (kill -9 included), so a
stale lock after a crash never blocks the next run, and nothing has to guess whether a recorded
pid is still alive. The file names its holder (pid, host, start time) for the error message.

Scope: a lock on one filesystem as the kernel sees it; on network filesystems flock may be
local to one client (NFS without lock support), so it guards against two runs on one machine.
Only rank 0 (the one writer under torchrun) takes it.
"""

from __future__ import annotations

import fcntl
import os
import socket
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from gspo.errors import TrainingError

LOCK_FILE = ".lock"


def unusable(run_dir: Path, why: str) -> TrainingError:
    return TrainingError(f"cannot write the run directory {run_dir}: {why}; choose another "
                         f"--output-dir")


def check_run_dir(run_dir: str | os.PathLike) -> None:
    """Without writing anything: TrainingError unless `run_dir` is a directory this process can
    write, or one it can create (its nearest existing parent a writable directory), and not a
    run's checkpoints directory or a checkpoint, or inside one (a run there would write into
    finished checkpoints and break their manifests)."""
    run_dir = Path(run_dir)
    run = _run_holding(run_dir.absolute())
    if run is not None:
        raise TrainingError(f"{run_dir} holds checkpoints of the run {run}, or is one: a run "
                            f"there would write into them; to continue that run pass its "
                            f"directory, --resume {run}, or start a new one in another "
                            f"--output-dir")
    try:
        path = run_dir.absolute()
        too_long = [p for p in path.parts if len(os.fsencode(p)) > 255]
        if too_long:
            raise unusable(run_dir, f"the name {too_long[0][:40]}... is longer than the 255 "
                                    f"bytes a file name may have")
        if path.exists() and not path.is_dir():
            raise unusable(run_dir, "it is a file, not a directory")
        parent = path
        while not parent.exists():
            parent = parent.parent
        if not parent.is_dir():
            raise unusable(run_dir, f"{parent} is a file, not a directory")
        if not os.access(parent, os.W_OK | os.X_OK):
            raise unusable(run_dir, f"{parent} is not writable here (permissions, or a "
                                    f"read-only filesystem)")
    except OSError as e:
        raise unusable(run_dir, e.strerror or str(e)) from None


def _run_holding(path: Path) -> Path | None:
    """The run directory whose checkpoints `path` is, or is in (None: not such a path)."""
    from gspo.checkpoint import CHECKPOINTS_DIR, LATEST_FILE, is_step_dir

    if path.name == CHECKPOINTS_DIR and path.is_dir() and (
            (path / LATEST_FILE).exists() or any(is_step_dir(p) for p in path.iterdir())):
        return path.parent
    for p in (path, *path.parents):
        if is_step_dir(p) and p.parent.name == CHECKPOINTS_DIR:
            return p.parent.parent
    return None


@contextmanager
def exclusive(run_dir: str | os.PathLike, enabled: bool = True) -> Iterator[None]:
    """Hold `run_dir`'s lock for the block, or raise TrainingError naming the holder."""
    if not enabled:
        yield
        return
    run_dir = Path(run_dir)
    check_run_dir(run_dir)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(run_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:  # a read-only filesystem, no permission, a name too long, ...
        raise unusable(run_dir, e.strerror or str(e)) from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "another process"
            raise TrainingError(f"{run_dir} is in use by another gspo train ({holder}); wait "
                                f"for it to finish, or choose another --output-dir") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}, since "
                      f"{time.strftime('%Y-%m-%d %H:%M:%S')}\n".encode(), 0)
        yield
    finally:
        os.close(fd)  # releases the lock
