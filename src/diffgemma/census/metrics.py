"""Trajectory metrics of one reply, from its denoise `Trace`: they depend on the model and the sampler, never on
the battery's checks (seed §10: contested, hard and duplicated rows, steps committed / run / retried).

- contested: a committed token whose p_max at the commit (the block's last step, at that step's temperature) is
  below CONTESTED_P_MAX: the model had not settled on it.
- hard: a committed token the block's last step did not accept: the entropy-bound sampler never grew sure enough
  of the row to accept it, and it reached the reply only through the final argmax (seed §6 step 7).
- dup: a committed token equal to the token before it in the reply (pad excepted): the signature of an unresolved
  row copying its neighbour (seed §9 #11).
- steps_committed: the denoise steps of the blocks that were committed; steps_retry: those of re-rolled canvases;
  steps_run: both."""

from __future__ import annotations

from typing import Any

from diffgemma.census.trace import Trace
from diffgemma.config import SamplerConfig

# The commit-time confidence trim's default tau (SamplerConfig.commit_conf_trim, seed §9 #11): the line below which
# the engine treats a committed row as unresolved, so the census counts the same rows as contested (the default,
# not an arm's setting, so that every arm is measured against one line).
CONTESTED_P_MAX = SamplerConfig.commit_conf_trim

# The counts a record holds; the summary's per-1k rates are sums of these over sums of `tokens`.
COUNTS = (
    "tokens",
    "contested",
    "hard",
    "dup",
    "blocks",
    "steps_committed",
    "steps_retry",
    "steps_run",
    "retries",
)


def trace_counts(trace: Trace, pad_id: int) -> dict[str, int]:
    """The COUNTS of one reply's trace."""
    tokens = [t for b in trace.blocks for t in b.tokens]
    contested = sum(p < CONTESTED_P_MAX for b in trace.blocks for p in b.p_max)
    hard = sum(not a for b in trace.blocks for a in b.accepted)
    dup = sum(1 for i in range(1, len(tokens)) if tokens[i] == tokens[i - 1] and tokens[i] != pad_id)
    committed = sum(b.steps for b in trace.blocks)
    return {
        "tokens": len(tokens),
        "contested": contested,
        "hard": hard,
        "dup": dup,
        "blocks": len(trace.blocks),
        "steps_committed": committed,
        "steps_retry": trace.retry_steps,
        "steps_run": committed + trace.retry_steps,
        "retries": trace.retries,
    }


# The summary's metrics of a set of records, each a function of the summed counts and the record count. Per-1k
# rates are over generated tokens; step counts are per reply, and steps_per_block over committed blocks.
def _per_1k(key: str):
    return lambda s, n: 1000.0 * s[key] / s["tokens"] if s["tokens"] else 0.0


METRICS: dict[str, Any] = {
    "pass_rate": lambda s, n: s["passed"] / n if n else 0.0,
    "contested_per_1k": _per_1k("contested"),
    "hard_per_1k": _per_1k("hard"),
    "dup_per_1k": _per_1k("dup"),
    "tokens_per_reply": lambda s, n: s["tokens"] / n if n else 0.0,
    "steps_per_block": lambda s, n: s["steps_committed"] / s["blocks"] if s["blocks"] else 0.0,
    "steps_run_per_reply": lambda s, n: s["steps_run"] / n if n else 0.0,
    "steps_retry_per_reply": lambda s, n: s["steps_retry"] / n if n else 0.0,
}


def sums(records: list[dict[str, Any]]) -> dict[str, int]:
    """COUNTS and `passed` summed over records."""
    out = {k: sum(int(r[k]) for r in records) for k in COUNTS}
    out["passed"] = sum(bool(r["passed"]) for r in records)
    return out


def metrics(records: list[dict[str, Any]]) -> dict[str, float]:
    """Every METRICS value of a set of records."""
    s = sums(records)
    return {name: f(s, len(records)) for name, f in METRICS.items()}
