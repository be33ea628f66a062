"""The child side of the sandbox: confine this process, run one untrusted program, report per test.

Run only by :mod:`lopd.envs.sandbox` as ``python -I -S -B sandbox_harness.py LIMITS_JSON`` with the
job (secret, program, tests) on stdin and a private verdict pipe. The parent trusts nothing this
process prints except one verdict record that starts with the per-run secret. The secret never
sits in a variable the program can reach through frames or module globals: it is read, handed to
an audit hook's closure (unreachable without ``gc``, which the hook blocks) and dropped, and that
hook writes the verdict only when asked from this file's ``finish``. The verdict is built from
plain ints and strings with builtin operations, so patching ``json`` or any other module cannot
change what it says.

Confinement, in order: resource limits (memory, CPU, file size, open files, no core dumps); a new
network namespace with no interfaces when the kernel allows it (root, or unprivileged user
namespaces); as root, the work directory is handed to ``nobody`` and the process drops to it, so it
cannot read the parent's files, signal it, or write outside the work directory; ``RLIMIT_NPROC`` 0
(no child processes or threads); then an audit hook that blocks process creation, sockets,
``ctypes``, ``gc`` introspection, tracing, new audit hooks, signals to other processes, ``/proc``
and writes or deletions outside the work directory. Modules a program may import are loaded
before the privilege drop (the interpreter's own files may be unreadable to ``nobody``).
"""

import builtins
import json
import os
import resource
import signal
import sys

# Loaded while the interpreter's files are still readable; a program may import these.
PRELOAD = ("array", "bisect", "cmath", "collections", "collections.abc", "contextlib", "copy",
           "dataclasses", "datetime", "decimal", "enum", "fnmatch", "fractions", "functools",
           "glob", "hashlib", "heapq", "io", "itertools", "math", "numbers", "operator",
           "pathlib", "pprint", "random", "re", "shutil", "statistics", "string", "struct",
           "textwrap", "threading", "time", "typing", "unicodedata")
NOBODY = 65534
CLONE_NEWUSER, CLONE_NEWNET = 0x10000000, 0x40000000
BLOCKED_EVENTS = frozenset((
    "os.fork", "os.forkpty", "os.exec", "os.posix_spawn", "os.spawn", "os.system", "os.startfile",
    "subprocess.Popen", "pty.spawn", "_thread.start_new_thread", "os.kill", "os.killpg",
    "signal.pthread_kill", "sys.settrace", "sys.setprofile", "sys.addaudithook",
    "gc.get_objects", "gc.get_referrers", "gc.get_referents", "ctypes.dlopen", "ctypes.dlsym",
    "ctypes.cdata", "ctypes.call_function", "mmap.__new__", "os.chroot", "os.setuid",
    "sys._current_frames", "sys._current_exceptions", "resource.prlimit"))
BLOCKED_MODULES = frozenset(("ctypes", "_ctypes", "cffi", "_posixsubprocess", "subprocess",
                             "multiprocessing", "_multiprocessing", "socket", "_socket", "ssl",
                             "_xxsubinterpreters", "signal", "_signal", "gc", "faulthandler",
                             "tracemalloc", "mmap", "pty", "fcntl", "resource"))
PATH_EVENTS = ("os.remove", "os.rename", "os.rmdir", "os.mkdir", "os.chmod", "os.chown",
               "os.link", "os.symlink", "os.truncate", "os.utime", "shutil.rmtree", "shutil.move",
               "shutil.copyfile", "os.listdir", "os.scandir")
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND


class TestTimeout(BaseException):
    """Raised in the program's code when a test runs past its time."""


def confine(limits: dict, workdir: str) -> str:
    """Apply the OS limits; returns whether the network is "isolated" or "shared" (not isolable)."""
    def limit(kind, value):
        resource.setrlimit(kind, (value, value))

    limit(resource.RLIMIT_AS, limits["memory_mb"] << 20)
    limit(resource.RLIMIT_CPU, limits["cpu_seconds"])
    limit(resource.RLIMIT_FSIZE, limits["file_size_mb"] << 20)
    limit(resource.RLIMIT_CORE, 0)
    limit(resource.RLIMIT_NOFILE, limits["max_open_files"])
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        flags = CLONE_NEWNET if os.geteuid() == 0 else CLONE_NEWUSER | CLONE_NEWNET
        network = "isolated" if libc.unshare(flags) == 0 else "shared"
    except OSError:
        network = "shared"
    if os.geteuid() == 0:
        os.chown(workdir, NOBODY, NOBODY)
        os.setgroups([])
        os.setgid(NOBODY)
        os.setuid(NOBODY)
    limit(resource.RLIMIT_NPROC, 0)
    return network


