"""Model discovery order and the Hub download path, offline against a cache laid out as huggingface_hub does."""

from __future__ import annotations

import pytest

from diffgemma.testing import write_tiny_checkpoint
from diffgemma.weights import download as dl
from tests.hub_server import FakeHub, point_huggingface_hub_at

REPO_DIR = "models--google--diffusiongemma-26B-A4B-it"


@pytest.fixture
def hub(tmp_path, monkeypatch):
    cache = tmp_path / "hub"
    snap = cache / REPO_DIR / "snapshots" / "0123abcd"
    write_tiny_checkpoint(snap, tokenizer=False)
    (cache / REPO_DIR / "refs").mkdir(parents=True)
    (cache / REPO_DIR / "refs" / "main").write_text("0123abcd")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    return snap


def test_discovery_prefers_local_then_hf_cache_then_bundled(tmp_path, hub, monkeypatch):
    work = tmp_path / "work"
    work.mkdir()
    assert dl.discover_model(work) == hub
    local = write_tiny_checkpoint(work / "model" / "diffgemma-tiny", tokenizer=False)
    assert dl.discover_model(work) == local
    packs = tmp_path / "hub" / "models--someone--diffgemma-26B-int4" / "snapshots" / "abc"
    write_tiny_checkpoint(packs, tokenizer=False)
    assert dl.discover_model(work) == local  # a local one still first
    assert dl.discover_model(tmp_path / "elsewhere") == packs  # a diffgemma-* pack before the bf16 snapshot
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty"))
    assert dl.discover_model(tmp_path / "elsewhere") == dl.bundled_model()


def test_resolve_repo_id_from_the_cache_and_clear_errors(hub, tmp_path):
    assert dl.resolve_model("google/diffusiongemma-26B-A4B-it") == hub
    with pytest.raises(FileNotFoundError, match="diffgemma download --repo acme/other"):
        dl.resolve_model("acme/other")
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        dl.resolve_model(str(tmp_path))


def test_download_offline_returns_the_cached_snapshot(hub, monkeypatch):
    import huggingface_hub.constants as c

    monkeypatch.setattr(c, "HF_HUB_OFFLINE", True)
    assert dl.download().resolve() == hub.resolve()


# -- download against a local stand-in for the Hub (tests/hub_server.py) --------------------------------------

REPO = "acme/tiny"
SAFE = "model.safetensors"
CHUNK = 64 << 10


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> dict[str, bytes]:
    """The files the fake hub serves: a tiny checkpoint, plus a pickle and a .gitattributes never to fetch."""
    path = write_tiny_checkpoint(tmp_path_factory.mktemp("source"))
    files = {p.name: p.read_bytes() for p in sorted(path.iterdir())}
    return {
        **files,
        "pytorch_model.bin": b"\x80\x04 a pickle",
        ".gitattributes": b"*.safetensors filter=lfs\n",
    }


@pytest.fixture
def fake_hub(source, tmp_path, monkeypatch):
    import huggingface_hub.file_download as fd

    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
    # http_get waits 1 s (time.sleep, patched for the test) before it retries a dropped read, and writes whole
    # chunks (10 MB): a 1.7 MB checkpoint needs smaller ones to be cut part-way
    monkeypatch.setattr(fd.time, "sleep", lambda s: None)
    monkeypatch.setattr(fd.constants, "DOWNLOAD_CHUNK_SIZE", CHUNK)
    with FakeHub(dict(source), repo=REPO) as hub:
        point_huggingface_hub_at(hub.endpoint, monkeypatch)
        yield hub


def same_files(path, source) -> None:
    wanted = {n for n in source if n.endswith((".json", ".safetensors"))}
    got = {p.name for p in path.iterdir() if p.is_file()}
    assert got == wanted  # no pickle, no .gitattributes
    for name in wanted:
        assert (path / name).read_bytes() == source[name], name


