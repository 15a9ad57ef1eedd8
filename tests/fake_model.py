"""A scripted stand-in for DiffusionGemma: logits chosen by the test, calls recorded."""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace

import torch


class FakeKV:
    def __init__(self) -> None:
        self.length = 0
        self.max_tokens = 1 << 20


class FakeModel:
    def __init__(
        self,
        vocab: int,
        canvas: int,
        script: Callable[[int, torch.Tensor], torch.Tensor],
        dtype: torch.dtype = torch.float32,
    ):
        # no final softcap: the scripted logits are what the sampler sees
        self.cfg = SimpleNamespace(vocab_size=vocab, canvas_length=canvas, final_logit_softcapping=None)
        self.device = torch.device("cpu")
        self.dtype = dtype
        self.graphs_on = False  # as a runner without CUDA graphs: no SC input buffer to ask for
        self.fast = False  # the reference kernels: the sampler's torch row pass
        self.script = script
        self.canvases: list[list[int]] = []
        self.sc: list[str] = []
        self.sc_dtypes: list[torch.dtype] = []  # of the SC probabilities passed in
        self.sc_exact: list[bool] = []
        self.prefilled: list[list[int]] = []
        self.prefill_dtypes: list[torch.dtype | None] = []

    def denoise(self, canvas, kv, sc_logits=None, *, sc_probs=None, sc_seed=False, sc_exact=False, raw=False):
        self.canvases.append(canvas[0].tolist())
        self.sc_exact.append(sc_exact)
        self.sc.append("probs" if sc_probs is not None else "seed" if sc_seed else "none")
        if sc_probs is not None:
            self.sc_dtypes.append(sc_probs.dtype)
        return self.script(len(self.canvases) - 1, canvas[0]).float()[None]

    def sc_input_buffer(self, kv, canvas_len):
        return None  # no captured graph

    def prefill(self, ids, kv, compute_dtype=None):
        self.prefilled.append(ids[0].tolist())
        self.prefill_dtypes.append(compute_dtype)
        kv.length += ids.shape[1]


def peaked(tokens: list[int], margins: list[float] | float, vocab: int) -> torch.Tensor:
    """Logits [C, V]: row r puts `margin` on tokens[r], 0 elsewhere."""
    c = len(tokens)
    m = torch.tensor(margins if isinstance(margins, list) else [margins] * c, dtype=torch.float32)
    out = torch.zeros(c, vocab)
    out[torch.arange(c), torch.tensor(tokens)] = m
    return out
