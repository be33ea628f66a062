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
import collections
import itertools
import json
import math
import os
import resource
import signal
import sys

MAX_DEPTH = 64
MAX_NODES = 200_000
MAX_BYTES = 1 << 20
"""The most one value's JSON may take."""
RUN_VALUE_BYTES = 4 << 20
"""The most all of a run's values may take together: a call whose value would pass it fails
(``unencodable:over the run's value budget``), the calls before it keep their values."""
TAGS = ("tuple", "dict", "set", "frozenset", "bytes", "complex", "float", "iter")
DICT_TYPES = (dict, collections.Counter, collections.OrderedDict, collections.defaultdict)
"""The standard library's dicts, sent as dicts (``Counter({"a": 1}) == {"a": 1}`` in Python)."""
_EMPTY = {}
ITERATOR_TYPES = frozenset({
    type(iter([])), type(reversed([])), type(iter(())), type(iter(set())), type(iter("")),
    type(iter("\u00e9")), type(iter(range(1))), type(iter(range(1 << 70))),
    type(iter(_EMPTY)), type(iter(_EMPTY.values())), type(iter(_EMPTY.items())),
    type(reversed(_EMPTY)), type(reversed(_EMPTY.values())), type(reversed(_EMPTY.items())),
    type(iter(b"")), type(iter(bytearray())), map, filter, zip, enumerate, reversed,
    type(x for x in ()), *(getattr(itertools, name) for name in (
        "accumulate", "chain", "combinations", "combinations_with_replacement", "compress",
        "count", "cycle", "dropwhile", "filterfalse", "islice", "pairwise", "permutations",
        "product", "repeat", "starmap", "takewhile", "zip_longest"))})
"""Iterators of the interpreter and the standard library (exact types): materialised, within
the element budget, and handed to a check as an iterator over the same items — so
``tuple(candidate(x))`` works as with the official harness, while ``candidate(x) == [..]`` stays
false, as it is in Python."""


class Unencodable(ValueError):
    """A value that is not plain data (its type, or its size)."""


def encode(value, depth: int = 0, budget: list | None = None):
    """``value`` as JSON-able plain data; raises :class:`Unencodable`.

    Only exact builtin types (and the standard library's dict and iterator types above) are
    plain data: a subclass of ``int`` that claims to equal everything is refused."""
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
    if kind in DICT_TYPES:
        return {"$": "dict", "v": [[encode(k, depth + 1, budget), encode(v, depth + 1, budget)]
                                   for k, v in dict.items(value)]}
    if kind is set or kind is frozenset:
        items = [encode(v, depth + 1, budget) for v in value]
        items.sort(key=lambda item: json.dumps(item, sort_keys=True))
        return {"$": kind.__name__, "v": items}
    if kind is bytes:
        return {"$": "bytes", "v": value.hex()}
    if kind is complex:
        return {"$": "complex", "v": [encode(value.real, depth + 1, budget),
                                      encode(value.imag, depth + 1, budget)]}
    if kind in ITERATOR_TYPES:
        # The budget bounds an endless iterator (itertools.count) as it bounds a long list.
        return {"$": "iter", "v": [encode(v, depth + 1, budget) for v in value]}
    raise Unencodable(f"not plain data: {kind.__name__}")


def dumps(value) -> str:
    """The JSON text of ``encode(value)``, refused past :data:`MAX_BYTES`."""
    text = json.dumps(encode(value), allow_nan=False)
    if len(text) > MAX_BYTES:
        raise Unencodable("too large")
    return text


