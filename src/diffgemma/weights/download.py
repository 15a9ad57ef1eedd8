"""Fetch a checkpoint or pack from the Hugging Face Hub, resumable across runs and verified; find local ones.

huggingface_hub (2.4) retries a dropped connection with a Range request inside one call, but it writes each file
to a temporary name that it deletes on any failure, so an interrupted run starts the file over. The large (LFS)
files are therefore fetched here, through huggingface_hub's own HTTP client (`http_get`), into a partial file
with a fixed name that the next run resumes; snapshot_download then fetches the small files and lays out the
cache (snapshot links, refs) or the local directory as it always does. Nothing is called ready until every file
has the size the hub lists, every safetensors header parses and fits its file, and the sha256 (LFS files) or git
blob id (the rest) the hub lists matches.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from diffgemma.weights.header import read_header

DEFAULT_REPO = "google/diffusiongemma-26B-A4B-it"
# Only what the engine reads: configs, tokenizer, template and safetensors (never pickles).
ALLOW_PATTERNS = ["*.json", "*.safetensors", "chat_template.jinja", "tokenizer*", "*.md"]
CHUNK = 8 << 20  # bytes hashed at a time: a multi-GB shard is never read in one go
# bits per element of the safetensors dtypes; a dtype not listed only skips the size-of-data check
DTYPE_BITS = {
    "BOOL": 8, "U8": 8, "I8": 8, "F8_E4M3": 8, "F8_E5M2": 8, "F8_E8M0": 8, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6,
    "U16": 16, "I16": 16, "F16": 16, "BF16": 16, "U32": 32, "I32": 32, "F32": 32, "U64": 64, "I64": 64,
    "F64": 64, "C64": 64,
}  # fmt: skip


class VerifyError(OSError):
    """Files that failed verification; they have been removed, so the next download fetches them again."""

    def __init__(self, failures: list[tuple[str, str]]):
        self.failures = failures
        what = "; ".join(f"{name}: {why}" for name, why in failures)
        if len(failures) == 1:
            message = f"{failures[0][0]} failed verification ({failures[0][1]}); removed it"
        else:
            message = f"{len(failures)} files failed verification ({what}); removed them"
        super().__init__(message)


@dataclass(frozen=True)
class HubFile:
    """A file as the hub lists it: its size, and its sha256 (LFS files) or git blob id (the others)."""

    name: str
    size: int | None
    sha256: str | None = None
    blob_id: str | None = None


def hub_files(repo: str, revision: str | None = None) -> tuple[str, list[HubFile]]:
    """The commit `revision` (default: the main branch) resolves to, and its files that ALLOW_PATTERNS admits."""
    from huggingface_hub import HfApi
    from huggingface_hub.utils import filter_repo_objects

    info = HfApi().model_info(repo, revision=revision, files_metadata=True)  # a fresh HfApi reads HF_ENDPOINT
    if not info.sha:
        raise OSError(f"the hub did not say which commit {repo}@{revision or 'main'} is")
    siblings = filter_repo_objects(
        info.siblings or [], allow_patterns=ALLOW_PATTERNS, key=lambda s: s.rfilename
    )
    files = [
        HubFile(s.rfilename, s.lfs.size, sha256=s.lfs.sha256.lower())
        if s.lfs is not None
        else HubFile(s.rfilename, s.size, blob_id=s.blob_id)
        for s in siblings
    ]
    if not files:
        raise FileNotFoundError(
            f"{repo}@{revision or 'main'} has no files matching {', '.join(ALLOW_PATTERNS)}"
        )
    return info.sha, files


def check_safetensors(path: Path) -> str | None:
    """What is wrong with the safetensors file at `path` (header, offsets, length), or None when it is sound."""
    try:
        header, start = read_header(path)
    except ValueError as e:
        return str(e)
    size = path.stat().st_size
    data = size - start
    spans = []
    for name, entry in header.items():
        try:
            dtype, shape, (begin, end) = entry["dtype"], entry["shape"], entry["data_offsets"]
            count = 1
            for d in shape:
                count *= int(d)
            begin, end = int(begin), int(end)
        except (KeyError, TypeError, ValueError):
            return f"tensor {name}: malformed header entry {entry!r}"
        if not 0 <= begin <= end:
            return f"tensor {name}: data_offsets [{begin}, {end}]"
        bits = DTYPE_BITS.get(dtype)
        if bits is not None and count * bits % 8 == 0 and end - begin != count * bits // 8:
            return f"tensor {name}: {end - begin} bytes for {dtype} {list(shape)}"
        spans.append((begin, end, name))
    need = max((end for _, end, _ in spans), default=0)
    if need != data:  # truncated (or trailing bytes): the last offset end must be where the file ends
        return f"file is {size} bytes, its header needs {start + need}"
    pos = 0  # tensors tile the data section with no gap or overlap, as safetensors itself requires
    for begin, end, name in sorted(spans):
        if begin != pos:
            return (
                f"tensor {name}: data at offset {begin}, not {pos} (tensors must tile it, no gap or overlap)"
            )
        pos = end
    return None


def _digest(path: Path, algorithm: str, prefix: bytes = b"") -> str:
    h = hashlib.new(algorithm, prefix)
    buf = bytearray(CHUNK)
    view = memoryview(buf)
    with open(path, "rb") as f:
        while n := f.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()


def check_file(path: Path, expected: HubFile, *, hashes: bool = True) -> str | None:
    """What is wrong with the local copy of `expected` at `path` (size, safetensors header, then the hub's
    sha256 or git blob id when `hashes`), or None when everything matches."""
    if not path.is_file():
        return "missing"
    size = path.stat().st_size
    if expected.size is not None and size != expected.size:
        return f"{size} bytes, the hub lists {expected.size}"
    if path.name.endswith(".safetensors") and (problem := check_safetensors(path)):
        return problem
    if hashes and expected.sha256:
        got = _digest(path, "sha256")
        if got != expected.sha256:
            return f"sha256 {got[:16]}… is not the hub's {expected.sha256[:16]}…"
    elif hashes and expected.blob_id and len(expected.blob_id) == 40:  # a git (sha1) object id
        got = _digest(path, "sha1", b"blob %d\0" % size)
        if got != expected.blob_id:
            return f"git blob id {got[:16]}… is not the hub's {expected.blob_id[:16]}…"
    return None


def _remove(path: Path) -> None:
    """Delete a file, and the HF-cache blob it links to, so that nothing of it is reused (a link to anywhere
    else is only unlinked: what it points at is not ours)."""
    if path.is_symlink() and (target := path.resolve()).parent.name == "blobs":
        target.unlink(missing_ok=True)
    path.unlink(missing_ok=True)


def _fail(failures: list[tuple[str, str]], root: Path) -> None:
    for name, _ in failures:
        _remove(root / name)
    raise VerifyError(failures)


def verify_download(
    path: str | Path,
    repo: str = DEFAULT_REPO,
    revision: str | None = None,
    *,
    files: list[HubFile] | None = None,
) -> None:
    """Check every file of `repo`@`revision` under `path` against the hub's listing (or `files`); remove the
    ones that fail and raise VerifyError naming them."""
    root = Path(path)
    if files is None:
        _, files = hub_files(repo, revision)
    failures = [(f.name, why) for f in files if (why := check_file(root / f.name, f))]
    if failures:
        _fail(failures, root)


def _fetch_resumable(
    repo: str, commit: str, f: HubFile, final: Path, partial: Path, lock: Path
) -> str | None:
    """Bring `f` to `final`, resuming the `partial` an earlier run left; what is wrong with it, or None."""
    from huggingface_hub import hf_hub_url
    from huggingface_hub.file_download import http_get
    from huggingface_hub.utils import WeakFileLock, build_hf_headers

    if final.exists():  # from an earlier run (or another tool): kept only if it checks out
        if check_file(final, f) is None:
            return None
        _remove(final)
    partial.parent.mkdir(parents=True, exist_ok=True)
    lock.parent.mkdir(parents=True, exist_ok=True)
    with WeakFileLock(lock):  # two downloads must not append to one partial file
        have = partial.stat().st_size if partial.exists() else 0
        if f.size is not None and have > f.size:
            partial.unlink()
            have = 0
        headers = build_hf_headers(library_name="diffgemma")
        headers["Accept-Encoding"] = "identity"  # byte offsets must be the file's, for the Range request
        with open(partial, "ab") as out:  # the commit in the URL pins the bytes a resumed run appends to
            http_get(
                hf_hub_url(repo, f.name, revision=commit),
                out,
                resume_size=have,
                headers=headers,
                expected_size=f.size,
                displayed_filename=f.name,
            )
        problem = check_file(partial, f)
        if problem is not None:
            partial.unlink()
            return problem
        final.parent.mkdir(parents=True, exist_ok=True)
        os.replace(partial, final)
    return None


def _mark_fetched(local_dir: Path, name: str, commit: str, sha256: str) -> None:
    """Record a file we fetched in huggingface_hub's local-dir metadata, or snapshot_download hashes it again."""
    try:
        from huggingface_hub._local_folder import write_download_metadata
    except ImportError:  # a private helper; without it the hub only re-hashes the file
        return
    write_download_metadata(local_dir=local_dir, filename=name, commit_hash=commit, etag=sha256)