def corrupt(data: bytes) -> bytes:
    """The same length and a valid header, other tensor bytes: only the sha256 can tell."""
    return data[:-64] + bytes(b ^ 0xFF for b in data[-64:])


def test_clean_download_into_a_directory_is_verified(fake_hub, source, tmp_path):
    out = tmp_path / "out"
    assert dl.download(REPO, out=out) == out
    same_files(out, source)
    assert [s.range for s in fake_hub.gets()] == [None]
    assert not list(out.rglob("*.incomplete"))

    fake_hub.seen.clear()  # a second run fetches nothing (it re-verifies what is there)
    assert dl.download(REPO, out=out) == out
    assert fake_hub.gets() == []


def test_clean_download_into_the_cache_is_what_resolve_finds(fake_hub, source, tmp_path):
    path = dl.download(REPO)
    storage = tmp_path / "cache" / "models--acme--tiny"
    assert path == storage / "snapshots" / fake_hub.commit
    same_files(path, source)
    assert (path / SAFE).is_symlink() and (path / SAFE).resolve().parent == storage / "blobs"
    assert (storage / "refs" / "main").read_text() == fake_hub.commit
    assert dl.resolve_model(REPO) == path


def test_a_dropped_connection_resumes_within_the_run(fake_hub, source, tmp_path):
    cut = 10 * CHUNK
    fake_hub.drop_once[SAFE] = cut
    out = dl.download(REPO, out=tmp_path / "out")
    assert [s.range for s in fake_hub.gets()] == [None, f"bytes={cut}-"]
    assert (out / SAFE).read_bytes() == source[SAFE]


@pytest.mark.parametrize("where", ["dir", "cache"])
def test_an_interrupted_run_resumes_on_the_next_with_a_range_request(fake_hub, source, tmp_path, where):
    out = tmp_path / "out" if where == "dir" else None
    root = out or tmp_path / "cache"
    cut = 8 * CHUNK
    fake_hub.drop_once[SAFE] = cut
    fake_hub.down_after_drop = True  # the connection drops, then the hub is gone for the rest of the run
    with pytest.raises(Exception, match="503"):
        dl.download(REPO, out=out)
    (partial,) = root.rglob("*.incomplete")
    assert partial.read_bytes() == source[SAFE][:cut]
    assert not [p for p in root.rglob(SAFE) if p.exists()]

    fake_hub.down = False
    fake_hub.seen.clear()
    path = dl.download(REPO, out=out)
    assert [s.range for s in fake_hub.gets()] == [f"bytes={cut}-"]
    assert (path / SAFE).read_bytes() == source[SAFE]
    assert not partial.exists()


@pytest.mark.parametrize("where", ["dir", "cache"])
def test_corrupt_bytes_of_the_right_size_fail_the_sha256_and_are_removed(fake_hub, source, tmp_path, where):
    out = tmp_path / "out" if where == "dir" else None
    fake_hub.serve[SAFE] = corrupt(source[SAFE])
    with pytest.raises(dl.VerifyError, match=rf"^{SAFE} failed verification \(sha256 \w+… is not the hub's"):
        dl.download(REPO, out=out)
    root = out if out is not None else tmp_path / "cache" / "models--acme--tiny"
    assert not [p for p in root.rglob("*") if p.is_file() and p.stat().st_size == len(source[SAFE])]

    del fake_hub.serve[SAFE]  # the re-run fetches it again
    same_files(dl.download(REPO, out=out), source)


def test_a_broken_safetensors_the_hub_lists_as_is_fails_the_header_check(fake_hub, source, tmp_path):
    fake_hub.files[SAFE] = source[SAFE][:-100]  # size and sha256 listed for the truncated bytes
    with pytest.raises(dl.VerifyError, match=f"^{SAFE} failed verification .*its header needs"):
        dl.download(REPO, out=tmp_path / "out")
    assert not (tmp_path / "out" / SAFE).exists()