def decode(data, depth: int = 0):
    """Plain data back to its Python value; ``ValueError`` on anything not made by
    :func:`encode` (unknown tags, wrong shapes, too deep).

    Only trusted children decode (a ``check`` needs real values): building a set or dict from
    untrusted keys can cost quadratic time (keys that all hash alike), which a child's time limit
    bounds and the parent must never pay (the parent compares :func:`canonical` texts)."""
    if depth > MAX_DEPTH + 2:
        raise ValueError("nested too deeply")
    kind = type(data)
    if data is None or kind is bool or kind is int or kind is str:
        return data
    if kind is float:
        return data
    if kind is list:
        return [decode(v, depth + 1) for v in data]
    tag, body = _tagged(data)
    if tag == "float":
        return float(body)
    if tag == "bytes":
        return bytes.fromhex(body)
    if tag == "dict":
        return {decode(k, depth + 1): decode(v, depth + 1) for k, v in body}
    items = [decode(v, depth + 1) for v in body]
    if tag == "complex":
        return complex(*items)
    return {"tuple": tuple, "set": set, "frozenset": frozenset, "iter": iter}[tag](items)


def _tagged(data) -> tuple[str, object]:
    """(tag, body) of a tagged object, its shape checked; ``ValueError`` otherwise."""
    if type(data) is not dict or len(data) != 2 or "$" not in data or "v" not in data \
            or data["$"] not in TAGS:
        raise ValueError("not plain data")
    tag, body = data["$"], data["v"]
    if tag == "float":
        ok = body in ("nan", "inf", "-inf")
    elif tag == "bytes":
        ok = type(body) is str and len(body) % 2 == 0
    elif tag == "dict":
        ok = type(body) is list and all(type(p) is list and len(p) == 2 for p in body)
    elif tag == "complex":
        ok = type(body) is list and len(body) == 2 and all(type(x) in (int, float) for x in body)
    else:
        ok = type(body) is list
    if not ok:
        raise ValueError("not plain data")
    return tag, body


def _number(value) -> str | None:
    """The canonical text of a number, or None when ``value`` is not one. Numbers compare by
    value, as in Python (``21.0 == 21``, ``complex(3, 0) == 3``); ``bool`` is not a number here,
    so ``True`` never passes for ``1``."""
    kind = type(value)
    if kind is int:
        return f"n{value}"
    if kind is float:
        if value != value:
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return f"n{int(value)}" if value.is_integer() else f"n{value!r}"
    return None


def canonical(data, depth: int = 0) -> str:
    """The text two plain data values (as :func:`encode` makes them) are compared by: equal texts
    exactly when the values are equal under Python's ``==`` for these types, except that ``bool``
    equals only ``bool`` and NaN equals NaN. Sets and dicts are compared as sorted texts, so no hash
    table is built from untrusted keys and the work is bounded by the data's size and depth;
    ``ValueError`` on anything :func:`encode` does not make.

    A list never equals a tuple or an iterator; a set equals a frozenset; every standard-library
    dict is a dict."""
    if depth > MAX_DEPTH + 2:
        raise ValueError("nested too deeply")
    kind = type(data)
    if data is None:
        return "N"
    if kind is bool:
        return "T" if data else "F"
    number = _number(data)
    if number is not None:
        return number
    if kind is str:
        return "s" + json.dumps(data)
    if kind is list:
        return "[" + ",".join(canonical(v, depth + 1) for v in data) + "]"
    tag, body = _tagged(data)
    if tag == "float":
        return _number(float(body))
    if tag == "bytes":
        bytes.fromhex(body)
        return "b" + body.lower()
    if tag == "complex":
        real, imag = body
        if _number(imag) == "n0":
            return _number(real)
        return f"c{_number(real)},{_number(imag)}"
    if tag == "dict":
        pairs = sorted(canonical(k, depth + 1) + ":" + canonical(v, depth + 1) for k, v in body)
        return "<" + ",".join(pairs) + ">"
    items = [canonical(v, depth + 1) for v in body]
    if tag in ("set", "frozenset"):
        return "{" + ",".join(sorted(items)) + "}"
    return ("(" if tag == "tuple" else "iter(") + ",".join(items) + ")"


