"""Run untrusted programs (model-written code) with containment, many at a time.

One run, as set up by a small launcher (this file run as a script with `python -I -S`, started
as a separate session so the whole process group can be killed):

    namespaces   new mount, network, PID, IPC and UTS namespaces (`unshare(2)`). The network
                 namespace has only a loopback interface that is down: no network at all, not
                 even 127.0.0.1 of the host. The program is a child of a mini-init that is PID 1
                 of the new PID namespace, so when the program ends or is killed the kernel
                 kills everything it started, daemons that called setsid() included.
    files        every mount is remounted read-only inside the mount namespace (bind remounts
                 of private copies: the host is untouched), then a fresh size-capped tmpfs is
                 mounted on /tmp holding the working directory, the only writable place. It
                 vanishes with the namespace, so nothing the program writes reaches the disk.
                 Empty read-only mounts on /run, /var/run, /dev/shm and /var/tmp hide the
                 unix sockets kept there (neither a read-only mount nor a network namespace
                 stops a socket: /dev/shm and /var/tmp are world-writable, so anyone may put
                 one there). The rest of the filesystem stays readable as far as the uid's
                 permissions go.
    identity     an unprivileged uid of the run's own (2_000_000_000 + slot, one per concurrent
                 run), with no groups, no capabilities and no_new_privs, so RLIMIT_NPROC counts
                 only this run's processes and setuid binaries grant nothing.
    memory       the run as a whole, all its processes together, in a memory cgroup of its
                 own (v1 or v2, where this process may create one: root with a writable
                 cgroupfs); the kernel kills the run past `memory_mb`. Without a cgroup the
                 parent sums the resident memory of the run's uid ten times a second and kills
                 the run past it (a program can overshoot for up to that interval).
    limits       RLIMIT_CPU, RLIMIT_AS (memory), RLIMIT_NPROC (processes and threads),
                 RLIMIT_FSIZE, RLIMIT_NOFILE, no core dumps; the parent enforces the wall-clock
                 limit and caps what it reads of stdout (the program is killed when it prints
                 more) and keeps the last `stderr_bytes` of stderr (as judges, which ignore a
                 program's stderr: debug output never fails a right answer), then kills the
                 process group and any process left with the uid.
    environment  scrubbed: PATH, LANG, HOME = TMPDIR = the working directory, and one-thread
                 settings for BLAS libraries; nothing of the parent's environment.

The launcher reports which layers it could set up (`RunResult.containment`,
`Sandbox.containment()`). Fallbacks where the kernel or the user's privileges allow less:

- not root: a user namespace maps the user to root inside it, which allows the same mount,
  network and PID namespaces; the program keeps the user's uid outside (no uid of its own), so
  all capabilities are dropped before exec and RLIMIT_NPROC is set above the user's current
  process count.
- no namespaces at all (some containers): the program runs in a fresh host temporary directory
  with the rlimits, its own session and, as root, its own uid; it can then reach the network and
  write wherever that uid may (world-writable /tmp). `strict=True` refuses to run instead.

Without root neither the cgroup nor the uid is the run's own, and memory is bounded per process
only (RLIMIT_AS): a run can then hold up to `processes * memory_mb`. Left out: seccomp filters.
"""

from __future__ import annotations

import ctypes
import json
import os
import resource
import signal
import socket
import sys

UID_BASE = 2_000_000_000
UID_SLOTS = 1024
SAFE_PATH = "/usr/local/bin:/usr/bin:/bin"
SETUP_ERROR = 125

# <sched.h>, <sys/mount.h>, <sys/prctl.h>, <linux/capability.h>
CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_NOATIME, MS_NODIRATIME, MS_BIND = 32, 1024, 2048, 4096
MS_REC, MS_PRIVATE, MS_RELATIME = 16384, 1 << 18, 1 << 21
PR_SET_PDEATHSIG, PR_CAPBSET_DROP, PR_SET_SECUREBITS, PR_SET_NO_NEW_PRIVS = 1, 24, 28, 38
SECBIT_ALL_LOCKED_NOROOT = 0x2F  # NOROOT, NO_SETUID_FIXUP, KEEP_CAPS_LOCKED, each locked


