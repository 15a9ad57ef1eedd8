"""What `diffgemma bench` measures and on what: the command line's options, checked."""

from __future__ import annotations

from dataclasses import dataclass

from diffgemma.bench.shapes import CONTEXTS, TINY_CONTEXTS


@dataclass
class BenchOptions:
    """What `diffgemma bench` measures and on what (the command line's options)."""

    model: str | None = None  # a checkpoint directory; None: random weights
    tiny: bool = False  # random weights at a tiny shape (a CPU smoke test)
    # random weights at the real shape even on CPU; without it (or -m or --tiny) a CPU measures the demo model
    real: bool = False
    device: str | None = None
    dtype: str | None = None  # None: bfloat16 on a GPU, float32 on CPU
    contexts: str | None = None  # comma-separated context lengths (default CONTEXTS, or TINY_CONTEXTS)
    threads: int | None = None
    reps: int = 10
    warmup: int = 3
    prefill_chunk: int = 8192
    gen_steps: int = 48
    gen_prompt: int = 1024
    gen_reps: int = 10
    fixed_steps: int = 16  # generate_tok_s: denoise steps a block, as vLLM's published figure (0 = skip)
    quant: str | None = None  # a quant profile (quant.profiles) applied to the weights on the device
    quant_set: tuple[str, ...] = ()  # --set CLASS=FORMAT on top of it
    init: str = "hf"  # random weights' distribution: transformers' _init_weights, or the "wide" test one
    kernels: str = "auto"
    compile: bool = True
    out: str | None = None  # write the results as JSON here
    concurrency: str | None = (
        None  # "1,2,4": N requests started together through the scheduler (`concurrency`)
    )
    max_context: dict[str, int] | None = None  # runner name -> the largest context it is measured at
    schema: bool = False  # also a 3-question schema scored through `Engine.score` (`schema_timing`)
    topk_error: bool = False  # also top-k sparse against dense attention at each context (`topk_error`)
    expert_parallel: int = 1  # ranks sharing the experts (under torchrun; `runner.parallel`)
    data_parallel: int = 1  # ranks each measuring a replica of its own (under torchrun), their tok/s summed

    def context_list(self) -> list[int]:
        return [
            int(x)
            for x in (self.contexts or (TINY_CONTEXTS if self.tiny else CONTEXTS)).split(",")
            if x.strip()
        ]

    def check(self) -> None:
        if self.real + self.tiny + (self.model is not None) > 1:
            raise ValueError("--real, --tiny and -m each choose the weights: pass one of them")
        if self.dtype is not None and self.dtype not in ("bfloat16", "float16", "float32"):
            raise ValueError(f"--dtype must be bfloat16, float16 or float32, got {self.dtype!r}")
        for name in ("reps", "gen_reps"):  # a median of at least 10
            if getattr(self, name) < 10:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 10, got {getattr(self, name)}")
        if self.concurrency is not None:
            ns = [x.strip() for x in self.concurrency.split(",") if x.strip()]
            if not ns or not all(x.isdigit() and int(x) > 0 for x in ns):
                raise ValueError(f"--concurrency takes positive counts like 1,2,4, got {self.concurrency!r}")
        if min(self.expert_parallel, self.data_parallel) < 1 or (
            self.expert_parallel > 1 and self.data_parallel > 1
        ):
            raise ValueError(
                "--expert-parallel and --data-parallel take a count of at least 1, and not both above 1 (their "
                f"combination is not built), got {self.expert_parallel} and {self.data_parallel}"
            )
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"--threads must be at least 1, got {self.threads}")
        if self.init not in ("hf", "wide"):
            raise ValueError(f"--init must be hf or wide, got {self.init!r}")
        if self.quant is not None or self.quant_set:
            from diffgemma.quant.profiles import resolve

            if self.quant is None:
                raise ValueError("--set needs --quant PROFILE")
            resolve(self.quant, self.quant_set)  # QuantSpecError (a ValueError) names the bad item
