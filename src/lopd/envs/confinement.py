"""Confinement: how one untrusted child runs, for :mod:`lopd.envs.sandbox`.

* **Isolation** (:func:`isolation`, :func:`check_isolation`): bubblewrap with its namespaces, the
  seccomp filter (:data:`DENIED_SYSCALLS`, built by libseccomp), a read-only view of the
  interpreter, its standard library and the shared libraries they load (:func:`shared_libraries`),
  a size-bounded private ``/tmp``; or, where bubblewrap cannot isolate and the user opted in
  (:func:`allow_unsafe_fallback`), the harness's own weaker confinement with the same filter.
* **Limits** (:class:`Limits`): time per call and per run, address space, tmpfs, files, output;
  :attr:`Limits.host_mb` is what one run can hold of the host's memory.
* **One child** (:func:`spawn`): started with the job on stdin, its output going to a memory
  file read once at the end, its channel read record by record against a protocol whose
  deadlines the parent enforces (a call past its time is killed from outside), then killed.

What the child computes is judged in :mod:`lopd.envs.sandbox`; the child's own side is
:mod:`lopd.envs.sandbox_harness`.
"""

from __future__ import annotations

import errno
import functools
import json
import os
import re
import selectors
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from lopd.envs import sandbox_harness as harness

HARNESS = Path(harness.__file__)


CHANNEL_BYTES = harness.RUN_VALUE_BYTES + (1 << 20)
"""The most the parent reads from one child's channel (the values' budget and the records around
them); past it, the calls not yet reported are malformed."""




START_SECONDS = 5.0
"""What starting bubblewrap and the interpreter may take before the program's load is timed."""


GRACE = 0.5
"""How far past ``test_seconds`` a call may run before the parent kills it (the child's own alarm
comes first for any program that leaves it alone)."""


INSTALL = "apt-get install bubblewrap (Debian/Ubuntu; `make` does it as root)"


INSTALL_SECCOMP = ("the seccomp library is missing: apt-get install libseccomp2 (Debian/Ubuntu) "
                   "and pip install pyseccomp")


class SandboxUnavailable(RuntimeError):
    """Untrusted code cannot be isolated on this machine and the weaker mode was not chosen."""


@dataclass(frozen=True)
class Limits:
    wall_seconds: float = 20.0
    """The whole run, start-up and restarts included."""
    test_seconds: float = 4.0
    """Loading the program, and each call."""
    cpu_seconds: int = 20
    memory_mb: int = 1024
    """Address space of the child (RLIMIT_AS)."""
    tmpfs_mb: int = 64
    """The private ``/tmp`` (the work directory): host memory, so part of the run's budget."""
    file_size_mb: int = 8
    """The largest file the child may write, what it prints included."""
    output_bytes: int = 16_384
    """What the program prints (stdout and stderr together) is kept up to this many bytes."""
    max_open_files: int = 64

    def __post_init__(self):
        for key, value in asdict(self).items():
            if value <= 0:
                raise ValueError(f"sandbox limit {key} must be > 0, got {value}")

    @property
    def host_mb(self) -> int:
        """The most host memory one run can hold: its address space, its tmpfs and the memory
        file its output goes to."""
        return self.memory_mb + self.tmpfs_mb + self.file_size_mb


# ----------------------------------------------------------------------------------------------
# Isolation


_UNSAFE = {"allowed": False}


def allow_unsafe_fallback(allowed: bool) -> None:
    """Let :func:`run` use the harness's own, weaker confinement where bubblewrap cannot isolate
    (``env.unsafe_sandbox_without_bubblewrap``). Off by default."""
    _UNSAFE["allowed"] = bool(allowed)