# ============================================================================================
# the launcher: runs as its own process, before and around the program


def _libc():
    return ctypes.CDLL(None, use_errno=True)


def _check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _mount(libc, src, target, fstype, flags, data=None) -> None:
    enc = lambda s: None if s is None else s.encode()  # noqa: E731
    _check(libc.mount(enc(src), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)),
           f"mount {target}")


def _mount_points() -> list[str]:
    points = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            point = line.split()[4]
            for code, char in (("\\040", " "), ("\\011", "\t"), ("\\012", "\n"),
                               ("\\134", "\\")):
                point = point.replace(code, char)  # mountinfo's octal escapes
            points.append(point)
    return sorted(set(points), key=lambda p: p.count("/"))


def _read_only_everywhere(libc) -> int:
    """Bind-remount every mount of this (private) namespace read-only; returns the failures.

    MS_BIND makes the remount change this namespace's mount, never the shared superblock, and
    the flags a mount already has are kept (a user namespace may not clear them)."""
    keep = [(os.ST_NOSUID, MS_NOSUID), (os.ST_NODEV, MS_NODEV), (os.ST_NOEXEC, MS_NOEXEC),
            (os.ST_NOATIME, MS_NOATIME), (os.ST_NODIRATIME, MS_NODIRATIME),
            (getattr(os, "ST_RELATIME", 4096), MS_RELATIME)]
    failures = 0
    for point in _mount_points():
        try:
            have = os.statvfs(point).f_flag
            flags = MS_BIND | MS_REMOUNT | MS_RDONLY
            for st, ms in keep:
                if have & st:
                    flags |= ms
            _mount(libc, None, point, None, flags)
        except OSError:
            failures += 1
    return failures


