"""Run untrusted, model-written Python against tests: isolated by bubblewrap, judged outside.

Each run starts a fresh interpreter (``python -I -S -B -u``) on :mod:`lopd.envs.sandbox_harness`
inside `bubblewrap <https://github.com/containers/bubblewrap>`_: its own user (``nobody``), PID,
network (its own loopback only: nothing outside is reachable), IPC and UTS namespaces and
session; a seccomp filter (:data:`DENIED_SYSCALLS`: no new namespaces, no kernel keyring, no
``bpf``, ``perf_event_open``, ``io_uring``, ``ptrace``, mounts, modules, SysV IPC or
``memfd_create``); a read-only filesystem holding only the interpreter, its standard library and
the shared libraries they load (resolved with ``ldd``; nothing of the project, the virtualenv,
the user's files or the rest of ``/usr/lib``); a private tmpfs of ``Limits.tmpfs_mb`` as work
directory; killed with its parent. Nothing survives a run: the tmpfs, IPC objects and network
namespace die with it, and the keyring it could share with the next run is out of reach.
Inside, the harness sets resource limits (memory, CPU, file size, open files, no core dumps, no
child processes or threads) and, when the parent is root, drops to ``nobody``; then it runs the
program. What the program prints goes to a memory file the parent reads once, at the end
(``Limits.output_bytes`` of it): a flood costs the parent nothing.

The child never judges. It returns *plain data* (exact builtin types, bounded depth, size and
count; :func:`lopd.envs.sandbox_harness.encode`) on a private pipe, one line per call, and a
trusted side compares:

* ``{"call": "f([1, 2])", "expected": 3}`` — the child reports the value; the parent compares
  its :func:`~lopd.envs.sandbox_harness.canonical` text with the expected value's: Python's
  ``==`` for plain data (``21.0 == 21``; a tuple is not a list), except that ``bool`` equals only
  ``bool``. The parent never builds a set or dict from what the child sent, so no value can make
  it work harder than reading it. Expected values never enter the child.
* ``{"check": CODE, "entry_point": "f", "reference": PROGRAM}`` — an official
  ``check(candidate)`` function (HumanEval). A trusted run of ``check`` against a recorder around
  the reference solution records every call's arguments (:func:`record_checks`, once per problem,
  at start-up); the untrusted child computes the candidate's outputs on those arguments; a
  trusted run of ``check`` (beside the reference, which ``check`` may call by name) answers each
  call of ``candidate`` with those outputs, as plain data, and its assertions decide.
  A ``check`` whose calls depend on earlier outputs still works when the candidate's outputs
  equal the reference's; a call the recording does not hold fails.

So there is no verdict for a program to forge: what it writes on the channel are outputs, worth
exactly as much as computing them. Every read of the channel is bounded and caught: malformed
content fails the calls it claims, never raises in the parent.

Time: each call has ``Limits.test_seconds``. The child's own alarm ends a slow call and moves on;
a program that removes the alarm (or catches what it raises) is timed from outside: the parent
kills the process when a call overruns, records that call as ``timeout`` and starts a new child
for the calls left. ``Limits.wall_seconds`` bounds the whole run, restarts included.

How one child is isolated, limited and followed is :mod:`lopd.envs.confinement`; this module
holds the tests, the judging and the reports.

Where bubblewrap is missing or cannot create namespaces, :func:`run` refuses (one line saying why
and how to install it) unless the weaker mode is opted into with :func:`allow_unsafe_fallback`
(the ``env.unsafe_sandbox_without_bubblewrap`` setting): the same harness then confines itself
(a private network namespace where the kernel allows it, the drop to ``nobody`` as root, the same
seccomp filter, an audit hook blocking process creation, sockets and writes outside the work
directory), which a determined program can get around.
"""

from __future__ import annotations

import hashlib
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from tqdm.auto import tqdm

from lopd.envs import sandbox_harness as harness
from lopd.envs.confinement import (
    GRACE,
    Calls,
    Limits,
    SandboxUnavailable,
    Single,
    allow_unsafe_fallback,
    check_isolation,
    isolation,
    memory_workers,
    spawn,
)

__all__ = ["Limits", "Report", "SandboxSetupError", "SandboxUnavailable", "TestOutcome",
           "allow_unsafe_fallback", "canonical", "check_isolation", "isolation", "record_checks",
           "recorded_calls", "run", "run_many"]

STATUSES = ("completed", "timeout", "killed", "no_result", "malformed")
"""completed: every call has an outcome (a call the parent had to kill is one: ``timeout``);
timeout: the run's wall clock ran out, killed; killed: ended by a signal (memory, CPU time);
no_result: exited without reporting (``sys.exit`` or ``os._exit`` at load time, a crash);
malformed: what it wrote on the channel is not the protocol."""


class SandboxSetupError(ValueError):
    """A trusted part of judging (a reference solution and its check) fails in the sandbox."""


