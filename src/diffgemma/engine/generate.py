"""Block-autoregressive generation (seed Part II §4, §6, §7): denoise a canvas, commit, prefill, repeat."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from diffgemma.config import SamplerConfig
from diffgemma.engine import sampler as S
from diffgemma.engine.rng import Rng, block_seed
from diffgemma.kernels import torch_ref as ref_ops
from diffgemma.model.kv_cache import KVCache

if TYPE_CHECKING:
    from diffgemma.runner.runner import ModelRunner

MIN_CANVAS = 64  # smallest canvas the empty-reply re-roll and MLX's shrink go down to


class CancelToken:
    """Set from any thread; generation stops between denoise steps."""

    def __init__(self) -> None:
        self._event = threading.Event()

    def cancel(self) -> None:
        self._event.set()

    @property
    def cancelled(self) -> bool:
        return self._event.is_set()


@dataclass
class StepInfo:
    block: int
    step: int  # executed steps in this block, from 1
    temperature: float
    argmax: torch.Tensor  # [C] on device
    accepted: torch.Tensor  # [C] bool on device
    mean_entropy: torch.Tensor  # 0-d on device
    entropy: torch.Tensor  # [C] on device: each row's, at the step's temperature


@dataclass
class TokenLogprob:
    """A committed token's log probability and its most likely alternatives (`top`: (id, logprob), best
    first), from the committing step's softcapped logits at temperature 1."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass
class BlockResult:
    tokens: list[int]  # final commit: the argmax of the last executed step
    p_max: list[float]
    steps: int
    logprobs: list[TokenLogprob] | None = None  # per canvas row, when asked for


@dataclass
class GenerateOutput:
    token_ids: list[int]  # generated ids, stop token trimmed
    steps: int = 0
    blocks: int = 0
    finish_reason: str = "length"  # "stop", "length" or "cancelled"
    stop_token: int | None = None
    prompt_tokens: int = 0
    prefill_seconds: float = 0.0
    denoise_seconds: float = 0.0
    retries: int = 0
    logprobs: list[TokenLogprob] = field(default_factory=list)  # per generated token, when asked for
    cached_tokens: int = 0  # generated tokens already prefilled into the cache (all but the last block)
    reused_tokens: int = 0  # prompt tokens whose KV was reused from an earlier turn
    text: str = ""  # with a tokenizer: the reply's content, reasoning and tool calls
    reasoning: str = ""
    tool_calls: list[Any] = field(default_factory=list)
    block_steps: list[int] = field(default_factory=list)

    @property
    def tokens_per_second(self) -> float:
        total = self.prefill_seconds + self.denoise_seconds
        return len(self.token_ids) / total if total > 0 else 0.0


