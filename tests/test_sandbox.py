"""The sandbox: honest programs pass, and a corpus of hostile programs is contained and fails."""

import os
import time

import pytest

from lopd.envs.sandbox import Limits, Report, canonical, run, run_many
from lopd.envs.sandbox import TestOutcome as Outcome

ADD = "def add(a, b):\n    return a + b\n"
TESTS = [{"call": "add(1, 2)", "expected": 3}, {"call": "add(-4, 4)", "expected": 0},
         {"code": "assert add(2, 2) == 4"}]
FAST = Limits(wall_seconds=6, test_seconds=2, cpu_seconds=5, memory_mb=256)


def assert_failed(report: Report) -> None:
    assert report.passed == 0 and not report.all_passed, report


def test_honest_program_passes_every_kind_of_test():
    report = run(ADD + "print('hello')\n", TESTS)
    assert report.status == "completed" and report.all_passed
    assert [o.value for o in report.outcomes] == ["3", "0", None]
    assert report.output == "hello\n"


def test_wrong_answers_fail_and_partial_credit_is_counted():
    report = run("def add(a, b):\n    return a + b if a < 0 else a * b\n", TESTS)
    assert [o.passed for o in report.outcomes] == [False, True, True]
    assert report.outcomes[0].error == "wrong value" and report.outcomes[0].value == "2"
    assert report.fraction == pytest.approx(2 / 3)
    assert "add(1, 2) returned 2, expected 3" in report.feedback(TESTS)


def test_values_are_compared_as_json_so_equality_tricks_fail():
    always_equal = ("class Anything(int):\n    def __eq__(self, other):\n        return True\n"
                    "def add(a, b):\n    return Anything(7)\n")
    assert_failed(run(always_equal, TESTS[:2]))
    assert_failed(run("def add(a, b):\n    return True\n", [{"call": "add(0, 1)", "expected": 1}]))
    assert canonical({"b": 1, "a": [1, 2]}) == canonical({"a": [1, 2], "b": 1})


def test_syntax_error_and_load_exception_fail_every_test():
    report = run("def add(a, b)\n    return a + b\n", TESTS)
    assert report.status == "completed"
    assert {o.error for o in report.outcomes} == {"load:SyntaxError"}
    assert {o.error for o in run("raise ValueError('x')", TESTS).outcomes} == {"load:ValueError"}


def test_bad_test_specs_are_refused_clearly():
    with pytest.raises(ValueError, match="exactly one of 'call' or 'code'"):
        run(ADD, [{"call": "add(1, 2)", "code": "x"}])
    with pytest.raises(ValueError, match="without an 'expected'"):
        run(ADD, [{"call": "add(1, 2)"}])
    with pytest.raises(ValueError, match="wall_seconds must be > 0"):
        Limits(wall_seconds=0)