DENIED_SYSCALLS = (
    # New namespaces: a user namespace gives full capabilities inside it, over mounts among others.
    "unshare", "setns", "clone", "clone3", "fork", "vfork",
    # Kernel keyrings outlive the process (one run could leave a key for the next).
    "keyctl", "add_key", "request_key",
    # Large kernel attack surfaces no pure-Python answer needs.
    "bpf", "perf_event_open", "io_uring_setup", "io_uring_enter", "io_uring_register",
    "userfaultfd", "ptrace", "process_vm_readv", "process_vm_writev", "kcmp", "pidfd_getfd",
    "pidfd_open", "personality", "syslog", "lookup_dcookie", "fanotify_init", "quotactl",
    "quotactl_fd", "acct", "uselib", "ustat", "sysfs", "vhangup", "iopl", "ioperm",
    "open_by_handle_at", "name_to_handle_at",
    # Filesystems and mounts.
    "mount", "umount2", "pivot_root", "chroot", "mount_setattr", "move_mount", "open_tree",
    "fsopen", "fsconfig", "fsmount", "fspick",
    # The machine itself.
    "init_module", "finit_module", "delete_module", "kexec_load", "kexec_file_load", "reboot",
    "swapon", "swapoff", "settimeofday", "clock_settime", "clock_adjtime", "adjtimex",
    "sethostname", "setdomainname", "mbind", "set_mempolicy", "migrate_pages", "move_pages",
    # Memory outside the address-space limit: memory files and SysV IPC objects hold pages that
    # RLIMIT_AS does not count until mapped.
    "memfd_create", "memfd_secret", "shmget", "shmat", "shmctl", "shmdt", "msgget", "msgsnd",
    "msgrcv", "msgctl", "semget", "semop", "semtimedop", "semctl", "mq_open", "mq_unlink",
    "mq_timedsend", "mq_timedreceive", "mq_notify", "mq_getsetattr")
"""The system calls a sandboxed process gets ``EPERM`` for (``clone3``: ``ENOSYS``, as Docker
does, so that a C library falls back to ``clone``, which is denied). A deny-list in the style of
Docker's and nsjail's profiles, on top of ``nobody``'s missing capabilities and the resource
limits: an allow-list would have to follow every interpreter's start-up, and this list closes
what the hostile corpus reached. Calls of other architectures (i386, x32) are killed."""


@functools.lru_cache(maxsize=1)
def seccomp_program() -> bytes:
    """The BPF program of the filter, built by libseccomp (through ``pyseccomp``)."""
    try:
        import pyseccomp as seccomp
    except (ImportError, OSError, AttributeError) as exc:
        raise SandboxUnavailable(f"untrusted code is not run: {INSTALL_SECCOMP} ({exc})") from None
    denied = seccomp.SyscallFilter(seccomp.ALLOW)
    for name in DENIED_SYSCALLS:
        action = seccomp.ERRNO(errno.ENOSYS if name == "clone3" else errno.EPERM)
        try:
            denied.add_rule(action, name)
        except (OSError, ValueError, RuntimeError):
            pass  # a call this architecture or libseccomp version does not have
    with tempfile.TemporaryFile() as handle:
        denied.export_bpf(handle)
        handle.seek(0)
        return handle.read()


def _filter_fd() -> int:
    """A pipe's read end holding the filter, for bubblewrap's ``--seccomp FD``."""
    program = seccomp_program()
    read_fd, write_fd = os.pipe()
    try:
        os.write(write_fd, program)  # a few hundred bytes: the pipe's buffer holds them
    finally:
        os.close(write_fd)
    return read_fd


_LDD = re.compile(r"(?:=>\s*)?(/\S+)\s+\(0x[0-9a-f]+\)")


def shared_libraries(files: list[str]) -> list[str]:
    """Every shared library the given executables and extension modules load (``ldd``), as the
    paths the loader looks them up by."""
    ldd = shutil.which("ldd")
    if ldd is None:
        raise SandboxUnavailable("untrusted code is not run: ldd is missing (it names the shared "
                                 "libraries the sandbox binds): apt-get install libc-bin")
    found: set[str] = set()
    for start in range(0, len(files), 64):
        done = subprocess.run([ldd, *files[start:start + 64]], capture_output=True, text=True,
                              env={"LC_ALL": "C", "PATH": "/usr/bin:/bin"})
        found.update(_LDD.findall(done.stdout))
    return sorted(path for path in found if os.path.exists(path))


