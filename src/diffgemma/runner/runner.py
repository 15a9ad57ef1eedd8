"""`ModelRunner`: how the model runs. It asks `kernels.dispatch` once which kernels a `RuntimeConfig` gets
(`fast_kernels`), builds the model's steps from the answer, and owns everything about executing the plain
forward fast: the prefill routes and chunks, CUDA graphs and their pools, the staging cache of padded prefills,
torch.compile'd regions, and what the engine's warm-up needs. Generation, conversations and the server call the
runner, never the model's forward directly.

The scheduler's contract with it (`engine.batch.Scheduler`) is data: a `StepPlan` (prompt chunks, commits and one
forward's canvases, each a cache and token ids) in, a `ModelOutput` (each canvas's logits) out, through `execute`;
how the plan runs (which commits share a pass, which canvases a batched pass, graphs) is the runner's alone.

The one difference in behaviour between the kernels (docs/performance.md, "Prefill in chunks at fixed
positions"): the reference prefills in aligned canvas chunks and a rewind encodes the cut chunk again, so that a
cache's bytes do not depend on its history; the fast kernels take their fastest routes and a rewind only
truncates: aligned C-row chunks would multiply a long prompt's passes (and expert weight reads) by
prefill_chunk / C, and a re-encode on the fast routes would not give back what a fresh prefill's route (a padded
graph, a commit, one large chunk) wrote."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.nn.functional as F

from diffgemma.config import ModelConfig, RuntimeConfig
from diffgemma.kernels import dispatch
from diffgemma.model.kv_cache import KVCache
from diffgemma.model.model import DiffusionGemma
from diffgemma.model.passes import COMMIT, Pass
from diffgemma.model.steps import FastSteps, Steps, kv_tables
from diffgemma.runner import parallel
from diffgemma.runner.graphs import DenoiseGraphs, GraphStep, full_keys


def _sc_mode(cv: DenoiseInput) -> str | None:
    """A canvas's SC input as `DiffusionGemma.decoder_input_runs` takes it."""
    if cv.probs is not None:
        return "exact" if cv.exact else "probs"
    return "seed" if cv.seed else None


