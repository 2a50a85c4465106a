"""Can this draft speak for this target? Vocabulary rules, from GGUF metadata only.

The rules are llama.cpp's own (``common_speculative_are_compatible``), plus EOT and PAD ids,
which it does not compare but which decide where a generation stops:

* same tokenizer model (gpt2 BPE, llama SPM, ...);
* vocabulary sizes within 128 of each other;
* identical token texts from id 5 up to the smaller vocabulary;
* same BOS, EOS, EOT and PAD ids, and the same add_bos / add_eos flags.

``tokenizer.ggml.pre`` (the pre-tokenizer regex family) is reported, not enforced: llama.cpp
does not enforce it either, and fine-tunes often relabel it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from specrun.gguf.facts import ModelFacts, ModelInfo

VOCAB_MAX_SIZE_DIFFERENCE = 128
VOCAB_CHECK_START_ID = 5
MAX_DIFFS_SHOWN = 3


TokenDiffs = Callable[[Any, Any], list[tuple[int, str, str]]]


@dataclass
class Check:
    name: str
    ok: bool
    target: object
    draft: object
    detail: str = ""
    enforced: bool = True


@dataclass
class Compatibility:
    checks: list[Check] = field(default_factory=list)

    @property
    def compatible(self) -> bool:
        return all(c.ok for c in self.checks if c.enforced)

    @property
    def failures(self) -> list[Check]:
        return [c for c in self.checks if c.enforced and not c.ok]

    def reason(self) -> str:
        """One sentence naming every failed rule."""
        return "; ".join(f"{c.name}: {c.detail}" for c in self.failures)

    def to_json(self) -> dict:
        return {"compatible": self.compatible, "checks": [asdict(c) for c in self.checks]}


def first_token_differences(t: ModelInfo, d: ModelInfo, limit: int = MAX_DIFFS_SHOWN) -> list[tuple[int, str, str]]:
    """The first ``limit`` ids >= 5 whose texts differ, as (id, target_text, draft_text)."""
    n = min(t.n_vocab, d.n_vocab)
    start = VOCAB_CHECK_START_ID
    if n <= start:
        return []
    ta, da = t.tokens, d.tokens
    # fast path: compare the encoded range in one go (150k strings in microseconds)
    if hasattr(ta, "raw_span") and hasattr(da, "raw_span"):
        if ta.raw_span(start, n) == da.raw_span(start, n):
            return []
    diffs = []
    for i in range(start, n):
        if ta[i] != da[i]:
            diffs.append((i, ta[i], da[i]))
            if len(diffs) >= limit:
                break
    return diffs


def check_vocab(t: ModelFacts, d: ModelFacts, token_diffs: TokenDiffs = first_token_differences) -> Compatibility:
    """Every rule, target ``t`` against draft ``d``. ``token_diffs`` finds the first differing
    token texts; a caller holding cached fingerprints passes one that reads no file when
    they already agree."""
    out = Compatibility()

    def add(name, tv, dv, detail_if_bad="", enforced=True):
        ok = tv == dv
        out.checks.append(Check(name, ok, tv, dv, "" if ok else detail_if_bad, enforced))

    add(
        "tokenizer model",
        t.tokenizer_model,
        d.tokenizer_model,
        f"target uses {t.tokenizer_model!r}, draft uses {d.tokenizer_model!r}",
    )
    size_diff = abs(t.n_vocab - d.n_vocab)
    out.checks.append(
        Check(
            "vocab size",
            size_diff <= VOCAB_MAX_SIZE_DIFFERENCE,
            t.n_vocab,
            d.n_vocab,
            ""
            if size_diff <= VOCAB_MAX_SIZE_DIFFERENCE
            else f"{t.n_vocab} vs {d.n_vocab} differ by {size_diff} (at most {VOCAB_MAX_SIZE_DIFFERENCE})",
        )
    )
    if t.tokenizer_model == d.tokenizer_model:
        diffs = token_diffs(t, d)
        detail = ", ".join(f"id {i}: {a!r} vs {b!r}" for i, a, b in diffs)
        n = min(t.n_vocab, d.n_vocab)
        out.checks.append(
            Check(
                "token texts",
                not diffs,
                f"ids {VOCAB_CHECK_START_ID}..{n - 1}",
                "identical" if not diffs else "differ",
                f"first differences at {detail}" if diffs else "",
            )
        )
    else:
        out.checks.append(Check("token texts", False, "-", "-", "not comparable across tokenizer models"))
    for label, tv, dv in (
        ("BOS id", t.bos_id, d.bos_id),
        ("EOS id", t.eos_id, d.eos_id),
        ("EOT id", t.eot_id, d.eot_id),
        ("PAD id", t.pad_id, d.pad_id),
        ("add_bos", t.add_bos, d.add_bos),
        ("add_eos", t.add_eos, d.add_eos),
    ):
        add(label, tv, dv, f"target {tv!r}, draft {dv!r}")
    add(
        "pre-tokenizer",
        t.tokenizer_pre,
        d.tokenizer_pre,
        f"target {t.tokenizer_pre!r}, draft {d.tokenizer_pre!r} (not enforced; text may split differently)",
        enforced=False,
    )
    return out