def install_guard(secret: str, verdict_fd: int, finish_code, workdir: str) -> None:
    """Block what a program must not do, and hold the secret for the one verdict ``finish`` sends.

    The functions the hook calls are bound here, so rebinding them on their modules later changes
    nothing in it. Its path checks are the second line of defence for files: as root, the drop to
    ``nobody`` already keeps the program from writing or deleting outside the work directory.
    """
    write, getframe, realpath, fsdecode = os.write, sys._getframe, os.path.realpath, os.fsdecode
    sep = os.sep
    root = realpath(workdir) + sep
    state = {"sent": False}

    def inside(path) -> bool:
        if isinstance(path, int):
            return False
        try:
            path = fsdecode(path)
        except TypeError:
            return False
        return realpath(path).startswith(root)

    def hook(event, args):
        if event == "lopd.verdict":
            if state["sent"] or getframe(1).f_code is not finish_code:
                raise RuntimeError("blocked: verdict")
            state["sent"] = True
            data = (secret + "\n" + args[0] + "\n").encode()
            while data:
                data = data[write(verdict_fd, data):]
            return
        if event in BLOCKED_EVENTS or event.startswith(("socket.", "ctypes.")):
            raise RuntimeError(f"blocked in the sandbox: {event}")
        if event == "import" and args[0].split(".")[0] in BLOCKED_MODULES:
            raise RuntimeError(f"blocked in the sandbox: import {args[0]}")
        if event == "open":
            path, mode, flags = args
            if isinstance(path, int):
                raise RuntimeError("blocked in the sandbox: opening a file descriptor")
            text = fsdecode(path) if isinstance(path, (str, bytes)) else ""
            if realpath(text).startswith("/proc"):
                raise RuntimeError("blocked in the sandbox: /proc")
            writing = (any(c in (mode or "") for c in "wax+")
                       or (mode is None and (flags or 0) & WRITE_FLAGS))
            if writing and not inside(path):
                raise RuntimeError("blocked in the sandbox: writing outside the work directory")
        elif event in PATH_EVENTS:
            if event in ("os.listdir", "os.scandir"):
                if args and realpath(fsdecode(args[0] or ".")).startswith("/proc"):
                    raise RuntimeError("blocked in the sandbox: /proc")
                return
            if not all(inside(a) for a in args[:2] if isinstance(a, (str, bytes, os.PathLike))):
                raise RuntimeError(f"blocked in the sandbox: {event} outside the work directory")

    sys.addaudithook(hook)


def finish(payload: str, audit=sys.audit) -> None:
    audit("lopd.verdict", payload)


def main() -> None:
    limits = json.loads(sys.argv[1])
    verdict_fd, workdir = int(sys.argv[2]), os.getcwd()
    raw = sys.stdin.buffer.read()
    job = json.loads(raw)
    del raw
    for name in PRELOAD:
        __import__(name)
    network = confine(limits, workdir)
    install_guard(job.pop("secret"), verdict_fd, finish.__code__, workdir)
    # Once the guard is in, these cannot be imported again by the program.
    for name in ("signal", "_signal", "gc", "resource", "ctypes", "_ctypes"):
        sys.modules.pop(name, None)

    setitimer, set_handler, ITIMER_REAL = signal.setitimer, signal.signal, signal.ITIMER_REAL
    dumps, test_seconds = json.dumps, float(limits["test_seconds"])

    def on_alarm(signum, frame):
        raise TestTimeout()

    def timed(code, namespace):
        set_handler(signal.SIGALRM, on_alarm)
        setitimer(ITIMER_REAL, test_seconds)
        try:
            return eval(code, namespace)
        finally:
            setitimer(ITIMER_REAL, 0)

    def error_name(exc: BaseException) -> str:
        if isinstance(exc, TestTimeout):
            return "timeout"
        return type(exc).__name__ if type(exc).__module__ == "builtins" else "exception"

    clean_builtins = dict(builtins.__dict__)
    namespace = {"__name__": "__candidate__", "__builtins__": builtins}
    records = []
    load_error = ""
    try:
        timed(compile(job["program"], "<program>", "exec"), namespace)
    except BaseException as exc:  # noqa: BLE001 - the program's failure, whatever it is
        load_error = "load:" + error_name(exc)
    for test in job["tests"]:
        builtins.__dict__.clear()
        builtins.__dict__.update(clean_builtins)
        if load_error:
            records.append("0" + load_error)
            continue
        try:
            if "call" in test:
                value = timed(compile(test["call"], "<test>", "eval"), namespace)
                text = dumps(value, sort_keys=True)
                records.append("1" + str(len(text)) + ":" + text)
            else:
                timed(compile(test["code"], "<test>", "exec"), namespace)
                records.append("1")
        except BaseException as exc:  # noqa: BLE001
            records.append("0" + error_name(exc))
    builtins.__dict__.clear()
    builtins.__dict__.update(clean_builtins)
    finish(network + "\n" + str(len(records)) + "\n"
           + "\n".join(str(len(r)) + ":" + r for r in records))
    os._exit(0)


if __name__ == "__main__":
    main()
