"""Overlay packs: a pack whose untransformed (raw) tensors are not copied but referenced in the base checkpoint's
safetensors shards, local tooling for experiment arms (the seed's §8.1), never a format to distribute.

An overlay is a pack directory (config.json, tokenizer, aligned safetensors) whose safetensors hold only the
tensors that differ from the base, plus `overlay.json`: the base's location, each referenced base shard pinned by
its size and the sha256 of its header (the 8-byte length and the JSON, not the payload), each raw tensor's shard,
and the self-contained pack's layout, so that `repack --monolithic` writes that pack back byte for byte.
Every pinned shard is checked before any tensor is read; a stale or missing one fails in one line that says
how to get it back.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path

from diffgemma.weights.header import header_bytes

INDEX = "overlay.json"
VERSION = 1
OVERRIDE_ENV = "DIFFGEMMA_OVERLAY_BASE"  # RuntimeConfig.overlay_base
# models--ORG--NAME/snapshots/REV: a Hugging Face cache snapshot, whose repo and revision a fetch command names
HF_SNAPSHOT = re.compile(r"models--(?P<org>[^/]+?)--(?P<name>[^/]+)/snapshots/(?P<rev>[^/]+)$")


class OverlayError(ValueError):
    """An overlay's index is unreadable or a base shard it pins is missing or not the one it was made from."""


def pin(path: Path) -> dict[str, int | str]:
    """A shard's size in bytes and the sha256 of its header (8-byte length and JSON): what an overlay pins."""
    try:
        head = header_bytes(path)
    except ValueError as e:
        raise OverlayError(f"{path} is not a safetensors file ({e})") from None
    return {"size": path.stat().st_size, "header_sha256": hashlib.sha256(head).hexdigest()}


def origin(base: Path) -> dict[str, str | None]:
    """The base's absolute path, and its hub repo and revision when it is a Hugging Face cache snapshot."""
    path = base.expanduser().absolute()
    m = HF_SNAPSHOT.search(path.as_posix())
    repo = f"{m['org']}/{m['name']}" if m else None
    return {"path": str(path), "repo": repo, "revision": m["rev"] if m else None}


@dataclass
class Overlay:
    """overlay.json: where the base is, its pinned shards, each referenced tensor's shard, and the layout of the
    self-contained pack (its shard files, each with its tensors in order)."""

    base: dict[str, str | None]
    shards: dict[str, dict[str, int | str]]  # base shard (relative to the base) -> its pin
    external: dict[str, str]  # tensor -> base shard
    layout: list[tuple[str, list[str]]]

    @classmethod
    def make(cls, base: Path, external: dict[str, str], layout: list[tuple[str, list[str]]]) -> Overlay:
        """The index of an overlay on `base` whose `external` tensors live in the named base shards."""
        shards = {f: pin(base / f) for f in sorted(set(external.values()))}
        return cls(origin(base), shards, external, layout)

    def write(self, directory: Path) -> None:
        body = {
            "overlay": VERSION,
            "note": "a local overlay pack (diffgemma quantize --overlay / repack --overlay): not for distribution; "
            "`diffgemma repack --monolithic` makes it a self-contained pack",
            "base": self.base,
            "shards": self.shards,
            "external": self.external,
            "layout": [{"file": f, "tensors": names} for f, names in self.layout],
        }
        (directory / INDEX).write_text(json.dumps(body, indent=1) + "\n")

    @classmethod
    def read(cls, directory: Path) -> Overlay | None:
        """The overlay index of a pack directory, or None when it is no overlay."""
        path = directory / INDEX
        if not path.exists():
            return None
        try:
            body = json.loads(path.read_text())
            if body.get("overlay") != VERSION:
                raise OverlayError(
                    f"{path}: overlay version {body.get('overlay')!r}, this build reads {VERSION}"
                )
            base = {k: body["base"].get(k) for k in ("path", "repo", "revision")}
            shards = {str(f): {"size": int(p["size"]), "header_sha256": str(p["header_sha256"])}
                      for f, p in body["shards"].items()}  # fmt: skip
            external = {str(t): str(f) for t, f in body["external"].items()}
            layout = [(str(s["file"]), [str(t) for t in s["tensors"]]) for s in body["layout"]]
        except (json.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError) as e:
            if isinstance(e, OverlayError):
                raise
            raise OverlayError(f"{path}: not a valid overlay index ({type(e).__name__}: {e})") from None
        stray = sorted(set(external.values()) - set(shards))
        if stray:
            raise OverlayError(f"{path}: tensors reference base shard {stray[0]}, which it does not pin")
        return cls(base, shards, external, layout)

    def fetch_hint(self) -> str:
        """What brings the base back: the download of its hub snapshot, or (a local base) restoring it."""
        repo, rev = self.base.get("repo"), self.base.get("revision")
        if repo:
            return f"run `diffgemma download --repo {repo} --revision {rev}`"
        return (
            f"restore the checkpoint the overlay was made from ({self.base.get('path')}; no hub repo is "
            f"recorded), or set {OVERRIDE_ENV} to a copy of it"
        )

    def base_dir(self, override: str | Path | None = None) -> Path:
        """Where the base is now: the override, else the recorded path, else (moved cache) the same snapshot
        under the current Hugging Face cache."""
        if override is not None:
            return Path(override).expanduser()
        recorded = Path(str(self.base.get("path")))
        repo, rev = self.base.get("repo"), self.base.get("revision")
        if not recorded.is_dir() and repo and rev:
            from diffgemma.weights.download import hf_cache_dir

            cached = hf_cache_dir() / ("models--" + repo.replace("/", "--")) / "snapshots" / rev
            if cached.is_dir():
                return cached
        return recorded

    def resolve(self, pack: Path, override: str | Path | None = None) -> dict[str, Path]:
        """Each referenced tensor's base shard, after checking every pinned shard (it exists, has its size and
        its header's sha256): raises OverlayError in one line, naming the shard and the fix, before any read."""
        base = self.base_dir(override)
        for name, want in self.shards.items():
            f = base / name
            if not f.is_file():
                why = "is missing"
            elif (size := f.stat().st_size) != want["size"]:
                why = f"is {size} bytes, the overlay pinned {want['size']}"
            else:
                try:
                    got = pin(f)["header_sha256"]
                except (OverlayError, OSError) as e:
                    got = f"unreadable ({e})"
                why = (
                    None
                    if got == want["header_sha256"]
                    else "has another header than the pinned one (its sha256 differs)"
                )
            if why:
                raise OverlayError(f"overlay {pack}: base shard {f} {why}: {self.fetch_hint()}")
        return {t: base / f for t, f in self.external.items()}
