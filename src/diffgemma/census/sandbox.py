"""Run an untrusted generated program (Python or bash) so that a hanging or hostile one is a failed run, never
a wedged machine or a touched file outside its directory.

Each run gets a fresh temporary directory (its cwd, HOME and TMPDIR; removed afterwards), an environment of
PATH, HOME and TMPDIR only (and the LC_CTYPE=C.UTF-8 that Python's locale coercion adds), stdin from an
unlinked file, stdout and stderr captured up to OUTPUT_CAP bytes each (past the cap the process group is
killed and the output flagged as truncated), and a hard wall timeout that SIGKILLs the whole process group.
The program is not started from this process with a `preexec_fn` (unsafe here: the caller holds torch's
threads, and a forked child running Python code can deadlock on a lock one of them held); instead this file
runs as a script in a fresh single-threaded `python -I -S -B` (the launcher), which isolates itself and then
execs the program. Its layers, each recorded in RunResult.isolation when it holds:

- "uid": run as root (as in our containers), the launcher drops to a fresh uid drawn per run from [UID_BASE,
  UID_BASE + UID_SPAN), no groups, owning only the run's directory. RLIMIT_NPROC counts processes per uid, so
  a fresh uid makes the limit count this run's processes alone (the root's own count is in the hundreds and
  shared with every other job on the machine), and after the run a reaper of that uid kills every process it
  left (`kill(-1)` as that uid, which also catches a child that left the process group).
- "network": an empty network namespace (only a down loopback: even 127.0.0.1 is unreachable).
- "filesystem": a private mount namespace in which the run's directory is a fresh tmpfs of WORKSPACE_BYTES
  (what the program writes is bounded, and goes with the namespace) and every other mount is read-only, so the
  world-writable /tmp, /var/tmp and /dev/shm are closed too. When the interpreter lies under a directory other
  users may not enter (a pyenv under /root), that directory is covered by a tmpfs holding only a bind of the
  interpreter's prefix: the program sees the interpreter, not the rest of /root.
As root the namespaces are made with the launcher's own capabilities before it drops the uid; otherwise (or
when that is refused) it creates a user namespace mapping only its own uid and makes them inside it. A layer
the platform refuses is left out and its reason is in RunResult.detail: without "uid" (not root) RLIMIT_NPROC
is set relative to the processes this user already runs, only the process group is killed afterwards, and the
program may signal this user's other processes (a pid namespace would stop that: not built, root has the fresh
uid); without "filesystem" the run's directory is on the disk (files of FILE_BYTES at most, but not their
number).

Resource limits (setrlimit in the launcher, inherited by the program): CPU seconds (the timeout rounded up,
plus one), address space MEMORY_BYTES, file size FILE_BYTES, PROCESSES processes, OPEN_FILES descriptors, no
core files; the program runs at nice 10 with no_new_privs (no setuid binary gives privileges back) and a
parent-death SIGKILL. Memory is per process: the worst a forking program can hold is PROCESSES x MEMORY_BYTES
(8 GiB). Orphaned zombies are reaped by the machine's init, whenever it gets to them."""

from __future__ import annotations

import contextlib
import ctypes
import json
import math
import os
import random
import resource
import selectors
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

OUTPUT_CAP = 1 << 20  # bytes kept of stdout and of stderr
MEMORY_BYTES = 512 << 20  # RLIMIT_AS per process
FILE_BYTES = 1 << 20  # RLIMIT_FSIZE: the largest file a program may write
PROCESSES = 16  # RLIMIT_NPROC: processes (and threads) of the run
OPEN_FILES = 64  # RLIMIT_NOFILE
WORKSPACE_BYTES = 16 << 20  # the tmpfs the run's directory is, where a mount namespace is allowed
_WORKSPACE_FILES = 1024  # its inodes
UID_BASE, UID_SPAN = 1_600_000_000, 100_000_000  # fresh uids: far above any real account, below 2**31
PATH = "/usr/local/bin:/usr/bin:/bin"
LANGUAGES = ("python", "bash")
_GRACE_S = 0.2  # after the program exits, how long its leftover children may hold the pipes open
_SETUP_FAILED = 125  # the launcher's exit code when it could not isolate the program (then nothing ran)


@dataclass(frozen=True)
class RunResult:
    """One run: status "ok" (the program exited by itself, with exit_code), "timeout" (killed at the wall
    timeout), "killed" (a signal: a resource limit, or the output cap), or "error" (the sandbox could not run
    it). `isolation` names the layers the run had ("uid", "network", "filesystem"; see the module)."""

    status: str
    exit_code: int | None
    stdout: str
    stderr: str
    detail: str
    isolation: tuple[str, ...] = ()


