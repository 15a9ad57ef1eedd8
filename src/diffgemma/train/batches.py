"""Training batches: fixed-shape buckets of synthetic examples (a prompt left-padded, a canvas of the reply, its
loss weights), built in worker processes ahead of the step that needs them (`Prefetcher`)."""

from __future__ import annotations

import collections
import concurrent.futures
import multiprocessing
import queue
import random
import re
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from tokenizers import Tokenizer

from diffgemma.train import data

if TYPE_CHECKING:
    from diffgemma.train.trainer import TrainConfig

PAD = 0

# Fixed-shape batches: every step has the same number of rows of each bucket (by task weight) and every context
# is left-padded to its bucket's length, so that on CUDA the whole step is replayed as one CUDA graph
# (`graphed.py`). Eager steps, bound by kernel launches, ran at 0.65 s a step at batch 1024 on an H200.
BUCKETS: tuple[tuple[tuple[str, ...], int], ...] = (
    (("arith", "think", "yesno", "long"), 160),
    (("retrieval", "retrieval_short", "schema"), 320),
    (("tool_call", "tool_answer", "tool_answer_json"), 416),
)


@dataclass
class Batch:
    prompt: torch.Tensor  # [B, P] left-padded
    mask: torch.Tensor  # [B, P]
    target: torch.Tensor  # [B, C] clean canvas
    weight: torch.Tensor  # [B, C] loss weights
    content: torch.Tensor  # [B, C] True up to and including the stop token
    lookup: torch.Tensor  # [B, 4] an answer's slot, the token it reads, the head, the state token it reads
    lines: torch.Tensor  # [B, P] True at a list's values (each two tokens after its key or letter)

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.prompt, self.mask, self.target, self.weight, self.content, self.lookup, self.lines)

    def to(self, device: str) -> Batch:
        nb = device != "cpu"
        return Batch(*(t.to(device, non_blocking=nb) for t in self.tensors()))


def task_weights(mix: str) -> dict[str, float]:
    """`data.TASK_WEIGHTS` with the overrides of a "task=weight,..." string."""
    weights = dict(data.TASK_WEIGHTS)
    for item in filter(None, mix.split(",")):
        task, _, w = item.partition("=")
        if task not in weights:
            raise ValueError(f"--mix: unknown task {task!r}; choose from {', '.join(weights)}")
        try:
            weights[task] = float(w)
        except ValueError:
            raise ValueError(f"--mix: {item!r} is not task=weight") from None
        if weights[task] < 0:
            raise ValueError(f"--mix: weight of {task} is negative")
    if not sum(weights.values()) > 0:
        raise ValueError("--mix: every task weight is 0")
    return weights


def bucket_rows(batch: int, weights: dict[str, float]) -> list[int]:
    """Rows of each bucket in a batch, by the buckets' task weights."""
    shares = [sum(weights[t] for t in tasks) for tasks, _ in BUCKETS]
    rows = [max(1, round(batch * s / sum(shares))) if s > 0 else 0 for s in shares]
    first = next(i for i, s in enumerate(shares) if s > 0)
    rows[first] += batch - sum(rows)
    return rows


