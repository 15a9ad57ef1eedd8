"""bench/fp32_prefill.py with the expert tiles fp32 activations took before (m32_s2): the A/B's other side.
Ran at 443663d, where `triton_moe.config_for` chose the tiles (deleted after: every dtype takes DEFAULT_CONFIG)."""

import runpy

from diffgemma.kernels import triton_moe as tm

tm.config_for = lambda x, w: tm.CONFIGS["m32_s2" if tm._split3(x, w) else tm.DEFAULT_CONFIG]
runpy.run_path("bench/fp32_prefill.py", run_name="__main__")
