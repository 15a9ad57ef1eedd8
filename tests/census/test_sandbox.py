"""The sandbox that runs generated programs (issue #61 "Must show"): hostile programs (an infinite loop, fork
bombs, a 10 GB allocation, writing outside the run's directory, reaching the network, flooding the output,
escaping the process group) each end as a failed run, leaving the machine and the filesystem as they were; a
normal program gets its args and stdin. Timeouts are kept small so that the file runs in seconds."""

from __future__ import annotations

import os
import resource
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from diffgemma.census import sandbox
from diffgemma.census.sandbox import run_program

PY_ISOLATION = "import os, sys\nprint(os.getuid(), os.getpgid(0), flush=True)\n"


def _live(pred) -> list[int]:
    """Live (not zombie) processes whose /proc/PID/stat satisfies pred(uid, pgid)."""
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(entry.path, "stat").read_text()
            uid = os.stat(entry.path).st_uid
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if fields[0] != "Z" and pred(uid, int(fields[2])):
            found.append(int(entry.name))
    return found


def _require(result, layer: str) -> None:
    """Skip unless the run had `layer`; a layer may be missing only where the platform refused it, which the
    run's detail then says (root in our containers and CI has every layer)."""
    if layer in result.isolation:
        return
    assert result.detail, f"the run lacks {layer!r} and does not say why: {result}"
    pytest.skip(f"no {layer!r} isolation on this platform: {result.detail}")


def _assert_nothing_left(result) -> None:
    """No live process of the run's uid (when it had its own) or of its process group remains."""
    uid, pgid = (int(x) for x in result.stdout.split()[:2])
    for _ in range(50):  # the kernel may take a moment to tear down killed processes
        left = _live(lambda u, g: g == pgid or ("uid" in result.isolation and u == uid))
        if not left:
            return
        time.sleep(0.05)
    raise AssertionError(f"processes left behind: {left}")


def test_normal_python_program_gets_args_stdin_and_a_minimal_environment():
    src = (
        "import os, sys\nprint(sys.argv[1:])\nprint(sys.stdin.read().upper(), end='')\n"
        "print(sorted(os.environ))\nprint(os.getcwd())\nprint(os.environ['HOME'], os.environ['TMPDIR'])\n"
        "open('out.txt', 'w').write('x')\nsys.exit(4)\n"
    )
    r = run_program(src, "python", ["a", "b c"], "hello\nworld\n", timeout_s=5)
    assert (r.status, r.exit_code) == ("ok", 4), r
    lines = r.stdout.splitlines()
    assert lines[:3] == ["['a', 'b c']", "HELLO", "WORLD"]
    assert set(eval(lines[3])) <= {
        "PATH",
        "HOME",
        "TMPDIR",
        "LC_CTYPE",
    }  # LC_CTYPE: Python's C.UTF-8 coercion
    cwd = Path(lines[4])
    home, tmp = lines[5].split()
    assert home == str(cwd) and Path(tmp).parent == cwd.parent
    assert not cwd.parent.exists()  # the run's directory is removed afterwards


def test_normal_bash_program():
    r = run_program(
        'echo "$#:$1"\nread -r x\necho "got $x"\necho oops >&2\nexit 3\n', "bash", ["1 2", "3"], "in\n"
    )
    assert (r.status, r.exit_code, r.stdout, r.stderr) == ("ok", 3, "2:1 2\ngot in\n", "oops\n"), r


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="language"):
        run_program("print(1)", "ruby")
    with pytest.raises(TypeError, match="args"):
        run_program("print(1)", "python", "abc")
    with pytest.raises(ValueError, match="timeout_s"):
        run_program("print(1)", "python", timeout_s=0)
    with pytest.raises(TypeError, match="source"):
        run_program(b"print(1)", "python")


def test_infinite_loop_times_out_and_is_killed():
    start = time.monotonic()
    r = run_program(PY_ISOLATION + "while True:\n    pass\n", "python", timeout_s=1)
    elapsed = time.monotonic() - start
    assert r.status == "timeout" and r.exit_code is None, r
    assert elapsed < 2.0, elapsed
    _assert_nothing_left(r)


def test_sleeping_bash_loop_times_out():
    start = time.monotonic()
    r = run_program("while true; do sleep 0.05; done", "bash", timeout_s=1)
    assert r.status == "timeout" and time.monotonic() - start < 2.0, r


