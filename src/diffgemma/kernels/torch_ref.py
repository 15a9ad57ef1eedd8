"""Reference ops in plain PyTorch: the oracle every fast kernel is pinned to. Runs on cpu, cuda and mps."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from diffgemma.quant.weight import dense


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


# The seed's kv-adaptive k of its top-k full-layer attention: ~0.8% of the keys, from 64 to 512 (architecture seed
# §3: a fixed k = 64 dropped the deepest needle at 121k, this k matched dense).
TOPK_DIVISOR, TOPK_MIN, TOPK_MAX = 128, 64, 512


def topk_keys(n_keys: int) -> int:
    """Keys a full layer's query row keeps under top-k attention: clamp(n_keys / 128, 64, 512)."""
    return min(max(n_keys // TOPK_DIVISOR, TOPK_MIN), TOPK_MAX)


def attention_topk(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, keep: int
) -> torch.Tensor:
    """`attention` over each query row's `keep` highest-scoring keys only (the seed's top-k sparse attention):
    scores q.k in fp32, the row's keep-th largest allowed score its threshold, ties at it broken toward the lower
    key index (deterministic), softmax over the kept keys, P.V in fp32, the result in q's dtype. With at most
    `keep` keys in all it is `attention` itself. q [1, H, Tq, d], k/v [1, Hkv, Tk, d], mask [Tq, Tk] or None."""
    if keep >= k.shape[2]:  # every key kept: dense attention itself
        return attention(q, k, v, mask)
    h, hkv = q.shape[1], k.shape[1]
    kf = k.float().repeat_interleave(h // hkv, dim=1)
    vf = v.float().repeat_interleave(h // hkv, dim=1)
    scores = q.float() @ kf.transpose(-1, -2)  # [1, H, Tq, Tk]
    allowed = torch.ones_like(scores, dtype=torch.bool) if mask is None else mask.expand_as(scores)
    p = torch.softmax(keep_top(scores.masked_fill(~allowed, float("-inf")), keep), dim=-1)
    return (p @ vf).to(q.dtype)


def keep_top(scores: torch.Tensor, keep: int) -> torch.Tensor:
    """scores with -inf past each row's `keep` best, ranked by (score descending, index ascending): ties at the
    threshold go to the lower index."""
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices
    ranks = torch.arange(order.shape[-1], device=order.device).expand_as(order)
    rank = torch.empty_like(order).scatter_(-1, order, ranks)
    return scores.masked_fill(rank >= keep, float("-inf"))


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
    """`route`'s second half: (weights [N, k] fp32, expert ids [N, k]) from the router's logits. Equal
    probabilities go to the lower expert index (seed §2.1, as the Triton kernel picks them): a stable sort, where
    torch.topk's order among ties is unspecified."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.sort(probs, dim=-1, descending=True, stable=True)
    weights, ids = weights[:, :top_k], ids[:, :top_k]
    weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights * per_expert_scale[ids], ids


def sort_pairs(ids: torch.Tensor, n_exp: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The (row, j) pairs of ids [N, k] sorted by expert, as torch.sort(ids.flatten(), stable=True) orders them:
    (bounds int32 [E + 1], expert e owning sorted pairs bounds[e]:bounds[e+1]; perm, each sorted pair's flat
    index; slot, its inverse). A counting sort on the one-hot [N*k, E]: no host read, no sort kernel."""
    flat = ids.reshape(-1)
    onehot = (flat[:, None] == torch.arange(n_exp, device=flat.device)[None, :]).to(torch.int32)
    counts = onehot.sum(0)
    offs = torch.cumsum(counts, dim=0, dtype=torch.int32)
    rank = torch.cumsum(onehot, dim=0).gather(1, flat[:, None].long())[:, 0] - 1
    slot = (offs - counts)[flat.long()] + rank
    perm = torch.empty_like(slot)
    perm[slot] = torch.arange(flat.shape[0], device=flat.device, dtype=slot.dtype)
    return F.pad(offs, (1, 0)), perm, slot


# A GEMM of one or two rows takes the CPU BLAS's GEMV path, whose sums differ from its GEMM's in the last bits: an
# expert's rows are padded to at least this many, so that a row's output does not depend on which other rows (of
# its canvas, or of other canvases in the batch) share its expert.
EXPERT_MIN_ROWS = 4


def experts_sorted(
    x: torch.Tensor,
    perm: torch.Tensor,
    bounds: torch.Tensor,
    k: int,
    gate_up: torch.Tensor,
    down: torch.Tensor,
) -> torch.Tensor:
    """Each expert's output for its pairs, in sorted pair order: y [N*k, H] in x's dtype, where sorted pair i is
    row perm[i] // k through expert e for bounds[e] <= i < bounds[e+1]: down(gelu_tanh(gate) * up), unweighted
    (the combine weights and sums them)."""
    y = x.new_empty(perm.shape[0], x.shape[1])
    edges = bounds.tolist()
    for e in range(gate_up.shape[0]):
        a, b = edges[e], edges[e + 1]
        if a == b:
            continue
        rows = F.pad(x[perm[a:b] // k], (0, 0, 0, max(0, EXPERT_MIN_ROWS - (b - a))))
        # a quantized expert decoded on its own: one expert's fp32 copy at a time, never the whole stack's
        gate, up = F.linear(rows, dense(gate_up[e], x.dtype)).chunk(2, dim=-1)
        y[a:b] = F.linear(gelu_tanh(gate) * up, dense(down[e], x.dtype))[: b - a]
    return y


def sum_sorted_pairs(y: torch.Tensor, perm: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """The experts' output rows y [N*k, H], in expert-sorted pair order (perm: each sorted pair's flat (row, j)
    index), put back in (row, j) order, weighted by weights [N, k] and summed per row in fp32: [N, H] fp32,
    deterministic (no atomics)."""
    n, k = weights.shape
    unsorted = torch.empty_like(y)
    unsorted[perm] = y
    return (unsorted.view(n, k, -1).float() * weights.reshape(n, k, 1).float()).sum(1)


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


def soft_embedding_survivors(probs: torch.Tensor, embed: torch.Tensor, cap: int) -> torch.Tensor:
    """probs [N, V] @ embed [V, H] in embed's dtype as the survivor gather computes it (kernels/triton_sc_embed.py):
    a row of at most `cap` nonzero probabilities sums its survivors' val * embed[idx] in fp32 in ascending column
    order, each product rounded before its add, and rounds once; a row with more is a dense fp32 product (the
    kernels' split-K GEMM, which sums in another order). probs are cast to embed's dtype first."""
    p = probs.to(embed.dtype)
    nz = p != 0
    count = nz.sum(-1)
    # the survivors first, in ascending column order (a stable sort of the nonzero flags)
    order = torch.sort(nz.to(torch.int8), dim=-1, descending=True, stable=True).indices
    keep = min(cap, int(count.max()) if count.numel() else 0)
    acc = torch.zeros(p.shape[0], embed.shape[1], dtype=torch.float32, device=p.device)
    for j in range(keep):
        col = order[:, j]
        val = torch.where(j < count, p.gather(1, col[:, None])[:, 0], 0).float()
        acc = acc + val[:, None] * embed[col].float()
    over = count > cap
    if bool(over.any()):
        acc[over] = p[over].float() @ embed.float()
    return acc.to(embed.dtype)
