"""The sandbox: honest programs pass, and a corpus of hostile programs is contained and fails."""

import os
import re
import time

import pytest

from lopd.envs.sandbox import Limits, Report, canonical, run, run_many
from lopd.envs.sandbox import TestOutcome as Outcome

ADD = "def add(a, b):\n    return a + b\n"
CHECK = {"check": "def check(candidate):\n    assert candidate(2, 2) == 4\n"
                  "    assert candidate(-1, 1) == 0\n", "entry_point": "add", "reference": ADD}
TESTS = [{"call": "add(1, 2)", "expected": 3}, {"call": "add(-4, 4)", "expected": 0}, CHECK]
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


def test_values_are_compared_as_plain_data_so_equality_tricks_fail():
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
    with pytest.raises(ValueError, match="exactly one of 'call' or 'check'"):
        run(ADD, [{"call": "add(1, 2)", "check": "x"}])
    with pytest.raises(ValueError, match="a 'check' test without entry_point, reference"):
        run(ADD, [{"check": "def check(candidate):\n    pass\n"}])
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


def test_run_many_runs_in_parallel_and_keeps_order():
    jobs = [(f"def add(a, b):\n    return a + b + {k}\n", TESTS[:1]) for k in range(6)]
    reports = run_many(jobs, FAST, workers=2)
    assert [r.outcomes[0].passed for r in reports] == [True] + [False] * 5
    assert [r.outcomes[0].value for r in reports] == [str(3 + k) for k in range(6)]


def test_outcome_defaults():
    assert Outcome(True).error == "" and Report("completed", [], "", False, 0.0).fraction == 0.0


def test_each_run_gets_a_fresh_private_work_directory():
    program = ("import os\nprint(sorted(os.listdir('.')))\n"
               "open('scratch.txt', 'w').write('x')\n" + ADD)
    first, second = run(program, TESTS, FAST), run(program, TESTS, FAST)
    assert first.all_passed and second.all_passed
    assert first.output == second.output == "[]\n"  # the first run's file is not there
    assert not os.path.exists(os.path.join(os.getcwd(), "scratch.txt"))


# -- Attacks on judging, isolation and the parent ---------------------------------------------
# Each program tries to pass without computing the answers (or to escape, or to crash the
# parent); each must score 0, leave nothing outside the sandbox and return a report.

LYING = {
    "always-equal int": "class E(int):\n    def __eq__(self, o):\n        return True\n"
                        "    __hash__ = int.__hash__\n",
    "always-equal object": ("class E:\n    def __init__(self, *a):\n        pass\n"
                            "    def __eq__(self, o):\n        return True\n"
                            "    def __ne__(self, o):\n        return False\n"
                            "    def __abs__(self):\n        return 0\n"
                            "    def __sub__(self, o):\n        return E()\n"
                            "    __rsub__ = __sub__\n"
                            "    def __lt__(self, o):\n        return True\n"
                            "    __le__ = __gt__ = __ge__ = __lt__\n"
                            "    def __bool__(self):\n        return True\n"
                            "    def __iter__(self):\n        return iter(())\n"
                            "    def __len__(self):\n        return 0\n"
                            "    __hash__ = object.__hash__\n"),
    "always-equal str": "class E(str):\n    def __eq__(self, o):\n        return True\n"
                        "    __hash__ = str.__hash__\n",
    "always-equal list": "class L(list):\n    def __eq__(self, o):\n        return True\n"
                         "def E(*a):\n    return L([7])\n",
    "float with a lying abs": "class E(float):\n    def __abs__(self):\n        return 0.0\n"
                              "    def __sub__(self, o):\n        return E(0)\n"
                              "    def __eq__(self, o):\n        return True\n"
                              "    __hash__ = float.__hash__\n",
    "tuple of liars": "class L:\n    def __eq__(self, o):\n        return True\n"
                      "def E(*a):\n    return (L(), L())\n",
}