def test_a_program_that_closes_its_output_is_still_waited_for():
    start = time.monotonic()
    r = run_program("exec >&- 2>&-\nsleep 0.3\nexit 7", "bash", timeout_s=5)
    assert (r.status, r.exit_code) == ("ok", 7) and time.monotonic() - start >= 0.3, r
    r = run_program("exec >&- 2>&-\nwhile true; do :; done", "bash", timeout_s=1)
    assert r.status == "timeout", r


def test_a_missing_interpreter_is_an_error(monkeypatch):
    monkeypatch.setattr(sandbox, "PATH", "/nonexistent")
    r = run_program("echo hi", "bash", timeout_s=5)
    assert (r.status, r.exit_code) == ("error", None) and "bash" in r.detail, r


def _nproc_in_sandbox() -> int:
    r = run_program(
        "import resource\nprint(resource.getrlimit(resource.RLIMIT_NPROC)[0])", "python", timeout_s=5
    )
    assert r.status == "ok", r
    return int(r.stdout)


def test_python_fork_bomb_is_contained():
    limit = _nproc_in_sandbox()
    # a guard before the bomb: its processes must be limited, and to the sandbox's own few
    assert limit < 1000 and limit != resource.RLIM_INFINITY, limit
    bomb = PY_ISOLATION + (
        "me = os.getpid()\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n"
        "        if os.getpid() == me:\n            print('limited', flush=True)\n            me = None\n"
    )
    r = run_program(bomb, "python", timeout_s=1)
    assert r.status == "timeout", r
    assert "limited" in r.stdout.split(), r  # it reached RLIMIT_NPROC rather than the machine's limit
    _assert_nothing_left(r)
    after = run_program("print('fine')", "python", timeout_s=5)
    assert (after.status, after.stdout) == ("ok", "fine\n"), after


def test_bash_fork_bomb_is_contained():
    r = run_program('echo "$(id -u) $(ps -o pgid= $$)"\n:(){ :|:& };:\nsleep 5', "bash", timeout_s=1)
    assert r.status != "ok" or r.detail, r  # a timeout, or its leftovers were killed
    _assert_nothing_left(r)
    after = run_program("echo fine", "bash", timeout_s=5)
    assert (after.status, after.stdout) == ("ok", "fine\n"), after


def test_a_child_that_leaves_the_process_group_is_killed():
    src = PY_ISOLATION + "import time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(60)\n"
    r = run_program(src, "python", timeout_s=2)
    assert r.status == "ok" and "killed" in r.detail, r
    _require(r, "uid")
    uid = int(r.stdout.split()[0])
    assert not _live(lambda u, g: u == uid)


def test_ten_gigabyte_allocation_fails():
    r = run_program("x = bytearray(10 * 1024**3)\nprint('allocated')", "python", timeout_s=5)
    assert r.status != "ok" or r.exit_code != 0, r
    assert "allocated" not in r.stdout and "MemoryError" in r.stderr, r
    after = run_program("print(sum(range(10)))", "python", timeout_s=5)
    assert after.stdout == "45\n", after


def test_a_big_file_is_refused():
    r = run_program("open('big', 'wb').write(b'x' * (8 << 20))\nprint('wrote')", "python", timeout_s=5)
    assert "wrote" not in r.stdout and (r.status == "killed" or r.exit_code != 0), r


def test_filling_the_disk_is_bounded():
    src = (
        "import os\nn = files = 0\ntry:\n    while True:\n"
        "        with open(f'f{n}', 'wb') as f:\n            f.write(b'x' * 1000000)\n        n += 1\n"
        "except OSError as e:\n    print(n, e.errno)\n"
        "try:\n    while True:\n        open(f'e{files}', 'w').close()\n        files += 1\n"
        "except OSError as e:\n    print(files, e.errno)\n"
    )
    r = run_program(src, "python", timeout_s=5)
    _require(r, "filesystem")
    assert r.status == "ok", r
    (megabytes, err1), (files, err2) = (line.split() for line in r.stdout.splitlines())
    assert int(megabytes) * 1_000_000 <= sandbox.WORKSPACE_BYTES and err1 == "28", r  # ENOSPC
    assert int(files) <= 1024 and err2 == "28", r