@dataclass
class TestOutcome:
    passed: bool
    error: str = ""
    """Why it failed: an exception name (``AssertionError``, ``timeout``, ``load:SyntaxError``),
    ``wrong value``, ``unencodable:...`` (not plain data), or the run's status."""
    value: str | None = None
    """For ``call`` tests: the value the program returned, as a Python literal (cut)."""
    key: str | None = None
    """For ``call`` tests that returned a value: a digest of its canonical text (two outcomes
    with the same key returned equal values)."""


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
    """``isolation``: "bubblewrap" or "unsafe fallback"; ``reason``: why a run was malformed;
    ``restarts``: children started again after a call the parent killed."""

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


def canonical(value) -> str:
    """The text a trusted value is compared by (:func:`lopd.envs.sandbox_harness.canonical`)."""
    return harness.canonical(harness.encode(value))


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
# Judging, in the parent and in trusted children


def _value(result: dict) -> tuple[str, str, str]:
    """(canonical text, literal, "") of one reported result, or ("", "", why it fails)."""
    if "error" in result:
        return "", "", result["error"][:120]
    try:
        data = result["value"]
        return harness.canonical(data), harness.literal(data), ""
    except (ValueError, RecursionError, MemoryError, TypeError, OverflowError):
        return "", "", "malformed result"


_RECORDINGS: dict[tuple[str, str, str], tuple[dict, ...]] = {}


def _recording_key(test: dict) -> tuple[str, str, str]:
    return test["reference"], test["check"], test["entry_point"]


def record_checks(tests: list[dict], limits: Limits | None = None, progress: bool = False,
                  chunk: int = 24) -> None:
    """Record the calls every ``check`` test makes on its reference solution (trusted code), a
    chunk of problems per child, and keep them for :func:`run`. Code environments call this at
    start-up: a reference that does not pass its own check in the sandbox (limits too tight for
    it) is one :class:`SandboxSetupError` line naming it, before any answer is scored."""
    limits = limits or Limits()
    _check_tests(tests)
    wanted = list({_recording_key(t): t for t in tests if "check" in t
                   and _recording_key(t) not in _RECORDINGS}.values())
    if not wanted:
        return
    check_isolation()
    groups = [wanted[i:i + chunk] for i in range(0, len(wanted), chunk)]

    def record(group: list[dict]) -> list[tuple[dict, dict | None, str]]:
        problems = [{"program": t["reference"], "check": t["check"],
                     "entry_point": t["entry_point"]} for t in group]
        recorded, first, status = {}, 0, "completed"
        while first < len(group) and len(recorded) < len(group):
            # Each problem runs its reference and then its check, each within test_seconds.
            protocol = Calls(first, len(group), 2 * limits.test_seconds + GRACE,
                              time.monotonic() + limits.wall_seconds * (len(group) - first),
                              expect_ready=False)
            child = spawn({"mode": "record", "problems": problems[first:], "first": first},
                           limits, protocol)
            recorded.update(protocol.results)
            status = child.status
            # A problem the parent had to stop fails alone; the rest are tried in a new child.
            first = protocol.running + 1 if protocol.running is not None else len(group)
        return [(t, recorded.get(i), status) for i, t in enumerate(group)]

    workers = max(1, min(os.cpu_count() or 1, len(groups), memory_workers(limits)))
    with ThreadPoolExecutor(max_workers=workers) as pool:
        done = list(tqdm(pool.map(record, groups), total=len(groups), disable=not progress,
                         desc="recording checks", unit="chunk"))
    failed = []
    for test, record, status in (item for group in done for item in group):
        if record and record.get("passed") is True and type(record.get("calls")) is list:
            _RECORDINGS[_recording_key(test)] = tuple(record["calls"])
        else:
            why = (record or {}).get("error") or ("timeout" if status == "completed" else status)
            failed.append(f"{test['entry_point']} ({str(why)[:40]})")
    if failed:
        raise SandboxSetupError(
            f"{len(failed)} reference solution(s) do not pass their own check in the sandbox: "
            f"{', '.join(failed[:5])}{', ...' if len(failed) > 5 else ''}; the sandbox limits "
            f"(test_seconds={limits.test_seconds}, memory_mb={limits.memory_mb}) may be too "
            "tight for them")


def recorded_calls(test: dict, limits: Limits | None = None) -> list[dict]:
    """The calls a ``check`` test makes, recorded on its reference solution (recorded now when
    :func:`record_checks` has not; :class:`SandboxSetupError` when the reference fails)."""
    key = _recording_key(test)
    if key not in _RECORDINGS:
        record_checks([test], limits)
    return [dict(c) for c in _RECORDINGS[key]]