def split_point(rng: random.Random, n_target: int, canvas: int) -> int:
    r = rng.random()
    if r < 0.6 or n_target <= 1:
        return 0
    blocks = [k * canvas for k in range(1, -(-n_target // canvas))]
    if r < 0.85 and blocks:
        return rng.choice(blocks)
    return rng.randrange(1, n_target)


LIST_LINE = re.compile(r"^- (\S+): (\S+)$", re.M)


def list_value_tokens(tok: Tokenizer, ex: data.Example, prompt) -> list[int]:
    """Token indices of a retrieval list's code words whose key is the token two before, in list order (from the
    encoding's offsets); [] for other tasks."""
    if ex.task != "retrieval":
        return []
    out = []
    for m in LIST_LINE.finditer(ex.prompt):
        j = prompt.char_to_token(m.start(2))
        ids = (tok.token_to_id("Ġ" + m.group(1)), tok.token_to_id("Ġ" + m.group(2)))
        if j is not None and j >= 2 and (prompt.ids[j - 2], prompt.ids[j]) == ids:
            out.append(j)
    return out


def answer_value_token(tok: Tokenizer, ex: data.Example, target) -> int | None:
    """Token index of a retrieval answer's code word in the target."""
    j = target.char_to_token(ex.target.index(f" is {ex.meta['value']}") + len(" is "))
    return j if target.ids[j] == tok.token_to_id("Ġ" + ex.meta["value"]) else None


# The head that each task's lookup is taught on: a retrieval answer matches a code word by the key it carries and
# reads the word; a choice matches an option by its name and reads the letter it carries.
LOOKUP_HEADS = {"retrieval": 0, "schema": 1}
NO_LOOKUP = (-1, -1, -1, -1)
# The state field whose value a schema question's label depends on; its slot reads that value in the first full
# layer, the hop that the last full layer's match of the option needs (the count's last digit for its parity).
STATE_FIELDS = {"kind": "item", "city": "city", "fruit": "item", "even": "count"}


def schema_option_tokens(tok: Tokenizer, ex: data.Example, prompt) -> dict[tuple[str, str], int]:
    """Token index of each choice option's name (its line "A) Madrid": the name two tokens after its letter),
    by (question id, name); {} for other tasks."""
    if ex.task != "schema":
        return {}
    out = {}
    for q in ex.meta["schema"]["questions"]:
        if q["type"] != "choice":
            continue
        at = ex.prompt.index(f"Question {q['id']}:")
        for letter, opt in zip("ABCDEFGH", q["options"], strict=False):
            at = ex.prompt.index(f"\n{letter}) {opt['name']}", at)
            j = prompt.char_to_token(at + len(f"\n{letter}) "))
            ids = (tok.token_to_id(letter), tok.token_to_id("Ġ" + opt["name"]))
            if j is not None and j >= 2 and (prompt.ids[j - 2], prompt.ids[j]) == ids:
                out[q["id"], opt["name"]] = j
    return out


def schema_state_token(tok: Tokenizer, ex: data.Example, prompt, field: str) -> int:
    """Token index of the state's value of `field` in the user's JSON (a number's last digit), -1 if not one
    token there."""
    value = ex.meta["state"][field]
    key = f'"{field}": '
    at = ex.prompt.rindex(key) + len(key)  # the state is the last message
    if isinstance(value, str):
        word, at = value, at + 1  # after the opening quote
    else:
        word, at = str(value)[-1], at + len(str(value)) - 1
    j = prompt.char_to_token(at)
    return j if j is not None and prompt.ids[j] == tok.token_to_id(word) else -1


def lookup_pointers(
    tok: Tokenizer, ex: data.Example, prompt, target
) -> tuple[tuple[int, int, int, int], list[int]]:
    """The `--lookup-weight` pointers of one example: (the answer's slot in the target, the context token its
    lookup reads or -1, the head, the state token it reads first or -1), `NO_LOOKUP` where there is none; and
    the context tokens whose key or letter is two tokens back. A retrieval answer reads the asked line's code
    word; a schema's first choice question reads the state's value and its right option's name, and without a
    choice question the first question with a `STATE_FIELDS` entry reads the state's value."""
    if ex.task == "schema":
        options = schema_option_tokens(tok, ex, prompt)
        at, state_only = 0, NO_LOOKUP
        for q in ex.meta["schema"]["questions"]:
            label = ex.meta["labels"][q["id"]]
            slot = at + len(f"{q['id']}:\n")
            at = slot + len(f"{label}\n")
            j = target.char_to_token(slot)
            if j is None or target.ids[j] != tok.token_to_id(label) or q["id"] not in STATE_FIELDS:
                continue
            state = schema_state_token(tok, ex, prompt, STATE_FIELDS[q["id"]])
            if q["type"] == "choice":
                name = q["options"]["ABCDEFGH".index(label)]["name"]
                if (q["id"], name) in options:
                    pointers = (j, options[q["id"], name], LOOKUP_HEADS["schema"], state)
                    return pointers, sorted(options.values())
            elif state >= 0 and state_only == NO_LOOKUP:
                state_only = (j, -1, LOOKUP_HEADS["schema"], state)
        return state_only, sorted(options.values())
    values = list_value_tokens(tok, ex, prompt)
    if len(values) == ex.meta.get("n"):  # every line found: values[i] is the asked line's code word
        answer = answer_value_token(tok, ex, target)
        if answer is not None:
            return (answer, values[ex.meta["index"]], LOOKUP_HEADS["retrieval"], -1), values
    return NO_LOOKUP, values


def make_batch(
    tok: Tokenizer,
    examples: list[data.Example],
    rng: random.Random,
    canvas: int,
    pad_weight: float,
    lookups: bool = False,
) -> list[tuple[list[int], list[int], list[float], list[bool], tuple[int, int, int, int], list[int]]]:
    """Rows (context, canvas, loss weights, content mask, lookup, list code words); the last two are the
    `--lookup-weight` pointers, filled only with `lookups` (`NO_LOOKUP` and [] otherwise: they cost a third of the
    batch-building time)."""
    prompts = tok.encode_batch([e.prompt for e in examples], add_special_tokens=False)
    targets = tok.encode_batch([e.target for e in examples], add_special_tokens=False)
    rows = []
    for ex, p, t in zip(examples, prompts, targets, strict=True):
        t_ids = t.ids
        s = split_point(rng, len(t_ids), canvas)
        ctx = p.ids + t_ids[:s]
        part = t_ids[s : s + canvas]
        n = len(part)
        (slot, *reads), values = lookup_pointers(tok, ex, p, t) if lookups else (NO_LOOKUP, [])
        look = (slot - s, *reads) if 0 <= slot - s < n else NO_LOOKUP  # the answer on this canvas
        rows.append(
            (
                ctx,
                part + [PAD] * (canvas - n),
                [1.0] * n + [pad_weight] * (canvas - n),
                [True] * n + [False] * (canvas - n),
                look,
                values,
            )
        )
    return rows


def collate(rows, length: int) -> Batch:
    """Rows left-padded to `length` context tokens, as CPU tensors."""
    prompt = torch.zeros(len(rows), length, dtype=torch.long)
    mask = torch.zeros(len(rows), length, dtype=torch.bool)
    lookup = torch.full((len(rows), 4), -1, dtype=torch.long)
    lines = torch.zeros(len(rows), length, dtype=torch.bool)
    for i, r in enumerate(rows):
        pad = length - len(r[0])  # context indices move with the left padding
        prompt[i, pad:] = torch.tensor(r[0])
        mask[i, pad:] = True
        if r[4][0] >= 0:
            slot, read, head, state = r[4]
            lookup[i] = torch.tensor(
                [slot, read + pad if read >= 0 else -1, head, state + pad if state >= 0 else -1]
            )
        lines[i, [pad + j for j in r[5]]] = True
    return Batch(
        prompt,
        mask,
        torch.tensor([r[1] for r in rows]),
        torch.tensor([r[2] for r in rows]),
        torch.tensor([r[3] for r in rows]),
        lookup,
        lines,
    )


# Retrieval curriculum. The lookup (match the asked key against the key written before each code word) forms
# as a sudden phase change. In a sweep on an H200 (a small model on retrieval alone) it formed only with 256
# retrieval rows a step AND lists grown from 2 lines by one line every 400 steps (the 2-8-line probe went
# 0.43 -> 1.00 between steps 2000 and 3000); batch 64 with the curriculum, or batch 256 without it, stayed at
# chance. The bundled model's retrieval-only first stage uses it (the lookup formed at steps 2750-3250); with
# the full task mix (192 retrieval rows a step) it did not form. Off by default. docs/train/ has the runs.
STEPS_PER_LINE = 400


def retrieval_cap(cfg: TrainConfig, step: int) -> int | None:
    """The longest retrieval list of a step under the curriculum, None once it is over."""
    return 2 + step // STEPS_PER_LINE if step < cfg.curriculum_steps else None


def batches_for_step(cfg: TrainConfig, tok: Tokenizer, step: int) -> list[Batch]:
    """The step's examples, one fixed-shape microbatch per bucket (deterministic in (seed, step))."""
    rng = random.Random(f"{cfg.seed}:batch:{step}")
    out = []
    mix = task_weights(cfg.mix)
    cap = retrieval_cap(cfg, step)
    for b, ((tasks, length), n) in enumerate(zip(BUCKETS, bucket_rows(cfg.batch, mix), strict=True)):
        if n == 0:
            continue
        weights = {t: mix[t] for t in tasks}
        rows: list = []
        draw = 0
        while len(rows) < n:  # the rare context longer than its bucket (a late split) is drawn again
            seed = ((cfg.seed * 1_000_003 + step) * 8 + b) * 1000 + draw
            examples = data.generate(n - len(rows), seed=seed, tasks=weights, max_lines=cap)
            rows += [
                r
                for r in make_batch(
                    tok, examples, rng, cfg.canvas_length, cfg.pad_weight, cfg.lookup_weight > 0
                )
                if len(r[0]) <= length
            ]
            draw += 1
            if draw > 50:
                raise ValueError(f"examples of {tasks} do not fit the bucket's {length} context tokens")
        out.append(collate(rows, length))
    return out


def _worker_init(tok_json: str) -> None:
    global _WORKER_TOK
    _WORKER_TOK = Tokenizer.from_str(tok_json)


def _worker_batches(cfg: TrainConfig, step: int) -> list[tuple]:
    # numpy arrays pickle by value; torch tensors would each go through a shared-memory file (measured: 4
    # workers were no faster than one thread)
    return [tuple(t.numpy() for t in b.tensors()) for b in batches_for_step(cfg, _WORKER_TOK, step)]


class Prefetcher:
    """Builds the next steps' batches in the background: on a thread, or (`workers` > 0) in worker processes,
    in step order. One Python thread built a batch-256 step in 38 ms on the H200's host, as long as a compiled,
    graphed step takes."""

    def __init__(
        self,
        cfg: TrainConfig,
        tok: Tokenizer,
        start: int,
        end: int,
        pin: bool,
        workers: int = 0,
        depth: int = 8,
    ):
        self.q: queue.Queue = queue.Queue(maxsize=depth)
        self.stop = threading.Event()
        self.pool = None
        if workers:
            ctx = multiprocessing.get_context("spawn")  # the parent holds CUDA: no fork
            self.pool = concurrent.futures.ProcessPoolExecutor(
                workers, mp_context=ctx, initializer=_worker_init, initargs=(tok.to_str(),)
            )

        def work() -> None:
            pending: collections.deque = collections.deque()
            step = start
            try:
                while not self.stop.is_set() and (step < end or pending):
                    while self.pool is not None and step < end and len(pending) < 2 * workers:
                        pending.append(self.pool.submit(_worker_batches, cfg, step))
                        step += 1
                    if self.pool is not None:
                        micro = [Batch(*map(torch.from_numpy, b)) for b in pending.popleft().result()]
                    else:
                        micro, step = batches_for_step(cfg, tok, step), step + 1
                    if pin:
                        micro = [Batch(*(t.pin_memory() for t in b.tensors())) for b in micro]
                    self._put(micro)
            except Exception as e:  # noqa: BLE001 - handed to the training loop, which raises it
                self._put(e)

        self.thread = threading.Thread(target=work, daemon=True)
        self.thread.start()

    def _put(self, item) -> None:
        while not self.stop.is_set():
            try:
                self.q.put(item, timeout=0.5)
                return
            except queue.Full:
                continue

    def get(self) -> list[Batch]:
        item = self.q.get()
        if isinstance(item, Exception):
            raise RuntimeError("building a training batch failed") from item
        return item

    def close(self) -> None:
        self.stop.set()
        while not self.q.empty():
            self.q.get_nowait()
        if self.pool is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)
