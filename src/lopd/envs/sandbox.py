"""Run untrusted, model-written Python against tests: isolated by bubblewrap, judged outside.

Each run starts a fresh interpreter (``python -I -S -B -u``) on :mod:`lopd.envs.sandbox_harness`
inside `bubblewrap <https://github.com/containers/bubblewrap>`_: its own user (``nobody``), PID,
network (its own loopback only: nothing outside is reachable), IPC and UTS namespaces and
session; a read-only filesystem holding only the interpreter, its standard library and the
system's shared libraries (nothing of the project, the virtualenv or the user's files); a private
tmpfs as work directory; killed with its parent.
Inside, the harness sets resource limits (memory, CPU, file size, open files, no core dumps, no
child processes or threads) and, when the parent is root, drops to ``nobody``; then it runs the
program. The parent enforces the wall-clock limit by killing the process group and keeps
only the first ``output_bytes`` of what the program prints.

The child never judges. It returns *plain data* (exact builtin types, bounded depth, size and
count; :func:`lopd.envs.sandbox_harness.encode`) on a private pipe, and a trusted side compares:

* ``{"call": "f([1, 2])", "expected": 3}`` — the child reports the value; the parent compares its
  JSON with the expected value's (codeworld). Expected values never enter the child.
* ``{"check": CODE, "entry_point": "f", "reference": PROGRAM}`` — an official
  ``check(candidate)`` function (HumanEval). A trusted run of ``check`` against a recorder around
  the reference solution records every call's arguments (cached per problem); the untrusted child
  computes the candidate's outputs on those arguments; a trusted run of ``check`` (beside the
  reference, which ``check`` may call by name) answers each call of ``candidate`` with those
  outputs, as plain data, and its assertions decide.
  A ``check`` whose calls depend on earlier outputs still works when the candidate's outputs
  equal the reference's; a call the recording does not hold fails.

So there is no verdict for a program to forge: what it writes on the channel are outputs, worth
exactly as much as computing them. Every read of the channel is bounded and caught: malformed
content is a failed answer with a reason, never an exception in the parent.

Where bubblewrap is missing or cannot create namespaces, :func:`run` refuses (one line saying why
and how to install it) unless the weaker mode is opted into with :func:`allow_unsafe_fallback`
(the ``env.unsafe_sandbox_without_bubblewrap`` setting): the same harness then confines itself
(a private network namespace where the kernel allows it, the drop to ``nobody`` as root, an audit
hook blocking process creation, sockets and writes outside the work directory), which a
determined program can get around.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import selectors
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tqdm.auto import tqdm

from lopd.envs import sandbox_harness as harness

HARNESS = Path(harness.__file__)
STATUSES = ("completed", "timeout", "killed", "no_result", "malformed")
"""completed: the child reported every call; timeout: past the wall-clock limit, killed; killed:
ended by a signal (memory, CPU time, file size); no_result: exited without reporting (``sys.exit``
or ``os._exit`` at load time, a crash); malformed: what it wrote on the channel is not a record."""
CHANNEL_BYTES = 4 * harness.MAX_BYTES
"""The most the parent reads from the channel; past it, the answer is malformed."""
INSTALL = "apt-get install bubblewrap (Debian/Ubuntu; `make` does it as root)"


class SandboxUnavailable(RuntimeError):
    """Untrusted code cannot be isolated on this machine and the weaker mode was not chosen."""


@dataclass(frozen=True)
class Limits:
    wall_seconds: float = 20.0
    """The whole child process, start-up included."""
    test_seconds: float = 4.0
    """Loading the program, and each call."""
    cpu_seconds: int = 20
    memory_mb: int = 1024
    """Address space of the child (RLIMIT_AS)."""
    file_size_mb: int = 8
    output_bytes: int = 16_384
    """What the program prints (stdout and stderr together) is kept up to this many bytes."""
    max_open_files: int = 64

    def __post_init__(self):
        for key, value in asdict(self).items():
            if value <= 0:
                raise ValueError(f"sandbox limit {key} must be > 0, got {value}")


@dataclass
class TestOutcome:
    passed: bool
    error: str = ""
    """Why it failed: an exception name (``AssertionError``, ``timeout``, ``load:SyntaxError``),
    ``wrong value``, ``unencodable:...`` (not plain data), or the run's status."""
    value: str | None = None
    """For ``call`` tests: the JSON of the value the program returned."""