def run(program: str, tests: list[dict], limits: Limits | None = None) -> Report:
    """Run ``program`` on every test's calls in an isolated child and judge outside it; never
    raises on bad programs (only :class:`SandboxUnavailable` when nothing can isolate it, and
    :class:`SandboxSetupError` when a ``check`` test's reference cannot be recorded)."""
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
    results, report = _run_calls(program, calls, limits)
    report.meta["isolation"] = kind
    if kind == "bubblewrap":
        report.network = "isolated"  # bubblewrap's own network namespace, whatever the child says
    elif report.network not in ("isolated", "shared"):
        report.network = "unknown"
    status, outcomes = report.status, report.outcomes
    for test, (at, n), recorded in zip(tests, spans, recordings):
        values = [_value(r) if r is not None else ("", "", status) for r in results[at:at + n]]
        if "call" in test:
            text, shown, why = values[0]
            if why:
                outcomes.append(TestOutcome(False, why))
            else:
                same = text == canonical(test["expected"])
                key = hashlib.blake2b(text.encode(), digest_size=12).hexdigest()
                outcomes.append(TestOutcome(same, "" if same else "wrong value", shown, key))
            continue
        if any(results[i] is None for i in range(at, at + n)):
            outcomes.append(TestOutcome(False, status))
            continue
        # The replay receives well-formed values; anything malformed is an error.
        outputs = [{"error": why} if why else {"value": results[at + j]["value"]}
                   for j, (_, _, why) in enumerate(values)]
        protocol = Single(time.monotonic() + limits.wall_seconds)
        replay = spawn({"mode": "replay", "program": test["reference"], "check": test["check"],
                         "entry_point": test["entry_point"], "calls": recorded,
                         "outputs": outputs}, limits, protocol)
        report.seconds += replay.seconds
        record = protocol.record or {}
        passed = record.get("passed") is True
        # A failure the candidate raised says more than the assertion it broke.
        raised = [why for _, _, why in values if why]
        error = "" if passed else str(raised[0] if raised else record.get("error")
                                      or replay.status)
        outcomes.append(TestOutcome(passed, error[:120]))
    return report


def _run_calls(program: str, calls: list[dict], limits: Limits
               ) -> tuple[list[dict | None], Report]:
    """Every call's reported result (None where there is none), in as many children as calls the
    parent had to kill need, within the run's wall clock; and the run's report, its outcomes not
    yet judged."""
    results: list[dict | None] = [None] * len(calls)
    end = time.monotonic() + limits.wall_seconds
    output, truncated, network, exit_code = b"", False, None, None
    status, reason, seconds, first, restarts = "completed", "", 0.0, 0, 0

    def report() -> tuple[list[dict | None], Report]:
        meta = {**({"reason": reason} if reason else {}),
                **({"restarts": restarts} if restarts else {})}
        return results, Report(status, [], output.decode("utf-8", errors="replace"), truncated,
                               seconds, network or "unknown", exit_code, meta)

    while True:
        protocol = Calls(first, len(calls), limits.test_seconds + GRACE, end)
        child = spawn({"mode": "candidate", "program": program, "calls": calls[first:],
                        "first": first}, limits, protocol)
        seconds += child.seconds
        output += child.output
        truncated |= child.truncated or len(output) > limits.output_bytes
        output = output[:limits.output_bytes]
        network, exit_code = protocol.network or network, child.exit_code
        for i, record in protocol.results.items():
            results[i] = {k: v for k, v in record.items() if k != "i"}
        if protocol.load_error:
            for i in range(first, len(calls)):
                results[i] = {"error": protocol.load_error}
            status, reason = "completed", ""
            return report()
        status, reason = child.status, child.reason
        overran = (child.status == "timeout" and protocol.running is not None
                   and time.monotonic() < end)
        if not overran:
            break
        # The call ran past its time with the child's alarm lifted: it fails alone, and a new
        # child takes the calls after it.
        results[protocol.running] = {"error": "timeout"}
        first, restarts = protocol.running + 1, restarts + 1
        if first >= len(calls):
            status = "completed"
            break
    if status == "completed" and any(r is None for r in results):
        status = "no_result"
    if not protocol.ready and status == "timeout" and time.monotonic() < end:
        # The load ran past its time: every call fails as the load did.
        results = [r or {"error": "load:timeout"} for r in results]
        status = "completed"
    return report()


def run_many(jobs: list[tuple[str, list[dict]]], limits: Limits | None = None,
             workers: int | None = None, progress: bool = False, desc: str = "sandbox"
             ) -> list[Report]:
    """:func:`run` for many (program, tests) pairs, ``workers`` children at a time (default: the
    CPU count, fewer when their memory budgets, :attr:`Limits.host_mb` each, would not fit the
    host's available memory); reports in the order of ``jobs``."""
    limits = limits or Limits()
    check_isolation()
    workers = max(1, min(workers or os.cpu_count() or 1, memory_workers(limits)))
    with ThreadPoolExecutor(max_workers=workers) as pool:
        futures = [pool.submit(run, program, tests, limits) for program, tests in jobs]
        return [f.result() for f in tqdm(futures, desc=desc, disable=not progress)]
