"""The child side of the sandbox, and the plain-data codec both sides share.

Run by :mod:`lopd.envs.sandbox` as ``python -I -S -B sandbox_harness.py LIMITS_JSON FD`` with the
job on stdin, inside bubblewrap (its own user, PID, network, IPC and mount namespaces, a read-only
filesystem holding the interpreter and its standard library only, a private tmpfs work
directory). The harness sets the resource limits, runs the job and writes one record of *plain
data* to the descriptor ``FD``. The child never judges anything: it reports values, and a trusted
process compares them. So nothing it writes can be a forged verdict — the worst a program can do
on the channel is state outputs, which is what computing them would do.

Jobs (``mode``):

* ``candidate`` (untrusted): run ``program``, then evaluate each ``calls`` entry — an expression
  (``{"expr": "f(1)"}``) or a function call on encoded arguments (``{"fn": "f", "args": ...,
  "kwargs": ...}``) — and report each value, encoded, or the exception's builtin name.
* ``record`` (trusted: a reference solution and its official check): run ``program`` then
  ``check`` with the entry point replaced by a recorder that keeps every call's arguments (encoded
  before the call) and the reference's output.
* ``replay`` (trusted): run ``program`` (the reference again: ``check`` may call the entry point
  by name) then ``check`` with a replayer as ``candidate``, answering each call with the
  candidate's reported output for those arguments; reports whether ``check`` passed.

Plain data (:func:`encode` / :func:`decode`): ``None``, ``bool``, ``int``, ``float``, ``str`` and
``list`` as JSON; ``tuple``, ``dict``, ``set``, ``frozenset``, ``bytes``, ``complex`` and
non-finite floats as tagged objects (``{"$": "tuple", "v": [...]}``). Only *exact* builtin types
are encoded (a subclass of ``int`` that claims to equal everything is refused), with bounded depth
and size; :func:`decode` accepts nothing else and never runs code.

When bubblewrap is unavailable and the user opts into the weaker mode, the harness also confines
itself as before bubblewrap existed here (``fallback: true``): a private network namespace where
the kernel allows it, the drop to ``nobody`` as root, and an audit hook that blocks process
creation, sockets, ``ctypes`` and writes outside the work directory.
"""

import builtins
import json
import math
import os
import resource
import signal
import sys

MAX_DEPTH = 64
MAX_NODES = 200_000
MAX_BYTES = 1 << 20
TAGS = ("tuple", "dict", "set", "frozenset", "bytes", "complex", "float")


class Unencodable(ValueError):
    """A value that is not plain data (its type, or its size)."""


def encode(value, depth: int = 0, budget: list | None = None):
    """``value`` as JSON-able plain data; raises :class:`Unencodable`."""
    budget = [MAX_NODES] if budget is None else budget
    budget[0] -= 1
    if budget[0] < 0:
        raise Unencodable("too many elements")
    if depth > MAX_DEPTH:
        raise Unencodable("nested too deeply")
    kind = type(value)
    if value is None or kind is bool or kind is int or kind is str:
        return value
    if kind is float:
        return value if math.isfinite(value) else {"$": "float", "v": repr(value)}
    if kind is list:
        return [encode(v, depth + 1, budget) for v in value]
    if kind is tuple:
        return {"$": "tuple", "v": [encode(v, depth + 1, budget) for v in value]}
    if kind is dict:
        return {"$": "dict", "v": [[encode(k, depth + 1, budget), encode(v, depth + 1, budget)]
                                   for k, v in value.items()]}
    if kind is set or kind is frozenset:
        items = [encode(v, depth + 1, budget) for v in value]
        items.sort(key=lambda item: json.dumps(item, sort_keys=True))
        return {"$": kind.__name__, "v": items}
    if kind is bytes:
        return {"$": "bytes", "v": value.hex()}
    if kind is complex:
        return {"$": "complex", "v": [encode(value.real, depth + 1, budget),
                                      encode(value.imag, depth + 1, budget)]}
    raise Unencodable(f"not plain data: {kind.__name__}")


def dumps(value) -> str:
    """The JSON text of ``encode(value)``, refused past :data:`MAX_BYTES`."""
    text = json.dumps(encode(value), allow_nan=False)
    if len(text) > MAX_BYTES:
        raise Unencodable("too large")
    return text