class Canvas:
    """One canvas of a block being denoised: the state seed §6's step loop carries (the canvas, the block's noise,
    the next step's SC input, the stop rules' history), advanced by `step` one forward's logits at a time. The
    forward is the caller's: one canvas (`denoise_block`) or several in one pass (`engine.batch`)."""

    def __init__(
        self,
        vocab: int,
        cfg: SamplerConfig,
        seed: int,
        length: int,
        device: torch.device,
        block_index: int = 0,
        logprobs: int | None = None,
        softcap: float | None = None,
        dtype: torch.dtype = torch.float32,
        fast: bool = False,
    ):
        self.fast = fast  # the run's kernels (`kernels.dispatch.fast_kernels`): the row pass's too
        self.cfg, self.length, self.block, self.logprobs, self.softcap = (
            cfg,
            length,
            block_index,
            logprobs,
            softcap,
        )
        # what a lone step's SC output buffer needs when no graph offers its own (`step_canvas`), held here so that
        # a step asks the runner for nothing but its forward
        self.vocab, self.device, self.dtype = vocab, device, dtype
        rng = Rng(seed)
        n = self.steps_max = cfg.max_denoising_steps
        # All noise for the block in one host->device copy: the initial canvas, then one row per step.
        self.noise = torch.from_numpy(rng.tokens((n + 1) * length, vocab).reshape(n + 1, length)).to(device)
        self.uniforms = None
        if not cfg.denoiser_argmax:
            self.uniforms = torch.from_numpy(rng.uniforms(n * length).reshape(n, length)).to(device)
        self.ids = self.noise[0]
        self.filler = S.filler_id(vocab)
        self.stops = S.StopState(cfg, cfg.pad_token_id, self.filler)
        self.stats: S.RowStats | None = None
        self.i = 0  # executed steps
        self.done = False
        self.result: BlockResult | None = None

    def sc_input(self) -> tuple[torch.Tensor | None, bool, bool]:
        """The next forward's self-conditioning: (probs, seed, exact), as `DiffusionGemma.denoise` takes them."""
        if self.stats is not None:
            return self.stats.sc, False, not self.cfg.sc_sparse
        return None, self.cfg.first_step_sc_seed, False

    def step(self, logits: torch.Tensor, sc_out: torch.Tensor | None) -> StepInfo:
        """Advance by one forward's logits [C, V] (before the final softcap): the sampler's row pass (the next SC
        input into `sc_out` when sparse), accept, renoise, the stop rules (`advance`), then `settle` on their
        verdict: the one host read of a step."""
        info, stop = self.advance(logits, sc_out)
        self.settle(bool(stop), logits)
        return info

    def row_pass(self) -> tuple:
        """What the next step's row pass (`sampler.row_stats`) takes besides the logits: canvases of one key can
        share one pass over all of their rows (`engine.batch`)."""
        temp = S.temperature(self.cfg, self.steps_max - self.i)
        return (self.length, temp, self.cfg.sc_sparse, self.uniforms is not None, self.softcap, self.fast)

    def advance(
        self, logits: torch.Tensor, sc_out: torch.Tensor | None, stats: S.RowStats | None = None
    ) -> tuple[StepInfo, torch.Tensor]:
        """`step` without its host read: the step's info and the stop rules' verdict (a 0-d bool on the device),
        which the caller hands to `settle` (after queueing other canvases' steps: one host read for them all).
        `stats`: this canvas's rows of a row pass shared with others of its `row_pass` key (then no `sc_out`)."""
        cfg, i = self.cfg, self.i
        temp = S.temperature(cfg, self.steps_max - i)
        if stats is None:
            stats = S.row_stats(
                logits, temp, cfg.sc_sparse, self.uniforms is not None, sc_out, self.softcap, self.fast
            )
        self.stats = stats
        invalid = S.guard_invalid_rows(stats, self.filler)
        mask = S.accept_mask(stats.entropy, cfg.entropy_bound)
        denoised = stats.argmax
        if self.uniforms is not None:
            denoised = torch.where(invalid, self.filler, S.categorical(stats.probs, self.uniforms[i]))
        self.ids = torch.where(mask, denoised, self.noise[i + 1])  # renoise every non-accepted row
        stop = self.stops.update(i + 1, stats.argmax, stats.entropy, mask)
        self.i = i + 1
        info = StepInfo(self.block, i + 1, temp, stats.argmax, mask, stats.entropy.mean(), stats.entropy)
        return info, stop

    def settle(self, stop: bool, logits: torch.Tensor) -> None:
        """End the block if the stop rules said so or its steps are used up: its result from the last step (and
        `logits`, that step's, still in place: no forward ran after it)."""
        if stop or self.i == self.steps_max:
            stats = self.stats
            self.done = True
            self.result = BlockResult(stats.argmax.tolist(), stats.p_max.tolist(), self.i)
            if self.logprobs is not None:
                self.result.logprobs = token_logprobs(logits, stats.argmax, self.logprobs, self.softcap)


def denoise_block(
    runner: ModelRunner,
    kv: KVCache,
    cfg: SamplerConfig,
    seed: int,
    canvas_len: int,
    on_step: Callable[[StepInfo], None] | None = None,
    cancel: CancelToken | None = None,
    block_index: int = 0,
    logprobs: int | None = None,
) -> BlockResult | None:
    """Run the entropy-bound loop on one canvas; None if cancelled. Reads `kv`, never writes it. With `logprobs`
    (k >= 0), each row's committed token's log probability and its top k alternatives (`TokenLogprob`)."""
    m = runner.cfg
    canvas = Canvas(
        m.vocab_size, cfg, seed, canvas_len, runner.device, block_index, logprobs, m.final_logit_softcapping,
        runner.dtype, runner.fast,
    )  # fmt: skip
    return run_canvas(runner, canvas, kv, on_step, cancel)


