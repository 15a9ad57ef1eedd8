"""Overlay packs (issue #61 item 4, the seed's §8.1) on the bundled demo model: `quantize --overlay` stores only
the quantized tensors and pins the base's shards; an overlay loads bit-identical to the self-contained pack;
`repack --overlay` / `--monolithic` round-trip byte for byte; a raw tensor that differs from the base is stored
locally; a missing, truncated or rewritten base shard is refused in one line that says how to fetch it; a moved
base is found through DIFFGEMMA_OVERLAY_BASE or the current Hugging Face cache."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from typer.testing import CliRunner

from diffgemma.cli import app
from diffgemma.quant.weight import QuantWeight
from diffgemma.testing import write_tiny_checkpoint
from diffgemma.weights import pack, repack
from diffgemma.weights.download import bundled_model
from diffgemma.weights.header import read_header
from diffgemma.weights.loader import CheckpointError, load_model
from diffgemma.weights.overlay import INDEX, Overlay

REV = "0123456789abcdef0123456789abcdef01234567"
FETCH = f"run `diffgemma download --repo local/demo --revision {REV}`"


def hf_snapshot(root: Path) -> Path:
    """A copy of the demo model laid out as a Hugging Face cache snapshot of `local/demo`@REV under root/hub."""
    base = root / "hub" / "models--local--demo" / "snapshots" / REV
    shutil.copytree(bundled_model(), base)
    return base


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    root = tmp_path_factory.mktemp("overlay")
    base = hf_snapshot(root)
    full = pack.quantize(base, root / "pack", "int4", quiet=True)
    over = pack.quantize(base, root / "overlay", "int4", quiet=True, overlay=True)
    return SimpleNamespace(root=root, base=base, pack=full, overlay=over)


def files_of(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def all_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter, buffer, quantized weight's stored tensor and rotary table of the model, by name."""
    out = dict(model.named_parameters())
    out.update(model.named_buffers())
    for mname, m in model.named_modules():
        for attr, w in vars(m).items():
            if isinstance(w, QuantWeight):
                out.update({f"{mname}.{attr}{s}": t for s, t in w.parts.items()})
    out.update({f"inv_freq.{k}": v for k, v in model.inv_freq.items()})
    return out


def assert_bit_identical(a: torch.nn.Module, b: torch.nn.Module) -> None:
    wa, wb = all_weights(a), all_weights(b)
    assert wa.keys() == wb.keys() and len(wa) > 100
    for name, t in wa.items():
        u = wb[name]
        assert (t.dtype, t.shape) == (u.dtype, u.shape), name
        assert torch.equal(t.reshape(-1).view(torch.uint8), u.reshape(-1).view(torch.uint8)), name


def tensor_names(directory: Path) -> set[str]:
    return {
        n for f in directory.glob("*.safetensors") for n in read_header(f)[0] if not n.startswith("__pad__.")
    }


def test_an_overlay_stores_only_the_quantized_tensors_and_pins_its_base(made):
    index = Overlay.read(made.overlay)
    local, full = tensor_names(made.overlay), tensor_names(made.pack)
    mine, theirs = (read_header(d / "model.safetensors")[0] for d in (made.pack, made.base))
    same = ("dtype", "shape")
    quantized = {
        n for n in full if n not in theirs or [mine[n][k] for k in same] != [theirs[n][k] for k in same]
    }
    assert local == quantized and len(local) > 20
    assert set(index.external) == full - local and not set(index.external) & local
    assert set(index.external.values()) == {"model.safetensors"}
    assert index.base == {"path": str(made.base), "repo": "local/demo", "revision": REV}
    raw = (made.base / "model.safetensors").read_bytes()
    header = raw[: 8 + int.from_bytes(raw[:8], "little")]
    want = {"size": len(raw), "header_sha256": hashlib.sha256(header).hexdigest()}
    assert index.shards == {"model.safetensors": want}
    assert pack.misaligned(made.overlay / "model.safetensors") is None
    small, big = ((d / "model.safetensors").stat().st_size for d in (made.overlay, made.pack))
    assert small < big / 3  # the demo's int4 pack: 3.0 MB of 10.6 MB
    assert "not for distribution" in (made.overlay / INDEX).read_text()


def test_an_overlay_loads_bit_identical_to_the_self_contained_pack(made):
    for dtype in (torch.float32, torch.bfloat16):
        assert_bit_identical(load_model(made.overlay, "cpu", dtype), load_model(made.pack, "cpu", dtype))


def test_repack_round_trips_byte_for_byte(made, tmp_path):
    flat = repack.flatten(made.overlay, tmp_path / "flat", quiet=True)
    assert files_of(flat) == files_of(made.pack)  # monolithic(quantize --overlay) == quantize
    split, n, differ = repack.split(made.pack, tmp_path / "split", made.base, quiet=True)
    assert files_of(split) == files_of(made.overlay) and n == len(Overlay.read(split).external) and not differ
    again = repack.flatten(split, tmp_path / "again", quiet=True)
    assert files_of(again) == files_of(made.pack)  # monolithic(overlay(pack)) == pack


def test_a_raw_tensor_that_differs_from_the_base_is_stored_locally(made, tmp_path):
    other = tmp_path / "other"
    shutil.copytree(made.base, other)
    header, start = read_header(other / "model.safetensors")
    name = "model.decoder.layers.2.input_layernorm.weight"
    at = start + header[name]["data_offsets"][0]
    with open(other / "model.safetensors", "r+b") as f:  # one bf16 value changed, the header kept
        f.seek(at)
        f.write(bytes(b ^ 0x01 for b in f.read(2)))
    split, n, differ = repack.split(made.pack, tmp_path / "split", other, quiet=True)
    index = Overlay.read(split)
    assert differ == [name] and name not in index.external and name in tensor_names(split)
    assert n == len(Overlay.read(made.overlay).external) - 1
    assert_bit_identical(load_model(split, "cpu", torch.float32), load_model(made.pack, "cpu", torch.float32))
    assert files_of(repack.flatten(split, tmp_path / "flat", quiet=True)) == files_of(made.pack)


