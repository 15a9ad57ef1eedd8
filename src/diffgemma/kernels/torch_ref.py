"""Reference ops in plain PyTorch: the oracle every fast kernel is pinned to. Runs on cpu, cuda and mps."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """Gemma RMSNorm in fp32: x / sqrt(mean(x^2) + eps) * w (not 1 + w); no weight = rms_norm_no_scale."""
    xf = x.float()
    out = xf * torch.pow(xf.pow(2).mean(-1, keepdim=True) + eps, -0.5)
    if weight is not None:
        out = out * weight.float()
    return out.to(x.dtype)


def softcap(logits: torch.Tensor, cap: float) -> torch.Tensor:
    """Final-logit softcapping in fp32 (at least): tanh(x / cap) * cap."""
    x = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return torch.tanh(x / cap) * cap


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


def rope_inv_freq(head_dim: int, theta: float, rope_type: str, partial_rotary_factor: float) -> torch.Tensor:
    """Inverse frequencies, head_dim // 2 of them. "proportional" rotates the first
    partial_rotary_factor * head_dim / 2 angles with exponents over the FULL head_dim and leaves the rest at 0."""
    if rope_type == "proportional":
        angles = int(partial_rotary_factor * head_dim // 2)
        rotated = 1.0 / (
            theta ** (torch.arange(0, 2 * angles, 2, dtype=torch.float, device="cpu") / head_dim)
        )
        return torch.cat([rotated, torch.zeros(head_dim // 2 - angles, device="cpu")])
    dim = int(head_dim * partial_rotary_factor)
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float, device="cpu") / dim))


def rope_cos_sin(
    inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [T, head_dim] for split-half rotation (pairs d and d + head_dim/2), cast to the activation dtype."""
    freqs = positions.float()[:, None] * inv_freq.to(positions.device)[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, d]; cos/sin [T, d]."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """q [1, H, Tq, d], k/v [1, Hkv, Tk, d], mask [Tq, Tk] bool (True = attend) or None. Scale 1 (QK-norm folds it)."""
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, scale=1.0, enable_gqa=q.shape[1] != k.shape[1]
    )


def rows(x: torch.Tensor) -> torch.Tensor:
    """Attention output [1, H, T, d] as o_proj's input rows [T, H * d]."""
    return x[0].transpose(0, 1).reshape(x.shape[2], -1)


def route(
    x: torch.Tensor,
    proj: torch.Tensor,
    scale: torch.Tensor,
    per_expert_scale: torch.Tensor,
    top_k: int,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """MoE router: rms_norm_no_scale -> * scale * hidden^-0.5 -> linear -> softmax(fp32) -> top-k ->
    renormalise -> * per_expert_scale. Returns (weights [N, k] fp32, expert ids [N, k])."""
    return route_weights(router_logits(x, proj, scale, eps), per_expert_scale, top_k)


def router_logits(x: torch.Tensor, proj: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor:
    """The router's logits [N, E] in x's dtype (`route`'s first half)."""
    return F.linear(router_input(x, scale, eps), proj)


def router_input(x: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor:
    """What the router's projection multiplies: x normed without a weight, times scale and H^-0.5."""
    return rms_norm(x, None, eps) * scale * (x.shape[-1] ** -0.5)


def route_weights(
    logits: torch.Tensor, per_expert_scale: torch.Tensor, top_k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """`route`'s second half: (weights [N, k] fp32, expert ids [N, k]) from the router's logits."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, k=top_k, dim=-1)
    weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights * per_expert_scale[ids], ids


def moe_experts(
    x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor
) -> torch.Tensor:
    """Sum over each row's experts of weight * down(gelu_tanh(gate) * up). x [N, H]; gate_up [E, 2I, H]; down [E, H, I]."""
    n, k = ids.shape
    flat_ids = ids.reshape(-1)
    order = torch.argsort(flat_ids, stable=True)
    rows = order // k
    counts = torch.bincount(flat_ids, minlength=gate_up.shape[0]).tolist()
    out = torch.zeros_like(x)
    start = 0
    for e, c in enumerate(counts):
        if c == 0:
            continue
        r = rows[start : start + c]
        gate, up = F.linear(x[r], gate_up[e]).chunk(2, dim=-1)
        y = F.linear(gelu_tanh(gate) * up, down[e])
        y = y * weights.reshape(-1)[order[start : start + c], None]
        out.index_add_(0, r, y.to(out.dtype))
        start += c
    return out