HOSTILE = {
    "infinite loop": "while True:\n    pass\n",
    "infinite loop in the function": "def add(a, b):\n    while True:\n        pass\n",
    "fork bomb": "import os\nwhile True:\n    os.fork()\n",
    "subprocess": "import subprocess\nsubprocess.run(['true'])\n",
    "threads": "import threading\nthreading.Thread(target=lambda: None).start()\n",
    "memory bomb": "x = bytearray(1 << 34)\n",
    "growing memory": "xs = []\nwhile True:\n    xs.append(bytearray(1 << 24))\n",
    "stdout flood": "while True:\n    print('x' * 10000)\n",
    "sys.exit(0) before tests": "import sys\nsys.exit(0)\n" + ADD,
    "os._exit(0) before tests": "import os\n" + ADD + "os._exit(0)\n",
    "SystemExit inside the tested function": "def add(a, b):\n    raise SystemExit(0)\n",
    "os._exit inside the tested function": "import os\ndef add(a, b):\n    os._exit(0)\n",
    "fake passed output": ("print('3 passed, 0 failed')\nprint('ALL TESTS PASSED')\n"
                           "import sys\nsys.stdout.write('1\\n' * 50)\n"
                           "def add(a, b):\n    return None\n"),
    "monkeypatched assertions and builtins": (
        "import builtins\nbuiltins.AssertionError = type('Quiet', (Exception,), {})\n"
        "builtins.abs = lambda x: 0\nbuiltins.len = lambda x: 0\n"
        "def add(a, b):\n    return None\n"),
    "writes to every file descriptor": (
        "import os\nfor fd in range(3, 64):\n    try:\n"
        "        os.write(fd, b'SECRET\\nisolated\\n3\\n2:13\\n2:10\\n1:1\\n')\n"
        "    except OSError:\n        pass\n" "def add(a, b):\n    return None\n"),
    "killing the parent": "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\n",
    "network": "import socket\nsocket.create_connection(('1.1.1.1', 53), timeout=1)\n",
    "ctypes": "import ctypes\nctypes.CDLL(None).fork()\n",
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_programs_are_contained_and_fail(name):
    start = time.monotonic()
    report = run(HOSTILE[name], TESTS, FAST)
    assert time.monotonic() - start < FAST.wall_seconds + 3
    assert_failed(report)
    assert len(report.output.encode()) <= FAST.output_bytes
    assert os.getpid() and os.path.isdir("/")  # the parent is alive to say so


def test_flood_is_capped_and_loops_end_by_the_wall_clock():
    flood = run(HOSTILE["stdout flood"], TESTS, FAST)
    assert flood.output_truncated and len(flood.output) == FAST.output_bytes
    loop = run(HOSTILE["infinite loop"], TESTS, FAST)
    assert {o.error for o in loop.outcomes} == {"load:timeout"}
    assert loop.seconds < FAST.test_seconds + 1.5


def test_a_test_that_loops_fails_alone():
    program = "def add(a, b):\n    while a == 1:\n        pass\n    return a + b\n"
    report = run(program, TESTS, FAST)
    assert [o.passed for o in report.outcomes] == [False, True, True]
    assert report.outcomes[0].error == "timeout"


def test_files_outside_the_work_directory_are_neither_written_nor_deleted(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    target = tmp_path / "written.txt"
    program = (f"import os, shutil\n"
               f"for attempt in (lambda: open({str(target)!r}, 'w').write('x'),\n"
               f"                lambda: os.remove({str(victim)!r}),\n"
               f"                lambda: shutil.rmtree({str(tmp_path)!r}),\n"
               f"                lambda: os.rename({str(victim)!r}, 'stolen.txt')):\n"
               f"    try:\n        attempt()\n    except Exception as exc:\n"
               f"        print(type(exc).__name__)\n"
               f"open('inside.txt', 'w').write('fine')\n"
               f"print(open('inside.txt').read())\n" + ADD)
    report = run(program, TESTS, FAST)
    assert report.all_passed, report  # contained, and honest work inside the sandbox still runs
    assert victim.read_text() == "keep me" and not target.exists()
    assert report.output.split() == ["RuntimeError"] * 4 + ["fine"]


def test_the_secret_cannot_be_read():
    # Every place a program might look for the verdict secret: the parent's environment and
    # command line, its own, stdin, open descriptors and the interpreter's frames.
    program = ("import os, sys\nfound = []\n"
               "def attempt(f):\n    try:\n        found.append(str(f()))\n"
               "    except BaseException as exc:\n        found.append(type(exc).__name__)\n"
               "attempt(lambda: open(f'/proc/{os.getppid()}/environ', 'rb').read())\n"
               "attempt(lambda: open(f'/proc/{os.getppid()}/cmdline', 'rb').read())\n"
               "attempt(lambda: open('/proc/self/mem', 'rb').read(1))\n"
               "attempt(lambda: dict(os.environ))\nattempt(lambda: sys.argv)\n"
               "attempt(lambda: sys.stdin.read())\n"
               "attempt(lambda: [os.read(fd, 4096) for fd in range(64) if fd not in (1, 2)"
               " and os.path.exists(f'/dev/fd/{fd}')])\n"
               "attempt(lambda: [repr(f.f_locals)\n"
               "                 for f in [sys._getframe(i) for i in range(1, 4)]])\n"
               "attempt(lambda: __import__('gc').get_objects())\n"
               "print('\\n'.join(found))\n" + ADD)
    report = run(program, TESTS, FAST)
    assert report.status == "completed"
    # The honest part still passes; no hex secret of the run's length appears anywhere it saw.
    import re
    assert not re.search(r"\b[0-9a-f]{48}\b", report.output), report.output


def test_run_many_runs_in_parallel_and_keeps_order():
    jobs = [(f"def add(a, b):\n    return a + b + {k}\n", TESTS[:1]) for k in range(6)]
    reports = run_many(jobs, FAST, workers=2)
    assert [r.outcomes[0].passed for r in reports] == [True] + [False] * 5
    assert [r.outcomes[0].value for r in reports] == [str(3 + k) for k in range(6)]


def test_outcome_defaults():
    assert Outcome(True).error == "" and Report("completed", [], "", False, 0.0).fraction == 0.0


def test_each_run_gets_a_fresh_work_directory_that_is_removed():
    program = "import os\nopen('scratch.txt', 'w').write('x')\nprint(os.getcwd())\n" + ADD
    first, second = run(program, TESTS, FAST), run(program, TESTS, FAST)
    assert first.all_passed and second.all_passed
    assert first.output != second.output
    assert not os.path.exists(first.output.strip()) and not os.path.exists(second.output.strip())