def run_canvas(
    runner: ModelRunner,
    canvas: Canvas,
    kv: KVCache,
    on_step: Callable[[StepInfo], None] | None = None,
    cancel: CancelToken | None = None,
) -> BlockResult | None:
    """Step a lone canvas to its end (`step_canvas`); None if `cancel` fires first."""
    while not canvas.done:
        if cancel is not None and cancel.cancelled:
            return None
        info = step_canvas(runner, canvas, kv)
        if on_step is not None:
            on_step(info)
    return canvas.result


def step_canvas(runner: ModelRunner, canvas: Canvas, kv: KVCache) -> StepInfo:
    """One denoise step of a lone canvas after `kv`: the runner's forward (its fast path and graphs), then
    `Canvas.step`."""
    # The logits are the graph's own buffer before the final softcap (raw=True), which the sampler's row pass
    # applies as it reads them, before the next step overwrites them; the next SC input goes straight into
    # the graph's input buffer once there is one.
    probs, seed_sc, exact = canvas.sc_input()
    if probs is not None:
        logits = runner.denoise(canvas.ids[None], kv, sc_probs=probs, sc_exact=exact, raw=True)
    else:
        logits = runner.denoise(canvas.ids[None], kv, sc_seed=seed_sc, raw=True)
    # The dense SC input is the exact path: fp32 probabilities, not the graph's 16-bit buffer (seed §5).
    sc_out = None
    if canvas.cfg.sc_sparse:
        # only captured graphs have an SC input buffer (`graphs_on`, an attribute: without graphs a step enters the
        # runner for its forward alone)
        sc_out = runner.sc_input_buffer(kv, canvas.length) if runner.graphs_on else None
        if sc_out is None:
            # No graph yet: a buffer in the dtype a graph's would have. Written in fp32 and cast by torch, the
            # SC input was one ulp off the sampler's own rounding in a few elements, so a first request that
            # captured graphs got other ids than the same request later (docs/performance.md, "Sampler row
            # pass").
            sc_out = torch.empty(canvas.length, canvas.vocab, device=canvas.device, dtype=canvas.dtype)
    return canvas.step(logits[0], sc_out)


def token_logprobs(raw: torch.Tensor, chosen: torch.Tensor, k: int, softcap: float) -> list[TokenLogprob]:
    """Log probabilities of `chosen` [C] and each row's top k under softmax(softcap(raw)), raw [C, V] the LM
    head's output before the final softcap (temperature 1: the model's own distribution)."""
    lp = torch.log_softmax(ref_ops.softcap(raw, softcap), dim=-1)
    picked = lp.gather(-1, chosen[:, None])[:, 0].tolist()
    top_lp, top_ids = lp.topk(k, dim=-1) if k > 0 else (lp[:, :0], chosen[:, None][:, :0])
    return [
        TokenLogprob(t, p, list(zip(ids, lps, strict=True)))
        for t, p, ids, lps in zip(chosen.tolist(), picked, top_ids.tolist(), top_lp.tolist(), strict=True)
    ]


def confidence_cut(tokens: list[int], p_max: list[float], tau: float, stop_ids: set[int]) -> int:
    """Seed §9 #11: length to commit. Cut at the first row of the answer region (before any stop token) that is
    below tau AND duplicates a neighbour's argmax; row 0 is never cut."""
    end = next((i for i, t in enumerate(tokens) if t in stop_ids), len(tokens))
    for i in range(1, end):
        dup = tokens[i] == tokens[i - 1] or (i + 1 < len(tokens) and tokens[i] == tokens[i + 1])
        if p_max[i] < tau and dup:
            return i
    return len(tokens)


