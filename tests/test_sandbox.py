"""The sandbox and the code reward: ordinary programs, then hostile ones.

Every hostile program must be contained, reported as a failed test (reward 0), and leave
nothing running or written. A test that needs a containment layer the machine does not give
(no namespaces, not root) is skipped with the reason.
"""

import contextlib
import os
import socket
import threading
import time
import uuid
from pathlib import Path

import pytest

from gspo.rewards.code import (CodeReward, extract_code, normalize_tests, outputs_match,
                               values_match)
from gspo.sandbox import UID_BASE, Limits, Sandbox

REPO = Path(__file__).resolve().parents[1]
LIMITS = Limits(wall_s=2.0, cpu_s=1.0, memory_mb=512, processes=16)


class RecordingSandbox(Sandbox):
    """Keeps every RunResult, so a test can see the uid a run had and how it ended."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.results = []

    def run(self, *args, **kwargs):
        result = super().run(*args, **kwargs)
        self.results.append(result)
        return result


@pytest.fixture(scope="module")
def sandbox():
    box = RecordingSandbox(LIMITS)
    box.containment()  # its probe run now, not inside the first test's (run_hostile counts runs)
    return box


@pytest.fixture(scope="module")
def reward(sandbox):
    r = CodeReward(mode="all", sandbox=sandbox, workers=2)
    yield r
    r.close()


def needs(sandbox, *layers):
    c = sandbox.containment()
    missing = [layer for layer in layers if not c.get(layer)]
    if missing:
        pytest.skip(f"this machine gives no {', '.join(missing)} (containment: {c})")


def needs_root():
    if os.geteuid() != 0:
        pytest.skip("a uid of the run's own needs root")


def processes_of_uid(uid):
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/status") as f:
                uids = next(line for line in f if line.startswith("Uid:")).split()[1:4]
        except (OSError, StopIteration):
            continue
        if str(uid) in uids:
            found.append(int(pid))
    return found


def processes_with_arg(marker):
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if marker.encode() in f.read():
                    found.append(int(pid))
        except OSError:
            continue
    return found


def run_hostile(reward, sandbox, program, expected="ok\n"):
    """The program as a completion against one stdin test; returns (reward, its RunResult)."""
    n = len(sandbox.results)
    score = reward(f"```python\n{program}\n```", tests=[{"input": "", "output": expected}])
    (result,) = sandbox.results[n:]
    return score, result


@contextlib.contextmanager
def serving(server, reply=b""):
    """Accept connections on a bound `server` socket (answering `reply`) while the block runs;
    yields the list of accepted connections."""
    server.listen(8)
    server.settimeout(0.2)
    accepted, done = [], threading.Event()

    def accept():
        while not done.is_set():
            try:
                conn = server.accept()[0]
                conn.sendall(reply)
                accepted.append(conn)
            except (socket.timeout, OSError):
                pass

    t = threading.Thread(target=accept)
    t.start()
    try:
        yield accepted
    finally:
        done.set()
        t.join()
        server.close()


def assert_nothing_left(result):
    uid = result.containment.get("uid")
    if uid is not None and uid >= UID_BASE:
        assert processes_of_uid(uid) == [], f"processes of uid {uid} outlived the run"


# ---------------------------------------------------------------------------------------------
# ordinary programs


def test_a_program_reads_stdin_and_its_stdout_is_compared(reward):
    assert reward("```python\nprint(sum(map(int, input().split())))\n```",
                  tests=[{"input": "1 2\n", "output": "3\n"}, {"input": "5 5\n", "output": "10"}]
                  ) == 1.0
    assert reward("```python\nprint(0)\n```", tests=[{"input": "1 2\n", "output": "3\n"}]) == 0.0


def test_a_right_program_with_an_output_longer_than_the_stdout_cap_passes():
    # the cap (output_limit) is for runaway printing, not for a test whose answer is long
    reward = CodeReward(sandbox=Sandbox(Limits(wall_s=10, cpu_s=10, stdout_bytes=1000)),
                        workers=1)
    expected = "\n".join(map(str, range(1000))) + "\n"  # 3890 bytes
    program = "```python\nprint(*range(int(input())), sep='\\n')\n```"
    try:
        assert reward(program, tests=[{"input": "1000\n", "output": expected}]) == 1.0
        assert reward(program, tests=[{"input": "1000\n", "output": "0"}]) == 0.0
    finally:
        reward.close()


def test_debug_output_on_stderr_past_its_cap_is_dropped_not_a_failure():
    # judges ignore stderr: a right answer after 250 KB of debug lines passes, and the result
    # keeps stderr's last bytes (where a traceback ends)
    sandbox = Sandbox(Limits(wall_s=10, cpu_s=10, stderr_bytes=4096))
    reward = CodeReward(sandbox=sandbox, workers=1)
    program = ("import sys\nfor i in range(25000):\n    print('debug', i, file=sys.stderr)\n"
               "print(int(input()) * 2)\nprint('last words', file=sys.stderr)")
    try:
        assert reward(f"```python\n{program}\n```", tests=[{"input": "21\n", "output": "42"}]) == 1.0
        r = sandbox.run({"main.py": program}, [sandbox.python, "main.py"], b"21\n")
        assert r.status == "ok" and r.stdout == b"42\n"
        assert len(r.stderr) == 4096 and r.stderr.endswith(b"debug 24999\nlast words\n")
    finally:
        reward.close()


def test_fraction_mode_scores_the_passing_share(sandbox):
    frac = CodeReward(mode="fraction", sandbox=sandbox, workers=2)
    tests = [{"input": "1\n", "output": "1"}, {"input": "2\n", "output": "2"},
             {"input": "3\n", "output": "1"}, {"input": "4\n", "output": "1"}]
    # prints 1, 2, 2, 2: the first two pass
    assert frac("```python\nprint(min(int(input()), 2))\n```", tests=tests) == pytest.approx(0.5)
    frac.close()


def test_call_based_tests_call_the_named_function(reward):
    tests = {"inputs": [[1, 2], [3, 4]], "outputs": [3, 7], "fn_name": "add"}
    assert reward("def add(a, b):\n    print('noise')\n    return a + b\n", tests=tests) == 1.0
    assert reward("def add(a, b):\n    return a - b\n", tests=tests) == 0.0
    leetcode = [{"input": "[1, 2, 3]\n2", "output": "[3, 4, 5]", "testtype": "functional"}]
    solution = ("class Solution:\n    def shift(self, nums, k):\n"
                "        return [x + k for x in nums]\n")
    assert reward(solution, tests=leetcode, fn_name="shift") == 1.0


def test_runtime_error_timeout_and_missing_code_fail(reward, sandbox):
    tests = [{"input": "", "output": "1"}]
    outcomes = reward.run_tests("```python\nraise SystemExit(3)\n```", tests)
    assert [o.status for o in outcomes] == ["error"]
    start = time.monotonic()
    outcomes = reward.run_tests("```python\nimport time\ntime.sleep(60)\n```", tests)
    assert [o.status for o in outcomes] == ["timeout"]
    assert time.monotonic() - start < LIMITS.wall_s + 3
    assert [o.status for o in reward.run_tests("   ", tests)] == ["no_code"]


def test_many_programs_run_in_parallel(sandbox):
    jobs = [{"source": "import time\ntime.sleep(1.0)\nprint('done')"} for _ in range(4)]
    start = time.monotonic()
    results = sandbox.run_many(jobs, workers=4)
    elapsed = time.monotonic() - start
    assert [r.stdout for r in results] == [b"done\n"] * 4
    assert elapsed < 3.0, f"4 one-second programs on 4 workers took {elapsed:.1f}s"


def test_program_sees_a_fresh_writable_directory_and_a_scrubbed_environment(sandbox):
    r = sandbox.run_python("import os\nopen('f.txt', 'w').write('x')\n"
                           "print(os.listdir('.'), sorted(os.environ))")
    assert r.ok, r.stderr
    listing, env = r.stdout.decode().split("] ")
    assert "'f.txt'" in listing and "'main.py'" in listing
    assert set(eval(env)) <= {"PATH", "LANG", "HOME", "TMPDIR", "PYTHONDONTWRITEBYTECODE",
                              "PYTHONIOENCODING", "OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS",
                              "MKL_NUM_THREADS"}


def test_containment_here_is_full(sandbox):
    needs_root()
    c = sandbox.containment()
    assert c["runs"], c
    assert c["netns"] and c["mountns"] and c["pidns"] and c["readonly_failures"] == 0, c
    assert c["uid"] >= UID_BASE and not c["userns"]


def test_extract_code_prefers_the_last_python_block():
    text = "```\nfirst\n```\nthen ```python\nsecond\n```\nand ```py\nthird\n```"
    assert extract_code(text) == "third\n"
    assert extract_code("```js\nx\n```") == "x\n"
    assert extract_code("print(1)") == "print(1)"
    assert extract_code("") is None and extract_code(None) is None


def test_extract_code_reads_a_block_with_windows_line_ends():
    # the fence's '\r' was not taken as its line end: the whole text ran, a SyntaxError
    assert extract_code("Here:\r\n```python\r\nprint(3)\r\n```\r\n") == "print(3)\r\n"


def test_outputs_match_tokens_and_numbers():
    assert outputs_match("1 2\n3\n", "1 2 3")
    assert outputs_match("0.3333333\n", "0.33333333")
    assert not outputs_match("1 2", "1 2 3")
    assert not outputs_match("yes", "YES")


def test_integers_must_match_exactly_not_within_a_tolerance():
    # 1e-6 relative would take an off-by-one answer modulo 10^9 + 7 for the right one
    assert not outputs_match("1000000008", "1000000007")
    assert outputs_match("1000000007\n", "1000000007")
    assert outputs_match("3.0000000001", "3")  # a real number still within 1e-6
    assert not values_match(10**9 + 8, 10**9 + 7)
    assert not values_match([10**12 + 1], [10**12])
    assert values_match(3, 3.0000000001)


def test_normalize_tests_formats_and_errors():
    stdin = normalize_tests('[{"input": "1", "output": "2", "testtype": "stdin"}]')
    assert stdin == [{"kind": "stdin", "input": "1", "output": "2"}]
    apps = normalize_tests({"inputs": [[1, 2]], "outputs": [3], "fn_name": "f"})
    assert apps == [{"kind": "call", "fn_name": "f", "args": [1, 2], "expected": 3}]
    assert normalize_tests(apps) == apps  # canonical in, canonical out
    for bad, why in [("not json", "JSON"), ([], "non-empty"), ({"inputs": [1]}, "outputs"),
                     ([{"input": "1"}], "output"), ([{"kind": "call", "args": []}], "fn_name"),
                     ([{"input": 1, "output": "1"}], "text")]:
        with pytest.raises(ValueError, match=why):
            normalize_tests(bad)


# ---------------------------------------------------------------------------------------------
# hostile programs


def test_hostile_socket_to_loopback_connects_nowhere(reward, sandbox):
    needs(sandbox, "netns")
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    port = server.getsockname()[1]
    program = (f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=2)\n"
               f"s.sendall(b'leak')\nprint('ok')")
    with serving(server) as accepted:
        score, result = run_hostile(reward, sandbox, program)
    assert score == 0.0 and result.status == "error"
    assert b"Network is unreachable" in result.stderr
    assert accepted == []
    assert_nothing_left(result)


@pytest.mark.parametrize("where", ["/dev/shm", "/var/tmp", "/run"])
def test_hostile_unix_socket_in_a_shared_directory_is_unreachable(reward, sandbox, where):
    # world-writable directories let anyone leave a socket there; a network namespace does not
    # stop unix sockets, and a read-only mount does not stop connect()
    needs(sandbox, "mountns")
    if not os.access(where, os.W_OK):
        pytest.skip(f"{where} is not writable here")
    path = f"{where}/gspo-test-{uuid.uuid4().hex[:8]}.sock"
    server = socket.socket(socket.AF_UNIX)
    server.bind(path)
    os.chmod(path, 0o777)
    program = (f"import socket\ns = socket.socket(socket.AF_UNIX)\ns.connect({path!r})\n"
               f"print(s.recv(64).decode(), end='')")
    try:
        with serving(server, reply=b"secret\n") as accepted:
            score, result = run_hostile(reward, sandbox, program, expected="secret\n")
    finally:
        os.unlink(path)
    assert score == 0.0 and result.status == "error"
    assert b"No such file or directory" in result.stderr, result.stderr
    assert accepted == []
    assert_nothing_left(result)


MEMORY_HOG = """import os, time
children = []
for _ in range(4):
    pid = os.fork()
    if pid == 0:
        block = bytearray(b"x") * (200 << 20)  # 200 MiB, every page written
        time.sleep(2)
        os._exit(0)
    children.append(pid)