def literal(data, limit: int = 200) -> str:
    """``data`` written as the Python literal of its value, cut after ``limit`` characters (for
    feedback and reports; never decoded, so it costs the parent no hash tables)."""
    parts: list[str] = []
    size = [0]

    def put(text: str) -> None:
        parts.append(text)
        size[0] += len(text)
        if size[0] > limit:
            raise StopIteration

    def walk(node, depth: int) -> None:
        if depth > MAX_DEPTH + 2:
            raise ValueError("nested too deeply")
        kind = type(node)
        if node is None or kind in (bool, int, float, str):
            put(repr(node))
            return
        if kind is list:
            opening, items, closing = "[", node, "]"
        else:
            tag, body = _tagged(node)
            if tag == "float":
                put(f"float({body!r})")
                return
            if tag == "bytes":
                put(repr(bytes.fromhex(body[:2 * limit])))
                return
            if tag == "complex":
                put(repr(complex(*body)))
                return
            if tag == "dict":
                put("{")
                for i, (k, v) in enumerate(body):
                    put(", " if i else "")
                    walk(k, depth + 1)
                    put(": ")
                    walk(v, depth + 1)
                put("}")
                return
            opening, closing = {"tuple": ("(", ")"), "set": ("{", "}"), "frozenset": (
                "frozenset({", "})"), "iter": ("iter([", "])")}[tag]
            items = body
            if tag == "tuple" and len(body) == 1:
                closing = ",)"
            if tag in ("set", "frozenset") and not body:
                put("set()" if tag == "set" else "frozenset()")
                return
        put(opening)
        for i, item in enumerate(items):
            put(", " if i else "")
            walk(item, depth + 1)
        put(closing)

    try:
        walk(data, 0)
    except StopIteration:
        return "".join(parts)[:limit] + "..."
    return "".join(parts)


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


def fallback_confine(workdir: str, program: bytes = b"") -> str:
    """The weaker mode's own confinement, with the seccomp filter ``program`` when given;
    returns "isolated" or "shared" (the network)."""
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
    if program:
        load_filter(program)
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