def prefill(
    runner: ModelRunner,
    ids: list[int],
    kv: KVCache,
    cfg: SamplerConfig,
    model_dtype: torch.dtype | None = None,
) -> None:
    """Extend `kv` by ids under seed rule 7 (`prefill_dtype`). `model_dtype`: the runner's dtype when the caller holds
    it already (a `Turn`, which reads it once)."""
    if not ids:
        return
    t = torch.tensor([ids], dtype=torch.long)
    runner.prefill(t, kv, compute_dtype=prefill_dtype(model_dtype or runner.dtype, len(ids), kv.length, cfg))


def prefill_dtype(dtype: torch.dtype, n: int, cached: int, cfg: SamplerConfig) -> torch.dtype | None:
    """The activations' dtype of n tokens prefilled after `cached` ones on a model in `dtype` (None: the model's):
    the one prefill precision rule."""
    # Seed rule 7: a whole prompt of up to prefill_f32_max_tokens, into an empty cache, prefills with fp32
    # activations; what extends a cache (a later turn, a committed block, a Finalize) takes the model-dtype path.
    f32 = cached == 0 and 0 < n <= cfg.prefill_f32_max_tokens and dtype != torch.float32
    return torch.float32 if f32 else None


@dataclass
class Proposal:
    """A denoised canvas not yet committed (`Turn.propose`): the block's final argmax, its confidences and the steps
    it took; `stop_at`, the first stop token's row (None without one)."""

    block: int
    retry: int
    tokens: list[int]
    p_max: list[float]
    steps: int
    stop_at: int | None
    logprobs: list[TokenLogprob] | None = None