@dataclass
class Report:
    status: str
    outcomes: list[TestOutcome]
    output: str
    """The first ``Limits.output_bytes`` of the program's stdout and stderr."""
    output_truncated: bool
    seconds: float
    network: str = "unknown"
    """"isolated" (a network namespace of its own, nothing outside reachable) or "shared";
    "unknown" when the child did not report."""
    exit_code: int | None = None
    meta: dict = field(default_factory=dict)
    """``isolation``: "bubblewrap" or "unsafe fallback"; ``reason``: why a run was malformed."""

    @property
    def passed(self) -> int:
        return sum(o.passed for o in self.outcomes)

    @property
    def total(self) -> int:
        return len(self.outcomes)

    @property
    def fraction(self) -> float:
        return self.passed / self.total if self.outcomes else 0.0

    @property
    def all_passed(self) -> bool:
        return bool(self.outcomes) and self.passed == self.total

    def feedback(self, tests: list[dict], max_items: int = 3) -> str:
        """A short text for the model: the status and the first failing tests."""
        if self.all_passed:
            return f"All {self.total} tests passed."
        lines = [f"{self.passed}/{self.total} tests passed" + (
            "" if self.status == "completed" else f" ({self.status})") + "."]
        for test, outcome in list(zip(tests, self.outcomes))[:len(tests)]:
            if len(lines) > max_items:
                break
            if outcome.passed:
                continue
            what = test.get("call") or "the test"
            if outcome.error == "wrong value" and "expected" in test:
                lines.append(f"{what} returned {outcome.value}, expected "
                             f"{json.dumps(test['expected'])}")
            else:
                lines.append(f"{what} failed: {outcome.error}")
        return "\n".join(lines)


def canonical(value) -> str:
    """The JSON text two values are compared by."""
    return json.dumps(value, sort_keys=True)


def _check_tests(tests: list[dict]) -> None:
    for i, test in enumerate(tests):
        kinds = [k for k in ("call", "check") if isinstance(test, dict) and k in test]
        if len(kinds) != 1:
            raise ValueError(f"test {i} must be a dict with exactly one of 'call' or 'check', "
                             f"got {test!r}")
        if "call" in test and "expected" not in test:
            raise ValueError(f"test {i} is a 'call' test without an 'expected' value")
        missing = [k for k in ("entry_point", "reference") if "check" in test
                   and k not in test]
        if missing:
            raise ValueError(f"test {i} is a 'check' test without {', '.join(missing)}")


# ----------------------------------------------------------------------------------------------
# Isolation


_UNSAFE = {"allowed": False}


def allow_unsafe_fallback(allowed: bool) -> None:
    """Let :func:`run` use the harness's own, weaker confinement where bubblewrap cannot isolate
    (``env.unsafe_sandbox_without_bubblewrap``). Off by default."""
    _UNSAFE["allowed"] = bool(allowed)


def _binds() -> list[str]:
    """bubblewrap's read-only view: the interpreter, its standard library (its site-packages
    hidden), libpython and the system's shared libraries (their Python packages hidden). Every
    directory above a bound path is created world-readable, so the child's unprivileged user
    can reach what is bound (``/root`` itself is not)."""
    python = os.path.realpath(sys.executable)
    stdlib = sysconfig.get_paths()["stdlib"]
    binds = [python, stdlib]
    libpython = Path(sysconfig.get_config_var("LIBDIR") or "") / (
        sysconfig.get_config_var("INSTSONAME") or "-")
    if libpython.is_file() and not str(libpython).startswith(stdlib):
        binds.append(str(libpython))
    links = []
    for lib in ("/usr/lib", "/usr/lib64", "/lib", "/lib64"):
        if Path(lib).is_symlink():
            links += ["--symlink", os.readlink(lib), lib]
        elif Path(lib).is_dir():
            binds.append(lib)
    made, args = set(), []
    for path in [*binds, HARNESS_IN_SANDBOX]:
        for parent in reversed(Path(path).parents[:-1]):
            if str(parent) not in made:
                made.add(str(parent))
                args += ["--perms", "0755", "--dir", str(parent)]
    for path in binds:
        args += ["--ro-bind", path, path]
    for hidden in (Path(stdlib) / "site-packages", Path(stdlib) / "dist-packages",
                   *sorted(Path("/usr/lib").glob("python3*"))):
        if hidden.is_dir():
            args += ["--tmpfs", str(hidden)]
    return args + links