@pytest.mark.parametrize("name", sorted(LYING))
def test_objects_that_lie_about_equality_fail_a_check(name):
    program = LYING[name] + "def add(a, b):\n    return E(7)\n"
    report = run(program, [CHECK, TESTS[0]], FAST)
    assert_failed(report)
    assert report.outcomes[0].error.startswith("unencodable:"), report.outcomes


def test_an_always_equal_answer_passes_no_humaneval_problem():
    from lopd.envs.humaneval import HumanEval

    env = HumanEval()
    liar = LYING["always-equal object"]
    # `return E()` is the body of the prompt's function; the class follows it.
    jobs = [(t.meta["prompt"] + "\n    return E()\n" + liar, env.reset(t).tests)
            for t in env.tasks("eval")]
    reports = run_many(jobs, env.limits, workers=2)
    assert sum(r.all_passed for r in reports) == 0


FORGERIES = {
    # The child's reporting can be rewritten; what it reports are still only outputs.
    "json.dumps patched to forge values": (
        "import json\njson.dumps = lambda *a, **k: '3'\ndef add(a, b):\n    return None\n"),
    "the harness's encoder patched": (
        "import sys\nh = sys.modules['__main__']\nh.encode = lambda v, *a: 3\n"
        "def add(a, b):\n    return None\n"),
    "a forged record on every descriptor, then exit": (
        "import os\nrecord = b'{\"network\": \"isolated\", \"results\": [{\"value\": \"3\"}, "
        "{\"value\": \"0\"}, {\"value\": \"4\"}], \"passed\": true}\\n'\n"
        "for fd in range(3, 64):\n    try:\n        os.write(fd, record)\n    except OSError:\n"
        "        pass\nos._exit(0)\n"),
    "an extra record after the harness's": (
        "import os, sys\nclass Late:\n    def __del__(self):\n"
        "        os.write(3, b'{\"results\": []}\\n')\nsys.modules['late'] = Late()\n"
        "def add(a, b):\n    for fd in range(3, 20):\n        try:\n"
        "            os.write(fd, b'{\"passed\": true}\\n')\n        except OSError:\n"
        "            pass\n    return None\n"),
    "the harness's results rewritten through its frame": (
        "import sys\ndef add(a, b):\n    f = sys._getframe(1)\n    while f is not None:\n"
        "        if 'results' in f.f_locals:\n"
        "            f.f_locals['results'][:] = [{'value': '3'}] * 3\n"
        "        f = f.f_back\n    return None\n"),
    "the secret hunted in its own memory": (
        "import os\nseen = []\nfor path in ('/proc/self/maps', '/proc/self/environ', "
        "'/proc/1/environ', '/proc/1/cmdline'):\n    try:\n"
        "        seen.append(open(path, 'rb').read(4096))\n    except OSError:\n        pass\n"
        "def add(a, b):\n    return None\n"),
}


@pytest.mark.parametrize("name", sorted(FORGERIES))
def test_forged_verdicts_are_only_outputs_and_fail(name):
    # The forged outputs (3) are wrong for these tests: a forgery is worth what it states.
    assert_failed(run(FORGERIES[name], TESTS[1:], FAST))


def test_the_parents_environment_and_files_are_out_of_reach(tmp_path, monkeypatch):
    monkeypatch.setenv("LOPD_SANDBOX_CANARY", "canary-7f3a")
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    program = (
        "import os\nout = []\n"
        "def attempt(f):\n    try:\n        out.append(repr(f()))\n"
        "    except BaseException as exc:\n        out.append(type(exc).__name__)\n"
        "attempt(lambda: dict(os.environ))\n"
        "attempt(lambda: open('/proc/1/environ', 'rb').read())\n"
        f"attempt(lambda: open({str(victim)!r}).read())\n"
        f"attempt(lambda: os.remove({str(victim)!r}))\n"
        f"attempt(lambda: open({str(tmp_path / 'planted.txt')!r}, 'w').write('x'))\n"
        "attempt(lambda: os.listdir('/root/.pyenv') if os.path.isdir('/root/.pyenv') else [])\n"
        "attempt(lambda: os.kill(-1, 9))\n"
        "print('\\n'.join(out))\n" + ADD)
    report = run(program, TESTS, FAST)
    assert report.all_passed  # honest work still runs beside the attempts
    assert "canary-7f3a" not in report.output and "keep me" not in report.output
    assert victim.read_text() == "keep me" and not (tmp_path / "planted.txt").exists()