def _binds() -> list[str]:
    """bubblewrap's read-only view: the interpreter, its standard library without
    ``site-packages``, and the shared libraries they load (each at the path the loader uses,
    holding the file it resolves to). Every directory above a bound path is created
    world-readable, so the child's unprivileged user can reach what is bound (``/root`` itself
    is not)."""
    python = os.path.realpath(sys.executable)
    stdlib = sysconfig.get_paths()["stdlib"]
    dynload = Path(sysconfig.get_config_var("DESTSHARED") or Path(stdlib) / "lib-dynload")
    modules = sorted(str(p) for p in dynload.glob("*.so")) if dynload.is_dir() else []
    libraries = [lib for lib in shared_libraries([python, *modules])
                 if not os.path.realpath(lib).startswith(stdlib + os.sep)]
    # The loader finds libraries through /lib, /lib64 and /usr/lib: keep the system's symlinks
    # between them (merged /usr), so a library is where both its names lead.
    links, made, args = [], set(), []
    for top in ("/lib", "/lib64"):
        if Path(top).is_symlink():
            links += ["--symlink", os.readlink(top), top]
            made.add(top)
    targets = {}
    for lib in libraries:
        at = os.path.join(os.path.realpath(os.path.dirname(lib)), os.path.basename(lib))
        targets[at] = os.path.realpath(lib)
    paths = [python, stdlib, *targets, HARNESS_IN_SANDBOX]
    for path in paths:
        for parent in reversed(Path(path).parents[:-1]):
            if str(parent) not in made:
                made.add(str(parent))
                args += ["--perms", "0755", "--dir", str(parent)]
    args += ["--ro-bind", python, python, "--ro-bind", stdlib, stdlib]
    for at, real in targets.items():
        args += ["--ro-bind", real, at]
    for hidden in (Path(stdlib) / "site-packages", Path(stdlib) / "dist-packages"):
        if hidden.is_dir():
            args += ["--tmpfs", str(hidden), "--remount-ro", str(hidden)]
    return args + links


WORKDIR = "/tmp/work"
"""The child's work directory: a private tmpfs."""


HARNESS_IN_SANDBOX = "/lopd/sandbox_harness.py"


@functools.lru_cache(maxsize=2)
def _bwrap_prefix(bwrap: str) -> tuple[str, ...]:
    """The bubblewrap command up to the per-run parts (the same for every child, so made once).

    As root, the namespaces are made without a user namespace and the harness drops to
    ``nobody`` itself: mapped into a user namespace, root would stay the host's root, whom the
    process limit does not bind. As another user, ``--unshare-all`` includes a user namespace,
    and ``--disable-userns`` keeps the program from making another."""
    if os.geteuid() == 0:
        namespaces = ["--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts",
                      "--unshare-cgroup-try"]
    else:
        namespaces = ["--unshare-all", "--unshare-user", "--disable-userns"]
    return (bwrap, *namespaces, "--die-with-parent", "--new-session", *_binds(),
            "--ro-bind", str(HARNESS), HARNESS_IN_SANDBOX, "--proc", "/proc", "--dev", "/dev",
            "--remount-ro", "/dev")


def _bwrap_command(bwrap: str, limits: Limits, filter_fd: int) -> list[str]:
    # /dev, the root and everything bound are read-only; the only writable place is the
    # size-bounded /tmp, so what a run writes counts against its budget and dies with it.
    return [*_bwrap_prefix(bwrap), "--perms", "1777", "--size", str(limits.tmpfs_mb << 20),
            "--tmpfs", "/tmp", "--perms", "1777", "--dir", WORKDIR, "--remount-ro", "/",
            "--chdir", WORKDIR, "--clearenv", "--setenv", "LC_ALL", "C.UTF-8",
            "--seccomp", str(filter_fd)]


@functools.lru_cache(maxsize=1)
def isolation() -> tuple[str | None, str]:
    """(bubblewrap's path, "") when it can isolate a child here, else (None, why not)."""
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        return None, f"bubblewrap (bwrap) is not installed; install it with {INSTALL}"
    try:
        filter_fd = _filter_fd()
    except SandboxUnavailable as exc:
        return None, str(exc).removeprefix("untrusted code is not run: ")
    try:
        done = subprocess.run([*_bwrap_command(bwrap, Limits(), filter_fd),
                               os.path.realpath(sys.executable), "-I", "-S", "-c", "pass"],
                              capture_output=True, timeout=30, pass_fds=(filter_fd,))
    except (OSError, subprocess.TimeoutExpired) as exc:
        return None, f"bubblewrap could not start a sandbox: {exc}"
    finally:
        os.close(filter_fd)
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
# One child: started, followed record by record, killed


