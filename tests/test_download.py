"""Model discovery order and the Hub download path, offline against a cache laid out as huggingface_hub does."""

from __future__ import annotations

import pytest

from diffgemma.testing import write_tiny_checkpoint
from diffgemma.weights import download as dl

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