def test_a_sharded_base_is_referenced_shard_by_shard(tmp_path, monkeypatch):
    src = write_tiny_checkpoint(tmp_path / "src", seed=3, shards=2, moe_intermediate_size=32)
    monkeypatch.setattr(pack, "SHARD_BYTES", 60_000)
    full = pack.quantize(src, tmp_path / "pack", "int4", quiet=True)
    over = pack.quantize(src, tmp_path / "overlay", "int4", quiet=True, overlay=True)
    index = Overlay.read(over)
    assert len(index.shards) == 2 and len(index.layout) > 2
    local = sorted(over.glob("*.safetensors"))  # the overlay's own tensors, sharded as well
    assert len(local) > 1 and all(pack.misaligned(f) is None for f in local)
    assert (over / "model.safetensors.index.json").exists()
    assert_bit_identical(load_model(over, "cpu", torch.float32), load_model(full, "cpu", torch.float32))
    assert files_of(repack.flatten(over, tmp_path / "flat", quiet=True)) == files_of(full)


def _flip_a_header_byte(shard: Path) -> None:
    data = bytearray(shard.read_bytes())
    at = data.index(b"model.decoder", 8)
    data[at] = ord("M")  # a tensor renamed: same size, another header
    shard.write_bytes(bytes(data))


def _truncate(shard: Path) -> None:
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size - 64)


DAMAGE = {
    "rewritten header": (_flip_a_header_byte, "has another header than the pinned one"),
    "truncated": (_truncate, "bytes, the overlay pinned"),
    "deleted": (Path.unlink, "is missing"),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_stale_base_shard_is_refused_in_one_line(tmp_path, damage):
    base = hf_snapshot(tmp_path)
    over = pack.quantize(base, tmp_path / "overlay", "int4", quiet=True, overlay=True)
    good = tmp_path / "good"
    shutil.copytree(base, good)
    harm, why = DAMAGE[damage]
    harm(base / "model.safetensors")
    with pytest.raises(CheckpointError, match=why):
        load_model(over, "cpu", torch.float32)
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path / "hub")}
    cmd = [sys.executable, "-m", "diffgemma.cli", "ask", "-m", str(over), "-p", "What is 17 + 25?"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("diffgemma: error:")]
    assert proc.returncode == 1 and proc.stdout == "" and "Traceback" not in proc.stderr, proc.stderr
    assert errors == [proc.stderr.splitlines()[-1]] and len(errors) == 1
    assert f"base shard {base / 'model.safetensors'} " in errors[0] and why in errors[0]
    assert errors[0].endswith(FETCH)
    if damage == "deleted":  # the override: the same command on a good copy of the base
        env["DIFFGEMMA_OVERLAY_BASE"] = str(good)
        ok = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
        assert ok.returncode == 0 and "42" in ok.stdout, ok.stderr


def test_a_moved_base_is_found_by_override_or_in_the_current_cache(made, tmp_path, monkeypatch):
    over = tmp_path / "overlay"
    shutil.copytree(made.overlay, over)
    body = json.loads((over / INDEX).read_text())
    body["base"]["path"] = str(tmp_path / "gone" / "models--local--demo" / "snapshots" / REV)
    (over / INDEX).write_text(json.dumps(body))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty"))
    with pytest.raises(CheckpointError, match=f"is missing: {FETCH}"):
        load_model(over, "cpu", torch.float32)
    want = load_model(made.pack, "cpu", torch.float32)
    assert_bit_identical(load_model(over, "cpu", torch.float32, base=made.base), want)
    monkeypatch.setenv("HF_HUB_CACHE", str(made.root / "hub"))  # the cache moved: the snapshot is found there
    assert_bit_identical(load_model(over, "cpu", torch.float32), want)
    body["base"].update(repo=None, revision=None)
    (over / INDEX).write_text(json.dumps(body))
    with pytest.raises(CheckpointError, match="no hub repo is recorded.*DIFFGEMMA_OVERLAY_BASE"):
        load_model(over, "cpu", torch.float32)


@pytest.mark.parametrize(
    "args, message",
    [
        ([], "pass exactly one of --overlay and --monolithic"),
        (["--overlay", "--monolithic"], "pass exactly one of --overlay and --monolithic"),
        (["--overlay"], "repack --overlay needs --base"),
        (["--monolithic", "--base", "B"], "repack --monolithic takes no --base"),
        (["--monolithic", "-m", "PACK"], "is not an overlay (it has no overlay.json)"),
        (["--overlay", "-m", "OVERLAY", "--base", "BASE"], "is an overlay already"),
        (["--overlay", "-m", "BASE", "--base", "BASE"], "is not a diffgemma pack"),
        (["--overlay", "-m", "PACK", "--base", "OVERLAY"], "the base"),
    ],
)
def test_repack_refusals_are_one_line_with_exit_2_and_no_output(made, tmp_path, args, message):
    where = {"PACK": made.pack, "OVERLAY": made.overlay, "BASE": made.base}
    args = [str(where.get(a, a)) for a in args]
    if "-m" not in args:
        args += ["-m", str(made.pack)]
    result = CliRunner().invoke(app, ["repack", *args, "-o", str(tmp_path / "out")])
    assert result.exit_code == 2 and not (tmp_path / "out").exists(), result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("diffgemma: error:") and message in lines[0]
    assert not list(tmp_path.iterdir())  # no partial directory either