def _write_ref(storage: Path, revision: str, commit: str) -> None:
    """refs/<revision> -> commit, as snapshot_download writes it when given a branch rather than a commit."""
    ref = storage / "refs" / revision
    if revision == commit or (ref.is_file() and ref.read_text() == commit):
        return
    ref.parent.mkdir(parents=True, exist_ok=True)
    tmp = ref.with_name(ref.name + ".tmp")
    tmp.write_text(commit)
    os.replace(tmp, ref)


def download(repo: str = DEFAULT_REPO, revision: str | None = None, out: str | Path | None = None) -> Path:
    """Download `repo` (into `out`, or the HF cache), verify it, and return the local directory.
    An interrupted run resumes where it stopped; a file that fails verification is removed and VerifyError
    raised. Offline (HF_HUB_OFFLINE), the cached copy is returned after its safetensors headers are checked."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.file_download import repo_folder_name

    cache = hf_cache_dir()  # the same cache that discovery reads
    local_dir = Path(out).expanduser().resolve() if out is not None else None
    if constants.HF_HUB_OFFLINE:
        path = Path(
            snapshot_download(
                repo_id=repo,
                revision=revision,
                allow_patterns=ALLOW_PATTERNS,
                local_dir=str(local_dir) if local_dir is not None else None,
                cache_dir=str(cache),
            )
        )
        local = [p for p in sorted(path.rglob("*.safetensors")) if ".cache" not in p.relative_to(path).parts]
        failures = [(str(p.relative_to(path)), why) for p in local if (why := check_safetensors(p))]
        if failures:
            _fail(failures, path)
        return path

    commit, files = hub_files(repo, revision)
    storage = cache / repo_folder_name(repo_id=repo, repo_type="model")
    failures = []
    for f in files:
        if f.sha256 is None:
            continue  # small files: snapshot_download fetches them whole
        # the partial files and locks where huggingface_hub keeps its own, so that its downloads and ours of one
        # file take the same lock
        if local_dir is not None:
            final = local_dir / f.name
            partial = local_dir / ".cache" / "huggingface" / "download" / f"{f.name}.{f.sha256}.incomplete"
            lock = local_dir / ".cache" / "huggingface" / "download" / f"{f.name}.lock"
        else:
            final = storage / "blobs" / f.sha256
            partial = final.with_name(f"{f.sha256}.incomplete")
            lock = cache / ".locks" / storage.name / f"{f.sha256}.lock"
        why = _fetch_resumable(repo, commit, f, final, partial, lock)
        if why is not None:
            failures.append((f.name, why))
        elif local_dir is not None:
            _mark_fetched(local_dir, f.name, commit, f.sha256)
    if failures:  # the good files stay: a re-run fetches only these
        raise VerifyError(failures)

    path = Path(
        snapshot_download(
            repo_id=repo,
            revision=commit,  # the commit listed above, so that every file is of the one we verify against
            allow_patterns=ALLOW_PATTERNS,
            local_dir=str(local_dir) if local_dir is not None else None,
            cache_dir=str(cache),
        )
    )
    if local_dir is None:
        _write_ref(storage, revision or "main", commit)
    # the LFS files were hashed as they were fetched above: here only that each one is in place
    failures = [
        (f.name, why) for f in files if (why := check_file(path / f.name, f, hashes=f.sha256 is None))
    ]
    if failures:
        _fail(failures, path)
    return path


def hf_cache_dir() -> Path:
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"])
    home = os.environ.get("HF_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "huggingface")
    return Path(home) / "hub"


def bundled_model() -> Path | None:
    """The demo model shipped inside the package, if this build has one."""
    path = Path(str(resources.files("diffgemma"))) / "assets" / "demo"
    return path if (path / "config.json").exists() else None


def _newest_snapshot(repo_dir: Path) -> Path | None:
    snapshots = repo_dir / "snapshots"
    if not snapshots.is_dir():
        return None
    found = sorted(
        (p for p in snapshots.iterdir() if (p / "config.json").exists()), key=lambda p: p.stat().st_mtime
    )
    return found[-1] if found else None


def discover_model(cwd: Path | None = None) -> Path | None:
    """./model/diffgemma-* (checkpoints or packs), then `diffgemma-*` packs in the HF cache (any owner), then the
    HF cache's snapshot of the real model, then the bundled demo model."""
    cwd = cwd or Path.cwd()
    local = sorted(p for p in (cwd / "model").glob("diffgemma-*") if (p / "config.json").exists())
    if local:
        return local[0]
    for repo_dir in sorted(hf_cache_dir().glob("models--*--diffgemma-*")):
        found = _newest_snapshot(repo_dir)
        if found is not None:
            return found
    found = _newest_snapshot(hf_cache_dir() / ("models--" + DEFAULT_REPO.replace("/", "--")))
    return found if found is not None else bundled_model()


def resolve_model(model: str | None) -> Path:
    """A directory for `-m`: a path, or a repo id already in the HF cache; None means discover."""
    if model is None:
        found = discover_model()
        if found is None:
            raise FileNotFoundError("no model found: pass -m DIR, or run `diffgemma download`")
        return found
    path = Path(model).expanduser()
    if path.exists():
        if not path.is_dir():
            raise FileNotFoundError(f"model path {path} is not a directory")
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"model directory {path} has no config.json")
        return path
    if model.count("/") == 1 and not model.startswith((".", "/")):
        snapshots = hf_cache_dir() / ("models--" + model.replace("/", "--")) / "snapshots"
        found = (
            sorted(p for p in snapshots.glob("*") if (p / "config.json").exists())
            if snapshots.is_dir()
            else []
        )
        if found:
            return found[-1]
        raise FileNotFoundError(
            f"{model} is not in the Hugging Face cache: run `diffgemma download --repo {model}`"
        )
    raise FileNotFoundError(f"model directory {path} does not exist")
