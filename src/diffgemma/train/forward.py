"""The trainer's forward: the model's own layers (`DiffusionGemma.layer_forward`, the reference kernels) over a
batch, as ONE joint pass over `[prompt slots | canvas slots]` per row, numerically the same as `prefill` +
`denoise` (a `TRAIN` pass whose masks say who sees whom):

* prompts are LEFT-padded to a common length P; `prompt_mask` marks real tokens; each row's positions count its
  real tokens from 0, and its canvas sits at positions L..L+C-1 (L = the row's prompt length), as after a
  prefill of that prompt;
* prompt rows attend causally to real prompt keys (sliding layers: key position > query position - window),
  exactly what a prefill computes, and never to the canvas, so their K/V equal the KV cache's;
* canvas rows attend to the prompt keys a cache read returns (full layers: all; sliding layers: the last
  window - 1 positions) and to the whole canvas, bidirectionally, as a denoise step does;
* prompt rows take the encoder's input (scaled embedding, no norm) and `encoder_layer_scalar`; canvas rows
  take the decoder's input (`decoder_input`, with or without self-conditioning) and `layer_scalar`;
* pad slots attend only to themselves (no NaN rows) and nothing attends to them.

The MoE runs "dense" by default: every expert on every row, zero-weighted where unrouted (`Steps("dense")`),
the same values as the sorted experts without their host reads, which suits a GPU and CUDA graphs; `moe="sparse"`
takes the sorted experts.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from diffgemma.kernels import torch_ref as ops
from diffgemma.model.model import DiffusionGemma, Layer
from diffgemma.model.passes import Pass
from diffgemma.model.steps import Steps

STEPS = {"dense": Steps(experts="dense"), "sparse": Steps(experts="sorted")}


@contextlib.contextmanager
def training_steps(model: DiffusionGemma, moe: str) -> Iterator[None]:
    """The model's layers on the reference kernels with the chosen experts, for the duration."""
    before = model.steps
    model.steps = STEPS[moe]
    try:
        yield
    finally:
        model.steps = before


def positions_and_masks(
    model: DiffusionGemma, prompt_mask: torch.Tensor, canvas_len: int
) -> tuple[torch.Tensor, dict[bool, torch.Tensor]]:
    """Positions [B, P+C] and the boolean attention masks [B, 1, P+C, P+C] (True = attend) by `sliding`."""
    b, p = prompt_mask.shape
    c = canvas_len
    dev = prompt_mask.device
    pm = prompt_mask.bool()
    lengths = pm.sum(1)  # [B]
    ppos = (pm.cumsum(1) - 1).clamp_min(0)
    cpos = lengths[:, None] + torch.arange(c, device=dev)[None]
    pos = torch.cat([ppos, cpos], 1)  # [B, T]

    t = p + c
    valid = torch.cat([pm, torch.ones(b, c, dtype=torch.bool, device=dev)], 1)  # key slot is real
    is_prompt = torch.zeros(t, dtype=torch.bool, device=dev)
    is_prompt[:p] = True
    qpos, kpos = pos[:, :, None], pos[:, None, :]
    q_prompt, k_prompt = is_prompt[None, :, None], is_prompt[None, None, :]
    window = model.cfg.sliding_window
    # prompt -> prompt: causal; canvas -> prompt: everything cached; canvas -> canvas: all; prompt -> canvas: no.
    base = torch.where(q_prompt, k_prompt & (kpos <= qpos), torch.ones((), dtype=torch.bool, device=dev))
    base = base & valid[:, None, :]
    # Sliding window: a prompt query sees keys > pos - window; the canvas sees cached keys > L - window.
    ref = torch.where(q_prompt, qpos, lengths[:, None, None])
    in_window = ~k_prompt | (kpos > ref - window)
    eye = torch.eye(t, dtype=torch.bool, device=dev)[None]
    pad_q = ~valid[:, :, None]
    masks = {}
    for sliding in (False, True):
        m = base & in_window if sliding else base
        m = torch.where(pad_q, eye, m)
        masks[sliding] = m[:, None]
    return pos, masks


def _qk(layer: Layer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, eps: float):
    """Q [B, H, T, d] and K [B, Hkv, T, d] of x [B, T, hidden] for the attention losses (cos/sin [B*T, d])."""
    b, t, _ = x.shape
    hd = layer.head_dim
    q = torch.nn.functional.linear(x, layer.q_proj.to(x.dtype)).view(b * t, layer.n_heads, hd)
    k = torch.nn.functional.linear(x, layer.k_proj.to(x.dtype)).view(b * t, layer.n_kv, hd)
    q = ops.apply_rope(ops.rms_norm(q, layer.q_norm, eps), cos.to(q.dtype), sin.to(q.dtype))
    k = ops.apply_rope(ops.rms_norm(k, layer.k_norm, eps), cos.to(q.dtype), sin.to(q.dtype))
    return (z.view(b, t, z.shape[1], hd).transpose(1, 2) for z in (q, k))