@dataclass
class _Child:
    status: str
    output: bytes
    truncated: bool
    exit_code: int | None
    seconds: float
    reason: str = ""


class _Protocol:
    """What the parent expects on one child's channel: ``feed`` takes each record (False: not
    the protocol), ``deadline`` is when the next record must have come, ``finished`` says when
    nothing more is expected."""

    finished = False

    def feed(self, record: dict) -> bool:
        raise NotImplementedError

    def deadline(self) -> float:
        raise NotImplementedError


class Single(_Protocol):
    """One record within the run's wall clock (a trusted replay)."""

    def __init__(self, end: float):
        self.end, self.record = end, None

    def feed(self, record: dict) -> bool:
        self.record, self.finished = record, True
        return True

    def deadline(self) -> float:
        return self.end


class Calls(_Protocol):
    """``{"ready": load_error, ...}``, then per call ``{"begin": i}`` and ``{"i": i, "value" |
    "error": ...}``, in order, for calls ``first`` .. ``count - 1``. Each call (and the load) is
    timed from its ``begin``: ``limit`` seconds, then the parent kills the child."""

    def __init__(self, first: int, count: int, limit: float, end: float,
                 expect_ready: bool = True):
        self.next, self.count, self.limit, self.end = first, count, limit, end
        self.results: dict[int, dict] = {}
        self.expect_ready = expect_ready
        self.ready = not expect_ready
        self.load_error = ""
        self.network = None
        self.running: int | None = None
        self.started = time.monotonic()
        self.finished = first >= count

    def feed(self, record: dict) -> bool:
        if not self.ready:
            error = record.get("ready")
            if type(error) is not str or len(error) > 200:
                return False
            self.ready, self.load_error, self.network = True, error, record.get("network")
            self.started = time.monotonic()
            self.finished = self.finished or bool(error)
            return True
        if self.running is None:
            if record != {"begin": self.next}:
                return False
            self.running, self.started = self.next, time.monotonic()
            return True
        if record.get("i") != self.running or not self._result(record):
            return False
        self.results[self.running] = record
        self.next, self.running = self.running + 1, None
        self.finished = self.next >= self.count
        return True

    def _result(self, record: dict) -> bool:
        if not self.expect_ready:  # a trusted recording: its own fields, checked by the caller
            return True
        return len(record) == 2 and ("value" in record or type(record.get("error")) is str)

    def deadline(self) -> float:
        if self.running is None:
            # Before the ready record: starting and loading the program. Between calls the
            # harness only resets builtins and writes, so a child that stalls there is given no
            # more than that.
            return min(self.end, self.started + START_SECONDS + self.limit)
        return min(self.end, self.started + self.limit)


