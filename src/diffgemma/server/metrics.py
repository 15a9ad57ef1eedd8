"""Prometheus metrics in the text exposition format, written here so the server needs no client library."""

from __future__ import annotations

import bisect
import threading
from collections.abc import Callable, Sequence

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)

Labels = tuple[tuple[str, str], ...]


def _labels(labels: Labels, extra: tuple[str, str] | None = None) -> str:
    items = list(labels) + ([extra] if extra else [])
    if not items:
        return ""
    body = ",".join(f'{k}="{_escape(v)}"' for k, v in items)
    return "{" + body + "}"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _num(value: float) -> str:
    return repr(float(value)) if value != int(value) else f"{int(value)}.0"


class _Metric:
    kind = ""

    def __init__(self, name: str, help: str, lock: threading.Lock) -> None:
        self.name = name
        self.help = help
        self._lock = lock

    def header(self) -> list[str]:
        return [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} {self.kind}"]


class Counter(_Metric):
    kind = "counter"

    def __init__(self, name: str, help: str, lock: threading.Lock) -> None:
        super().__init__(name, help, lock)
        self._values: dict[Labels, float] = {}

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        key = tuple(sorted(labels.items()))
        with self._lock:
            self._values[key] = self._values.get(key, 0.0) + amount

    def value(self, **labels: str) -> float:
        return self._values.get(tuple(sorted(labels.items())), 0.0)

    def render(self) -> list[str]:
        lines = self.header()
        values = self._values or {(): 0.0}
        lines += [f"{self.name}_total{_labels(k)} {_num(v)}" for k, v in sorted(values.items())]
        return lines


class Gauge(_Metric):
    kind = "gauge"

    def __init__(self, name: str, help: str, lock: threading.Lock, read: Callable[[], float]) -> None:
        super().__init__(name, help, lock)
        self._read = read

    def render(self) -> list[str]:
        return [*self.header(), f"{self.name} {_num(self._read())}"]


BATCH_BUCKETS = (1, 2, 4, 8, 16, 32)


class Histogram(_Metric):
    kind = "histogram"

    def __init__(
        self, name: str, help: str, lock: threading.Lock, buckets: Sequence[float] = LATENCY_BUCKETS
    ) -> None:
        super().__init__(name, help, lock)
        self._buckets = tuple(buckets)
        self._series: dict[Labels, tuple[list[int], list[float]]] = {}

    def observe(self, value: float, **labels: str) -> None:
        key = tuple(sorted(labels.items()))
        with self._lock:
            counts, totals = self._series.setdefault(key, ([0] * (len(self._buckets) + 1), [0.0, 0.0]))
            counts[bisect.bisect_left(self._buckets, value)] += 1
            totals[0] += value
            totals[1] += 1

    def render(self) -> list[str]:
        lines = self.header()
        for key, (counts, (total, n)) in sorted(self._series.items()):
            running = 0
            for bound, count in zip((*self._buckets, float("inf")), counts, strict=True):
                running += count
                le = "+Inf" if bound == float("inf") else repr(float(bound))
                lines.append(f"{self.name}_bucket{_labels(key, ('le', le))} {_num(running)}")
            lines.append(f"{self.name}_sum{_labels(key)} {_num(total)}")
            lines.append(f"{self.name}_count{_labels(key)} {_num(n)}")
        return lines


class Metrics:
    """The server's metrics. Gauges read live values through callables set by the app."""

    def __init__(self, queue_depth: Callable[[], float], conversations: Callable[[], float]) -> None:
        lock = threading.Lock()
        self.requests = Counter("diffgemma_requests", "HTTP requests by route and status code", lock)
        self.unauthorized = Counter(
            "diffgemma_unauthorized_requests", "Requests without the API key, by route (not journalled)", lock
        )
        self.refused = Counter(
            "diffgemma_refused_requests", "Requests refused by the Host or Origin check, by reason", lock
        )
        self.prompt_tokens = Counter("diffgemma_prompt_tokens", "Prompt tokens of finished generations", lock)
        self.cached_tokens = Counter(
            "diffgemma_cached_prompt_tokens", "Prompt tokens whose KV was reused instead of prefilled", lock
        )
        self.generated_tokens = Counter("diffgemma_generated_tokens", "Tokens generated", lock)
        self.denoise_steps = Counter("diffgemma_denoise_steps", "Denoise steps run", lock)
        self.finished = Counter("diffgemma_generations", "Generations by finish reason", lock)
        self.retries = Counter("diffgemma_validation_retries", "Generations re-run with a new seed", lock)
        self.latency = Histogram("diffgemma_request_duration_seconds", "Request latency by route", lock)
        self.queue_wait = Histogram("diffgemma_queue_wait_seconds", "Time a job waited for the engine", lock)
        self.first_token = Histogram(
            "diffgemma_time_to_first_token_seconds", "From enqueue to the first committed block", lock
        )
        self.batch_size = Histogram(
            "diffgemma_canvases_per_forward", "Canvases in one denoise forward", lock, BATCH_BUCKETS
        )
        self.prefill_seconds = Histogram("diffgemma_prefill_seconds", "Prefill time per generation", lock)
        self.denoise_seconds = Histogram("diffgemma_denoise_seconds", "Denoise time per generation", lock)
        self.queue_depth = Gauge(
            "diffgemma_queue_depth", "Jobs waiting for or running on the engine", lock, queue_depth
        )
        self.conversations = Gauge(
            "diffgemma_conversations", "Conversations whose KV is cached", lock, conversations
        )

    def render(self) -> str:
        parts: list[str] = []
        for metric in vars(self).values():
            if isinstance(metric, _Metric):
                parts += metric.render()
        return "\n".join(parts) + "\n"