def follows(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether rows b [C, V] come right after rows a in one contiguous buffer."""
    return (
        a.is_contiguous()
        and b.is_contiguous()
        and a.shape == b.shape
        and a.dtype == b.dtype
        and b.untyped_storage().data_ptr() == a.untyped_storage().data_ptr()
        and b.data_ptr() == a.data_ptr() + a.numel() * a.element_size()
    )


class Prefill(NamedTuple):
    """Tokens to append to a cache: `ids` after `kv`, with activations in `compute_dtype` (None: the model's)."""

    kv: KVCache
    ids: list[int]
    compute_dtype: torch.dtype | None = None


class DenoiseInput(NamedTuple):
    """One canvas of a forward: its ids [C], its cache, its SC input (`Canvas.sc_input`: probs, seed, exact)."""

    ids: torch.Tensor
    kv: KVCache
    probs: torch.Tensor | None
    seed: bool
    exact: bool


@dataclass
class StepPlan:
    """What one scheduler step has the runner run, in this order: prompt chunks (each its own prefill), committed
    blocks (their prefill), then one forward over `canvases` (all of one length, each after its own cache)."""

    prompts: list[Prefill] = field(default_factory=list)
    commits: list[Prefill] = field(default_factory=list)
    canvases: list[DenoiseInput] = field(default_factory=list)


@dataclass
class ModelOutput:
    """What a `StepPlan` gave: each canvas's logits [C, V] (the LM head's raw output, before the final softcap; a
    graph's own buffer, valid until the runner's next forward) and the seconds its parts took: each prompt chunk's,
    each commit's (the pass it shared), and the forward's (launched, not waited for: the sampler's read waits)."""

    logits: list[torch.Tensor]
    prompt_seconds: list[float]
    commit_seconds: list[float]
    forward_seconds: float


# A prompt of up to PREFILL_GRAPH_MAX tokens into an empty cache is padded to a multiple of PREFILL_GRAPH_BUCKET
# and, on CUDA, replayed as a CUDA graph: eagerly its ~950 launches bound it by the host (docs/performance.md,
# "CUDA graphs").
PREFILL_GRAPH_MAX = 2048
PREFILL_GRAPH_BUCKET = 256


class ModelRunner:
    """Runs `model` as `config` says: `prefill`, `denoise` and `rewind` on KV caches (`engine.warm_up` compiles it
    before serving)."""

    def __init__(self, model: DiffusionGemma, config: RuntimeConfig | None = None) -> None:
        self.model = model
        self.config = config or RuntimeConfig()
        self.fast = dispatch.fast_kernels(self.config.kernels, model.device, model.dtype)  # the one choice
        if self.fast and self.config.attention_topk and model.device.type != "cuda":
            raise ValueError(
                "attention_topk on the fast kernels needs a CUDA device (the reference kernels have it)"
            )
        model.steps = (
            FastSteps(compile=self.config.compile, topk=self.config.attention_topk)
            if self.fast
            else Steps(topk=self.config.attention_topk)
        )
        # expert parallel: this rank's experts, the other ranks' summed in (a host read a layer)
        if self.config.expert_parallel > 1:
            lo, hi = parallel.shard_experts(model, self.config.expert_parallel)
            model.steps = parallel.ExpertParallelSteps(model.steps, lo, hi)
        self.graphs_on = (
            self.fast
            and self.config.graphs
            and model.device.type == "cuda"
            and self.config.expert_parallel == 1
        )
        self.graphs = DenoiseGraphs(model.device, model.cfg.vocab_size, model.dtype, model.embed.dtype)
        # by row count: each cache's `KVCache.denoise_geometry` on the device, as graphs read it
        self._geometry: dict[int, torch.Tensor] = {}
        # by row count: each cache's layer buffers as the ragged attention reads them (`steps.kv_tables`)
        self._tables: dict[int, torch.Tensor] = {}
        self._prefill_graphs: dict[
            int, GraphStep | None
        ] = {}  # padded length -> graph (None: ran eagerly once)
        self._prefill_pool = None
        self._stage: KVCache | None = None  # where a padded prefill writes K/V before they are copied out

    def follow(self) -> None:
        """On ranks 1.. of an expert parallel group: serve this rank's experts to rank 0's forwards until rank 0
        releases the group (`parallel.release`, at its exit if not before). Rank 0 runs the engine."""
        if not isinstance(self.model.steps, parallel.ExpertParallelSteps) or self.model.steps.rank == 0:
            raise ValueError("follow runs on ranks 1.. of an expert parallel group (expert_parallel > 1)")
        self.model.steps.follow(self.model)

    @property
    def cfg(self) -> ModelConfig:
        return self.model.cfg

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    def new_cache(self, max_tokens: int, ring_size: int | None = None) -> KVCache:
        return self.model.new_cache(max_tokens, ring_size=ring_size)

    # -- a scheduler step ---------------------------------------------------------------------------------

    @torch.no_grad()
    def execute(self, plan: StepPlan) -> ModelOutput:
        """Run `plan`: its prompt chunks one by one, its commits (those that fit their canvas slots in one pass,
        `commit_many`, the rest one by one), then its canvases' forward (`_forward`)."""
        prompt_seconds = [self._timed(self.prefill, p.ids, p.kv, p.compute_dtype) for p in plan.prompts]
        commit_seconds = self._commit_blocks(plan.commits)
        t0 = time.perf_counter()
        logits = self._forward(plan.canvases)
        return ModelOutput(logits, prompt_seconds, commit_seconds, time.perf_counter() - t0)

    def _commit_blocks(self, commits: list[Prefill]) -> list[float]:
        """Prefill each commit; the seconds each waited for (a shared pass's, for each commit in it)."""
        shared = [
            i
            for i, p in enumerate(commits)
            if p.ids and p.compute_dtype is None and self._commits_on_canvas(p.kv, len(p.ids))
        ]
        seconds: list[float | None] = [None] * len(commits)
        if len(shared) > 1:
            dt = self._timed(self.commit_many, [(commits[i].ids, commits[i].kv) for i in shared])
            for i in shared:
                seconds[i] = dt
        for i, p in enumerate(commits):
            if seconds[i] is None:
                seconds[i] = self._timed(self.prefill, p.ids, p.kv, p.compute_dtype)
        return seconds

    def _forward(self, canvases: list[DenoiseInput]) -> list[torch.Tensor]:
        """Each canvas's raw logits [C, V]: those that can share a pass (`_batches`) in one (`denoise_many`), a
        lone one through `denoise` (its graphs). Of a plan's canvases at most one reads a graph's buffer (a lone one
        that could share: the others run eagerly), so every canvas's logits hold until the next forward."""
        if not canvases:
            return []
        c = canvases[0].ids.shape[-1]
        if any(x.ids.shape[-1] != c for x in canvases):
            raise ValueError("a plan's canvases are of one length")
        shared = [i for i, x in enumerate(canvases) if self._batches(x.kv, c)]
        logits: list[torch.Tensor | None] = [None] * len(canvases)
        if len(shared) > 1:
            many = self.denoise_many([canvases[i] for i in shared])
            for b, i in enumerate(shared):
                logits[i] = many[b]
        for i, x in enumerate(canvases):
            if logits[i] is None:
                one = self.denoise(
                    x.ids[None], x.kv, sc_probs=x.probs, sc_seed=x.seed, sc_exact=x.exact, raw=True
                )
                logits[i] = one[0]
        return logits

    def _timed(self, fn: Callable[..., object], *args: object) -> float:
        """Seconds `fn(*args)` takes on the host clock, the device waited for."""
        t0 = time.perf_counter()
        fn(*args)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - t0

    # -- prefill -----------------------------------------------------------------------------------------

    @torch.no_grad()
    def prefill(
        self, ids: torch.Tensor | list[int], kv: KVCache, compute_dtype: torch.dtype | None = None
    ) -> None:
        """Extend `kv` by ids (a list, or [1, T] / [T]) and its token log (`KVCache.tokens`). `compute_dtype`
        (fp32 for short prompts, seed §3) runs the activations in it. The reference kernels prefill in aligned
        chunks (`_prefill_aligned`); the fast kernels take the fastest route: a padded graph for a short prompt
        into an empty cache, a commit graph on the canvas slots for a block after a cache, chunks otherwise."""
        ids = torch.as_tensor(ids, dtype=torch.long).reshape(-1)
        if kv.length + ids.shape[0] > kv.max_tokens:
            raise ValueError(
                f"prompt does not fit: {kv.length} cached + {ids.shape[0]} new > {kv.max_tokens}"
            )
        if not ids.numel():
            return
        self.model.check_ids(ids, 1)
        known = kv.knows_tokens()
        new = ids.tolist()
        dtype = compute_dtype or self.dtype
        t = ids.shape[0]
        if not self.fast:
            self._prefill_aligned(ids, kv, dtype)
        elif (
            kv.length == 0 and t <= min(self.config.prefill_chunk, PREFILL_GRAPH_MAX) and dtype == self.dtype
        ):
            self._prefill_padded(ids, kv)
        elif dtype == self.dtype and self._commits_on_canvas(kv, t):
            self._commit([(ids, kv)])
        else:
            for s in range(0, t, self.config.prefill_chunk):
                self.model.prefill(ids[s : s + self.config.prefill_chunk], kv, compute_dtype=dtype)
        if known:
            kv.tokens.extend(new)

    def _prefill_aligned(self, ids: torch.Tensor, kv: KVCache, dtype: torch.dtype) -> None:
        """ids [T] after the cache in chunks of one canvas at fixed absolute positions (0, C, 2C, ...), each padded
        to C rows: a cache that ends inside a chunk has that chunk's cached part encoded again with the new tokens.
        Every chunk is then the same computation whatever came before it, so a conversation's K/V, and its
        answers, do not depend on how its turns were prefilled or what the cache held (docs/performance.md,
        "Prefill in chunks at fixed positions"). The pad rows come after every real one and write nothing."""
        c, start = self.cfg.canvas_length, kv.length
        redo = start % c
        if redo and kv.knows_tokens() and kv.can_truncate(start - redo):
            ids = torch.cat([torch.tensor(kv.tokens[start - redo : start]), ids])
            kv.length = start - redo  # encoded again below, to the same length and tokens
        pad = self.cfg.pad_token_id or 0
        for s in range(0, ids.shape[0], c):
            part = ids[s : s + c]
            padded = F.pad(part, (0, c - part.shape[0]), value=pad)
            self.model.prefill(padded[None], kv, compute_dtype=dtype, valid=part.shape[0])

    def _prefill_padded(self, ids: torch.Tensor, kv: KVCache) -> None:
        """ids [T] into the empty cache `kv`, encoded padded with pad tokens to a multiple of PREFILL_GRAPH_BUCKET
        (causal attention: no prompt row sees them) into a staging cache, whose first T positions are then copied
        into `kv`. On CUDA a bucket's second prompt captures a graph that the later ones replay; its first runs
        eagerly, and so compiles what the capture needs. Eager or replayed, the shapes are the bucket's: a prompt
        leaves the same cache either way."""
        t = ids.shape[0]
        tb = -(-t // PREFILL_GRAPH_BUCKET) * PREFILL_GRAPH_BUCKET
        padded = F.pad(ids, (0, tb - t), value=self.cfg.pad_token_id or 0).to(self.device)
        if self._stage is None:  # a ring as long as the cache: every layer keeps positions in order
            self._stage = self.model.new_cache(PREFILL_GRAPH_MAX, ring_size=PREFILL_GRAPH_MAX)
        stage = self._stage
        stage.reset()
        step = self._prefill_graphs.get(tb)
        if step is None and tb in self._prefill_graphs and self.graphs_on:
            if self._prefill_pool is None:
                self._prefill_pool = torch.cuda.graph_pool_handle()
            step = GraphStep(
                lambda i, _: self.model.prefill(i[None], stage),
                padded,
                None,
                self._prefill_pool,
                warm_up=False,
            )
            self._prefill_graphs[tb] = step
        if step is not None:
            step(padded, None)
        else:
            self.model.prefill(padded[None], stage)
            self._prefill_graphs[tb] = None
        for layer in self.model.layers:
            kv.write(layer.idx, 0, stage.kv[layer.idx][:, :, :t])
        kv.length = t

    def _commits_on_canvas(self, kv: KVCache, t: int) -> bool:
        """Whether t new tokens after `kv` prefill as a commit on its canvas slots (`_commit`): the fast kernels, a
        non-empty cache in the model's dtype, at most a canvas of tokens."""
        return self.fast and kv.length > 0 and t <= kv.canvas_slots and kv.dtype == self.dtype

    @torch.no_grad()
    def commit_many(self, items: list[tuple[list[int], KVCache]]) -> None:
        """`prefill` of each (ids, kv) where every one `_commits_on_canvas`: one commit pass for all of them."""
        if not items:
            return
        if not all(self._commits_on_canvas(kv, len(ids)) and ids for ids, kv in items):
            raise ValueError("commit_many takes non-empty commits that fit their caches' canvas slots")
        self._commit([(torch.tensor(ids, dtype=torch.long), kv) for ids, kv in items])
        for ids, kv in items:
            if kv.knows_tokens():
                kv.tokens.extend(ids)

    def _commit(self, items: list[tuple[torch.Tensor, KVCache]]) -> None:
        """Each ids [t] (t <= the canvas slots) after its non-empty cache (a block's commit, a short turn), all in
        one pass: a prefill run on the canvas slots as a denoise step runs, causal, each row padded with pad
        tokens to the canvas (no real row sees them), and graphed on CUDA like the denoise step
        (docs/performance.md, "CUDA graphs"). The canvas slots are the full layers' own positions; a sliding
        layer's K/V are then written to its ring from there."""
        kvs = [kv for _, kv in items]
        c, pad = kvs[0].canvas_slots, self.cfg.pad_token_id or 0
        padded = torch.cat([F.pad(ids, (0, c - ids.shape[0]), value=pad) for ids, _ in items]).to(self.device)
        geometry = self._load_geometry(kvs, c)
        tables = self._load_tables(kvs) if len(kvs) > 1 else None
        keys = [full_keys(kv, c) for kv in kvs]
        model = self.model

        def forward(i: torch.Tensor, _) -> torch.Tensor:
            p = Pass.denoise(kvs, c, geometry, keys, phase=COMMIT, kv_tables=tables)
            return model.layers_forward(model.embed_tokens(i), p)

        step = self._graph(kvs, ("commit", c), c, forward, padded)
        if step is not None:
            step(padded, None)
        else:
            forward(padded, None)
        for ids, kv in items:
            start, t = kv.length, ids.shape[0]
            first_slot = kv.denoise_geometry(c)[3]  # the sliding layers' first canvas slot
            for layer in model.layers:
                if layer.sliding:
                    kv.write(layer.idx, start, kv.kv[layer.idx][:, :, first_slot : first_slot + t].clone())
            kv.length = start + t

    def _graph(
        self, kvs: list[KVCache], mode: tuple, c: int, fn, x: torch.Tensor, sc: torch.Tensor | None = None
    ) -> GraphStep | None:
        """The CUDA graph of a canvas pass over these caches (reading `sc`, a set's SC input buffer): a lone
        cache's captured on first use, a set's from its second use (`DenoiseGraphs.get_batch`); None without
        graphs, or a set's first use (run `fn` eagerly)."""
        if not self.graphs_on:
            return None
        if len(kvs) == 1:
            return self.graphs.get(kvs[0], mode, fn, x, None)
        return self.graphs.get_batch(kvs, mode, c, fn, x, sc)

    @torch.no_grad()
    def rewind(self, kv: KVCache, pos: int) -> None:
        """Drop every position >= pos (`KVCache.truncate`). On the reference kernels, then encode the chunk that now
        ends the cache again from its own tokens, so that the cache holds what a prefill of its tokens from empty
        would (`_prefill_aligned`): a rewind restores the K/V bytes of the shorter cache exactly."""
        kv.truncate(pos)
        redo = pos % self.cfg.canvas_length
        # the fast kernels' prefill routes are not aligned chunks: nothing to restore (see the module's docstring)
        if self.fast or not redo or not kv.knows_tokens() or not kv.can_truncate(pos - redo):
            return
        tokens = kv.tokens[pos - redo :]
        cut = kv.cut
        kv.truncate(pos - redo)
        self.prefill(tokens, kv)
        kv.cut = cut  # the chunk encoded again holds the same tokens: the log was cut at pos, not below

    # -- denoise -----------------------------------------------------------------------------------------

    @torch.no_grad()
    def denoise(
        self,
        canvas: torch.Tensor,
        kv: KVCache,
        sc_logits: torch.Tensor | None = None,
        *,
        sc_probs: torch.Tensor | None = None,
        sc_seed: bool = False,
        sc_exact: bool = False,
        raw: bool = False,
    ) -> torch.Tensor:
        """`DiffusionGemma.denoise` for one canvas [1, C] after `kv` (logits [1, C, V]): on the fast kernels with the
        cache geometry read on the device and, on CUDA, replayed from the graph of this cache, key bucket and SC
        mode. raw=True returns the LM head's output before the final softcap, which on a graph is the graph's own
        buffer, overwritten by the next step (the sampler reads it before). `sc_exact` (the exact soft embedding of
        fp32 probabilities, `DiffusionGemma.soft_embedding`) runs eagerly: the graphs read a 16-bit SC input."""
        model = self.model
        sc = {"sc_seed": sc_seed, "sc_exact": sc_exact, "raw": raw}
        if not self.fast:
            return model.denoise(canvas, kv, sc_logits, sc_probs=sc_probs, **sc)
        canvas = model.check_ids(canvas, 1)[0]
        c = canvas.shape[0]
        if sc_logits is not None:
            sc_probs = torch.softmax(sc_logits.reshape(c, -1), dim=-1, dtype=torch.float32)
        # no room for the canvas in the cache's own slots, or an SC input the graphs do not take
        if c > kv.canvas_slots or kv.dtype != model.dtype or (sc_exact and sc_probs is not None):
            return model.denoise(canvas[None], kv, sc_probs=sc_probs, **sc)
        geometry = self._load_geometry([kv], c)

        def forward(
            ids: torch.Tensor, sc: torch.Tensor | None, out: torch.Tensor | None = None
        ) -> torch.Tensor:
            p = Pass.denoise([kv], c, geometry, [full_keys(kv, c)])
            seed = sc_seed and sc is None
            return model.denoise(ids[None], kv, sc_probs=sc, sc_seed=seed, raw=True, out=out, p=p)[0]

        if self.graphs_on:
            out = self.graphs.io(c)[0]
            mode = (c, sc_probs is not None, sc_seed and sc_probs is None)
            logits = self.graphs.get(kv, mode, lambda i, sc: forward(i, sc, out), canvas, sc_probs)(
                canvas, sc_probs
            )
        else:
            logits = forward(canvas, sc_probs)
        return (logits if raw else model.steps.softcap(logits, self.cfg.final_logit_softcapping))[None]

    def sc_input_buffer(self, kv: KVCache, canvas_len: int) -> torch.Tensor | None:
        """The captured denoise graph's SC input for this cache and canvas length, if there is one ([C, V] in the
        model's dtype): SC probabilities written there are not copied in again by the next `denoise`."""
        return self.graphs.sc_input(kv, canvas_len) if self.graphs_on else None

    def _batches(self, kv: KVCache, c: int) -> bool:
        """Whether a canvas of c after `kv` can share a pass with others (`denoise_many`): on the fast kernels it
        needs room in the cache's own canvas slots and the model's dtype."""
        return not self.fast or (c <= kv.canvas_slots and kv.dtype == self.dtype)

    @torch.no_grad()
    def denoise_many(self, canvases: list[DenoiseInput]) -> torch.Tensor:
        """The LM head's raw output [B, C, V] (before the final softcap, the model's dtype) for canvases of one
        length, each after its own cache (`_batches`), in one pass: every canvas's decoder input (its SC input:
        probabilities, the seed or none, exact or not) over all rows at once, a run of canvases of one SC mode a
        call (`DiffusionGemma.decoder_input_runs`: row for row a lone canvas's arithmetic), then the layers and
        the LM head. On CUDA the whole pass replays from the graph of this set of caches, key buckets and SC
        modes once the set has come twice (an exact SC input runs eagerly: the graphs read a 16-bit one). On a
        graph the output is the graph's own buffer, overwritten by the next pass of as many rows (the sampler
        reads it before)."""
        model, b = self.model, len(canvases)
        c = canvases[0].ids.shape[-1]
        kvs = [cv.kv for cv in canvases]
        if any(cv.ids.shape[-1] != c for cv in canvases) or not all(self._batches(kv, c) for kv in kvs):
            raise ValueError("denoise_many takes canvases of one length that fit their caches' canvas slots")
        ids = torch.cat([model.check_ids(cv.ids, 1).reshape(-1) for cv in canvases]).to(self.device)
        modes = [_sc_mode(cv) for cv in canvases]
        runs: list[tuple[int, int, str | None]] = []
        for i, mode in enumerate(modes):  # consecutive canvases of one mode: one run of rows
            if runs and runs[-1][2] == mode:
                runs[-1] = (runs[-1][0], (i + 1) * c, mode)
            else:
                runs.append((i * c, (i + 1) * c, mode))
        with_sc = any(cv.probs is not None for cv in canvases)
        if not self.fast:
            x = model.decoder_input_runs(ids, self._sc_rows(canvases, c, None) if with_sc else None, runs, c)
            return model.logits(model.layers_forward(x, Pass.denoise(kvs, c)), raw=True).view(b, c, -1)
        geometry = self._load_geometry(kvs, c)
        tables = self._load_tables(kvs)
        keys = [full_keys(kv, c) for kv in kvs]
        graphed = self.graphs_on and "exact" not in modes
        out = self.graphs.batch_out(b * c) if graphed else None

        def forward(i: torch.Tensor, sc: torch.Tensor | None) -> torch.Tensor:
            p = Pass.denoise(kvs, c, geometry, keys, kv_tables=tables)
            h = model.decoder_input_runs(i, sc, runs, c)
            return model.logits(model.layers_forward(h, p), out=out, raw=True)

        sc_buf = self.graphs.batch_sc(b * c) if graphed and with_sc else None
        step = self._graph(kvs, ("denoise", c, tuple(modes)), c, forward, ids, sc_buf) if graphed else None
        sc = self._sc_rows(canvases, c, None if step is None else step.sc) if with_sc else None
        return (step(ids, sc) if step is not None else forward(ids, sc)).view(b, c, -1)

    def _sc_rows(self, canvases: list[DenoiseInput], c: int, buf: torch.Tensor | None) -> torch.Tensor:
        """The canvases' SC probabilities as rows [B*C, V] (a canvas without them: rows left unread): `buf` with
        each canvas's copied into its rows, or without `buf`, their own rows where they follow one another in one
        buffer (the batched sampler's), else a new tensor."""
        probs = [cv.probs.reshape(c, -1) if cv.probs is not None else None for cv in canvases]
        first = next(p for p in probs if p is not None)
        if buf is None:
            if all(p is not None for p in probs) and all(
                follows(a, z) for a, z in zip(probs, probs[1:], strict=False)
            ):
                return first.as_strided((len(probs) * c, first.shape[1]), first.stride())
            buf = torch.zeros(len(probs) * c, first.shape[1], device=first.device, dtype=first.dtype)
        for i, p in enumerate(probs):
            if p is not None and p.data_ptr() != buf[i * c].data_ptr():
                buf[i * c : (i + 1) * c].copy_(p)
        return buf

    def _load_geometry(self, kvs: list[KVCache], c: int) -> torch.Tensor:
        """Each cache's `denoise_geometry(c)` into the device buffer [B, 5] the fast denoise and commit passes of B
        rows read (their graphs too)."""
        b = len(kvs)
        if b not in self._geometry or self._geometry[b].device != self.device:
            self._geometry[b] = torch.zeros(b, 5, dtype=torch.int32, device=self.device)
        geo = torch.tensor([kv.denoise_geometry(c) for kv in kvs], dtype=torch.int32)
        return self._geometry[b].copy_(geo)

    def _load_tables(self, kvs: list[KVCache]) -> torch.Tensor:
        """Each cache's layer buffers (`steps.kv_tables`) into the device buffer [layers, B, 2] the batched denoise
        pass of B rows reads (its graphs too)."""
        b = len(kvs)
        if b not in self._tables or self._tables[b].device != self.device:
            self._tables[b] = torch.zeros(len(kvs[0].kv), b, 2, dtype=torch.int64, device=self.device)
        return self._tables[b].copy_(kv_tables(kvs))

    # -- graphs and memory ------------------------------------------------------------------------

    def release_graphs(self) -> None:
        """Drop the denoise and commit graphs (each tied to the cache it was captured on), their memory pool and
        their shared buffers."""
        self.graphs.clear()

    def return_memory(self) -> None:
        """On CUDA: wait for the device, then hand the allocator's cached blocks (a released graph pool's) back to
        it, for the memory a server plans (`engine.warm_up`)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
