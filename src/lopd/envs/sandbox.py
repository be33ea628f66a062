"""Run untrusted, model-written Python against tests, in a confined child process.

Each run gets a fresh temporary work directory (removed afterwards), a new process group and a
new interpreter (``python -I -S -B -u``: no site-packages, no environment, no bytecode writes,
unbuffered output) running :mod:`lopd.envs.sandbox_harness`, which confines itself before it
reads the program: memory, CPU,
file-size and open-file limits, no child processes or threads, no network where the kernel allows
a private network namespace (it does for root and for unprivileged user namespaces; elsewhere the
harness's audit hook still refuses to create sockets), and, as root, the unprivileged ``nobody``
user. The parent enforces the wall-clock limit by killing the whole process group and keeps only
the first ``output_bytes`` of what the program prints.

Two kinds of test:

* ``{"call": "f([1, 2])", "expected": 3}`` — the child evaluates the call and sends back the JSON
  of the value; the **parent** compares it with the expected value (JSON-canonical, so ``True`` is
  not ``1`` and an object that claims to equal everything is just its JSON). Expected values never
  enter the child, so no program can pass these tests without computing the answers. codeworld
  uses these.
* ``{"code": "check(candidate)"}`` — passes when the code runs without raising (HumanEval's
  official ``check`` functions).

Why a verdict cannot be forged: the parent counts only a record that follows a per-run secret,
on a private pipe. The child holds the secret only inside an audit hook, which writes the record
once, when the harness's own ``finish`` asks after the last test. A program that exits early
(``sys.exit``, ``os._exit``, a crash, a kill) leaves no record; ``SystemExit`` raised inside a test
fails that test; printed "passed" text goes to the output, which decides nothing; builtins are
restored before every test. What stays possible in principle for the ``code`` tests is a program
written against this harness that walks the interpreter's frames to call ``finish`` itself;
``call`` tests are immune to that.
"""

from __future__ import annotations

import json
import os
import secrets
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tqdm.auto import tqdm

HARNESS = Path(__file__).with_name("sandbox_harness.py")
STATUSES = ("completed", "timeout", "killed", "no_verdict")
"""completed: the harness reported every test; timeout: past the wall-clock limit, killed; killed:
ended by a signal (memory, CPU time, file size); no_verdict: exited without reporting (the program
called ``sys.exit`` / ``os._exit`` at load time, or crashed the interpreter)."""


@dataclass(frozen=True)
class Limits:
    wall_seconds: float = 20.0
    """The whole child process, start-up included."""
    test_seconds: float = 4.0
    """Loading the program, and each test."""
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
    ``wrong value``, or the run's status when the harness did not report."""
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
    """"isolated" (private network namespace) or "shared"; "unknown" when the harness did not
    report."""
    exit_code: int | None = None
    meta: dict = field(default_factory=dict)

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
        if not isinstance(test, dict) or (("call" in test) == ("code" in test)):
            raise ValueError(f"test {i} must be a dict with exactly one of 'call' or 'code', "
                             f"got {test!r}")
        if "call" in test and "expected" not in test:
            raise ValueError(f"test {i} is a 'call' test without an 'expected' value")


def _parse_verdict(data: bytes, secret: str, tests: list[dict]
                   ) -> tuple[str, list[TestOutcome]] | None:
    """The network state and outcomes from the record after the last copy of the secret, or
    None when there is no well-formed record."""
    text = data.decode("utf-8", errors="replace")
    at = text.rfind(secret + "\n")
    if at < 0:
        return None
    lines = text[at + len(secret) + 1:]
    try:
        network, count, body = lines.split("\n", 2)
        records = []
        for _ in range(int(count)):
            size, rest = body.split(":", 1)
            records.append(rest[:int(size)])
            body = rest[int(size) + 1:]
    except ValueError:
        return None
    if len(records) != len(tests):
        return None
    outcomes = []
    for test, record in zip(tests, records):
        if not record.startswith("1"):
            outcomes.append(TestOutcome(False, record[1:] or "error"))
        elif "call" in test:
            size, value = record[1:].split(":", 1)
            try:
                same = canonical(json.loads(value)) == canonical(test["expected"])
            except ValueError:
                same = False
            outcomes.append(TestOutcome(same, "" if same else "wrong value", value))
        else:
            outcomes.append(TestOutcome(True))
    return network, outcomes


