"""Fetch a checkpoint from the Hugging Face Hub (resumable, verified by the hub client), and find local ones."""

from __future__ import annotations

import os
from importlib import resources
from pathlib import Path

DEFAULT_REPO = "google/diffusiongemma-26B-A4B-it"
# Only what the engine reads: configs, tokenizer, template and safetensors (never pickles).
ALLOW_PATTERNS = ["*.json", "*.safetensors", "chat_template.jinja", "tokenizer*", "*.md"]


def download(repo: str = DEFAULT_REPO, revision: str | None = None, out: str | Path | None = None) -> Path:
    """Download `repo` (into `out`, or the HF cache) and return the local directory."""
    from huggingface_hub import snapshot_download

    path = snapshot_download(
        repo_id=repo,
        revision=revision,
        allow_patterns=ALLOW_PATTERNS,
        local_dir=str(out) if out is not None else None,
        cache_dir=str(hf_cache_dir()),  # the same cache that discovery reads
    )
    return Path(path)


def hf_cache_dir() -> Path:
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"])
    home = os.environ.get("HF_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "huggingface")
    return Path(home) / "hub"


def bundled_model() -> Path | None:
    """The demo model shipped inside the package, if this build has one."""
    path = Path(str(resources.files("diffgemma"))) / "assets" / "demo"
    return path if (path / "config.json").exists() else None


def discover_model(cwd: Path | None = None) -> Path | None:
    """./model/diffgemma-*, then the HF cache's snapshots of the real model, then the bundled demo model."""
    cwd = cwd or Path.cwd()
    local = sorted(p for p in (cwd / "model").glob("diffgemma-*") if (p / "config.json").exists())
    if local:
        return local[0]
    snapshots = hf_cache_dir() / ("models--" + DEFAULT_REPO.replace("/", "--")) / "snapshots"
    if snapshots.is_dir():
        found = sorted(
            (p for p in snapshots.iterdir() if (p / "config.json").exists()), key=lambda p: p.stat().st_mtime
        )
        if found:
            return found[-1]
    return bundled_model()


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
