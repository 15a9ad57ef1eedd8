"""What a pack quantizes: the tensor classes, the locked ones and why, the profiles, and `--set` overrides."""

from __future__ import annotations

from diffgemma.quant.formats import FORMATS

# Classes a profile or `--set` assigns a format to (experts as its two halves, which must agree).
CLASSES = ("experts.gate_up", "experts.down", "attn", "dense", "sc", "vision")
SET_CLASSES = ("experts", *CLASSES)
LOCKED = {  # the seed's reasons
    "embed": "the embedding is tied to the LM head and is the SC soft-embedding table",
    "router": "routing is control flow: a rounded router picks other experts",
    "norms": "norms and layer scalars are tiny tensors: nothing to gain",
}


def _profile(experts: str) -> dict[str, str]:
    return {
        "experts.gate_up": experts,
        "experts.down": experts,
        "attn": "bf16",
        "dense": "bf16",
        "sc": "q8",
        "vision": "bf16",
    }


PROFILES = {p: _profile(p) for p in ("int4", "q5", "q6", "q8", "fp8", "nvfp4")}
# The seed's nvfp4x: a profile name that expands to another profile with overrides.
ALIASES = {"nvfp4x": ("int4", ("experts=nvfp4",))}
PROFILE_NAMES = (*PROFILES, *ALIASES)


class QuantSpecError(ValueError):
    """A profile or `--set` that cannot be honoured (the CLI's exit 2)."""


def tensor_class(name: str, rank: int) -> str | None:
    """The class of a checkpoint tensor (one of CLASSES or LOCKED), or None for the tensors no class covers
    (kept as they are)."""
    leaf = name.rsplit(".", 2)
    if name.startswith(("model.encoder.vision_tower.", "model.encoder.embed_vision.")):
        return "vision" if rank == 2 and name.endswith(".weight") and "norm" not in name else "norms"
    if name.endswith("embed_tokens.weight") or name == "lm_head.weight":
        return "embed"
    if ".router." in name:
        return "router"
    if name.endswith(".experts.gate_up_proj"):
        return "experts.gate_up"
    if name.endswith(".experts.down_proj"):
        return "experts.down"
    if name.endswith("layer_scalar") or "norm" in leaf[-2] or "norm" in leaf[-1]:
        return "norms"
    if ".self_attn." in name and name.endswith("_proj.weight"):
        return "attn"
    if ".self_conditioning." in name and name.endswith("_proj.weight"):
        return "sc"
    if ".mlp." in name and name.endswith("_proj.weight"):
        return "dense"
    return None


def resolve(profile: str, overrides: list[str] | tuple[str, ...] = ()) -> tuple[str, dict[str, str], dict]:
    """(the base profile, each class's format, the overrides as given) for `--profile` and `--set CLASS=FORMAT`
    items. Zero overrides is exactly the base profile."""
    if profile in ALIASES:
        profile, implied = ALIASES[profile]
        overrides = (*implied, *overrides)
    if profile not in PROFILES:
        raise QuantSpecError(f"unknown profile {profile!r} (profiles: {', '.join(PROFILE_NAMES)})")
    formats = dict(PROFILES[profile])
    given: dict[str, str] = {}
    for item in overrides:
        cls, sep, fmt = item.partition("=")
        cls, fmt = cls.strip(), fmt.strip()
        if not sep or not cls or not fmt:
            raise QuantSpecError(f"--set {item!r}: expected CLASS=FORMAT, e.g. --set experts=int4")
        if cls in LOCKED:
            raise QuantSpecError(f"--set {item}: {cls} is locked ({LOCKED[cls]})")
        if cls not in SET_CLASSES:
            raise QuantSpecError(
                f"--set {item}: unknown class {cls!r} (classes: {', '.join(SET_CLASSES)}; "
                f"locked: {', '.join(LOCKED)})"
            )
        if fmt not in FORMATS:
            raise QuantSpecError(f"--set {item}: unknown format {fmt!r} (formats: {', '.join(FORMATS)})")
        given[cls] = fmt
        for target in ("experts.gate_up", "experts.down") if cls == "experts" else (cls,):
            formats[target] = fmt
    if formats["experts.gate_up"] != formats["experts.down"]:
        raise QuantSpecError(
            f"experts.gate_up resolves to {formats['experts.gate_up']} and experts.down to "
            f"{formats['experts.down']}: the experts' two halves must share one format"
        )
    return profile, formats, given