def run_program(
    source: str, language: str, args: Sequence[str] = (), stdin: str = "", timeout_s: float = 10.0
) -> RunResult:
    """Run `source` as a `language` program with `args` and `stdin` in a fresh sandbox (see the module)."""
    _check_arguments(source, language, args, stdin, timeout_s)
    bash = shutil.which("bash", path=PATH)
    if language == "bash" and not bash:
        return RunResult("error", None, "", "", f"bash is not on PATH {PATH}")
    top = Path(tempfile.mkdtemp(prefix="diffgemma-sandbox-"))
    try:
        return _run_in(top, source, language, list(args), stdin, timeout_s, bash)
    finally:
        _remove(top)


def _check_arguments(
    source: object, language: object, args: object, stdin: object, timeout_s: object
) -> None:
    if not isinstance(source, str):
        raise TypeError(f"source must be a str, not {type(source).__name__}")
    if language not in LANGUAGES:
        raise ValueError(f"language must be one of {LANGUAGES}, not {language!r}")
    if isinstance(args, str) or not isinstance(args, Sequence) or not all(isinstance(a, str) for a in args):
        raise TypeError("args must be a sequence of str")
    if not isinstance(stdin, str):
        raise TypeError(f"stdin must be a str, not {type(stdin).__name__}")
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, int | float):
        raise TypeError(f"timeout_s must be a number, not {type(timeout_s).__name__}")
    if not (math.isfinite(timeout_s) and timeout_s > 0):
        raise ValueError(f"timeout_s must be a positive number of seconds, not {timeout_s}")


def _run_in(
    top: Path, source: str, language: str, args: list[str], stdin: str, timeout_s: float, bash: str | None
) -> RunResult:
    """Run in `top`, the run's directory: run/ is the program's cwd and HOME, tmp/ its TMPDIR, and nothing
    else is writable by its uid."""
    run, tmp = top / "run", top / "tmp"
    run.mkdir()
    tmp.mkdir()
    script = run / ("main.py" if language == "python" else "main.sh")
    script.write_text(source, encoding="utf-8")
    uid = _fresh_uid() if os.geteuid() == 0 else None
    expose = None
    if language == "python":
        # the binary itself, not a venv's link to it: -S leaves the venv's packages out anyway
        python = os.path.realpath(sys.executable)
        argv = [python, "-I", "-S", "-B", script.name, *args]
        if uid is not None:
            expose = _hidden_prefix(os.path.commonpath([sys.base_prefix, python]))
    else:
        argv = [bash, "--norc", "--noprofile", script.name, *args]
    if uid is not None:
        os.chmod(top, 0o711)
        for path in (run, tmp, script):
            os.chown(path, uid, uid)
    status_r, status_w = os.pipe()
    spec = {
        "argv": argv,
        "status_fd": status_w,
        "top": str(top),
        "expose": expose,
        "uid": uid,
        "cpu_s": math.ceil(timeout_s) + 1,
        "limits": {"AS": MEMORY_BYTES, "FSIZE": FILE_BYTES, "NOFILE": OPEN_FILES, "CORE": 0},
        "processes": PROCESSES,
        "workspace_bytes": WORKSPACE_BYTES,
        "parent": os.getpid(),
    }
    env = {"PATH": PATH, "HOME": str(run), "TMPDIR": str(tmp)}
    with tempfile.TemporaryFile() as stdin_file:
        stdin_file.write(stdin.encode("utf-8"))
        stdin_file.seek(0)
        try:
            proc = subprocess.Popen(
                [sys.executable, "-I", "-S", "-B", __file__, json.dumps(spec)],
                stdin=stdin_file,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                cwd=run,
                env=env,
                pass_fds=(status_w,),
                start_new_session=True,
            )
        except OSError as e:
            os.close(status_r)
            return RunResult("error", None, "", "", f"could not start the sandbox launcher: {e}")
        finally:
            os.close(status_w)
    try:
        captured = _capture(proc, status_r, time.monotonic() + timeout_s)
    finally:
        os.close(status_r)
        _kill_group(proc)
        proc.wait()
        proc.stdout.close()
        proc.stderr.close()
        if uid is not None and bash:
            _reap(uid, bash)
    return _result(proc.returncode, captured, timeout_s)