def decode(data, depth: int = 0):
    """Plain data back to its Python value; ``ValueError`` on anything not made by
    :func:`encode` (unknown tags, wrong shapes, too deep)."""
    if depth > MAX_DEPTH + 2:
        raise ValueError("nested too deeply")
    kind = type(data)
    if data is None or kind is bool or kind is int or kind is str:
        return data
    if kind is float:
        return data
    if kind is list:
        return [decode(v, depth + 1) for v in data]
    if kind is not dict or set(data) != {"$", "v"} or data["$"] not in TAGS:
        raise ValueError("not plain data")
    tag, body = data["$"], data["v"]
    if tag == "float":
        if body not in ("nan", "inf", "-inf"):
            raise ValueError("not plain data")
        return float(body)
    if tag == "bytes":
        if type(body) is not str:
            raise ValueError("not plain data")
        return bytes.fromhex(body)
    if type(body) is not list:
        raise ValueError("not plain data")
    items = [decode(v, depth + 1) for v in body] if tag != "dict" else None
    if tag == "tuple":
        return tuple(items)
    if tag == "set":
        return set(items)
    if tag == "frozenset":
        return frozenset(items)
    if tag == "complex":
        if len(items) != 2 or any(type(x) not in (int, float) for x in items):
            raise ValueError("not plain data")
        return complex(*items)
    pairs = {}
    for pair in body:
        if type(pair) is not list or len(pair) != 2:
            raise ValueError("not plain data")
        pairs[decode(pair[0], depth + 1)] = decode(pair[1], depth + 1)
    return pairs


# ----------------------------------------------------------------------------------------------
# The child


class TestTimeout(BaseException):
    """Raised in running code when a call runs past its time."""


PRELOAD = ("array", "bisect", "cmath", "collections", "collections.abc", "contextlib", "copy",
           "dataclasses", "datetime", "decimal", "enum", "fnmatch", "fractions", "functools",
           "glob", "hashlib", "heapq", "io", "itertools", "math", "numbers", "operator",
           "pathlib", "pprint", "random", "re", "shutil", "statistics", "string", "struct",
           "textwrap", "threading", "time", "typing", "unicodedata")
"""Modules loaded before the fallback mode's privilege drop (a program may import them)."""
NOBODY = 65534
CLONE_NEWUSER, CLONE_NEWNET = 0x10000000, 0x40000000
BLOCKED_EVENTS = frozenset((
    "os.fork", "os.forkpty", "os.exec", "os.posix_spawn", "os.spawn", "os.system", "os.startfile",
    "subprocess.Popen", "pty.spawn", "_thread.start_new_thread", "os.kill", "os.killpg",
    "signal.pthread_kill", "sys.settrace", "sys.setprofile", "sys.addaudithook",
    "ctypes.dlopen", "ctypes.dlsym", "ctypes.cdata", "ctypes.call_function", "mmap.__new__",
    "os.chroot", "os.setuid", "resource.prlimit"))
BLOCKED_MODULES = frozenset(("ctypes", "_ctypes", "cffi", "_posixsubprocess", "subprocess",
                             "multiprocessing", "_multiprocessing", "socket", "_socket", "ssl",
                             "_xxsubinterpreters", "signal", "_signal", "faulthandler", "mmap",
                             "pty", "fcntl", "resource"))
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND


def set_limits(limits: dict) -> None:
    def limit(kind, value):
        resource.setrlimit(kind, (value, value))

    limit(resource.RLIMIT_AS, limits["memory_mb"] << 20)
    limit(resource.RLIMIT_CPU, limits["cpu_seconds"])
    limit(resource.RLIMIT_FSIZE, limits["file_size_mb"] << 20)
    limit(resource.RLIMIT_CORE, 0)
    limit(resource.RLIMIT_NOFILE, limits["max_open_files"])
    # No child processes or threads: the count is per real user, so none can start.
    limit(resource.RLIMIT_NPROC, 0)


def drop_to_nobody(workdir: str) -> None:
    """As root: hand the work directory to ``nobody`` and become it (all capabilities go)."""
    os.chown(workdir, NOBODY, NOBODY)
    os.setgroups([])
    os.setgid(NOBODY)
    os.setuid(NOBODY)


def fallback_confine(workdir: str) -> str:
    """The weaker mode's own confinement; returns "isolated" or "shared" (the network)."""
    for name in PRELOAD:
        __import__(name)
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        flags = CLONE_NEWNET if os.geteuid() == 0 else CLONE_NEWUSER | CLONE_NEWNET
        network = "isolated" if libc.unshare(flags) == 0 else "shared"
    except OSError:
        network = "shared"
    if os.geteuid() == 0:
        drop_to_nobody(workdir)
    realpath, fsdecode, root = os.path.realpath, os.fsdecode, os.path.realpath(workdir) + os.sep

    def hook(event, args):
        if event in BLOCKED_EVENTS or event.startswith(("socket.", "ctypes.")):
            raise RuntimeError(f"blocked in the sandbox: {event}")
        if event == "import" and args[0].split(".")[0] in BLOCKED_MODULES:
            raise RuntimeError(f"blocked in the sandbox: import {args[0]}")
        if event == "open" and not isinstance(args[0], int):
            mode, flags = args[1], args[2]
            writing = (any(c in (mode or "") for c in "wax+")
                       or (mode is None and (flags or 0) & WRITE_FLAGS))
            path = fsdecode(args[0]) if isinstance(args[0], (str, bytes)) else ""
            if writing and not realpath(path).startswith(root):
                raise RuntimeError("blocked in the sandbox: writing outside the work directory")

    sys.addaudithook(hook)
    return network