def test_a_file_damaged_after_download_is_fetched_again(fake_hub, source, tmp_path):
    """huggingface_hub trusts a local-dir file whose mtime is not newer than its metadata; our check does not."""
    import os

    out = dl.download(REPO, out=tmp_path / "out")
    stat = (out / SAFE).stat()
    (out / SAFE).write_bytes(corrupt(source[SAFE]))
    os.utime(out / SAFE, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    fake_hub.seen.clear()
    assert dl.download(REPO, out=out) == out
    assert len(fake_hub.gets()) == 1 and (out / SAFE).read_bytes() == source[SAFE]


def test_verify_download_checks_small_files_by_git_blob_id(fake_hub, source, tmp_path):
    out = dl.download(REPO, out=tmp_path / "out")
    dl.verify_download(out, REPO)
    text = (out / "config.json").read_bytes()
    (out / "config.json").write_bytes(text.replace(b"64", b"65", 1))  # same size, other bytes
    with pytest.raises(dl.VerifyError, match="^config.json failed verification \\(git blob id"):
        dl.verify_download(out, REPO)
    assert not (out / "config.json").exists()
    dl.download(REPO, out=out)  # fetched again
    assert (out / "config.json").read_bytes() == text


def test_check_safetensors_catches_truncation_bad_headers_and_offsets(source, tmp_path):
    import json
    import struct

    good = source[SAFE]
    (n,) = struct.unpack("<Q", good[:8])
    header = json.loads(good[8 : 8 + n])
    name, twin = (
        "model.decoder.layers.0.input_layernorm.weight",
        "model.decoder.layers.1.input_layernorm.weight",
    )

    def problem(data: bytes) -> str | None:
        path = tmp_path / "x.safetensors"
        path.write_bytes(data)
        return dl.check_safetensors(path)

    def with_header(h: dict) -> bytes:
        raw = json.dumps(h).encode()
        return struct.pack("<Q", len(raw)) + raw + good[8 + n :]

    assert problem(good) is None
    assert "too short" in problem(good[:5])
    assert "its header needs" in problem(good[:-1])
    assert "its header needs" in problem(good + b"x")
    assert "does not fit" in problem(struct.pack("<Q", len(good)) + good[8:])
    assert "not JSON" in problem(good[:8] + b"\xff" * n + good[8 + n :])
    entry = header[name]
    begin, end = entry["data_offsets"]
    past = {**header, name: {**entry, "data_offsets": [begin + 10**8, end + 10**8]}}
    assert "its header needs" in problem(with_header(past))  # past the end of the file
    overlap = {
        **header,
        name: {**entry, "data_offsets": header[twin]["data_offsets"]},
    }  # same shape, same bytes
    assert "no gap or overlap" in problem(with_header(overlap))
    assert "bytes for" in problem(with_header({**header, name: {**entry, "shape": [1]}}))


def test_cli_download_prints_the_directory_or_one_line_error(fake_hub, source, tmp_path):
    import os
    import subprocess
    import sys

    def run(*args: str) -> subprocess.CompletedProcess:
        env = {
            **os.environ,
            "HF_ENDPOINT": fake_hub.endpoint,
            "HF_HUB_OFFLINE": "0",
            "HF_HUB_DISABLE_PROGRESS_BARS": "1",
        }
        cmd = [sys.executable, "-m", "diffgemma.cli", "download", *args]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env)

    out = tmp_path / "out"
    fake_hub.serve[SAFE] = corrupt(source[SAFE])
    proc = run("--repo", REPO, "-o", str(out))
    assert proc.returncode == 1 and proc.stdout == "" and "Traceback" not in proc.stderr
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith(
        f"diffgemma: error: {SAFE} failed verification"
    )
    assert proc.stderr.rstrip().endswith(f"run `diffgemma download --repo {REPO} -o {out}` to fetch it again")

    del fake_hub.serve[SAFE]
    proc = run("--repo", REPO, "-o", str(out))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == f"{out}\n"
    same_files(out, source)
