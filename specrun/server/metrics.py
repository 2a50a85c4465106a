"""Prometheus metrics: llama.cpp's names where one exists, so existing dashboards work, and
specrun's own (``specrun_*``) for what llama.cpp has no name for.

Counters move when a request ends (also when it was interrupted), by that request's
``RunStats``: the same numbers its response's ``timings`` and ``usage`` report.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from specrun.decode.stats import RunStats
from specrun.server.suffixes import Suffixes

__all__ = ["CONTENT_TYPE", "Metrics"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class Metrics:
    def __init__(self, queue_length: Callable[[], int], running: Callable[[], int], suffixes: Suffixes | None = None):
        """``suffixes``: the tenants' earlier replies and the shared corpus, whose sizes are gauges."""
        disable_created_metrics()  # no `*_created` series: llama-server has none, and dashboards do not read them
        self.registry = r = CollectorRegistry(auto_describe=True)
        self.totals = {"prompt_tokens": 0.0, "prompt_s": 0.0, "predicted": 0.0, "predicted_s": 0.0}  # for the average gauges
        # llama-server's names (tools/server/README.md), and the speculative-decoding counters
        self.prompt_tokens = Counter("llamacpp:prompt_tokens", "Number of prompt tokens processed.", registry=r)
        self.prompt_seconds = Counter("llamacpp:prompt_seconds", "Prompt process time.", registry=r)
        self.tokens_predicted = Counter("llamacpp:tokens_predicted", "Number of generation tokens processed.", registry=r)
        self.predicted_seconds = Counter("llamacpp:tokens_predicted_seconds", "Predict process time.", registry=r)
        self.n_decode = Counter("llamacpp:n_decode", "Total number of llama_decode() calls on the target.", registry=r)
        self.drafts = Counter("llamacpp:spec_decode_num_drafts", "Rounds that verified a draft.", registry=r)
        self.draft_tokens = Counter("llamacpp:spec_decode_num_draft_tokens", "Draft tokens sent to the target.", registry=r)
        self.accepted_tokens = Counter("llamacpp:spec_decode_num_accepted_tokens", "Draft tokens the target accepted.", registry=r)
        self.accepted_at = Counter(
            "llamacpp:spec_decode_num_accepted_tokens_per_pos",
            "Accepted draft tokens by draft position (0-based).",
            ["position"],
            registry=r,
        )
        # specrun's own
        self.requests = Counter("specrun_requests", "Finished requests by finish reason.", ["finish_reason"], registry=r)
        self.cached_tokens = Counter("specrun_prompt_cached_tokens", "Prompt tokens reused from the KV cache.", registry=r)
        self.rounds = Counter("specrun_rounds", "Rounds by draft source (model, ngram, none = a plain step).", ["source"], registry=r)
        # (the suffix sources' origins are sources of their own: suffix, the tenant's earlier replies; corpus, the shared files)
        self.source_drafted = Counter("specrun_draft_tokens", "Draft tokens by source.", ["source"], registry=r)
        self.source_accepted = Counter("specrun_accepted_tokens", "Accepted draft tokens by source.", ["source"], registry=r)
        self.draft_length = Histogram(
            "specrun_draft_length", "The draft length the chooser chose, per round (0 = a plain step).",
            buckets=(0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64), registry=r,
        )  # fmt: skip
        self.tree_rounds = Counter("specrun_tree_rounds", "Rounds that verified a token tree (--tree).", registry=r)
        self.tree_nodes = Counter("specrun_tree_nodes", "Nodes of the token trees verified.", registry=r)
        self.branch_wins = Counter(
            "specrun_branch_wins", "Tree rounds where a branch other than the first (the source's chain) won.", registry=r
        )
        self.rejected = Counter("specrun_requests_rejected", "Requests refused because the queue was full (429).", registry=r)
        r.register(_Live(queue_length, running, self, suffixes))

    def observe(self, s: RunStats) -> None:
        """One finished request."""
        for name, v in (
            ("prompt_tokens", s.n_prompt_tokens),
            ("prompt_s", s.prompt_s),
            ("predicted", s.n_generated),
            ("predicted_s", s.wall_s),
        ):
            self.totals[name] += v
        self.prompt_tokens.inc(s.n_prompt_tokens)
        self.prompt_seconds.inc(s.prompt_s)
        self.tokens_predicted.inc(s.n_generated)
        self.predicted_seconds.inc(s.wall_s)
        self.n_decode.inc(s.n_target_decodes)
        self.drafts.inc(s.n_drafted_rounds)
        self.draft_tokens.inc(s.n_drafted)
        self.accepted_tokens.inc(s.n_accepted)
        for i, a in enumerate(s.accepted_at):
            if a:
                self.accepted_at.labels(position=str(i)).inc(a)
        self.cached_tokens.inc(s.n_cached_tokens)
        self.requests.labels(finish_reason=s.finish_reason or "interrupted").inc()
        for source, (rounds, drafted, accepted) in s.by_source.items():
            self.rounds.labels(source=source).inc(rounds)
            self.source_drafted.labels(source=source).inc(drafted)
            self.source_accepted.labels(source=source).inc(accepted)
        self.tree_rounds.inc(s.n_tree_rounds)
        self.tree_nodes.inc(s.n_tree_nodes)
        self.branch_wins.inc(s.n_branch_wins)
        for length in s.draft_lengths:
            self.draft_length.observe(length)

    def text(self) -> bytes:
        return generate_latest(self.registry)


class _Live:
    """Gauges read at scrape time: the queue and llama-server's average throughputs."""

    def __init__(self, queue_length: Callable[[], int], running: Callable[[], int], m: Metrics, suffixes: Suffixes | None):
        self.queue_length, self.running, self.m, self.suffixes = queue_length, running, m, suffixes

    def collect(self):
        t = self.m.totals
        yield GaugeMetricFamily("llamacpp:requests_processing", "Number of requests processing.", value=float(self.running()))
        yield GaugeMetricFamily(
            "llamacpp:requests_deferred", "Number of requests deferred (waiting in the queue).", value=self.queue_length()
        )
        yield GaugeMetricFamily(
            "llamacpp:prompt_tokens_seconds", "Average prompt throughput in tokens/s.",
            value=t["prompt_tokens"] / t["prompt_s"] if t["prompt_s"] > 0 else 0.0,
        )  # fmt: skip
        yield GaugeMetricFamily(
            "llamacpp:predicted_tokens_seconds", "Average generation throughput in tokens/s.",
            value=t["predicted"] / t["predicted_s"] if t["predicted_s"] > 0 else 0.0,
        )  # fmt: skip
        if self.suffixes is not None:
            s = self.suffixes
            yield GaugeMetricFamily("specrun_suffix_bytes", "Bytes the tenants' earlier replies and the corpus take, as counted (at most --suffix-mb).",
                                    value=s.held)  # fmt: skip
            yield GaugeMetricFamily("specrun_suffix_replies", "Earlier replies kept to draft from.", value=len(s))
            yield CounterMetricFamily("specrun_suffix_evicted", "Earlier replies evicted to stay under --suffix-mb.", value=s.evicted)
            yield GaugeMetricFamily("specrun_suffix_corpus_bytes", "Bytes the shared corpus takes, as counted (within specrun_suffix_bytes).",
                                    value=s.corpus_bytes)  # fmt: skip
            yield GaugeMetricFamily("specrun_suffix_corpus_files", "Files of the shared corpus (--suffix-corpus) drafted from.",
                                    value=s.corpus_files)  # fmt: skip