def _hidden_prefix(prefix: str) -> list[str] | None:
    """[the topmost directory above `prefix` that other users may not enter, `prefix`], or None when an
    unprivileged uid reaches `prefix` (a root-owned pyenv under /root does not: the launcher exposes it)."""
    parts = Path(prefix).parts
    for i in range(2, len(parts) + 1):
        here = os.path.join(*parts[:i])
        if not os.stat(here).st_mode & stat.S_IXOTH:
            return [here, prefix]
    return None


@dataclass
class _Captured:
    stdout: bytes = b""
    stderr: bytes = b""
    status: bytes = b""
    timed_out: bool = False
    overflow: str = ""  # the stream that passed OUTPUT_CAP
    leftovers: bool = False  # children still held the pipes after the program exited


def _capture(proc: subprocess.Popen, status_fd: int, deadline: float) -> _Captured:
    """Read the program's pipes (and the launcher's status pipe) until they close, the wall deadline passes or
    a stream passes OUTPUT_CAP; the last two kill the process group."""
    got = _Captured()
    names = {proc.stdout.fileno(): "stdout", proc.stderr.fileno(): "stderr", status_fd: "status"}
    exited_at = None
    with selectors.DefaultSelector() as sel:
        for fd in names:
            os.set_blocking(fd, False)
            sel.register(fd, selectors.EVENT_READ)
        while sel.get_map():
            now = time.monotonic()
            if now >= deadline:
                got.timed_out = True
                break
            if exited_at is None and proc.poll() is not None:
                exited_at = now
            if exited_at is not None and now - exited_at > _GRACE_S:
                got.leftovers = True
                break
            for key, _ in sel.select(min(deadline - now, 0.1)):
                chunk = os.read(key.fd, 1 << 16)
                if not chunk:
                    sel.unregister(key.fd)
                    continue
                name = names[key.fd]
                kept = getattr(got, name) + chunk
                if name != "status" and len(kept) > OUTPUT_CAP:
                    setattr(got, name, kept[:OUTPUT_CAP])
                    got.overflow = name
                    _kill_group(proc)
                    return got
                setattr(got, name, kept)
    if not (got.timed_out or got.leftovers):  # the pipes closed: wait for the exit (a program may close them)
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            got.timed_out = True
    return got


def _result(returncode: int, got: _Captured, timeout_s: float) -> RunResult:
    out = got.stdout.decode("utf-8", errors="replace")
    err = got.stderr.decode("utf-8", errors="replace")
    lines = got.status.splitlines()
    try:
        launch = json.loads(lines[-1]) if lines else {}
    except ValueError:
        launch = {"error": f"unreadable launcher status {got.status[:200]!r}"}
    if "error" in launch:
        return RunResult("error", None, out, err, f"the sandbox could not run the program: {launch['error']}")
    if not launch:  # the launcher died before reporting
        return RunResult("error", None, out, err, f"the sandbox launcher ended early (exit {returncode})")
    isolation = tuple(launch.get("isolation", ()))
    notes = list(launch.get("notes", ()))
    if got.overflow:
        status, code = "killed", None
        notes.insert(0, f"{got.overflow} passed the {OUTPUT_CAP}-byte cap: killed, output truncated")
    elif got.timed_out:
        status, code = "timeout", None
        notes.insert(0, f"still running after {timeout_s:g} s: its process group was killed")
    elif returncode < 0:
        status, code = "killed", None
        notes.insert(0, f"killed by {_signal_name(-returncode)}")
    else:
        status, code = "ok", returncode
        if got.leftovers:
            notes.insert(0, "it exited leaving children that held its output open: they were killed")
    return RunResult(status, code, out, err, "; ".join(notes), isolation)


def _signal_name(signum: int) -> str:
    why = {signal.SIGXCPU: " (CPU time limit)", signal.SIGXFSZ: " (file size limit)"}
    try:
        sig = signal.Signals(signum)
    except ValueError:
        return f"signal {signum}"
    return sig.name + why.get(sig, "")


def _kill_group(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)


def _reap(uid: int, bash: str) -> None:
    """Kill every process of the run's uid, in or out of its process group: a process of that uid sends
    kill(-1), which the kernel delivers to all of them at once (no fork can slip between)."""
    for _ in range(5):
        if not _pids_of(uid):
            return
        subprocess.run(
            [bash, "--norc", "--noprofile", "-c", "kill -KILL -1"],
            user=uid,
            group=uid,
            extra_groups=[],
            env={},
            cwd="/",
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            timeout=10,
            check=False,
        )
        time.sleep(0.01)