def _enter_namespaces(libc, spec: dict, report: dict) -> str | None:
    """Unshare and build the filesystem view; returns the working directory inside, or None."""
    base = CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWUTS
    root = os.geteuid() == 0
    uid, gid = os.getuid(), os.getgid()
    if not root:  # RLIMIT_NPROC will count the user's processes on the host too
        report["host_processes"] = _count_processes(uid)
    if libc.unshare(base | (0 if root else CLONE_NEWUSER)) != 0:
        report["unshare_error"] = os.strerror(ctypes.get_errno())
        return None
    if not root:
        report["userns"] = True
        for name, text in (("setgroups", "deny"), ("uid_map", f"0 {uid} 1"),
                           ("gid_map", f"0 {gid} 1")):
            with open(f"/proc/self/{name}", "w") as f:
                f.write(text)
    report.update(netns=True, pidns=True)
    # Private first: without it the remounts below could propagate to the host.
    _mount(libc, None, "/", None, MS_REC | MS_PRIVATE)
    report["readonly_failures"] = _read_only_everywhere(libc)
    _mount(libc, "tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV,
           f"size={spec['disk_mb']}m,mode=0755")
    # Unix sockets ignore read-only mounts and network namespaces: hide where they are kept.
    for path in ("/run", "/var/run", "/dev/shm", "/var/tmp"):
        if os.path.isdir(path) and not os.path.islink(path):
            _mount(libc, "tmpfs", path, "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV, "size=4k")
    report["mountns"] = True
    return "/tmp/work"


def _drop_capabilities(libc) -> None:
    """No capability survives exec, not even for uid 0 of a user namespace."""
    for cap in range(64):
        if libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
            break  # past the last capability the kernel knows
    _check(libc.prctl(PR_SET_SECUREBITS, SECBIT_ALL_LOCKED_NOROOT, 0, 0, 0), "securebits")
    header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this thread
    data = (ctypes.c_uint32 * 6)()  # effective, permitted, inheritable: all zero
    _check(libc.capset(header, data), "capset")


def _count_processes(uid: int) -> int:
    n = 0
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                if os.stat(f"/proc/{pid}").st_uid == uid:
                    n += 1
            except OSError:
                pass
    return n


def _exec_program(libc, spec: dict, workdir: str, drop_uid: bool, in_userns: bool) -> None:
    """In the child: limits, identity, then exec. Never returns."""
    try:
        os.chdir(workdir)
        lim = spec["limits"]
        nproc = lim["processes"]
        if not drop_uid:  # the uid is shared with the user's other processes
            nproc += spec["host_processes"]
        mb = 1024 * 1024
        for res, value in ((resource.RLIMIT_AS, lim["memory_mb"] * mb),
                           (resource.RLIMIT_NPROC, nproc),
                           (resource.RLIMIT_FSIZE, lim["file_size_mb"] * mb),
                           (resource.RLIMIT_NOFILE, lim["open_files"]),
                           (resource.RLIMIT_CORE, 0)):
            resource.setrlimit(res, (value, value))
        cpu = max(1, int(-(-lim["cpu_s"] // 1)))  # whole seconds, rounded up
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))  # SIGXCPU, then SIGKILL
        if drop_uid:
            os.setgroups([])
            os.setresgid(spec["gid"], spec["gid"], spec["gid"])
            os.setresuid(spec["uid"], spec["uid"], spec["uid"])  # clears all capabilities
        elif in_userns:
            _drop_capabilities(libc)
        _check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
        # Set after the uid change, which clears it: the program dies with its parent.
        _check(libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "pdeathsig")
        env = dict(spec["env"], HOME=workdir, TMPDIR=workdir)
        os.execve(spec["argv"][0], spec["argv"], env)
    except BaseException as e:  # noqa: BLE001 - report anything, then die
        try:
            os.write(2, f"sandbox: cannot start the program: {e}\n".encode())
        finally:
            os._exit(SETUP_ERROR)


def _wait_status(status: int) -> int:
    return os.WEXITSTATUS(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status)


def _mini_init(libc, spec: dict, workdir: str, drop_uid: bool, in_userns: bool,
               status_w: int) -> None:
    """PID 1 of the new namespace: start the program, reap everything, report, exit."""
    try:
        _mount(libc, "proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC | MS_RDONLY)
    except OSError:
        pass  # the host's /proc stays visible (read-only); nothing depends on it
    pid = os.fork()
    if pid == 0:
        _exec_program(libc, spec, workdir, drop_uid, in_userns)
    while True:  # orphans are re-parented to us; reap them until the program itself ends
        got, status, usage = os.wait4(-1, 0)
        if got == pid:
            break
    os.write(status_w, (json.dumps({"exit": _wait_status(status),
                                    "cpu_s": usage.ru_utime + usage.ru_stime}) + "\n").encode())
    os._exit(0)  # the kernel now kills whatever the program left behind in the namespace


def _launch(spec_path: str) -> None:
    with open(spec_path) as f:
        spec = json.load(f)
    status_w = spec["status_fd"]
    os.set_inheritable(status_w, False)  # the program never sees it
    libc = _libc()
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != spec["parent_pid"]:
        os._exit(SETUP_ERROR)  # the parent is already gone
    report = {"netns": False, "mountns": False, "pidns": False, "userns": False,
              "uid": os.geteuid(), "readonly_failures": None,
              "memory_cgroup": bool(spec["cgroup"])}
    try:
        if spec["cgroup"]:  # first: every process of the run is born inside it
            with open(os.path.join(spec["cgroup"], "cgroup.procs"), "w") as f:
                f.write(str(os.getpid()))
        files = {}
        for name in spec["files"]:
            with open(os.path.join(spec["files_dir"], name), "rb") as f:
                files[name] = f.read()  # read now: the host /tmp is hidden once we mount
        workdir = _enter_namespaces(libc, spec, report)
        if workdir is None:
            if spec["strict"]:
                raise OSError(f"namespaces unavailable ({report.get('unshare_error')}) and "
                              f"strict=True")
            workdir = spec["host_workdir"]
        drop_uid = os.geteuid() == 0 and not report["userns"]
        spec["host_processes"] = report.get("host_processes", 0)
        os.makedirs(workdir, mode=0o700, exist_ok=True)
        for name, data in files.items():
            with open(os.path.join(workdir, name), "wb") as f:
                f.write(data)
        if drop_uid:
            for path in [workdir] + [os.path.join(workdir, n) for n in files]:
                os.chown(path, spec["uid"], spec["gid"])
            report["uid"] = spec["uid"]
        report["ok"] = True
        os.write(status_w, (json.dumps(report) + "\n").encode())
    except Exception as e:  # noqa: BLE001
        report.update(ok=False, error=str(e))
        os.write(status_w, (json.dumps(report) + "\n").encode())
        os._exit(SETUP_ERROR)
    if not report["pidns"]:
        _exec_program(libc, spec, workdir, drop_uid, report["userns"])
    pid = os.fork()
    if pid == 0:
        try:
            libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
            _mini_init(libc, spec, workdir, drop_uid, report["userns"], status_w)
        finally:
            os._exit(SETUP_ERROR)  # only reached when the mini-init itself failed
    _, status = os.waitpid(pid, 0)
    os._exit(_wait_status(status))


if __name__ == "__main__":
    _launch(sys.argv[1])  # never returns: it execs the program or exits


# ============================================================================================
# the parent side: the API. The launcher never gets here, so it never pays for these imports.

import logging  # noqa: E402
import selectors  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from concurrent.futures import ThreadPoolExecutor  # noqa: E402
from dataclasses import asdict, dataclass, field  # noqa: E402
from pathlib import Path  # noqa: E402

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Limits:
    """Per-run limits. Wall and CPU time in seconds, sizes in MiB."""

    wall_s: float = 10.0
    """Wall-clock time of the program, after set-up; then the whole run is killed."""
    cpu_s: float = 10.0
    """CPU time (RLIMIT_CPU, whole seconds rounded up; SIGXCPU, then SIGKILL)."""
    memory_mb: int = 1024
    """Memory of the whole run, its processes together (a memory cgroup, else the uid's
    resident memory as the parent sees it), and the address space of each (RLIMIT_AS)."""
    processes: int = 16
    """Processes and threads of the run's uid (RLIMIT_NPROC)."""
    file_size_mb: int = 16
    """Largest file the program may write (RLIMIT_FSIZE)."""
    disk_mb: int = 64
    """Size of the tmpfs holding the working directory (all files together)."""
    open_files: int = 64
    """Open file descriptors (RLIMIT_NOFILE)."""
    stdout_bytes: int = 1 << 20
    """Most bytes of stdout kept; printing more kills the run ('output_limit')."""
    stderr_bytes: int = 64 << 10
    """Most bytes of stderr kept: its last ones (a traceback's end); more is read and dropped."""


@dataclass
class RunResult:
    """What one run did. status: ok | error | timeout | output_limit | memory_limit |
    setup_error."""

    status: str
    exit_code: int | None
    stdout: bytes
    stderr: bytes
    wall_s: float
    cpu_s: float | None = None
    containment: dict = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.status == "ok"


def default_python() -> str:
    """An interpreter an unprivileged uid can execute (a venv under /root may not be)."""
    for path in ("/usr/bin/python3", "/usr/local/bin/python3"):
        if os.access(path, os.X_OK):
            return path
    return shutil.which("python3", path=SAFE_PATH) or sys.executable


class _UidSlot:
    """An exclusive uid for one run, across threads and processes: an abstract unix
    socket name can be bound by one socket at a time and is freed when its owner dies."""

    def __init__(self):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        start = (os.getpid() * 7 + threading.get_ident()) % UID_SLOTS
        for i in range(UID_SLOTS):
            uid = UID_BASE + (start + i) % UID_SLOTS
            try:
                self.sock.bind(f"\0gspo-sandbox-uid-{uid}")
                self.uid = uid
                return
            except OSError:
                continue
        self.sock.close()
        raise RuntimeError(f"all {UID_SLOTS} sandbox uids are in use")

    def release(self):
        self.sock.close()


class MemoryCgroup:
    """A memory cgroup of one run (v1 `memory.limit_in_bytes` or v2 `memory.max`), or None
    from `create` where this process may not make one. Processes join it by writing their
    pid into `cgroup.procs`; `close` removes it once they are gone."""

    V1, V2 = "/sys/fs/cgroup/memory", "/sys/fs/cgroup"

    def __init__(self, path: str, v2: bool):
        self.path, self.v2 = path, v2

    @classmethod
    def create(cls, name: str, limit_mb: int) -> "MemoryCgroup | None":
        v2 = not os.path.isdir(cls.V1) and "memory" in _read(f"{cls.V2}/cgroup.subtree_control")
        path = os.path.join(cls.V2 if v2 else cls.V1, name)
        limit = "memory.max" if v2 else "memory.limit_in_bytes"
        try:
            if os.path.isdir(path):  # left by a run that was killed -9
                os.rmdir(path)
            os.mkdir(path)
        except OSError:
            return None
        group = cls(path, v2)
        try:
            Path(path, limit).write_text(str(limit_mb * 1024 * 1024))
            if not v2 and os.path.exists(f"{path}/memory.memsw.limit_in_bytes"):
                Path(path, "memory.memsw.limit_in_bytes").write_text(str(limit_mb << 20))
        except OSError:
            group.close()
            return None
        return group

    def oom_killed(self) -> bool:
        """Whether the kernel killed a process of the run for going over the limit."""
        text = _read(f"{self.path}/{'memory.events' if self.v2 else 'memory.oom_control'}")
        counts = dict(line.split()[:2] for line in text.splitlines() if len(line.split()) > 1)
        return int(counts.get("oom_kill", 0)) > 0

    def close(self) -> None:
        for _ in range(50):  # the last processes may take a moment to leave
            try:
                os.rmdir(self.path)
                return
            except FileNotFoundError:
                return
            except OSError:
                time.sleep(0.01)
        log.warning("sandbox memory cgroup %s could not be removed", self.path)


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def uid_rss_mb(uid: int) -> float:
    """Resident memory of every process whose real uid is `uid`, in MiB."""
    total = 0
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            fields = dict(line.split(":", 1) for line in _read(f"/proc/{pid}/status").splitlines()
                          if ":" in line)
            if fields.get("Uid", "").split()[:1] == [str(uid)]:
                total += int(fields.get("VmRSS", "0 kB").split()[0])
    return total / 1024


STAGING_PREFIX = "gspo-sandbox-"


def remove_stale_staging(tmp: str | None = None) -> list[str]:
    """Delete the staging directories of processes that are gone (killed -9 mid-run: their
    `finally` never ran); returns what was removed. A live owner's directories stay."""
    tmp = tmp or tempfile.gettempdir()
    removed = []
    for name in os.listdir(tmp):
        pid = name[len(STAGING_PREFIX):].split("-", 1)[0]
        if not (name.startswith(STAGING_PREFIX) and pid.isdigit()):
            continue
        try:
            os.kill(int(pid), 0)
            continue  # alive (or another user's: PermissionError below)
        except ProcessLookupError:
            shutil.rmtree(os.path.join(tmp, name), ignore_errors=True)
            removed.append(name)
        except PermissionError:
            continue
    return removed


def kill_uid(uid: int, rounds: int = 50) -> int:
    """SIGKILL every process whose real, effective or saved uid is `uid`; returns how many.

    Repeats until a scan finds none, so processes forked during the sweep are caught too."""
    killed = 0
    for _ in range(rounds):
        found = 0
        for pid in os.listdir("/proc"):
            if not pid.isdigit():
                continue
            try:
                with open(f"/proc/{pid}/status") as f:
                    uids = next(line for line in f if line.startswith("Uid:")).split()[1:4]
            except (OSError, StopIteration):
                continue
            if str(uid) in uids:
                found += 1
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except OSError:
                    pass
        killed += found
        if not found:
            break
        time.sleep(0.01)
    return killed


class Sandbox:
    """Runs programs under `limits`; thread-safe, so a pool can call `run` concurrently.

    strict: refuse to run (status 'setup_error') where the kernel allows no namespaces,
    instead of falling back to rlimits and a host temporary directory.
    """

    def __init__(self, limits: Limits | None = None, python: str | None = None,
                 strict: bool = False):
        self.limits = limits or Limits()
        self.python = python or default_python()
        self.strict = strict
        self._containment: dict | None = None
        self._lock = threading.Lock()

    # ---- one run

    def run(self, files: dict[str, str | bytes], argv: list[str], stdin: str | bytes = b"",
            limits: Limits | None = None) -> RunResult:
        """Write `files` into a fresh working directory and run argv there.

        argv[0] must be an absolute path; relative names in argv resolve in the working
        directory, e.g. run({"main.py": src}, [sandbox.python, "main.py"])."""
        lim = limits or self.limits
        stdin = stdin.encode() if isinstance(stdin, str) else stdin
        slot = _UidSlot() if os.geteuid() == 0 else None
        cgroup = MemoryCgroup.create(f"gspo-sandbox-{slot.uid}", lim.memory_mb) if slot else None
        # 0700, ours; the pid in the name lets a later run remove it if we die (remove_stale)
        staging = tempfile.mkdtemp(prefix=f"{STAGING_PREFIX}{os.getpid()}-")
        status_r, status_w = os.pipe()
        proc = None
        try:
            spec_path = self._stage(staging, files, argv, lim, slot, status_w, cgroup)
            proc = subprocess.Popen(
                [sys.executable, "-I", "-S", "-B", __file__, spec_path],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                env={"PATH": SAFE_PATH, "LANG": "C.UTF-8"}, cwd=staging,
                start_new_session=True, pass_fds=(status_w,))
            os.close(status_w)
            status_w = -1
            # no cgroup: the parent watches the run's own uid instead
            watch = slot.uid if slot and not cgroup else None
            result = self._communicate(proc, stdin, status_r, lim, watch)
            if cgroup and cgroup.oom_killed():  # of the program or any process it started
                result.status = "memory_limit"
            return result
        finally:
            if proc is not None:
                _kill_group(proc)
            for fd in (status_r, status_w):
                if fd >= 0:
                    os.close(fd)
            if slot is not None:
                kill_uid(slot.uid)  # whatever escaped the group and the namespace
                slot.release()
            if cgroup is not None:
                cgroup.close()
            shutil.rmtree(staging, ignore_errors=True)

    def run_python(self, source: str, stdin: str | bytes = b"",
                   extra_files: dict[str, str | bytes] | None = None,
                   limits: Limits | None = None) -> RunResult:
        """Run `source` as main.py with the sandbox's interpreter (isolated mode)."""
        files = {"main.py": source, **(extra_files or {})}
        return self.run(files, [self.python, "-I", "-B", "main.py"], stdin, limits)

    def run_many(self, jobs: list[dict], workers: int | None = None) -> list[RunResult]:
        """run_python(**job) for each job, `workers` at a time; results in job order."""
        workers = workers or os.cpu_count() or 1
        with ThreadPoolExecutor(max_workers=workers) as pool:
            return list(pool.map(lambda job: self.run_python(**job), jobs))

    def containment(self) -> dict:
        """The layers a run gets on this machine, found once by running a trivial program."""
        with self._lock:
            if self._containment is None:
                remove_stale_staging()
                r = self.run_python("print('ok')", limits=Limits(wall_s=30, cpu_s=30))
                self._containment = {**r.containment, "python": self.python,
                                     "runs": r.ok and r.stdout.strip() == b"ok",
                                     "error": None if r.ok else r.stderr.decode()[-500:]}
            return self._containment

    # ---- internals

    def _stage(self, staging, files, argv, lim, slot, status_w, cgroup) -> str:
        files_dir = os.path.join(staging, "files")
        host_workdir = os.path.join(staging, "work")
        os.mkdir(files_dir)
        os.mkdir(host_workdir, 0o700)
        for name, data in files.items():
            if os.path.basename(name) != name or name in ("", ".", ".."):
                raise ValueError(f"sandbox file names must be plain names, got {name!r}")
            Path(files_dir, name).write_bytes(data.encode() if isinstance(data, str)
                                              else data)
        if slot is not None:
            os.chmod(staging, 0o711)  # the uid must reach work/ in the no-namespace case
        spec = {
            "argv": list(argv), "files": list(files), "files_dir": files_dir,
            "host_workdir": host_workdir, "status_fd": status_w, "parent_pid": os.getpid(),
            "uid": slot.uid if slot else os.getuid(), "gid": slot.uid if slot else os.getgid(),
            "strict": self.strict, "disk_mb": lim.disk_mb, "limits": asdict(lim),
            "cgroup": cgroup.path if cgroup else None,
            "env": {"PATH": SAFE_PATH, "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1",
                    "PYTHONIOENCODING": "utf-8", "OMP_NUM_THREADS": "1",
                    "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"},
        }
        spec_path = os.path.join(staging, "spec.json")
        Path(spec_path).write_text(json.dumps(spec))
        return spec_path

    def _communicate(self, proc, stdin: bytes, status_r: int, lim: Limits,
                     watch_uid: int | None) -> RunResult:
        pipes = _RunPipes(proc, stdin, status_r, lim, watch_uid)
        try:
            reason = pipes.loop()
        finally:
            pipes.close()
        _kill_group(proc)
        return self._result(proc, reason, pipes.bufs, lim, pipes.wall_s())

    def _result(self, proc, reason, bufs, lim: Limits, wall: float) -> RunResult:
        reports = [json.loads(line) for line in bytes(bufs["status"]).splitlines()
                   if line.strip()]
        setup = reports[0] if reports else {}
        final = reports[1] if len(reports) > 1 else {}
        code = final.get("exit", proc.returncode)
        if code is not None and code < 0:  # killed by a signal, the Popen way
            code = 128 - code
        cpu = final.get("cpu_s")
        if not setup.get("ok", False) and reason is None:
            status = "setup_error"
            bufs["err"] += f"sandbox set-up failed: {setup.get('error', 'no report')}".encode()
        elif reason is not None:
            status = reason
        elif code == 0:
            status = "ok"
        elif code in (128 + signal.SIGXCPU, 128 + signal.SIGKILL) and cpu is not None \
                and cpu >= int(-(-lim.cpu_s // 1)) - 0.05:
            status = "timeout"
        else:
            status = "error"
        containment = {k: setup.get(k) for k in ("netns", "mountns", "pidns", "userns",
                                                 "uid", "readonly_failures", "memory_cgroup")}
        return RunResult(status, code, bytes(bufs["out"][:lim.stdout_bytes]),
                         bytes(bufs["err"]), wall, cpu, containment)


class _RunPipes:
    """The parent's end of one run: stdin fed, stdout read up to its cap and stderr's end kept, the
    launcher's reports collected, the wall clock enforced (from the set-up report on)."""

    SETUP_S = 30.0  # the launcher's own set-up, before the program's clock starts

    def __init__(self, proc, stdin: bytes, status_r: int, lim: Limits, watch_uid: int | None):
        self.proc, self.lim, self.watch_uid = proc, lim, watch_uid
        self.bufs = {"out": bytearray(), "err": bytearray(), "status": bytearray()}
        self.caps = {"out": lim.stdout_bytes, "err": lim.stderr_bytes, "status": 1 << 16}
        self.sel = selectors.DefaultSelector()
        for name, fd in (("out", proc.stdout.fileno()), ("err", proc.stderr.fileno()),
                         ("status", status_r)):
            os.set_blocking(fd, False)
            self.sel.register(fd, selectors.EVENT_READ, name)
        self.pending = memoryview(stdin)
        if stdin:
            os.set_blocking(proc.stdin.fileno(), False)
            self.sel.register(proc.stdin.fileno(), selectors.EVENT_WRITE, "in")
        else:
            proc.stdin.close()
        # A pidfd turns "the launcher exited" into one more readable fd.
        self.pidfd = os.pidfd_open(proc.pid) if hasattr(os, "pidfd_open") else None
        if self.pidfd is not None:
            self.sel.register(self.pidfd, selectors.EVENT_READ, "exit")
        self.t0 = time.monotonic()
        self.started = self.exited_at = None

    def loop(self) -> str | None:
        """'timeout', 'output_limit', 'memory_limit' (the uid's resident memory, when no cgroup
        bounds it), or None when the run ended by itself."""
        deadline = self.t0 + self.SETUP_S
        while self.sel.get_map():
            now = time.monotonic()
            if self.started is None and b"\n" in self.bufs["status"]:
                self.started, deadline = now, now + self.lim.wall_s
            if now >= deadline:
                return "timeout"
            if (self.watch_uid is not None and self.started is not None
                    and uid_rss_mb(self.watch_uid) > self.lim.memory_mb):
                return "memory_limit"
            if self.exited_at is None and self.pidfd is None and self.proc.poll() is not None:
                self.exited_at = now
            if self.exited_at is not None and now - self.exited_at > 0.5:
                return None  # the launcher is gone but something still holds the pipes
            for key, _ in self.sel.select(timeout=min(0.1, deadline - now)):
                if key.data == "exit":
                    self.sel.unregister(key.fd)
                    self.exited_at = time.monotonic()
                elif key.data == "in":
                    self._feed(key.fd)
                elif self._read(key.fd, key.data):
                    return "output_limit"
        return None

    def _feed(self, fd: int) -> None:
        try:
            self.pending = self.pending[os.write(fd, self.pending[:65536]):]
        except BlockingIOError:
            return
        except BrokenPipeError:  # the program stopped reading; it gets no more
            self.pending = self.pending[:0]
        if not self.pending:
            self.sel.unregister(fd)
            self.proc.stdin.close()

    def _read(self, fd: int, name: str) -> bool:
        """Read what is there; True when the stream went over its cap."""
        try:
            chunk = os.read(fd, 65536)
        except BlockingIOError:
            return False
        if not chunk:
            self.sel.unregister(fd)
            return False
        buf = self.bufs[name]
        buf += chunk
        if name == "err" and len(buf) > self.caps[name]:  # its end is kept, the rest dropped
            del buf[:len(buf) - self.caps[name]]
        return len(buf) > self.caps[name]

    def wall_s(self) -> float:
        return time.monotonic() - (self.started or self.t0)

    def close(self) -> None:
        self.sel.close()
        if self.pidfd is not None:
            os.close(self.pidfd)
        try:
            self.proc.stdin.close()
        except OSError:
            pass


def _kill_group(proc) -> None:
    """SIGKILL the launcher's whole process group, then reap the launcher."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        log.warning("sandbox launcher %d did not exit after SIGKILL", proc.pid)
    for f in (proc.stdout, proc.stderr):
        if f and not f.closed:
            f.close()
