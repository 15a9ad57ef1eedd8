"""Where a model's retrieval lookup lives, on CPU: per layer and head, the attention of the noised code-word slot
on the asked line's code word, on its key, and on all the list's code words, for asked lines near the list's end
(the last 8 lines) and far from it.

Run from the repository root: `python docs/train/retrieval_sweep/attention_from_slot.py MODEL_DIR [N]`.
"""

import random
import sys
from collections import defaultdict

import torch
from probe_by_length import noised_slot_batch  # this folder (the script's directory is on sys.path)
from tokenizers import Tokenizer

from diffgemma.train import data, forward
from diffgemma.weights.loader import load_model

captured: list[torch.Tensor] = []
_attention = forward.ops.attention


def attention_recording(q, k, v, mask):
    """The layer's attention, with its probabilities [B, H, T, T] kept in `captured`."""
    k_full = k.repeat_interleave(q.shape[1] // k.shape[1], 1)
    scores = (q @ k_full.transpose(-1, -2)).masked_fill(~mask, float("-inf"))  # scale 1, as ops.attention
    captured.append(torch.softmax(scores, -1))
    return _attention(q, k, v, mask)


def token_at(offsets: list[tuple[int, int]], char: int) -> int:
    """Index of the token that covers character `char`."""
    return next(i for i, (a, b) in enumerate(offsets) if a <= char < b)


def main(model_dir: str, n: int) -> None:
    tok = Tokenizer.from_file(f"{model_dir}/tokenizer.json")
    colon_id = tok.token_to_id(":")
    model = load_model(model_dir, "cpu", torch.float32).eval()
    forward.ops.attention = attention_recording
    mass = defaultdict(list)  # (layer, head, near|far, what) -> attention masses
    for lines in (16, 32):
        rng = random.Random(3000 + lines)
        for i in range(n):
            ex = data._retrieval(rng, lines=(lines, lines))
            enc = tok.encode(ex.prompt, add_special_tokens=False)
            line = f"- {ex.meta['key']}: {ex.meta['value']}"
            start = ex.prompt.index(line)
            key_i = token_at(enc.offsets, start + 2)
            val_i = token_at(enc.offsets, start + line.index(": ") + 2)
            values = [i for i in range(1, len(enc.ids)) if enc.ids[i - 1] == colon_id]
            b, canvas, slots = noised_slot_batch(tok, [ex], seed=1000 * lines + i)
            p, slot = b.prompt.shape[1], int(slots[0])
            shift = p - len(enc.ids)  # left padding
            captured.clear()
            with torch.no_grad():
                forward.train_forward(model, b.prompt, b.mask, canvas)
            where = "near" if ex.meta["n"] - 1 - ex.meta["index"] < 8 else "far"
            for layer, probs in enumerate(captured):
                row = probs[0, :, p + slot]  # [H, T]
                for h in range(row.shape[0]):
                    mass[(layer, h, where, "value")].append(row[h, val_i + shift].item())
                    mass[(layer, h, where, "key")].append(row[h, key_i + shift].item())
                    mass[(layer, h, where, "all values")].append(
                        row[h, [v + shift for v in values]].sum().item()
                    )

    def mean(key) -> float:
        return sum(mass[key]) / len(mass[key])

    print("layer type head | near: value key all-values | far: value key all-values")
    for layer, kind in enumerate(model.cfg.layer_types):
        for h in range(model.cfg.num_heads):
            cells = [
                f"{w}: {mean((layer, h, w, 'value')):.2f} {mean((layer, h, w, 'key')):.2f} "
                f"{mean((layer, h, w, 'all values')):.2f}"
                for w in ("near", "far")
            ]
            print(layer, kind.split("_")[0], h, "|", " | ".join(cells))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 40)