def _kill(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.kill()


def parse_record(data: bytes) -> tuple[dict | None, str]:
    """One record of the channel (a JSON object on one line, without its newline) or (None, why
    not); never raises."""
    try:
        record = json.loads(data.decode("utf-8"))
    except (ValueError, RecursionError, MemoryError, UnicodeError):
        return None, "channel content is not a JSON record"
    if type(record) is not dict:
        return None, "the record is not an object"
    return record, ""


def _output_file() -> int:
    """A memory file for the child's stdout and stderr: the parent reads its start once, after
    the run, so no amount of printing costs the parent anything (its size is bounded by the
    child's file-size limit)."""
    try:
        return os.memfd_create("lopd-sandbox-output", os.MFD_CLOEXEC)
    except (AttributeError, OSError):
        handle, path = tempfile.mkstemp(prefix="lopd-sandbox-output-")
        os.unlink(path)
        return handle


def spawn(job: dict, limits: Limits, protocol: _Protocol) -> _Child:
    isolation_kind = check_isolation()
    fallback = isolation_kind != "bubblewrap"
    job = {**job, "fallback": fallback, "drop": os.geteuid() == 0}
    if fallback:
        try:
            job["filter"] = seccomp_program().hex()
        except SandboxUnavailable:
            job["filter"] = ""
    read_fd, write_fd = os.pipe()
    output_fd = _output_file()
    filter_fd = -1
    workdir = tempfile.mkdtemp(prefix="lopd-sandbox-") if fallback else None
    python = os.path.realpath(sys.executable)
    args = [json.dumps(asdict(limits)), str(write_fd)]
    if fallback:
        command = [python, "-I", "-S", "-B", "-u", str(HARNESS), *args]
        pass_fds = (write_fd,)
    else:
        filter_fd = _filter_fd()
        command = [*_bwrap_command(isolation()[0], limits, filter_fd), python, "-I", "-S", "-B",
                   "-u", HARNESS_IN_SANDBOX, *args]
        pass_fds = (write_fd, filter_fd)
    start = time.monotonic()
    try:
        proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=output_fd,
                                stderr=output_fd, cwd=workdir or "/",
                                env={"PATH": "/usr/bin:/bin", "LC_ALL": "C.UTF-8"},
                                pass_fds=pass_fds, start_new_session=True)
        os.close(write_fd)
        write_fd = -1
        try:
            proc.stdin.write(json.dumps(job).encode())
            proc.stdin.close()
        except BrokenPipeError:
            pass
        status, reason = _follow(proc, read_fd, protocol)
        exit_code = proc.returncode
        output = os.pread(output_fd, limits.output_bytes + 1, 0)
    finally:
        for fd in (write_fd, read_fd, output_fd, filter_fd):
            if fd >= 0:
                os.close(fd)
        if workdir:
            shutil.rmtree(workdir, ignore_errors=True)
    if status == "completed" and not protocol.finished:
        status = "killed" if exit_code is not None and exit_code < 0 else "no_result"
    return _Child(status, output[:limits.output_bytes], len(output) > limits.output_bytes,
                  exit_code, time.monotonic() - start, reason)


def _follow(proc: subprocess.Popen, channel_fd: int, protocol: _Protocol) -> tuple[str, str]:
    """Read the channel record by record until the protocol is done, the child closes it, a
    deadline passes ("timeout") or it breaks the protocol ("malformed"). The child is dead when
    this returns."""
    pending, total = bytearray(), 0
    status, reason = "completed", ""
    with selectors.DefaultSelector() as selector:
        selector.register(channel_fd, selectors.EVENT_READ)
        while not protocol.finished and status == "completed":
            left = protocol.deadline() - time.monotonic()
            # What the child wrote before its deadline is read even when the parent is late;
            # after that, only a whole record that moves the deadline on keeps the child alive.
            if not selector.select(timeout=min(max(left, 0.0), 0.5)):
                if left <= 0:
                    status = "timeout"
                continue
            chunk = os.read(channel_fd, 65536)
            if not chunk:
                break
            total += len(chunk)
            if total > CHANNEL_BYTES:
                status, reason = "malformed", "channel over its size limit"
                break
            pending += chunk
            if b"\n" not in chunk:
                continue
            *lines, rest = bytes(pending).split(b"\n")
            pending = bytearray(rest)
            for line in lines:
                record, why = parse_record(line)
                if record is None or not protocol.feed(record):
                    status, reason = "malformed", why or "a record out of the protocol"
                if protocol.finished or status != "completed":
                    break
            if status == "completed" and not protocol.finished \
                    and time.monotonic() > protocol.deadline():
                status = "timeout"
    if status == "completed" and protocol.finished:
        # Done: the child only has to exit; give it a moment, then make sure.
        try:
            proc.wait(timeout=2.0)
        except subprocess.TimeoutExpired:
            pass
    _kill(proc)
    proc.wait()
    return status, reason


def memory_workers(limits: Limits) -> int:
    """How many runs fit the host's available memory at once, each at its full budget."""
    try:
        with open("/proc/meminfo") as handle:
            info = dict(line.split(":", 1) for line in handle)
        available_mb = int(info["MemAvailable"].split()[0]) // 1024
    except (OSError, KeyError, ValueError):
        return os.cpu_count() or 1
    return max(1, available_mb // limits.host_mb)
