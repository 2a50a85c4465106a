"""Which known GGUF files can draft for a target, ranked, and why the others cannot.

A file can draft when check-pair's vocabulary rules (``compat.check_vocab``) pass and it is
smaller than the target. The rules run on cached summaries (``catalog.Summary``): equal
token-text hashes settle the text rule without opening either file, so only near misses
(same tokenizer, close vocabulary sizes, different texts) have their headers read, to name
the first differing id as check-pair does.

Ranking, most useful first: the target's own MTP heads when it carries them (trained with it,
free to store and nearly free to run: see ``heads.py``), then draft heads trained for it in files
of their own (EAGLE-3 heads, Gemma 4's MTP assistant; one for another target, by its hidden size
or the layers it reads, cannot draft), then
the target's own architecture (same family, trained alike, so higher acceptance), then the
smallest (drafting cost is roughly proportional to size).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specrun.fit.memory import ModelMemory, estimate_local
from specrun.gguf.heads import Heads, named_beside
from specrun.gguf.vocabulary import Compatibility, check_vocab
from specrun.models.catalog import Catalog, Known, Summary, SummaryCache, build_catalog
from specrun.models.registry import Registry
from specrun.models.stores import Found


@dataclass
class Candidate:
    known: Known
    summary: Summary
    compat: Compatibility
    memory: ModelMemory  # the whole model at the report's context (placement does not change the total)
    size_ratio: float  # draft weights over target weights, e.g. 0.33 for 0.5B drafting 1.5B
    reason: str = ""  # why it cannot draft; empty when it can

    def to_json(self) -> dict[str, Any]:
        return {
            "refs": self.known.refs,
            "path": str(self.summary.path),
            "name": self.summary.name,
            "architecture": self.summary.architecture,
            "quant": self.summary.quant,
            "size": self.summary.file_size,
            "weights_bytes": self.summary.weights_bytes,
            "size_ratio": round(self.size_ratio, 4),
            "memory_bytes": self.memory.total,
            "can_draft": not self.reason,
            "reason": self.reason or None,
            "failed_checks": [{"name": c.name, "detail": c.detail} for c in self.compat.failures],
            "draft_head": self.summary.draft_head.to_json() if self.summary.draft_head else None,
        }


@dataclass
class DraftReport:
    target: Summary
    target_label: str
    n_ctx: int
    drafts: list[Candidate] = field(default_factory=list)
    cannot: list[Candidate] = field(default_factory=list)
    unreadable: list[Known] = field(default_factory=list)
    no_tokenizer: list[Known] = field(default_factory=list)  # projectors and the like
    target_memory: ModelMemory | None = None
    seconds: float = 0.0  # catalog and checks together
    headers_read: int = 0  # files whose header was parsed (the rest came from the cache)

    @property
    def heads(self) -> Heads:
        """The target's own MTP heads (``count`` 0: none)."""
        return self.target.heads

    @property
    def any(self) -> bool:
        """Is there anything to draft with: the target's heads or a draft file?"""
        return self.heads.usable or bool(self.drafts)

    def to_json(self) -> dict[str, Any]:
        return {
            "target": {
                "label": self.target_label,
                "path": str(self.target.path),
                "name": self.target.name,
                "architecture": self.target.architecture,
                "weights_bytes": self.target.weights_bytes,
                "memory_bytes": self.target_memory.total if self.target_memory else None,
            },
            "mtp_heads": {**self.heads.to_json(), "memory_bytes": self.heads.memory(self.n_ctx), "best": self.heads.usable},
            "n_ctx": self.n_ctx,
            "drafts": [c.to_json() for c in self.drafts],
            "cannot_draft": [c.to_json() for c in self.cannot],
            "unreadable": [{"refs": k.refs, "error": k.error} for k in self.unreadable],
            "skipped_without_tokenizer": [k.label for k in self.no_tokenizer],
            "seconds": round(self.seconds, 4),
            "headers_read": self.headers_read,
        }


def drafts_for(registry: Registry, target: Path, label: str, n_ctx: int = 4096, given: Path | None = None) -> DraftReport:
    """Every GGUF the registry and the stores know, checked as a draft for ``target``, and the
    block drafters put beside it (as ``--draft hybrid`` finds one; beside ``given``, the path
    the user named, where that is a link to ``target``)."""
    start = time.perf_counter()
    cache = SummaryCache(registry.roots.cache_dir)
    extra = [Found(p.name, "beside the target", p) for p in named_beside(given or target)]
    report = find_drafts(target, label, build_catalog(registry, registry.roots, cache, extra=extra), cache, n_ctx)
    report.seconds = time.perf_counter() - start
    report.headers_read = cache.read
    return report


def short_reason(compat: Compatibility) -> str:
    """The first failed rule in full (the most basic: tokenizer, size, texts, special ids),
    then the names of the others."""
    first, *rest = compat.failures
    also = f"; also {', '.join(c.name for c in rest)}" if rest else ""
    return f"{first.name}: {first.detail}{also}"


def find_drafts(target: Path, label: str, catalog: Catalog, cache: SummaryCache, n_ctx: int = 4096) -> DraftReport:
    """Every file in ``catalog`` checked as a draft for the GGUF at ``target``."""
    t = cache.get(target)
    report = DraftReport(t, label, n_ctx, target_memory=estimate_local(t, "target", n_ctx))
    target_real = t.path.resolve()

    for k in catalog.models:
        s = k.summary
        if s is None:
            report.unreadable.append(k)
            continue
        if s.path.resolve() == target_real:
            continue
        if s.n_vocab == 0 or s.tokenizer_model == "none":
            report.no_tokenizer.append(k)
            continue
        compat = check_vocab(t, s, cache.token_diffs)
        ratio = s.weights_bytes / t.weights_bytes if t.weights_bytes else 0.0
        c = Candidate(k, s, compat, estimate_local(s, "draft", n_ctx), ratio)
        if not compat.compatible:
            c.reason = short_reason(compat)
        elif s.draft_head is not None:
            c.reason = f"{s.draft_head.kind} for another target: {why}" if (why := s.draft_head.mismatch(t)) else ""
        elif s.weights_bytes >= t.weights_bytes:
            c.reason = f"same vocabulary, but not smaller than the target ({c.size_ratio:.2f}x its weights)"
        (report.cannot if c.reason else report.drafts).append(c)
    report.drafts.sort(
        key=lambda c: (c.summary.draft_head is None, c.summary.architecture != t.architecture, c.summary.weights_bytes, c.known.label)
    )
    # compatible-but-larger first: they are the closest misses
    report.cannot.sort(key=lambda c: (not c.compat.compatible, c.summary.tokenizer_model != t.tokenizer_model, c.known.label))
    cache.save()
    return report