WORKDIR = "/tmp/work"
"""The child's work directory: a private tmpfs."""
HARNESS_IN_SANDBOX = "/lopd/sandbox_harness.py"


@functools.lru_cache(maxsize=2)
def _bwrap_prefix(bwrap: str) -> tuple[str, ...]:
    """The bubblewrap command up to the interpreter (the same for every child, so made once).

    As root, the namespaces are made without a user namespace and the harness drops to
    ``nobody`` itself: mapped into a user namespace, root would stay the host's root, whom the
    process limit does not bind."""
    if os.geteuid() == 0:
        namespaces = ["--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts",
                      "--unshare-cgroup-try"]
    else:
        namespaces = ["--unshare-all"]
    return (bwrap, *namespaces, "--die-with-parent", "--new-session", *_binds(),
            "--ro-bind", str(HARNESS), HARNESS_IN_SANDBOX, "--proc", "/proc", "--dev", "/dev",
            "--perms", "1777", "--tmpfs", "/tmp", "--perms", "1777", "--dir", WORKDIR,
            "--chdir", WORKDIR, "--clearenv", "--setenv", "LC_ALL", "C.UTF-8")


@functools.lru_cache(maxsize=1)
def isolation() -> tuple[str | None, str]:
    """(bubblewrap's path, "") when it can isolate a child here, else (None, why not)."""
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        return None, f"bubblewrap (bwrap) is not installed; install it with {INSTALL}"
    try:
        done = subprocess.run([*_bwrap_prefix(bwrap), os.path.realpath(sys.executable), "-I",
                               "-S", "-c", "pass"], capture_output=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return None, f"bubblewrap could not start a sandbox: {exc}"
    if done.returncode != 0:
        why = done.stderr.decode(errors="replace").strip().splitlines()[-1:] or ["no message"]
        return None, f"bubblewrap cannot create namespaces on this machine ({why[0]})"
    return bwrap, ""


def check_isolation() -> str:
    """"bubblewrap", or "unsafe fallback" when opted into; else :class:`SandboxUnavailable`."""
    bwrap, why = isolation()
    if bwrap:
        return "bubblewrap"
    if _UNSAFE["allowed"]:
        return "unsafe fallback"
    raise SandboxUnavailable(f"untrusted code is not run: {why}. To run it anyway in a weaker "
                             "sandbox, set env.unsafe_sandbox_without_bubblewrap=true")


# ----------------------------------------------------------------------------------------------
# One child


@dataclass
class _Child:
    record: dict | None
    status: str
    output: str
    truncated: bool
    exit_code: int | None
    seconds: float
    reason: str = ""


def _kill(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.kill()


def parse_record(data: bytes) -> tuple[dict | None, str]:
    """The child's one record (a JSON object on one line) or (None, why not); never raises."""
    try:
        if len(data) > CHANNEL_BYTES:
            return None, "channel over its size limit"
        text = data.decode("utf-8")
        lines = text.split("\n")
        if len(lines) != 2 or lines[1] != "":
            return None, "not exactly one record on the channel"
        record = json.loads(lines[0])
    except (ValueError, RecursionError, MemoryError, UnicodeError):
        return None, "channel content is not a JSON record"
    if type(record) is not dict:
        return None, "the record is not an object"
    return record, ""


def _spawn(job: dict, limits: Limits) -> _Child:
    isolation_kind = check_isolation()
    fallback = isolation_kind != "bubblewrap"
    job = {**job, "fallback": fallback, "drop": os.geteuid() == 0}
    read_fd, write_fd = os.pipe()
    workdir = tempfile.mkdtemp(prefix="lopd-sandbox-") if fallback else None
    python = os.path.realpath(sys.executable)
    args = [json.dumps(asdict(limits)), str(write_fd)]
    if fallback:
        command = [python, "-I", "-S", "-B", "-u", str(HARNESS), *args]
    else:
        command = [*_bwrap_prefix(isolation()[0]), python, "-I", "-S", "-B", "-u",
                   HARNESS_IN_SANDBOX, *args]
    start = time.monotonic()
    try:
        proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, cwd=workdir or "/",
                                env={"PATH": "/usr/bin:/bin", "LC_ALL": "C.UTF-8"},
                                pass_fds=(write_fd,), start_new_session=True)
        os.close(write_fd)
        write_fd = -1
        try:
            proc.stdin.write(json.dumps(job).encode())
            proc.stdin.close()
        except BrokenPipeError:
            pass
        output, truncated, channel, timed_out = _collect(proc, read_fd, limits, start)
        exit_code = proc.returncode
    finally:
        if write_fd >= 0:
            os.close(write_fd)
        os.close(read_fd)
        if workdir:
            shutil.rmtree(workdir, ignore_errors=True)
    seconds = time.monotonic() - start
    text = output.decode("utf-8", errors="replace")
    if timed_out:
        return _Child(None, "timeout", text, truncated, exit_code, seconds)
    if not channel:
        status = "killed" if exit_code is not None and exit_code < 0 else "no_result"
        return _Child(None, status, text, truncated, exit_code, seconds)
    record, reason = parse_record(channel)
    return _Child(record, "completed" if record else "malformed", text, truncated, exit_code,
                  seconds, reason)


def _collect(proc: subprocess.Popen, channel_fd: int, limits: Limits, start: float):
    """Read the program's output (capped) and the channel (capped) until both close or time is
    up."""
    output, channel = bytearray(), bytearray()
    truncated = timed_out = False
    with selectors.DefaultSelector() as selector:
        selector.register(proc.stdout, selectors.EVENT_READ, "output")
        selector.register(channel_fd, selectors.EVENT_READ, "channel")
        while selector.get_map():
            left = limits.wall_seconds - (time.monotonic() - start)
            if left <= 0:
                timed_out = True
                break
            for key, _ in selector.select(timeout=min(left, 0.5)):
                chunk = os.read(key.fd, 65536)
                if not chunk:
                    selector.unregister(key.fileobj)
                elif key.data == "output":
                    room = limits.output_bytes - len(output)
                    truncated |= len(chunk) > room
                    output += chunk[:max(room, 0)]
                elif len(channel) <= CHANNEL_BYTES:
                    channel += chunk
    if timed_out:
        _kill(proc)
    try:
        proc.wait(timeout=max(1.0, limits.wall_seconds - (time.monotonic() - start)))
    except subprocess.TimeoutExpired:
        _kill(proc)
        proc.wait()
        timed_out = True
    proc.stdout.close()
    return bytes(output), truncated, bytes(channel), timed_out


# ----------------------------------------------------------------------------------------------
# Judging, in the parent and in trusted children


def _value(result) -> tuple[object, str, str]:
    """(value, its JSON text, "") of one reported result, or (None, "", why it fails)."""
    if type(result) is not dict or len(result) != 1:
        return None, "", "malformed result"
    if "error" in result:
        error = result["error"]
        return None, "", error[:120] if type(error) is str else "malformed result"
    text = result.get("value")
    if type(text) is not str or len(text) > harness.MAX_BYTES:
        return None, "", "malformed result"
    try:
        return harness.decode(json.loads(text)), text, ""
    except (ValueError, RecursionError, MemoryError, TypeError, OverflowError):
        return None, "", "malformed result"


def _plain_equal(value, expected) -> bool:
    try:
        return canonical(value) == canonical(expected)
    except (TypeError, ValueError, RecursionError):
        return False


@functools.lru_cache(maxsize=512)
def _recording(reference: str, check: str, entry_point: str, limits: Limits) -> tuple:
    """Every call ``check`` makes on the reference solution (trusted code), or raise."""
    child = _spawn({"mode": "record", "program": reference, "check": check,
                    "entry_point": entry_point}, limits)
    record = child.record or {}
    if not record.get("passed") or type(record.get("calls")) is not list:
        raise RuntimeError(f"the reference solution of {entry_point} does not pass its own check "
                           f"({record.get('error') or child.status})")
    return tuple(json.dumps(c, sort_keys=True) for c in record["calls"])


def recorded_calls(test: dict, limits: Limits) -> list[dict]:
    """The calls a ``check`` test makes, recorded on its reference solution (cached). A failed
    recording is tried once more (a loaded machine can time a reference out) and then raises: an
    answer is never scored against a recording that does not exist."""
    key = (test["reference"], test["check"], test["entry_point"], limits)
    try:
        calls = _recording(*key)
    except RuntimeError:
        calls = _recording(*key)
    return [json.loads(c) for c in calls]


def run(program: str, tests: list[dict], limits: Limits | None = None) -> Report:
    """Run ``program`` on every test's calls in one isolated child and judge outside it; never
    raises on bad programs (only :class:`SandboxUnavailable` when nothing can isolate it)."""
    limits = limits or Limits()
    _check_tests(tests)
    calls, spans, recordings = [], [], []
    for test in tests:
        if "call" in test:
            spans.append((len(calls), 1))
            calls.append({"expr": test["call"]})
            recordings.append(None)
        else:
            recorded = [{"args": c["args"], "kwargs": c["kwargs"]}
                        for c in recorded_calls(test, limits)]
            spans.append((len(calls), len(recorded)))
            calls += [{"fn": test["entry_point"], **c} for c in recorded]
            recordings.append(recorded)
    kind = check_isolation()
    child = _spawn({"mode": "candidate", "program": program, "calls": calls}, limits)
    results = (child.record or {}).get("results")
    status, reason = child.status, child.reason
    if status == "completed" and (type(results) is not list or len(results) != len(calls)):
        status, reason = "malformed", "the record does not hold one result per call"
    if kind == "bubblewrap":
        network = "isolated"  # bubblewrap's own network namespace, whatever the child says
    else:
        network = (child.record or {}).get("network") if status == "completed" else "unknown"
        network = network if network in ("isolated", "shared") else "unknown"
    seconds = child.seconds
    if status != "completed":
        outcomes = [TestOutcome(False, status) for _ in tests]
    else:
        outcomes = []
        for test, (at, n), recorded in zip(tests, spans, recordings):
            values = [_value(r) for r in results[at:at + n]]
            if "call" in test:
                value, text, why = values[0]
                if why:
                    outcomes.append(TestOutcome(False, why))
                else:
                    same = _plain_equal(value, test["expected"])
                    outcomes.append(TestOutcome(same, "" if same else "wrong value", text))
                continue
            # The replay receives well-formed values re-encoded; anything malformed is an error.
            outputs = [{"error": why} if why else {"value": text} for _, text, why in values]
            replay = _spawn({"mode": "replay", "program": test["reference"],
                             "check": test["check"], "entry_point": test["entry_point"],
                             "calls": recorded, "outputs": outputs}, limits)
            seconds += replay.seconds
            passed = bool(replay.record and replay.record.get("passed") is True)
            # A failure the candidate raised says more than the assertion it broke.
            raised = [why for _, _, why in values if why]
            error = "" if passed else str(raised[0] if raised else (replay.record or {}).get(
                "error") or replay.status)
            outcomes.append(TestOutcome(passed, error[:120]))
    return Report(status, outcomes, child.output, child.truncated, seconds, network,
                  child.exit_code, {"isolation": kind, **({"reason": reason} if reason else {})})


def run_many(jobs: list[tuple[str, list[dict]]], limits: Limits | None = None,
             workers: int | None = None, progress: bool = False, desc: str = "sandbox"
             ) -> list[Report]:
    """:func:`run` for many (program, tests) pairs, ``workers`` children at a time (default: the
    CPU count); reports in the order of ``jobs``."""
    check_isolation()
    workers = workers or os.cpu_count() or 1
    with ThreadPoolExecutor(max_workers=workers) as pool:
        futures = [pool.submit(run, program, tests, limits) for program, tests in jobs]
        return [f.result() for f in tqdm(futures, desc=desc, disable=not progress)]