def test_directory_descriptors_reach_nothing_outside_the_sandbox(tmp_path):
    import uuid

    name = f"lopd-escape-{uuid.uuid4().hex}"
    program = (
        "import os\n"
        f"for d in ('/tmp', '/var/tmp', '/dev/shm', {str(tmp_path)!r}, '.'):\n"
        "    try:\n        fd = os.open(d, os.O_RDONLY)\n"
        f"        w = os.open({name!r}, os.O_CREAT | os.O_WRONLY, dir_fd=fd)\n"
        "        os.write(w, b'x')\n"
        f"        os.rename({name!r}, {name + '-moved'!r}, src_dir_fd=fd, dst_dir_fd=fd)\n"
        "    except OSError as exc:\n        print(d, type(exc).__name__)\n" + ADD)
    report = run(program, TESTS, FAST)
    assert report.all_passed
    for where in ("/tmp", "/var/tmp", "/dev/shm", str(tmp_path)):
        assert not any(p.name.startswith(name) for p in __import__("pathlib").Path(where)
                       .glob("lopd-escape-*")), where


def test_the_answer_key_is_not_on_the_childs_disk():
    # codeworld's tasks and expected values live in lopd's source: the child can neither import
    # it nor find it anywhere on its filesystem.
    program = (
        "import os\nhits = []\ntry:\n    import lopd\n    hits.append('import')\n"
        "except ImportError:\n    pass\n"
        "for root, dirs, files in os.walk('/'):\n"
        "    if root.startswith('/proc'):\n        dirs[:] = []\n        continue\n"
        "    hits += [os.path.join(root, f) for f in files if 'lopd' in f or f == 'problems.py'"
        " or 'codeworld' in root or f.endswith('.jsonl')]\n"
        "    hits += [os.path.join(root, d) for d in dirs if d in ('.venv', 'torch', 'work')"
        " and root != '/tmp']\n"
        "print(hits)\n" + ADD)
    # The walk visits every file of the read-only system (over 100k under /usr on some machines):
    # time enough for it, so that the test checks what is visible, not how fast the disk is.
    report = run(program, TESTS, Limits(wall_seconds=60, test_seconds=40, cpu_seconds=40,
                                        memory_mb=256))
    assert report.all_passed, report
    # Only the harness file is bound in (as /lopd/sandbox_harness.py); nothing else of the project.
    assert report.output.strip() == "[]", report.output


PARENT_CRASHERS = {
    "a value nested 1,000 deep": ("def add(a, b):\n    v = []\n    for _ in range(1000):\n"
                                  "        v = [v]\n    return v\n"),
    "a dict nested 1,000 deep": ("def add(a, b):\n    v = {}\n    for _ in range(1000):\n"
                                 "        v = {'k': v}\n    return v\n"),
    "garbage bytes on the channel": ("import os\nfor fd in range(3, 20):\n    try:\n"
                                     "        os.write(fd, bytes(range(256)) * 8)\n"
                                     "    except OSError:\n        pass\nos._exit(0)\n"),
    "a nesting bomb on the channel": ("import os\nfor fd in range(3, 20):\n    try:\n"
                                      "        os.write(fd, b'[' * 200000 + b'\\n')\n"
                                      "    except OSError:\n        pass\nos._exit(0)\n"),
    "a flood on the channel": ("import os\nchunk = b'{' * 65536\nfor fd in range(3, 20):\n"
                               "    try:\n        for _ in range(200):\n"
                               "            os.write(fd, chunk)\n    except OSError:\n"
                               "        pass\nos._exit(0)\n"),
    "wrong types in a record": ("import os\nfor fd in range(3, 20):\n    try:\n"
                                "        os.write(fd, b'{\"results\": [{\"value\": 3}, 7, "
                                "{\"error\": [1]}]}\\n')\n    except OSError:\n"
                                "        pass\nos._exit(0)\n"),
    "a huge integer": "def add(a, b):\n    return 10 ** 20000\n",
}