def flagged_decoder_input(
    model: DiffusionGemma, canvas: torch.Tensor, sc_probs: torch.Tensor | None, sc_seed: torch.Tensor
) -> torch.Tensor:
    """`model.decoder_input` with the self-conditioning choice on the device, so that one CUDA graph serves every
    choice: the soft signal is soft_embedding(sc_probs) (all-zero probabilities for none) plus the canvas's
    embedding where the 0-dim bool `sc_seed` is set. The unchosen term is exactly zero, and so is a zero
    signal's SC MLP output, so each choice gives `decoder_input`'s values."""
    emb = model.embed_tokens(canvas)
    soft = torch.where(sc_seed, emb, torch.zeros_like(emb))
    if sc_probs is not None:
        soft = soft + model.soft_embedding(sc_probs) * model.embed_scale(emb.dtype)
    return model.self_conditioned(emb, soft)


def train_forward(
    model: DiffusionGemma,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    canvas_ids: torch.Tensor,
    sc_probs: torch.Tensor | None = None,
    sc_seed: bool | torch.Tensor = False,
    moe: str = "dense",
    compiled: bool = False,
    lookup: torch.Tensor | None = None,
    lines: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Softcapped logits [B, C, V] for canvases [B, C] after left-padded prompts [B, P] (mask [B, P]).

    Self-conditioning as `model.denoise`: `sc_probs` [B, C, V] (normalised), or `sc_seed` (the canvas's own
    embedding), or neither; with `sc_seed` a 0-dim bool tensor, the choice is on the device (`flagged_decoder_input`).
    Differentiable w.r.t. every parameter that has requires_grad. With `lookup`
    ([B, 4], `batches.lookup_pointers`) and `lines` ([B, P]) returns (logits, the hops' attention losses
    summed): `prev_token_nll` in layer 0, `lookup_nll` of the state read in `state_layer` and of the lookup in
    `lookup_layer`.
    """
    b, p = prompt_ids.shape
    c = canvas_ids.shape[1]
    t = p + c
    pos, masks = positions_and_masks(model, prompt_mask, c)
    enc_in = model.embed_tokens(prompt_ids)
    sc = None if sc_probs is None else sc_probs.reshape(b * c, -1)
    if isinstance(sc_seed, torch.Tensor):
        dec_in = flagged_decoder_input(model, canvas_ids.reshape(-1), sc, sc_seed).view(b, c, -1)
    else:
        dec_in = model.decoder_input(canvas_ids.reshape(-1), sc, sc_seed).view(b, c, -1)
    h = torch.cat([enc_in.to(dec_in.dtype), dec_in], 1).reshape(b * t, -1)  # [B*T, hidden]
    is_prompt = (torch.arange(t, device=h.device) < p).repeat(b)[:, None]
    pas = Pass.train(pos, t, masks, is_prompt)
    step = compiled_layer() if compiled else DiffusionGemma.layer_forward
    # The compiled layer runs in fp32 with autocast off: under bf16 autocast on CUDA its gradients were wrong (the
    # demo model's norm 3.3e3 against 0.07 eager), in fp32 they equal eager's (docs/train/README.md).
    precision = torch.autocast(h.device.type, enabled=False) if compiled else contextlib.nullcontext()
    # Every RoPE table before the layers run: a table cache that grew between the compiled layer's calls would be a
    # guard of each call, a recompile a layer, until dynamo's limit left the rest eager.
    for layer in model.layers:
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            pas.cos_sin("sliding" if layer.sliding else "full", model.inv_freq_for(layer, h.device), dtype)
    nll = torch.zeros((), device=h.device)
    eps = model.cfg.rms_norm_eps
    reads_state, reads_option = state_layer(model), lookup_layer(model)
    with training_steps(model, moe):
        for layer in model.layers:
            if lookup is not None and layer.idx in (0, reads_state, reads_option):
                cos, sin = pas.cos_sin(
                    "sliding" if layer.sliding else "full", model.inv_freq_for(layer, h.device), torch.float32
                )
                hb = h.view(b, t, -1)
                mask = masks[layer.sliding]
                if layer.idx == 0:
                    nll = nll + prev_token_nll(layer, hb, cos, sin, mask, lines, eps)
                # columns of lookup, not an index list: a list is a host-to-device copy, which CUDA-graph capture
                # refuses
                if layer.idx == reads_state:
                    nll = nll + lookup_nll(
                        layer, hb, cos, sin, mask, lookup[:, 0], lookup[:, 3], lookup[:, 2], p, eps
                    )
                if layer.idx == reads_option:
                    nll = nll + lookup_nll(
                        layer, hb, cos, sin, mask, lookup[:, 0], lookup[:, 1], lookup[:, 2], p, eps
                    )
            with precision:
                h, _ = step(model, layer, h.float() if compiled else h, None, pas, None)
        logits = model.logits(h.view(b, t, -1)[:, p:].reshape(b * c, -1)).view(b, c, -1)
    return logits if lookup is None else (logits, nll)


def prev_token_nll(
    layer: Layer,
    h: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    mask: torch.Tensor,
    lines: torch.Tensor,
    eps: float,
    head: int = 1,
) -> torch.Tensor:
    """The lookup's first hop: mean -log attention of `layer`'s head `head`, from each list code word
    (lines[b, j]) to its key two tokens back, which puts the key into the code word's stream for the full layer
    to match. Only prompt rows are involved (they see only prompt keys)."""
    b, t, _ = h.shape
    p = lines.shape[1]

    def prompt_rows(z: torch.Tensor) -> torch.Tensor:  # cos/sin [B*T, d] -> the prompt slots' [B*P, d]
        return z.view(b, t, -1)[:, :p].reshape(b * p, -1)

    x = ops.rms_norm(h[:, :p], layer.input_layernorm, eps)
    q, k = _qk(layer, x, prompt_rows(cos), prompt_rows(sin), eps)
    kv = head // (q.shape[1] // k.shape[1])
    scores = torch.einsum("bqd,bkd->bqk", q[:, head].float(), k[:, kv].float())
    logp = torch.log_softmax(scores.masked_fill(~mask[:, 0, :p, :p], float("-inf")), -1)
    j = torch.arange(2, p, device=h.device)
    lp = logp[:, j, j - 2]  # [B, P - 2]
    sel = lines[:, 2:]
    return -torch.where(sel, lp, torch.zeros_like(lp)).sum() / sel.sum().clamp_min(1)


def lookup_layer(model: DiffusionGemma) -> int:
    """The layer whose attention `lookup_nll` supervises: the last full-attention layer, the only kind that
    reaches a list line beyond the sliding window."""
    return max(i for i in range(model.cfg.num_layers) if not model.cfg.is_sliding(i))


def state_layer(model: DiffusionGemma) -> int:
    """The layer in which a schema label's slot is taught to read the state's value: the first full-attention
    layer, so that the layers up to `lookup_layer` can turn the value into the option it matches."""
    return min(i for i in range(model.cfg.num_layers) if not model.cfg.is_sliding(i))


def lookup_nll(
    layer: Layer,
    h: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    mask: torch.Tensor,
    slot: torch.Tensor,
    read: torch.Tensor,
    head: torch.Tensor,
    n_prompt: int,
    eps: float,
) -> torch.Tensor:
    """A lookup's attention loss: the mean over rows of -log(attention of `layer`'s head head[b], from the
    canvas slot slot[b] to the context slot read[b]), rows with either -1 left out. For a retrieval row the slots
    are the answer's code word and the asked line's code word; for a schema row a choice's label and its correct
    option's name (or, in `state_layer`, the state's value): the loss teaches the head the lookup directly.

    h [B, P + C, hidden] is the layer's input stream (P = `n_prompt`); cos/sin and mask as in `layer_forward`.
    The scores are the layer's own (scale 1), recomputed here for the one query row per example."""
    b = h.shape[0]
    x = ops.rms_norm(h, layer.input_layernorm, eps)
    q, k = _qk(layer, x, cos, sin, eps)  # [B, H, T, d], [B, Hkv, T, d]
    has = (slot >= 0) & (read >= 0)
    rows = torch.arange(b, device=h.device)
    qrow = n_prompt + slot.clamp_min(0)
    head = head.clamp_min(0)
    kv = head // (q.shape[1] // k.shape[1])
    scores = torch.einsum("bd,btd->bt", q[rows, head, qrow].float(), k[rows, kv].float())
    scores = scores.masked_fill(~mask[rows, 0, qrow], float("-inf"))
    nll = -torch.log_softmax(scores, -1)[rows, read.clamp_min(0)]
    return torch.where(has, nll, torch.zeros_like(nll)).sum() / has.sum().clamp_min(1)


_COMPILED = None


def compiled_layer():
    """`DiffusionGemma.layer_forward` through torch.compile, one compile for every layer of a type and any batch
    shape. Fusing the unfused elementwise work took the demo trainer's graphed step from 138 to 38 ms on an H200
    (batch 256)."""
    global _COMPILED
    if _COMPILED is None:
        # Variants by layer type and input (5 on the demo model after the first shapes); past dynamo's limit of 8
        # a call runs eagerly, and the demo trainer's step took 7x as long on the H200.
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 32)
        _COMPILED = torch.compile(DiffusionGemma.layer_forward, dynamic=True)
    return _COMPILED