def _pids_of(uid: int) -> list[int]:
    """The live (not zombie) processes whose real uid is `uid`."""
    pids = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            fields = dict(
                line.split(":", 1)
                for line in Path(entry.path, "status").read_text().splitlines()
                if ":" in line
            )
        except OSError:
            continue
        if int(fields["Uid"].split()[0]) == uid and not fields["State"].strip().startswith("Z"):
            pids.append(int(entry.name))
    return pids


def _fresh_uid() -> int:
    """A uid no live process has, from the sandbox's range."""
    while True:
        uid = UID_BASE + random.randrange(UID_SPAN)
        if not _pids_of(uid):
            return uid


def _remove(top: Path) -> None:
    """Delete the run's directory, even where the program took the permissions off its own files."""
    for root, dirs, _ in os.walk(top):
        for d in dirs:
            with contextlib.suppress(OSError):
                os.chmod(os.path.join(root, d), 0o700, follow_symlinks=False)
    shutil.rmtree(top, ignore_errors=True)


# ---- the launcher: this file as a script, in a fresh interpreter, between the caller and the program ----

_CLONE_NEWNS, _CLONE_NEWUSER, _CLONE_NEWNET = 0x00020000, 0x10000000, 0x40000000
_MS_NOSUID, _MS_NODEV, _MS_BIND, _MS_REC, _MS_PRIVATE = 0x2, 0x4, 0x1000, 0x4000, 1 << 18
_MOUNT_ATTR_RDONLY, _AT_RECURSIVE, _AT_FDCWD = 0x1, 0x8000, -100
_SYS_MOUNT_SETATTR = 442  # the same number on x86_64 and aarch64
_PR_SET_PDEATHSIG, _PR_SET_DUMPABLE, _PR_SET_NO_NEW_PRIVS = 1, 4, 38


class _MountAttr(ctypes.Structure):
    _fields_ = [(name, ctypes.c_uint64) for name in ("attr_set", "attr_clr", "propagation", "userns_fd")]


def _libc_call(what: str, result: int) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _launch(spec: dict, status_fd: int) -> None:
    """Isolate this process as `spec` says, report the layers on `status_fd`, then exec the program."""
    libc = ctypes.CDLL(None, use_errno=True)
    isolation, notes = [], []
    namespaced = False
    uid = spec["uid"]
    if uid is not None:
        try:
            _libc_call("unshare", libc.unshare(_CLONE_NEWNS | _CLONE_NEWNET))
            namespaced = True
        except OSError as e:
            notes.append(f"namespaces as root refused ({e}); trying a user namespace")
        if namespaced:
            _private_mounts(libc)
            _expose(libc, spec["expose"])
            _workspace(libc, spec, uid, isolation, notes)
        elif spec["expose"]:
            hidden, prefix = spec["expose"]
            raise OSError(
                f"the interpreter under {prefix} is in {hidden}, which an unprivileged uid may not enter, "
                "and no mount namespace is allowed to expose it"
            )
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)
        if os.getresuid() != (uid, uid, uid):
            raise OSError(f"could not drop to uid {uid}")
        isolation.append("uid")
    if not namespaced:
        namespaced = _user_namespace(libc, notes)
        if namespaced:
            _private_mounts(libc)
            _workspace(libc, spec, os.getuid(), isolation, notes)
    if namespaced:
        isolation.insert(0, "network")
        os.chdir(os.path.join(spec["top"], "run"))  # the cwd was taken before the tmpfs: take it on the tmpfs
    processes = spec["processes"]
    if uid is None and not namespaced:  # RLIMIT_NPROC counts every process this user runs on the machine
        processes += len(_pids_of(os.getuid()))
        notes.append(f"no fresh uid: RLIMIT_NPROC is {processes}, what this user already runs plus the run's")
    cpu = spec["cpu_s"]
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    resource.setrlimit(resource.RLIMIT_NPROC, (processes, processes))
    for name, value in spec["limits"].items():
        resource.setrlimit(getattr(resource, f"RLIMIT_{name}"), (value, value))
    os.nice(10)
    _libc_call("no_new_privs", libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0))
    _libc_call("pdeathsig", libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0))
    if os.getppid() != spec["parent"]:  # the caller died before the death signal was armed
        os._exit(_SETUP_FAILED)
    # one line per report; the pipe closes at the exec, and a failed exec adds an error line after this one
    os.set_inheritable(status_fd, False)
    os.write(status_fd, json.dumps({"isolation": isolation, "notes": notes}).encode() + b"\n")
    argv = spec["argv"]
    os.execve(argv[0], argv, os.environ)


