"""How far a model's retrieval lookup reaches, on CPU: the code-word probe by list length and by the asked line's
distance from the list's end, and generation exact match through the engine by list length.

Run from the repository root: `python docs/train/retrieval_sweep/probe_by_length.py MODEL_DIR [N]`. It probes
twice: as the eval asks, and with a sliding window of filler between the list and the question.
The probe noises only the answer's code-word slot of a clean reply and reads the argmax there.
"""

import json
import random
import sys
from collections import defaultdict

import torch
from tokenizers import Tokenizer

import diffgemma
from diffgemma.train import data, trainer
from diffgemma.train.forward import train_forward
from diffgemma.weights.loader import load_model

LINES = (2, 4, 8, 12, 16, 24, 32, 40, 48)
GEN_LINES = (2, 4, 8, 16, 32)


def noised_slot_batch(
    tok: Tokenizer, exs: list[data.Example], seed: int
) -> tuple[trainer.Batch, torch.Tensor, torch.Tensor]:
    """The examples as one batch, its canvases [B, C] clean but for the code-word slot (after "is"), noised;
    returns (batch, canvases, slot index per row)."""
    rows = trainer.make_batch(tok, exs, random.Random(1), 32, 0.25)
    b = trainer.collate(rows, max(len(r[0]) for r in rows))
    canvas = b.target.clone()
    slot = (canvas == tok.token_to_id("Ġis")).float().argmax(1) + 1
    noise = torch.randint(3, 2000, (len(exs),), generator=torch.Generator().manual_seed(seed))
    canvas[torch.arange(len(exs)), slot] = noise
    return b, canvas, slot


def probe(model_dir: str, n: int, filler: bool = False) -> tuple[dict[int, float], dict[str, float]]:
    tok = Tokenizer.from_file(f"{model_dir}/tokenizer.json")
    model = load_model(model_dir, "cpu", torch.float32).eval()
    by_lines, by_back = {}, defaultdict(list)
    for lines in LINES:
        rng = random.Random(1000 + lines)
        exs = [data._retrieval(rng, lines=(lines, lines), filler=filler) for _ in range(n)]
        b, canvas, slot = noised_slot_batch(tok, exs, seed=lines)
        rows_i = torch.arange(n)
        with torch.no_grad():
            pred = train_forward(model, b.prompt, b.mask, canvas).argmax(-1)[rows_i, slot]
        ok = (pred == b.target[rows_i, slot]).tolist()
        by_lines[lines] = round(sum(ok) / n, 3)
        for ex, hit in zip(exs, ok, strict=True):
            back = ex.meta["n"] - 1 - ex.meta["index"]
            by_back[min(back // 8, 5)].append(hit)
    back = {f"{8 * k}-{8 * k + 7}": round(sum(v) / len(v), 3) for k, v in sorted(by_back.items())}
    return by_lines, back


def generation(model_dir: str, n: int) -> dict[int, float]:
    eng = diffgemma.load(model_dir, device="cpu", dtype="float32")
    tok = Tokenizer.from_file(f"{model_dir}/tokenizer.json")
    out = {}
    for lines in GEN_LINES:
        rng = random.Random(50 + lines)
        hits = 0
        for i in range(n):
            ex = data._retrieval(rng, lines=(lines, lines))
            reply = eng.generate(
                tok.encode(ex.prompt, add_special_tokens=False).ids, max_new_tokens=40, seed=i
            )
            hits += tok.decode(reply.token_ids, skip_special_tokens=False) == ex.answer
        out[lines] = hits / n
    return out


if __name__ == "__main__":
    model_dir = sys.argv[1]
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 128
    by_lines, by_back = probe(model_dir, n)
    print("probe by list lines:", json.dumps(by_lines))
    print("probe by lines from the list's end:", json.dumps(by_back))
    # a window of filler between the list and the question: only the full-attention layers can answer
    by_lines, by_back = probe(model_dir, n, filler=True)
    print("with filler, probe by list lines:", json.dumps(by_lines))
    print("with filler, by lines from the list's end:", json.dumps(by_back))
    print("generation exact match by list lines:", json.dumps(generation(model_dir, max(1, n * 40 // 128))))