@pytest.mark.parametrize("name", sorted(PARENT_CRASHERS))
def test_nothing_on_the_channel_crashes_the_parent(name):
    report = run(PARENT_CRASHERS[name], TESTS, FAST)
    assert_failed(report)


def test_the_channel_parser_never_raises_on_random_or_deep_input():
    import json
    import random

    from lopd.envs.confinement import Calls, parse_record
    from lopd.envs.sandbox import _value

    rng = random.Random(0)
    samples = [bytes(rng.randrange(256) for _ in range(rng.randrange(64))) for _ in range(2000)]
    samples += [b"[" * n for n in (10, 1000, 100000)]
    samples += [b'{"a":' * n + b"1" + b"}" * n for n in (10, 5000)]
    samples += [b'{"results": null}', b"\xff\xfe", b"{}{}", b"", b"1" * 5000]
    for data in samples:
        record, why = parse_record(data)
        assert (record is None) == bool(why)
    values = ["[" * 100000, '{"$": "tuple", "v": 5}', '{"$": "dict", "v": [[1]]}',
              '{"$": "float", "v": "1e999"}', '{"$": "bytes", "v": "zz"}', "NaN", "1" * 5000,
              '{"$": "set", "v": [[1]]}', '{"$": "complex", "v": ["a", 1]}', '"ok"',
              '{"$": "iter", "v": {}}', '{"$": "dict", "v": [[[1], 2]]}', '{"$": "x", "v": []}',
              '{"$": "tuple", "v": [], "w": 1}', '{"$": "bytes", "v": "abc"}']
    for text in values:
        try:
            data = json.loads(text)
        except (ValueError, RecursionError):
            continue
        _, _, why = _value({"value": data})
        assert why in ("", "malformed result")
    # Any sequence of records: the protocol accepts or refuses each, never raises.
    junk = [{}, {"ready": 3}, {"ready": ""}, {"begin": 0}, {"begin": 1}, {"i": 0}, {"i": 0,
            "value": 1}, {"i": 0, "error": 3}, {"i": 0, "error": "x", "value": 1}, {"i": "0"}]
    for _ in range(500):
        protocol = Calls(0, 2, 1.0, 1e12)
        for record in rng.choices(junk, k=6):
            if not protocol.feed(record):
                break
        assert protocol.deadline() <= 1e12


def test_plain_data_round_trips_exact_types_and_refuses_the_rest():
    import json

    from lopd.envs.sandbox_harness import Unencodable, decode, dumps

    value = [1, -2.5, float("inf"), "s\ud800", None, True, (1, (2,)), {1: "a", (2, 3): [4]},
             {1, 2}, frozenset({"x"}), b"\x00\xff", 1 + 2j]
    back = decode(json.loads(dumps(value)))
    assert back == value and type(back[6]) is tuple and type(back[7]) is dict
    assert type(back[9]) is frozenset and back[5] is True
    for bad in (type("I", (int,), {})(3), object(), [[[]]] * 0 + [eval("[" * 80 + "]" * 80)]):
        with pytest.raises(Unencodable):
            dumps(bad)


