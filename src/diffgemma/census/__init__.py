"""Census campaigns (seed §10): quality decided by measurement. Arms (a model or pack, `DIFFGEMMA_*` overrides)
run over batteries (prompts with checkable outcomes) and seeds in one process; every reply's denoise trace gives
metrics that do not depend on the battery (contested, hard and duplicated rows per 1k tokens, steps committed /
run / retried) beside each battery's pass rate. A campaign directory is re-analysed without a model, and gates set
acceptance thresholds per metric. `diffgemma census` is the command; docs/census.md the user's guide."""

from diffgemma.census.analyze import report, summarize
from diffgemma.census.arms import Arm
from diffgemma.census.arms import read as read_arms
from diffgemma.census.batteries import Battery
from diffgemma.census.batteries import load as load_battery
from diffgemma.census.campaign import Campaign, run
from diffgemma.census.gate import failures as gate_failures
from diffgemma.census.gate import read as read_gate

__all__ = [
    "Arm",
    "Battery",
    "Campaign",
    "gate_failures",
    "load_battery",
    "read_arms",
    "read_gate",
    "report",
    "run",
    "summarize",
]