def main() -> None:
    limits = json.loads(sys.argv[1])
    out_fd, workdir = int(sys.argv[2]), os.getcwd()
    job = json.loads(sys.stdin.buffer.read())
    set_limits(limits)
    if job.get("fallback"):
        network = fallback_confine(workdir)
    else:
        network = "isolated"
        if job.get("drop") and os.geteuid() == 0:
            drop_to_nobody(workdir)
    sys.modules.pop("resource", None)  # in the fallback, the hook refuses to import it again
    setitimer, set_handler, ITIMER_REAL = signal.setitimer, signal.signal, signal.ITIMER_REAL
    call_seconds = float(limits["test_seconds"])
    write, encode_json = os.write, dumps

    def on_alarm(signum, frame):
        raise TestTimeout()

    def timed(fn, *args):
        set_handler(signal.SIGALRM, on_alarm)
        setitimer(ITIMER_REAL, call_seconds)
        try:
            return fn(*args)
        finally:
            setitimer(ITIMER_REAL, 0)

    def error_name(exc: BaseException) -> str:
        if isinstance(exc, TestTimeout):
            return "timeout"
        return type(exc).__name__ if type(exc).__module__ == "builtins" else "exception"

    def send(record: dict) -> None:
        data = (json.dumps(record) + "\n").encode()
        while data:
            data = data[write(out_fd, data):]

    clean_builtins = dict(builtins.__dict__)
    namespace = {"__name__": "__candidate__", "__builtins__": builtins}
    mode = job["mode"]
    if mode != "candidate":
        import random

        random.seed(job.get("seed", 0))
    try:
        timed(exec, compile(job["program"], "<program>", "exec"), namespace)
        load_error = ""
    except BaseException as exc:  # noqa: BLE001 - the program's failure, whatever it is
        load_error = "load:" + error_name(exc)
    if mode == "candidate":
        results = []
        for call in job["calls"]:
            builtins.__dict__.clear()
            builtins.__dict__.update(clean_builtins)
            if load_error:
                results.append({"error": load_error})
                continue
            try:
                if "expr" in call:
                    value = timed(eval, compile(call["expr"], "<test>", "eval"), namespace)
                else:
                    fn = namespace[call["fn"]]
                    args, kwargs = decode(call["args"]), decode(call["kwargs"])
                    value = timed(lambda: fn(*args, **kwargs))
                results.append({"value": encode_json(value)})
            except Unencodable as exc:
                results.append({"error": f"unencodable:{exc}"})
            except BaseException as exc:  # noqa: BLE001
                results.append({"error": error_name(exc)})
        builtins.__dict__.clear()
        builtins.__dict__.update(clean_builtins)
        send({"network": network, "results": results})
    elif mode == "record":
        reference, calls = namespace.get(job["entry_point"]), []

        def recorder(*args, **kwargs):
            entry = {"args": encode(list(args)), "kwargs": encode(kwargs)}
            out = reference(*args, **kwargs)
            entry["out"] = encode(out)
            calls.append(entry)
            return out

        try:
            if load_error:
                raise RuntimeError(load_error)
            exec(compile(job["check"], "<check>", "exec"), namespace)
            timed(namespace["check"], recorder)
            send({"network": network, "calls": calls, "passed": True})
        except BaseException as exc:  # noqa: BLE001
            send({"network": network, "calls": calls, "passed": False,
                  "error": error_name(exc) if not load_error else load_error})
    elif mode == "replay":
        recorded = [json.dumps({"args": c["args"], "kwargs": c["kwargs"]}, sort_keys=True)
                    for c in job["calls"]]
        outputs, used = job["outputs"], set()

        def replayer(*args, **kwargs):
            key = json.dumps({"args": encode(list(args)), "kwargs": encode(kwargs)},
                             sort_keys=True)
            for i in [len(used), *range(len(recorded))]:
                if i < len(recorded) and i not in used and recorded[i] == key:
                    used.add(i)
                    result = outputs[i]
                    if "error" in result:
                        raise RuntimeError(f"the candidate raised {result['error']}")
                    return decode(json.loads(result["value"]))
            raise LookupError("a call the recording does not hold")

        try:
            if load_error:
                raise RuntimeError(load_error)
            exec(compile(job["check"], "<check>", "exec"), namespace)
            timed(namespace["check"], replayer)
            send({"network": network, "passed": True})
        except BaseException as exc:  # noqa: BLE001
            send({"network": network, "passed": False, "error": error_name(exc)})
    os._exit(0)


if __name__ == "__main__":
    main()