def test_without_bubblewrap_untrusted_code_is_refused_unless_the_unsafe_mode_is_chosen(
        monkeypatch, capsys):
    from lopd.envs import confinement, sandbox

    sandbox.isolation.cache_clear()
    monkeypatch.setattr(confinement.shutil, "which", lambda name: None)
    try:
        with pytest.raises(sandbox.SandboxUnavailable, match=re.escape(
                "untrusted code is not run: bubblewrap (bwrap) is not installed; install it with "
                "apt-get install bubblewrap")):
            run(ADD, TESTS, FAST)
        # At start-up, in one line: `lopd eval` on a code environment refuses before any model
        # or task is loaded.
        from lopd.cli import main

        assert main(["eval", "--env", "humaneval", "--agent", "oracle", "--limit", "1"]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("lopd eval: error: untrusted code is not run: bubblewrap (bwrap) "
                              "is not installed") and "\n" not in err
        assert err.endswith("set env.unsafe_sandbox_without_bubblewrap=true")
        assert main(["eval", "--env", "humaneval", "--agent", "oracle", "--limit", "1",
                     "--set", "env.unsafe_sandbox_without_bubblewrap=true"]) == 0
        sandbox.allow_unsafe_fallback(True)
        report = run(ADD, TESTS, FAST)
        assert report.all_passed and report.meta["isolation"] == "unsafe fallback"
        assert_failed(run(HOSTILE["fork bomb"], TESTS, FAST))
    finally:
        sandbox.allow_unsafe_fallback(False)
        monkeypatch.undo()
        sandbox.isolation.cache_clear()
    assert run(ADD, TESTS, FAST).meta["isolation"] == "bubblewrap"


# -- Sandbox v3: the kernel's surface, state between runs, memory, the parent's time -------------

SYSCALLS = {"unshare": (272, "0x10000000"), "setns": (308, "0, 0"), "bpf": (321, "0, 0, 0"),
            "perf_event_open": (298, "0, 0, -1, -1, 0"), "io_uring_setup": (425, "1, 0"),
            "keyctl": (250, "0, -4"), "add_key": (248, "b'user', b'k', b'v', 1, -4"),
            "request_key": (249, "b'user', b'k', None, 0"), "ptrace": (101, "16, 1, 0, 0"),
            "mount": (165, "b'none', b'/tmp', b'tmpfs', 0, None"), "memfd_create": (319, "b'x', 0"),
            "shmget": (29, "0, 4096, 0o1000"), "userfaultfd": (323, "0"),
            "clone3": (435, "None, 0")}


def test_a_seccomp_filter_denies_namespaces_keyrings_and_kernel_attack_surface():
    program = ("import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\n"
               "libc.syscall.restype = ctypes.c_long\n"
               "def sc(name, nr, *args):\n    ctypes.set_errno(0)\n"
               "    r = libc.syscall(nr, *args)\n"
               "    print(name, 'ok' if r >= 0 else os.strerror(ctypes.get_errno()))\n"
               + "".join(f"sc({name!r}, {nr}, {args})\n" for name, (nr, args) in SYSCALLS.items())
               + "print('getpid', 'ok' if os.getpid() > 0 else 'no')\n" + ADD)
    report = run(program, TESTS, FAST)
    assert report.all_passed, report
    seen = dict(line.split(" ", 1) for line in report.output.splitlines())
    assert seen.pop("clone3") == "Function not implemented"
    assert seen.pop("getpid") == "ok"
    assert seen == {name: "Operation not permitted" for name in SYSCALLS if name != "clone3"}


def test_nothing_one_run_leaves_is_visible_to_the_next():
    leave = (
        "import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\n"
        "def attempt(f):\n    try:\n        f()\n    except BaseException:\n        pass\n"
        "for k in (-4, -5, -3):\n"  # user, user-session and session keyrings
        "    libc.syscall(248, b'user', b'lopd-canary', b'v', 1, k)\n"
        "for d in ('/tmp', '/dev/shm', '.', '/'):\n"
        "    attempt(lambda: open(d + '/lopd-canary', 'w').write('v'))\n"
        "libc.syscall(29, 0x10DC, 4096, 0o1666)\n"  # SysV shared memory, key 0x10DC
        "libc.syscall(68, 0x10DC, 0o1666)\n"  # SysV message queue
        "libc.syscall(64, 0x10DC, 1, 0o1666)\n"  # SysV semaphore
        "libc.syscall(240, b'lopd-canary', 0o102, 0o666, None)\n"  # POSIX message queue
        "libc.sethostname(b'lopd-canary', 11)\n" + ADD)
    look = (
        "import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\nfound = []\n"
        "for k in (-4, -5, -3):\n"
        "    if libc.syscall(250, 10, k, b'user', b'lopd-canary', 0) > 0:\n"
        "        found.append(('key', k))\n"
        "for d in ('/tmp', '/dev/shm', '.', '/'):\n"
        "    if os.path.exists(d + '/lopd-canary'):\n        found.append(d)\n"
        "if libc.syscall(29, 0x10DC, 0, 0) >= 0:\n    found.append('shm')\n"
        "if libc.syscall(68, 0x10DC, 0) >= 0:\n    found.append('msg')\n"
        "if libc.syscall(64, 0x10DC, 0, 0) >= 0:\n    found.append('sem')\n"
        "if libc.syscall(240, b'lopd-canary', 0, 0, None) >= 0:\n    found.append('mqueue')\n"
        "if os.uname().nodename == 'lopd-canary':\n    found.append('hostname')\n"
        "print(found)\n" + ADD)
    assert run(leave, TESTS, FAST).all_passed
    report = run(look, TESTS, FAST)
    assert report.all_passed and report.output == "[]\n", report.output


def test_the_private_tmp_is_bounded_and_everything_else_is_read_only():
    limits = Limits(wall_seconds=20, test_seconds=15, cpu_seconds=15, memory_mb=256, tmpfs_mb=16)
    program = ("import os\nwritten, chunk = 0, b'x' * (1 << 20)\n"
               "for i in range(64):\n    try:\n"
               "        with open(f'/tmp/fill{i}', 'wb') as f:\n"
               "            for _ in range(4):\n                f.write(chunk)\n"
               "                f.flush()\n                written += len(chunk)\n"
               "    except OSError:\n        break\n"
               "denied = []\nfor d in ('/', '/dev', '/dev/shm', '/usr', '/proc/self'):\n"
               "    try:\n        open(d + '/x', 'w').write('x')\n"
               "    except OSError:\n        denied.append(d)\n"
               "print(written >> 20, denied)\n" + ADD)
    report = run(program, TESTS, limits)
    assert report.all_passed, report
    written, denied = report.output.split(" ", 1)
    assert int(written) <= 16  # 64 MiB were asked for
    assert denied.strip() == "['/', '/dev', '/dev/shm', '/usr', '/proc/self']"


def test_parallel_runs_are_sized_to_fit_the_hosts_memory():
    from lopd.envs.confinement import memory_workers

    assert Limits().host_mb == 1024 + 64 + 8
    assert memory_workers(Limits(memory_mb=1 << 40)) == 1
    assert memory_workers(Limits(memory_mb=1)) >= 2


def _parent_cpu_seconds(fn):
    import resource

    before = resource.getrusage(resource.RUSAGE_SELF)
    result = fn()
    after = resource.getrusage(resource.RUSAGE_SELF)
    return result, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def _forged(value_json: str) -> str:
    """A program that writes the channel's protocol itself, with ``value_json`` as call 0's
    value (the child then needs no time to build it)."""
    return ("import os, sys\nfd = int(sys.argv[2])\n"
            "def put(text):\n    data = (text + '\\n').encode()\n"
            "    while data:\n        data = data[os.write(fd, data):]\n"
            "put('{\"ready\": \"\", \"network\": \"isolated\"}')\nput('{\"begin\": 0}')\n"
            f"put('{{\"i\": 0, \"value\": ' + {value_json} + '}}')\nos._exit(0)\n")


@pytest.mark.parametrize("shape", ["set", "dict"])
def test_values_whose_keys_all_hash_alike_cost_the_parent_nothing(shape):
    # 30,000 ints that are all 0 modulo 2**61 - 1 (CPython's int hash): a set or dict of them
    # costs quadratic time to build. The parent never builds one from a child's data.
    items = ("[str(i * (2**61 - 1)) for i in range(30000)]" if shape == "set" else
             "['[' + str(i * (2**61 - 1)) + ', 1]' for i in range(30000)]")
    value = f"'{{\"$\": \"{shape}\", \"v\": [' + ', '.join({items}) + ']}}'"
    report, cpu = _parent_cpu_seconds(lambda: run(_forged(value), TESTS[:1], FAST))
    assert report.outcomes[0].error == "wrong value"
    assert cpu < 1.0, f"the parent spent {cpu:.2f} s of CPU on one answer"


def test_an_output_flood_costs_the_parent_no_cpu():
    report, cpu = _parent_cpu_seconds(lambda: run(HOSTILE["stdout flood"], TESTS[:1], FAST))
    assert report.output_truncated and len(report.output) == FAST.output_bytes
    assert cpu < 0.5, f"the parent spent {cpu:.2f} s of CPU reading a flood"


LIFTED_TIMERS = {
    "timer cancelled": "    import signal\n    signal.setitimer(signal.ITIMER_REAL, 0)\n",
    "alarm ignored": "    import signal\n    signal.signal(signal.SIGALRM, signal.SIG_IGN)\n",
    "timeout caught": "",
}


@pytest.mark.parametrize("how", sorted(LIFTED_TIMERS))
def test_a_call_cannot_lift_its_own_time_limit(how):
    limits = Limits(wall_seconds=12, test_seconds=1, cpu_seconds=12, memory_mb=256)
    # Call 0 computes the right answer in 2.5 s, past its 1 s; the calls after it still run.
    body = ("    import time\n    if a == 1:\n        end = time.monotonic() + 2.5\n"
            "        while time.monotonic() < end:\n            try:\n"
            "                while time.monotonic() < end:\n                    pass\n"
            "            except BaseException:\n                pass\n    return a + b\n")
    program = "def add(a, b):\n" + LIFTED_TIMERS[how] + body
    report = run(program, TESTS, limits)
    assert [o.passed for o in report.outcomes] == [False, True, True], report
    assert report.outcomes[0].error == "timeout"
    assert report.seconds < 1 + 1.5 + 3  # killed at its limit and a grace, not at 2.5 s


def test_numbers_compare_by_value_and_types_as_in_python():
    cases = [("21.0", 21, True), ("-0.0", 0, True), ("2 ** 53 + 1.0", 2 ** 53 + 1, False),
             ("complex(3, 0)", 3, True), ("True", 1, False), ("1", True, False),
             ("(1, 2)", [1, 2], False), ("[1, 2]", (1, 2), False), ("frozenset({1})", {1}, True),
             ("{1.0: 'a'}", {1: "a"}, True), ("{'b': [1.0], 'a': 2}", {"a": 2, "b": [1]}, True),
             ("__import__('collections').Counter('aab')", {"a": 2, "b": 1}, True),
             ("__import__('collections').OrderedDict(a=1)", {"a": 1}, True),
             ("__import__('collections').defaultdict(int, a=1)", {"a": 1}, True),
             ("iter([1, 2])", [1, 2], False), ("float('nan')", 0, False),
             ("'1'", 1, False), ("None", 0, False), ("b'ab'", b"ab", True)]
    tests = [{"call": f"f({i})", "expected": expected} for i, (_, expected, _) in enumerate(cases)]
    program = "def f(i):\n    return [" + ", ".join(code for code, _, _ in cases) + "][i]\n"
    report = run(program, tests, FAST)
    assert [o.passed for o in report.outcomes] == [same for _, _, same in cases], report.outcomes
    # Only the standard library's exact dict types are dicts: a subclass is not plain data.
    subclass = run("class D(dict):\n    pass\ndef f():\n    return D(a=1)\n",
                   [{"call": "f()", "expected": {"a": 1}}], FAST)
    assert subclass.outcomes[0].error == "unencodable:not plain data: D"


def test_the_value_budget_fails_only_the_calls_past_it():
    from lopd.envs.sandbox_harness import RUN_VALUE_BYTES

    # Six values of ~0.9 MB: the budget (4 MiB) holds four of them.
    size = 900_000
    program = f"def f(i):\n    return 'x' * {size}\n"
    tests = [{"call": f"f({i})", "expected": "x" * size} for i in range(6)]
    report = run(program, tests, Limits(wall_seconds=30, test_seconds=5, cpu_seconds=30))
    kept = RUN_VALUE_BYTES // (size + 2)
    assert [o.passed for o in report.outcomes] == [True] * kept + [False] * (6 - kept)
    assert report.outcomes[-1].error == "unencodable:over the run's value budget"


def test_correct_answers_that_return_iterators_or_counters_pass_humaneval():
    from lopd.envs.humaneval import HumanEval

    env = HumanEval()
    tasks = {t.task_id: t for t in env.tasks("eval")}
    answers = {
        "HumanEval/33": "    l = list(l)\n    thirds = sorted(l[::3])\n"
                        "    return (thirds[i // 3] if i % 3 == 0 else x for i, x in enumerate(l))\n",
        "HumanEval/37": "    l = list(l)\n    evens = sorted(l[::2])\n"
                        "    return map(lambda i: evens[i // 2] if i % 2 == 0 else l[i], range(len(l)))\n",
        "HumanEval/111": "    import collections\n    counts = collections.Counter(test.split())\n"
                         "    most = max(counts.values(), default=0)\n"
                         "    return collections.Counter({k: v for k, v in counts.items()"
                         " if v == most and k})\n",
    }
    for task_id, body in answers.items():
        task = tasks[task_id]
        report = run(task.meta["prompt"] + body, env.reset(task).tests, env.limits)
        assert report.all_passed, (task_id, report.outcomes)


def test_a_reference_that_fails_its_check_is_one_start_up_error(monkeypatch):
    from lopd.envs import sandbox
    from lopd.envs.humaneval import HumanEval
    from lopd.envs.sandbox import SandboxSetupError, record_checks

    monkeypatch.setattr(sandbox, "_RECORDINGS", {})  # recordings are kept per process

    slow = {"check": "def check(candidate):\n    assert candidate(1, 2) == 3\n",
            "entry_point": "add", "reference": "import time\ntime.sleep(3)\n" + ADD}
    with pytest.raises(SandboxSetupError, match=r"^1 reference solution\(s\) do not pass their "
                       r"own check in the sandbox: add \(load:timeout\).*test_seconds=1"):
        record_checks([slow], Limits(wall_seconds=10, test_seconds=1))
    env = HumanEval(limits=Limits(memory_mb=8))  # too little memory for any reference
    with pytest.raises(SandboxSetupError) as caught:
        env.tasks("eval")
    assert "\n" not in str(caught.value) and "memory_mb=8" in str(caught.value)


def test_only_the_libraries_the_interpreter_loads_are_visible():
    program = ("import os\nlibs = [f for d in ('/usr/lib', '/usr/lib64') if os.path.isdir(d)\n"
               "        for _, _, files in os.walk(d) for f in files]\n"
               "print(len(libs), os.path.exists('/usr/lib/python3'), os.path.exists('/usr/bin'),"
               " os.path.exists('/etc'))\n"
               "import json, ssl, sqlite3, ctypes, decimal, zlib, lzma, bz2\n" + ADD)
    report = run(program, TESTS, FAST)
    assert report.all_passed, report
    count, *rest = report.output.split()
    assert int(count) < 200 and rest == ["False", "False", "False"], report.output