def load_filter(program: bytes) -> None:
    """Install a seccomp BPF program on this process (the fallback mode; under bubblewrap,
    bubblewrap installs it before the interpreter starts)."""
    import ctypes

    class SockFprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    buffer = ctypes.create_string_buffer(program, len(program))
    fprog = SockFprog(len(program) // 8, ctypes.cast(buffer, ctypes.c_void_p))
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(38, 1, 0, 0, 0) != 0 or libc.prctl(22, 2, ctypes.byref(fprog), 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "the seccomp filter could not be installed")


def main() -> None:
    limits = json.loads(sys.argv[1])
    out_fd, workdir = int(sys.argv[2]), os.getcwd()
    job = json.loads(sys.stdin.buffer.read())
    set_limits(limits)
    if job.get("fallback"):
        network = fallback_confine(workdir, bytes.fromhex(job.get("filter") or ""))
    else:
        network = "isolated"
        if job.get("drop") and os.geteuid() == 0:
            drop_to_nobody(workdir)
    sys.modules.pop("resource", None)  # in the fallback, the hook refuses to import it again
    setitimer, set_handler, ITIMER_REAL = signal.setitimer, signal.signal, signal.ITIMER_REAL
    call_seconds = float(limits["test_seconds"])
    write, dumps_json, dumps_value = os.write, json.dumps, dumps

    def on_alarm(signum, frame):
        raise TestTimeout()

    # The alarm is the cheap way out of a slow call: the run goes on with the next call. A
    # program can remove it (or catch what it raises); then the parent, which times every call
    # from outside, kills the process and starts a new one for the calls left.
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

    def send_line(text: str) -> None:
        data = (text + "\n").encode()
        while data:
            data = data[write(out_fd, data):]

    def send(record: dict) -> None:
        send_line(dumps_json(record))

    clean_builtins = dict(builtins.__dict__)
    mode = job["mode"]
    if mode == "record":
        # Trusted: each problem's reference solution and official check, one line per problem.
        import random

        for i, problem in enumerate(job["problems"], start=job.get("first", 0)):
            random.seed(0)
            send({"begin": i})
            send({"i": i, **record_calls(problem, timed, error_name)})
        os._exit(0)
    namespace = {"__name__": "__candidate__", "__builtins__": builtins}
    if mode != "candidate":
        import random

        random.seed(job.get("seed", 0))
    try:
        timed(exec, compile(job["program"], "<program>", "exec"), namespace)
        load_error = ""
    except BaseException as exc:  # noqa: BLE001 - the program's failure, whatever it is
        load_error = "load:" + error_name(exc)
    if mode == "candidate":
        send({"ready": load_error, "network": network})
        if load_error:
            os._exit(0)
        spent = 0
        for i, call in enumerate(job["calls"], start=job.get("first", 0)):
            builtins.__dict__.clear()
            builtins.__dict__.update(clean_builtins)
            send({"begin": i})
            try:
                if "expr" in call:
                    code = compile(call["expr"], "<test>", "eval")
                    # Encoding is timed with the call: it runs the program's own generators.
                    text = timed(lambda: dumps_value(eval(code, namespace)))
                else:
                    fn = namespace[call["fn"]]
                    args, kwargs = decode(call["args"]), decode(call["kwargs"])
                    text = timed(lambda: dumps_value(fn(*args, **kwargs)))
                if spent + len(text) > RUN_VALUE_BYTES:
                    raise Unencodable("over the run's value budget")
            except Unencodable as exc:
                send({"i": i, "error": f"unencodable:{exc}"})
                continue
            except BaseException as exc:  # noqa: BLE001
                send({"i": i, "error": error_name(exc)})
                continue
            spent += len(text)
            # The value's JSON goes into the record as it is: serialised once.
            send_line(f'{{"i": {i}, "value": {text}}}')
        builtins.__dict__.clear()
        builtins.__dict__.update(clean_builtins)
    elif mode == "replay":
        recorded = [dumps_json({"args": c["args"], "kwargs": c["kwargs"]}, sort_keys=True)
                    for c in job["calls"]]
        outputs, used = job["outputs"], set()

        def replayer(*args, **kwargs):
            key = dumps_json({"args": encode(list(args)), "kwargs": encode(kwargs)},
                             sort_keys=True)
            for i in [len(used), *range(len(recorded))]:
                if i < len(recorded) and i not in used and recorded[i] == key:
                    used.add(i)
                    result = outputs[i]
                    if "error" in result:
                        raise RuntimeError(f"the candidate raised {result['error']}")
                    return decode(result["value"])
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


def record_calls(problem: dict, timed, error_name) -> dict:
    """Run a reference ``program`` and its ``check`` with the entry point replaced by a recorder
    of every call's arguments (encoded before the call) and output."""
    namespace = {"__name__": "__candidate__", "__builtins__": builtins}
    calls = []
    try:
        timed(exec, compile(problem["program"], "<program>", "exec"), namespace)
    except BaseException as exc:  # noqa: BLE001
        return {"calls": [], "passed": False, "error": "load:" + error_name(exc)}
    reference = namespace.get(problem["entry_point"])

    def recorder(*args, **kwargs):
        entry = {"args": encode(list(args)), "kwargs": encode(kwargs)}
        out = reference(*args, **kwargs)
        if type(out) in ITERATOR_TYPES:  # recorded without using up what check will read
            items = list(out)
            entry["out"] = encode(iter(items))
            out = iter(items)
        else:
            entry["out"] = encode(out)
        calls.append(entry)
        return out

    try:
        exec(compile(problem["check"], "<check>", "exec"), namespace)
        timed(namespace["check"], recorder)
        return {"calls": calls, "passed": True}
    except BaseException as exc:  # noqa: BLE001
        return {"calls": calls, "passed": False, "error": error_name(exc)}


if __name__ == "__main__":
    main()