def _user_namespace(libc: ctypes.CDLL, notes: list[str]) -> bool:
    """Enter a new user namespace (mapping only this uid and gid) with new mount and network namespaces."""
    uid, gid = os.getuid(), os.getgid()
    try:
        # a process that changed uid is not dumpable, and then it may not write its own /proc maps
        _libc_call("dumpable", libc.prctl(_PR_SET_DUMPABLE, 1, 0, 0, 0))
        _libc_call("unshare", libc.unshare(_CLONE_NEWUSER | _CLONE_NEWNS | _CLONE_NEWNET))
        for name, text in (
            ("setgroups", "deny"),
            ("uid_map", f"{uid} {uid} 1"),
            ("gid_map", f"{gid} {gid} 1"),
        ):
            with open(f"/proc/self/{name}", "w") as f:
                f.write(text)
    except OSError as e:
        notes.append(f"no network or filesystem isolation: a user namespace was refused ({e})")
        return False
    return True


def _private_mounts(libc: ctypes.CDLL) -> None:
    """Stop mount events of the new namespace reaching the machine's (where / is shared, as under systemd)."""
    _libc_call("make / private", libc.mount(b"none", b"/", None, _MS_REC | _MS_PRIVATE, None))


def _expose(libc: ctypes.CDLL, expose: list[str] | None) -> None:
    """Make the interpreter's prefix reachable by the unprivileged uid in this namespace only: a tmpfs over
    the directory it may not enter (hiding the rest of it, /root say), holding a bind of the prefix at its
    path."""
    if not expose:
        return
    hidden, prefix = expose
    keep = os.open(prefix, os.O_PATH | os.O_DIRECTORY)
    _libc_call(
        f"tmpfs over {hidden}", libc.mount(b"tmpfs", hidden.encode(), b"tmpfs", 0, b"mode=0755,size=64k")
    )
    os.makedirs(prefix, mode=0o755, exist_ok=True)
    _libc_call(
        f"bind {prefix}",
        libc.mount(f"/proc/self/fd/{keep}".encode(), prefix.encode(), None, _MS_BIND | _MS_REC, None),
    )
    os.close(keep)


def _workspace(libc: ctypes.CDLL, spec: dict, owner: int, isolation: list[str], notes: list[str]) -> None:
    """In this (new, private) mount namespace: put the run's directory on a fresh tmpfs of WORKSPACE_BYTES
    (what the program writes is bounded in bytes and files, and goes with the namespace), then make every
    other mount read-only."""
    top = spec["top"]
    run = Path(top, "run")
    scripts = {p.name: p.read_bytes() for p in run.iterdir()}
    options = f"mode=0711,size={spec['workspace_bytes']},nr_inodes={_WORKSPACE_FILES}".encode()
    try:
        _libc_call("tmpfs", libc.mount(b"tmpfs", top.encode(), b"tmpfs", _MS_NOSUID | _MS_NODEV, options))
    except OSError as e:
        notes.append(f"no private workspace or read-only filesystem ({e})")
        return
    for path in (run, Path(top, "tmp")):
        path.mkdir(mode=0o700)
        os.chown(path, owner, owner)
    for name, data in scripts.items():
        (run / name).write_bytes(data)
        os.chown(run / name, owner, owner)
    try:
        ro = _MountAttr(_MOUNT_ATTR_RDONLY, 0, 0, 0)
        _libc_call("mount_setattr /", _mount_setattr(libc, b"/", _AT_RECURSIVE, ro))
        rw = _MountAttr(0, _MOUNT_ATTR_RDONLY, 0, 0)
        _libc_call("mount_setattr of the workspace", _mount_setattr(libc, top.encode(), 0, rw))
    except OSError as e:
        notes.append(f"no read-only filesystem ({e})")
        return
    isolation.append("filesystem")


def _mount_setattr(libc: ctypes.CDLL, path: bytes, flags: int, attr: _MountAttr) -> int:
    return libc.syscall(_SYS_MOUNT_SETATTR, _AT_FDCWD, path, flags, ctypes.byref(attr), ctypes.sizeof(attr))


if __name__ == "__main__":
    _spec = json.loads(sys.argv[1])
    try:
        _launch(_spec, _spec["status_fd"])
    except BaseException as _e:  # report any failure (an exec that failed included): the program did not run
        with contextlib.suppress(OSError):
            os.write(_spec["status_fd"], json.dumps({"error": f"{type(_e).__name__}: {_e}"}).encode() + b"\n")
        os._exit(_SETUP_FAILED)
