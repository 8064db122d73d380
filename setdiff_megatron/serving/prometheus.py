"""The Prometheus metrics of `setdiff serve`: what its front end counts, and their exposition.

The counts live in `ServingStats`, updated on the event loop as requests and jobs come and go;
`StatsCollector` reads them at each scrape. Each app has a registry of its own, not
prometheus_client's global one, so several apps in one process (the tests) never collide.
"""

import time
from collections import deque
from collections.abc import Iterator

from setdiff_megatron.errors import require

require("prometheus_client", "serve", "setdiff serve")

from prometheus_client import CollectorRegistry  # noqa: E402
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric  # noqa: E402
from prometheus_client.exposition import choose_encoder  # noqa: E402
from prometheus_client.registry import Collector  # noqa: E402

__all__ = ["ServingStats", "StatsCollector", "exposition", "metrics_registry"]

RATE_WINDOW_S = 60.0
"""The decode rate is measured over the jobs finished in the last minute."""


class ServingStats:
    """Requests accepted and refused, finished jobs' tokens and steps, the recent decode rate,
    the replicas' latest load reports and their rows in all."""

    def __init__(self) -> None:
        self.requests = self.errors = self.tokens = self.jobs_done = self.rows = 0
        self.tokens_per_step_sum = 0.0
        self.recent: deque[tuple[float, int]] = deque()
        self.load: dict[int, dict] = {}

    def finished(self, summary: dict) -> None:
        """Count a finished job's summary from its replica."""
        self.tokens += summary["num_decoded"]
        self.jobs_done += 1
        self.tokens_per_step_sum += summary["num_decoded"] / max(summary["steps"], 1)
        now = time.monotonic()
        self.recent.append((now, summary["num_decoded"]))
        while self.recent and now - self.recent[0][0] > RATE_WINDOW_S:
            self.recent.popleft()

    def tokens_per_s(self) -> float:
        """Tokens decoded per second between the first and last recent job (the first only opens the span)."""
        if len(self.recent) < 2:
            return 0.0
        span = max(self.recent[-1][0] - self.recent[0][0], 1e-9)
        return sum(n for _, n in list(self.recent)[1:]) / span

    def load_total(self, key: str) -> int:
        """A count of the replicas' latest load reports ("running" rows, "waiting" jobs), summed."""
        return sum(report.get(key, 0) for report in self.load.values())


class StatsCollector(Collector):
    """The metric families of a `ServingStats`, read when Prometheus scrapes."""

    def __init__(self, stats: ServingStats) -> None:
        self.stats = stats

    def collect(self) -> Iterator[Metric]:
        s = self.stats
        running = s.load_total("running")
        for family, name, documentation, value in (
            (CounterMetricFamily, "setdiff_requests_total", "HTTP requests accepted", s.requests),
            (CounterMetricFamily, "setdiff_request_errors_total", "requests refused", s.errors),
            (GaugeMetricFamily, "setdiff_jobs_running", "rows decoding in the replicas' batches", running),
            (GaugeMetricFamily, "setdiff_queue_depth", "jobs waiting for a row", s.load_total("waiting")),
            (CounterMetricFamily, "setdiff_tokens_total", "tokens decoded", s.tokens),
            (
                GaugeMetricFamily,
                "setdiff_tokens_per_second",
                "decoded tokens per second over the last minute",
                s.tokens_per_s(),
            ),
            (
                GaugeMetricFamily,
                "setdiff_tokens_per_step",
                "mean tokens per step of finished jobs",
                s.tokens_per_step_sum / max(s.jobs_done, 1),
            ),
            (
                GaugeMetricFamily,
                "setdiff_batch_occupancy",
                "running rows over the replicas' max rows",
                running / (s.rows or 1),
            ),
        ):
            yield family(name, documentation, value=value)


def metrics_registry(stats: ServingStats) -> CollectorRegistry:
    """A registry of one app's own over its stats."""
    registry = CollectorRegistry()
    registry.register(StatsCollector(stats))
    return registry


def exposition(registry: CollectorRegistry, accept: str | None) -> tuple[bytes, str]:
    """(body, content type) of a scrape: Prometheus text, or OpenMetrics where the Accept header asks."""
    encoder, content_type = choose_encoder(accept or "")
    return encoder(registry), content_type