class Turn:
    """One reply generated block by block: the per-block protocol under `generate` (seed Part III, the token
    pipeline). `propose` prefills what the last commit left pending and denoises the next canvas (reading the cache,
    never writing it); `commit(kept_len)` takes the proposal's first kept_len tokens; `discard` re-rolls it (the
    next retry's seed, half the canvas: seed §9 #10). A commit ends the turn when the token after the kept ones is a
    stop token or the block is nothing but pad/filler (`pad_block_stop`, the blanks dropped) ("stop"), or when the
    budget or the block limit is used up ("length"); a commit cut before a stop token (the confidence trim) leaves
    the rest to the next block. `out` is the reply so far.

    Between calls `kv` holds the prompt and every committed block but the last (which the caller prefills with
    whatever follows it), so a turn stopped anywhere leaves the cache consistent."""

    def __init__(
        self,
        runner: ModelRunner,
        prompt_ids: list[int],
        kv: KVCache,
        cfg: SamplerConfig,
        seed: int = 42,
        max_new_tokens: int | None = None,
        logprobs: int | None = None,
        prefill_now: bool = True,
    ):
        max_new = cfg.max_new_tokens if max_new_tokens is None else max_new_tokens
        if max_new <= 0:
            raise ValueError(f"max_new_tokens must be positive, got {max_new}")
        self.model, self.kv, self.cfg, self.seed, self.max_new, self.logprobs = (
            runner, kv, cfg, seed, max_new, logprobs
        )  # fmt: skip
        self.prompt_ids = list(prompt_ids)  # the uncached prompt the turn prefills first
        self.stop_ids = set(cfg.stop_token_ids)
        # the runner's model config, device and dtype, read once: a block enters the runner for its forwards alone
        self.model_cfg, self.device, self.dtype, self.fast = (
            runner.cfg,
            runner.device,
            runner.dtype,
            runner.fast,
        )
        self.blank_ids = {cfg.pad_token_id, S.filler_id(self.model_cfg.vocab_size)}  # `pad_block_stop`
        canvas_len = self.model_cfg.canvas_length
        self.max_blocks = -(-max_new // canvas_len) * (2 if cfg.commit_conf_trim > 0 else 1)  # trim headroom
        self.out = GenerateOutput(token_ids=[], prompt_tokens=len(prompt_ids))
        self.block = 0
        self.retry = 0
        self.length = self._canvas_length()
        self.pending: list[int] = []  # committed, not yet prefilled
        self.done = False
        self.proposal: Proposal | None = None
        self.unprefilled = list(prompt_ids)  # the prompt's tokens not yet in the cache (`prefill_prompt`)
        if prefill_now:
            self.prefill_prompt()

    def prefill_prompt(self, budget: int | None = None) -> int:
        """Prefill the prompt's next `budget` tokens (all of them by default); returns how many. A prompt that fits
        the budget goes in whole, so seed rule 7 (a whole short prompt in fp32) sees it as a lone turn would."""
        ids = self.unprefilled if budget is None else self.unprefilled[:budget]
        if not ids:
            return 0
        self._prefill(ids)
        self.unprefilled = self.unprefilled[len(ids) :]
        return len(ids)

    def _prefill(self, ids: list[int]) -> None:
        """`prefill` ids into the turn's cache, its time counted as the turn's prefill time."""
        t0 = time.perf_counter()
        prefill(self.model, ids, self.kv, self.cfg, self.dtype)
        sync(self.device)
        self.out.prefill_seconds += time.perf_counter() - t0

    @property
    def remaining(self) -> int:
        return self.max_new - len(self.out.token_ids)

    def _canvas_length(self) -> int:
        canvas_len = self.model_cfg.canvas_length
        return min(canvas_len, max(self.remaining, MIN_CANVAS)) if self.cfg.canvas_shrink else canvas_len

    def propose(
        self, on_step: Callable[[StepInfo], None] | None = None, cancel: CancelToken | None = None
    ) -> Proposal | None:
        """Denoise the next canvas; None (and the turn ends "cancelled") if `cancel` fires first."""
        self.prefill_pending()
        t0 = time.perf_counter()
        res = run_canvas(self.model, self.canvas(), self.kv, on_step, cancel)
        self.out.denoise_seconds += time.perf_counter() - t0
        return self.propose_from(res)

    def prefill_pending(self) -> None:
        """Open the next proposal: prefill what is left of the prompt, and what the last commit left pending."""
        if self.done or self.proposal is not None:
            raise RuntimeError("propose needs an open turn without a proposal pending")
        self.prefill_prompt()
        if self.pending:
            self._prefill(self.pending)
            self.pending = []

    def canvas(self) -> Canvas:
        """The next proposal's canvas (`propose` runs it; a caller that runs its forwards itself, `engine.batch`,
        prefills what is left of the prompt and `pending` first and calls `propose_from(canvas.result)` when it is
        done)."""
        m = self.model_cfg
        seed = block_seed(self.seed, self.block, self.retry)
        return Canvas(
            m.vocab_size, self.cfg, seed, self.length, self.device, self.block, self.logprobs,
            m.final_logit_softcapping, self.dtype, self.fast,
        )  # fmt: skip

    def propose_from(self, res: BlockResult | None) -> Proposal | None:
        """The proposal of a denoised canvas's result (None: cancelled, and the turn ends so)."""
        out = self.out
        if res is None:
            self.done = True
            out.finish_reason = "cancelled"
            out.cached_tokens = len(out.token_ids)
            return None
        out.steps += res.steps
        out.block_steps.append(res.steps)
        stop_at = next((i for i, t in enumerate(res.tokens) if t in self.stop_ids), None)
        self.proposal = Proposal(
            self.block, self.retry, res.tokens, res.p_max, res.steps, stop_at, res.logprobs
        )
        return self.proposal

    def discard(self) -> None:
        """Drop the proposal and re-roll the block: the next retry's seed, half the canvas (not below MIN_CANVAS)."""
        self._pending_proposal()
        self.proposal = None
        self.retry += 1
        self.out.retries += 1
        self.length = max(MIN_CANVAS, self.length // 2) if self.length > MIN_CANVAS else self.length

    def commit(self, kept_len: int) -> list[int]:
        """Take the proposal's first kept_len tokens (at most the budget left) into the reply; returns them."""
        prop = self._pending_proposal()
        if not 0 <= kept_len <= len(prop.tokens):
            raise ValueError(f"kept_len {kept_len} outside the proposal's {len(prop.tokens)} tokens")
        out = self.out
        kept = prop.tokens[:kept_len][: self.remaining]
        out.blocks += 1
        out.cached_tokens = len(out.token_ids)
        if self._blank(prop, kept):
            # Nothing left to say: the blanks are no text, so they leave the reply (and are never prefilled).
            self.proposal = None
            self.done = True
            out.finish_reason = "stop"
            return []
        out.token_ids += kept
        out.logprobs += (prop.logprobs or [])[: len(kept)]
        self.proposal = None
        if len(kept) < len(prop.tokens) and prop.tokens[len(kept)] in self.stop_ids:
            self.done = True
            out.finish_reason, out.stop_token = "stop", prop.tokens[len(kept)]
        elif self.remaining <= 0 or self.block + 1 >= self.max_blocks:
            self.done = True
            out.finish_reason = "length"
        else:
            self.pending = kept
            self.block += 1
            self.retry = 0
            self.length = self._canvas_length()
        return kept

    def _blank(self, prop: Proposal, kept: list[int]) -> bool:
        """`pad_block_stop`: the kept tokens and the rest of the proposal before its stop token are all pad/filler."""
        if not self.cfg.pad_block_stop or not kept:
            return False
        # the whole answer region, not only the kept rows: a confidence cut after a leading pad keeps the text after it
        end = len(prop.tokens) if prop.stop_at is None else prop.stop_at
        return all(t in self.blank_ids for t in kept) and all(t in self.blank_ids for t in prop.tokens[:end])

    def _pending_proposal(self) -> Proposal:
        if self.proposal is None:
            raise RuntimeError("no proposal to commit or discard: propose first")
        return self.proposal


def default_commit(turn: Turn, prop: Proposal) -> int | None:
    """The contract's decision on a proposal: None to re-roll it (a first block opening on a stop or pad token,
    seed §9 #10), else how many of its tokens to keep: up to the first stop token, or to the confidence cut
    (seed §9 #11), within the budget."""
    cfg = turn.cfg
    empty = not turn.out.token_ids and prop.tokens[0] in turn.stop_ids | {cfg.pad_token_id}
    if empty and turn.retry < cfg.empty_reply_retry:
        return None
    kept = len(prop.tokens) if prop.stop_at is None else prop.stop_at
    if cfg.commit_conf_trim > 0:
        kept = min(kept, confidence_cut(prop.tokens, prop.p_max, cfg.commit_conf_trim, turn.stop_ids))
    return min(kept, turn.remaining)


def drive(
    turn: Turn,
    on_step: Callable[[StepInfo], None] | None = None,
    cancel: CancelToken | None = None,
    on_commit: Callable[[Turn, list[int]], None] | None = None,
) -> GenerateOutput:
    """Run `turn` to its end under `default_commit`; `on_commit(turn, kept)` after each commit."""
    while not turn.done:
        prop = turn.propose(on_step, cancel)
        if prop is None:
            break
        kept_len = default_commit(turn, prop)
        if kept_len is None:
            turn.discard()
            continue
        kept = turn.commit(kept_len)
        if on_commit is not None:
            on_commit(turn, kept)
    return turn.out


def generate(
    runner: ModelRunner,
    prompt_ids: list[int],
    kv: KVCache,
    cfg: SamplerConfig,
    seed: int = 42,
    max_new_tokens: int | None = None,
    on_step: Callable[[StepInfo], None] | None = None,
    on_block: Callable[[list[int]], None] | None = None,
    cancel: CancelToken | None = None,
    logprobs: int | None = None,
) -> GenerateOutput:
    """Prefill `prompt_ids` (the tokens not yet in `kv`) and generate a reply: a `Turn` `drive`n by
    `default_commit`. With `logprobs` (k >= 0), `out.logprobs` holds each generated token's `TokenLogprob` with k
    alternatives. On return `kv` holds the prompt and every committed block except the last one."""
    turn = Turn(runner, prompt_ids, kv, cfg, seed, max_new_tokens, logprobs)
    on_commit = None if on_block is None else lambda _turn, kept: on_block(kept)
    return drive(turn, on_step, cancel, on_commit)


def sync(device: torch.device) -> None:
    """Wait for the model's device (CUDA), so that host clocks time its work."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