def test_output_flood_is_capped_and_killed():
    r = run_program("import sys\nwhile True:\n    sys.stdout.write('y' * 65536)", "python", timeout_s=5)
    assert r.status == "killed" and "cap" in r.detail, r
    assert len(r.stdout) == sandbox.OUTPUT_CAP
    r = run_program("yes error >&2", "bash", timeout_s=5)
    assert r.status == "killed" and "stderr" in r.detail and len(r.stderr) == sandbox.OUTPUT_CAP, r


@pytest.fixture
def victim_dir():
    """A directory outside the sandbox, readable by all (0755), with a file and a world-writable directory."""
    with tempfile.TemporaryDirectory(prefix="diffgemma-victim-") as d:
        base = Path(d)
        os.chmod(base, 0o755)
        (base / "keep.txt").write_text("original")
        os.chmod(base / "keep.txt", 0o644)
        (base / "open").mkdir()
        os.chmod(base / "open", 0o777)
        yield base


def _attempt_writes(paths: list[Path]) -> str:
    """A program that tries to create, append to, or delete each path and prints what it managed."""
    return (
        "import os\n"
        f"for p in {[str(p) for p in paths]!r}:\n"
        "    for how in ('a', 'x'):\n"
        "        try:\n            open(p, how).write('pwned')\n            print('wrote', p)\n"
        "        except OSError as e:\n            pass\n"
        "    try:\n        os.remove(p)\n        print('removed', p)\n    except OSError:\n        pass\n"
    )


def test_files_outside_its_directory_are_untouched(victim_dir):
    probe = Path.home() / f"diffgemma-sandbox-probe-{os.getpid()}"
    targets = [victim_dir / "keep.txt", victim_dir / "new.txt", probe]
    r = run_program(_attempt_writes(targets), "python", timeout_s=5)
    assert r.status == "ok", r
    if "filesystem" not in r.isolation:
        _require(r, "uid")
    assert r.stdout == "", r
    assert (victim_dir / "keep.txt").read_text() == "original"
    assert not (victim_dir / "new.txt").exists() and not probe.exists()


def test_world_writable_directories_are_read_only_too(victim_dir):
    targets = [
        victim_dir / "open" / "new.txt",
        Path(tempfile.gettempdir()) / f"diffgemma-probe-{os.getpid()}",
    ]
    r = run_program(_attempt_writes(targets), "python", timeout_s=5)
    _require(r, "filesystem")
    assert r.stdout == "", r
    assert not any(t.exists() for t in targets)


def test_the_network_is_unreachable():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        server.settimeout(0.5)
        port = server.getsockname()[1]
        src = (
            "import socket\ntry:\n"
            f"    socket.create_connection(('127.0.0.1', {port}), timeout=2).sendall(b'hi')\n"
            "    print('connected')\n"
            "except OSError as e:\n    print('refused', e.errno)\n"
        )
        r = run_program(src, "python", timeout_s=5)
        _require(r, "network")
        assert r.status == "ok" and r.stdout.startswith("refused"), r
        with pytest.raises(TimeoutError):
            server.accept()


def test_it_cannot_signal_processes_outside_the_run():
    probe = run_program("true", "bash", timeout_s=5)
    _require(probe, "uid")  # without a fresh uid, kill -1 would reach this user's own processes
    bystander = subprocess.Popen(["sleep", "30"])
    try:
        r = run_program("kill -KILL -1\nkill -KILL 1\necho survived", "bash", timeout_s=5)
        assert bystander.poll() is None, "the sandbox killed a process outside its run"
        assert r.status == "ok" and "survived" in r.stdout, r
    finally:
        bystander.kill()
        bystander.wait()


def test_it_cannot_gain_privileges():
    r = run_program(
        "import os\nprint(os.getuid(), os.geteuid())\nprint(open('/proc/self/status').read())",
        "python",
        timeout_s=5,
    )
    assert r.status == "ok", r
    if os.geteuid() == 0:
        assert "uid" in r.isolation, r
        assert "0" not in r.stdout.splitlines()[0].split()
    status = dict(line.split(":", 1) for line in r.stdout.splitlines()[1:] if ":" in line)
    assert int(status["CapEff"].strip(), 16) == 0 and status["NoNewPrivs"].strip() == "1"