def _kill(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.kill()


def run(program: str, tests: list[dict], limits: Limits | None = None) -> Report:
    """Run ``program`` and then each test in one confined child; never raises on bad programs."""
    limits = limits or Limits()
    _check_tests(tests)
    secret = secrets.token_hex(24)
    # Expected values stay here: the child sees only what it must evaluate.
    job = {"secret": secret, "program": program,
           "tests": [{"call": t["call"]} if "call" in t else {"code": t["code"]} for t in tests]}
    workdir = tempfile.mkdtemp(prefix="lopd-sandbox-")
    read_verdict, write_verdict = os.pipe()
    start = time.monotonic()
    try:
        proc = subprocess.Popen(
            [sys.executable, "-I", "-S", "-B", "-u", str(HARNESS), json.dumps(asdict(limits)),
             str(write_verdict)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            cwd=workdir, env={"PATH": "/usr/bin:/bin", "LC_ALL": "C.UTF-8"},
            pass_fds=(write_verdict,), start_new_session=True)
        os.close(write_verdict)
        write_verdict = -1
        try:
            proc.stdin.write(json.dumps(job).encode())
            proc.stdin.close()
        except BrokenPipeError:
            pass
        output, truncated, verdict, timed_out = _collect(proc, read_verdict, limits, start)
        exit_code = proc.returncode
    finally:
        if write_verdict >= 0:
            os.close(write_verdict)
        os.close(read_verdict)
        shutil.rmtree(workdir, ignore_errors=True)
    seconds = time.monotonic() - start
    parsed = None if timed_out else _parse_verdict(verdict, secret, tests)
    if parsed is not None:
        network, outcomes = parsed
        status = "completed"
    else:
        network = "unknown"
        status = ("timeout" if timed_out else "killed" if exit_code is not None and exit_code < 0
                  else "no_verdict")
        outcomes = [TestOutcome(False, status) for _ in tests]
    return Report(status, outcomes, output.decode("utf-8", errors="replace"), truncated, seconds,
                  network, exit_code)


def _collect(proc: subprocess.Popen, verdict_fd: int, limits: Limits, start: float):
    """Read the program's output (capped) and the verdict pipe until both close or time is up."""
    output, verdict = bytearray(), bytearray()
    truncated = timed_out = False
    cap_verdict = 1 << 20
    with selectors.DefaultSelector() as selector:
        selector.register(proc.stdout, selectors.EVENT_READ, "output")
        selector.register(verdict_fd, selectors.EVENT_READ, "verdict")
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
                elif len(verdict) < cap_verdict:
                    verdict += chunk
    if timed_out:
        _kill(proc)
    try:
        proc.wait(timeout=max(1.0, limits.wall_seconds - (time.monotonic() - start)))
    except subprocess.TimeoutExpired:
        _kill(proc)
        proc.wait()
        timed_out = True
    proc.stdout.close()
    return bytes(output), truncated, bytes(verdict), timed_out


def run_many(jobs: list[tuple[str, list[dict]]], limits: Limits | None = None,
             workers: int | None = None, progress: bool = False, desc: str = "sandbox"
             ) -> list[Report]:
    """:func:`run` for many (program, tests) pairs, ``workers`` children at a time (default: the
    CPU count); reports in the order of ``jobs``."""
    workers = workers or os.cpu_count() or 1
    with ThreadPoolExecutor(max_workers=workers) as pool:
        futures = [pool.submit(run, program, tests, limits) for program, tests in jobs]
        return [f.result() for f in tqdm(futures, desc=desc, disable=not progress)]