alive = sum(os.waitpid(pid, 0)[1] == 0 for pid in children)
print(f"{alive} of 4 children held 200 MiB")
"""


@pytest.mark.parametrize("bound", ["cgroup", "watched uid"])
def test_hostile_processes_together_cannot_exceed_the_runs_memory(bound, monkeypatch):
    # 4 processes x 200 MiB, each within its own address-space limit, against a 400 MiB run
    needs_root()
    limits = Limits(wall_s=20.0, cpu_s=10.0, memory_mb=400, processes=16)
    if bound == "watched uid":
        monkeypatch.setattr("gspo.sandbox.MemoryCgroup.create", lambda *a: None)
    sb = Sandbox(limits)
    if bound == "cgroup" and not sb.containment().get("memory_cgroup"):
        pytest.skip(f"no memory cgroup can be made here (containment: {sb.containment()})")
    r = sb.run_python(MEMORY_HOG)
    assert r.status == "memory_limit", (r.status, r.stdout, r.stderr[-500:])
    assert b"4 of 4" not in r.stdout
    assert_nothing_left(r)
    assert r.containment.get("memory_cgroup") == (bound == "cgroup")


def test_a_run_within_its_memory_passes():
    # the same program with room for all four: the bound is the run's, not a smaller one
    needs_root()
    r = Sandbox(Limits(wall_s=20.0, cpu_s=10.0, memory_mb=1400, processes=16)).run_python(
        MEMORY_HOG)
    assert r.status == "ok" and r.stdout == b"4 of 4 children held 200 MiB\n", r.stderr[-500:]


def test_hostile_fork_bomb_is_capped_and_cleaned_up(reward, sandbox):
    needs_root()
    program = ("import os\nwhile True:\n    try:\n        os.fork()\n"
               "    except OSError:\n        pass")
    start = time.monotonic()
    score, result = run_hostile(reward, sandbox, program)
    assert score == 0.0 and result.status == "timeout"
    assert time.monotonic() - start < LIMITS.wall_s + 5
    assert_nothing_left(result)


def test_hostile_10gb_allocation_fails(reward, sandbox):
    start = time.monotonic()
    score, result = run_hostile(reward, sandbox, "x = bytearray(10 * 1024 ** 3)\nprint('ok')")
    assert score == 0.0 and result.status == "error" and b"MemoryError" in result.stderr
    assert time.monotonic() - start < LIMITS.wall_s
    assert_nothing_left(result)


def test_hostile_infinite_loop_hits_the_cpu_limit(reward, sandbox):
    score, result = run_hostile(reward, sandbox, "while True:\n    pass")
    assert score == 0.0 and result.status == "timeout"
    assert_nothing_left(result)


def test_hostile_write_to_the_project_directory_fails(reward, sandbox):
    target = REPO / f"PWNED-{uuid.uuid4().hex}"
    program = f"open({str(target)!r}, 'w').write('x')\nprint('ok')"
    score, result = run_hostile(reward, sandbox, program)
    assert score == 0.0 and result.status == "error"
    assert not target.exists()
    assert_nothing_left(result)


def test_hostile_write_to_tmp_outside_its_directory_fails(reward, sandbox):
    name = f"gspo-escape-{uuid.uuid4().hex}"
    targets = [Path("/tmp") / name, Path("/var/tmp") / name, Path("/dev/shm") / name]
    program = ("import os\nwritten = []\n"
               f"for p in {[str(t) for t in targets]!r} + ['../{name}']:\n"
               "    try:\n        open(p, 'w').write('x')\n        written.append(p)\n"
               "    except OSError:\n        pass\n"
               "print('ok' if written else 'blocked')")
    score, result = run_hostile(reward, sandbox, program)
    assert score == 0.0 and result.stdout == b"blocked\n"
    assert not any(t.exists() for t in targets)
    assert_nothing_left(result)


def test_hostile_program_cannot_read_a_parent_environment_secret(reward, sandbox, monkeypatch):
    secret = f"s3cr3t-{uuid.uuid4().hex}"
    monkeypatch.setenv("GSPO_TEST_SECRET", secret)
    program = ("import os\nfound = [os.environ.get('GSPO_TEST_SECRET', '')]\n"
               "for pid in ['self', '1', str(os.getppid())] + os.listdir('/proc'):\n"
               "    try:\n        found.append(open(f'/proc/{pid}/environ').read())\n"
               "    except OSError:\n        pass\n"
               "print(' '.join(found))")
    score, result = run_hostile(reward, sandbox, program, expected=secret)
    assert score == 0.0
    assert secret.encode() not in result.stdout + result.stderr
    assert_nothing_left(result)


def test_hostile_daemon_does_not_outlive_the_run(reward, sandbox):
    needs(sandbox, "pidns")
    marker = f"{time.time_ns() % 10**9}.{os.getpid()}"  # a unique `sleep` argument
    program = ("import os, time\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
               "        print('daemon-up', flush=True)\n"
               f"        os.execv('/bin/sleep', ['/bin/sleep', '{marker}'])\n"
               "    os._exit(0)\ntime.sleep(0.5)\nprint('parent exits')")
    score, result = run_hostile(reward, sandbox, program)
    assert b"daemon-up" in result.stdout  # it did start
    assert score == 0.0
    assert processes_with_arg(marker) == []
    assert_nothing_left(result)


def test_hostile_gigabyte_of_output_is_cut_off(reward, sandbox):
    program = ("import sys\nchunk = 'x' * (1 << 20)\n"
               "for _ in range(1024):\n    sys.stdout.write(chunk)")
    start = time.monotonic()
    score, result = run_hostile(reward, sandbox, program)
    assert score == 0.0 and result.status == "output_limit"
    assert len(result.stdout) <= LIMITS.stdout_bytes
    assert time.monotonic() - start < LIMITS.wall_s
    assert_nothing_left(result)


def test_staging_left_by_a_killed_process_is_removed_and_a_live_ones_kept(tmp_path):
    import subprocess
    from gspo.sandbox import STAGING_PREFIX, remove_stale_staging
    dead_pid = subprocess.Popen(["true"])
    dead_pid.wait(timeout=10)  # reaped: its pid now belongs to no process
    gone = tmp_path / f"{STAGING_PREFIX}{dead_pid.pid}-abc123"
    live = tmp_path / f"{STAGING_PREFIX}{os.getpid()}-def456"
    other = tmp_path / "gspo-sandbox-notapid"
    for d in (gone, live, other):
        (d / "files").mkdir(parents=True)
    assert remove_stale_staging(str(tmp_path)) == [gone.name]
    assert not gone.exists() and live.exists() and other.exists()
