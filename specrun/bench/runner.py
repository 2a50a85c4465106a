"""Is this pair worth it on this machine? Plain decoding and each mode, side by side.

Every mode runs on the same loaded models and the same prompts, interleaved (plain, mode A,
mode B, then mode B, mode A, plain: the order turns round with every prompt and run) after a
warm-up, so a noisy machine affects them alike and no mode always runs first. Speedups are
ratios of tokens/s measured in the same run, never absolute times.
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from specrun.bench.llamacpp import PREFIX as OUTSIDE
from specrun.decode.costs import CostModel
from specrun.decode.engine import DRAFT_MODES, Engine, Settings
from specrun.decode.sampling import Sampler
from specrun.decode.stats import RunStats, add_per_position
from specrun.errors import InputError, UsageError
from specrun.run.stream import stream_generate

BASELINE = "none"


@dataclass(frozen=True)
class BenchPrompt:
    cls: str
    prompt: str
    chat: bool = True
    n_predict: int | None = None


def builtin_prompts_path() -> Path:
    return Path(str(resources.files("specrun").joinpath("data/bench_prompts.jsonl")))


PROMPT_KEYS = ("class", "prompt", "chat", "n")


def _prompt_from(d) -> BenchPrompt:
    """One JSONL line, checked: a ValueError says what is wrong with it."""
    if not isinstance(d, dict) or not isinstance(d.get("prompt"), str) or not d["prompt"].strip():
        raise ValueError("needs a non-empty string 'prompt'")
    unknown = sorted(set(d) - set(PROMPT_KEYS))
    if unknown:
        raise ValueError(f"unknown key {unknown[0]!r}; the keys are {', '.join(PROMPT_KEYS)}")
    cls, chat, n = d.get("class", "default"), d.get("chat", True), d.get("n")
    if not isinstance(cls, str) or not cls.strip():
        raise ValueError("'class' must be a non-empty string")
    if not isinstance(chat, bool):
        raise ValueError(f"'chat' must be true or false, got {chat!r}")
    if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 1):
        raise ValueError(f"'n' must be a positive integer, got {n!r}")
    return BenchPrompt(cls, d["prompt"], chat, n)


def load_prompts(path: Path | None = None) -> list[BenchPrompt]:
    p = path or builtin_prompts_path()
    try:
        lines = p.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise InputError(f"prompts file not found: {p}", "check {prompts}", "prompts") from None
    except (OSError, UnicodeDecodeError) as e:
        raise InputError(f"cannot read prompts file {p}: {e}", "pass a UTF-8 JSONL file") from None
    out = []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            out.append(_prompt_from(json.loads(line)))
        except ValueError as e:
            raise InputError(f"{p}:{i}: not a prompt object ({e})", 'each line: {"class": "...", "prompt": "..."}') from None
    if not out:
        raise InputError(f"{p} holds no prompts", 'add lines like {"class": "chat", "prompt": "..."}')
    return out


@dataclass
class Sample:
    cls: str
    prompt_index: int
    mode: str
    run: int
    stats: RunStats
    tokens: list[int] | None  # None: another tool's run, whose tokens are not compared


@dataclass
class ModeSummary:
    mode: str
    tps: list[float] = field(default_factory=list)
    speedups: list[float] = field(default_factory=list)  # per (prompt, run): mode tps / plain tps
    by_prompt: dict[tuple[str, int], list[float]] = field(default_factory=dict)  # the same, grouped by prompt
    drafted: int = 0
    accepted: int = 0
    drafted_rounds: int = 0
    proposed_at: list[int] = field(default_factory=list)
    accepted_at: list[int] = field(default_factory=list)
    identical: bool | None = True  # greedy output identical to plain decoding; None: not compared (another tool's)
    by_source: dict[str, list[int]] = field(default_factory=dict)  # source -> [rounds, drafted, accepted]
    generated: int = 0
    decodes: int = 0  # the target's decodes: one verify per round
    tree_rounds: int = 0  # rounds that verified a token tree (--tree) ...
    tree_nodes: int = 0  # ... their nodes ...
    branch_wins: int = 0  # ... and those a branch other than the first won

    def add(self, s: RunStats) -> None:
        self.tps.append(s.generation_tps)
        self.generated += s.n_generated
        self.decodes += s.n_target_decodes
        self.tree_rounds += s.n_tree_rounds
        self.tree_nodes += s.n_tree_nodes
        self.branch_wins += s.n_branch_wins
        self.drafted += s.n_drafted
        self.accepted += s.n_accepted
        self.drafted_rounds += s.n_drafted_rounds
        add_per_position(self.proposed_at, self.accepted_at, s)
        for name, counts in s.by_source.items():
            mine = self.by_source.setdefault(name, [0, 0, 0])
            for i, v in enumerate(counts):
                mine[i] += v

    def to_json(self) -> dict:
        mean = statistics.fmean(self.tps) if self.tps else 0.0
        return {
            "mode": self.mode,
            "tps_mean": round(mean, 3),
            "tps_stdev": round(statistics.stdev(self.tps), 3) if len(self.tps) > 1 else 0.0,
            "tps_min": round(min(self.tps), 3) if self.tps else 0.0,
            "tps_max": round(max(self.tps), 3) if self.tps else 0.0,
            "speedup": round(geomean(self.speedups), 4) if self.speedups else 1.0,
            "speedup_min": round(min(self.speedups), 4) if self.speedups else 1.0,
            "speedup_ci95": [round(x, 4) for x in ci95([geomean(v) for v in self.by_prompt.values()])],
            "drafted": self.drafted,  # 0: the mode never drafted, so its acceptance says nothing
            "accepted": self.accepted,
            "acceptance_rate": round(self.accepted / self.drafted, 4) if self.drafted else 0.0,
            "mean_accept_len": round(self.accepted / self.drafted_rounds, 4) if self.drafted_rounds else 0.0,
            "accept_per_position": [round(a / p, 4) if p else 0.0 for p, a in zip(self.proposed_at, self.accepted_at)],
            "tokens_per_decode": round(self.generated / self.decodes, 4) if self.decodes else 0.0,  # tokens per verify
            "tree_rounds": self.tree_rounds,  # 0: no tree ran (no --tree, or the target cannot branch)
            "tree_nodes": self.tree_nodes,
            "branch_wins": self.branch_wins,
            "branch_win_rate": round(self.branch_wins / self.tree_rounds, 4) if self.tree_rounds else 0.0,
            "identical_to_plain": self.identical,
            "by_source": {k: {"rounds": v[0], "drafted": v[1], "accepted": v[2]} for k, v in sorted(self.by_source.items())},
            "n": len(self.tps),
        }


# Student's t, two-sided 95%, by degrees of freedom (1..30); 1.96 beyond
_T95 = (12.71, 4.30, 3.18, 2.78, 2.57, 2.45, 2.36, 2.31, 2.26, 2.23, 2.20, 2.18, 2.16, 2.14, 2.13, 2.12, 2.11, 2.10, 2.09, 2.09,
        2.08, 2.07, 2.07, 2.06, 2.06, 2.06, 2.05, 2.05, 2.05, 2.04)  # fmt: skip


def ci95(ratios: list[float]) -> tuple[float, float]:
    """A 95% interval for the geometric mean of ``ratios`` (t over their logs): each prompt's
    speedup is one observation, so the interval covers the class, not one prompt's noise."""
    xs = [math.log(r) for r in ratios if r > 0]
    if len(xs) < 2:
        g = math.exp(xs[0]) if xs else 1.0
        return g, g
    m, sd = statistics.fmean(xs), statistics.stdev(xs)
    t = _T95[len(xs) - 2] if len(xs) - 1 <= len(_T95) else 1.96
    half = t * sd / math.sqrt(len(xs))
    return math.exp(m - half), math.exp(m + half)


def geomean(xs: list[float]) -> float:
    xs = [x for x in xs if x > 0]
    if not xs:
        return 0.0
    prod = 1.0
    for x in xs:
        prod *= x
    return prod ** (1.0 / len(xs))


@dataclass
class BenchResult:
    modes: list[str]
    samples: list[Sample]
    cost: CostModel
    plain_cost: float
    meta: dict = field(default_factory=dict)
    draft_per_token: float | None = None  # the draft model's measured seconds per drafted token

    def summaries(self) -> dict[str, dict[str, ModeSummary]]:
        """class -> mode -> summary, plus an "overall" class."""
        plain = {(s.cls, s.prompt_index, s.run): s for s in self.samples if s.mode == BASELINE}
        out: dict[str, dict[str, ModeSummary]] = {}
        rank = {m: i for i, m in enumerate(self.modes)}
        for s in sorted(self.samples, key=lambda s: rank.get(s.mode, len(rank))):  # modes in the order given, whatever order they ran in
            for cls in (s.cls, "overall"):
                m = out.setdefault(cls, {}).setdefault(s.mode, ModeSummary(s.mode))
                m.add(s.stats)
                base = plain.get((s.cls, s.prompt_index, s.run))
                if base is not None and base.stats.generation_tps > 0:
                    m.speedups.append(s.stats.generation_tps / base.stats.generation_tps)
                    m.by_prompt.setdefault((s.cls, s.prompt_index), []).append(m.speedups[-1])
                    if s.tokens is None:
                        m.identical = None
                    elif s.tokens != base.tokens:
                        m.identical = False
        return out

    def predicted_speedup(self, mode: str) -> float:
        """What the measured cost model predicts for the rounds this mode actually ran."""
        t_pred, n_tok = 0.0, 0
        d = self.draft_per_token or 0.0
        for s in self.samples:
            if s.mode != mode:
                continue
            n_tok += s.stats.n_generated
            t_pred += sum(self.cost.verify_cost(k + 1) for k in s.stats.draft_lengths)
            t_pred += d * s.stats.by_source.get("model", [0, 0, 0])[1]
        if not t_pred or not self.plain_cost:
            return 0.0
        return (n_tok / t_pred) / (1.0 / self.plain_cost)

    def verdict(self) -> str:
        sums = {c: {m: s for m, s in ms.items() if not m.startswith(OUTSIDE)} for c, ms in self.summaries().items()}
        overall = sums.get("overall", {})
        best = max((m for m in overall.values()), key=lambda m: geomean(m.speedups) if m.speedups else 1.0, default=None)
        if best is None or best.mode == BASELINE or geomean(best.speedups) < 1.03:
            return "use --draft none: no mode beat plain decoding by more than noise on this machine"
        per_class = {
            c: max(ms.values(), key=lambda m: geomean(m.speedups) if m.speedups else 1.0).mode for c, ms in sums.items() if c != "overall"
        }
        classes = ", ".join(f"{c}: {m}" for c, m in sorted(per_class.items()))
        return f"use --draft {best.mode} ({geomean(best.speedups):.2f}x plain overall); best per class: {classes}"

    def against_outside(self) -> dict[str, dict]:
        """Per class, the best of the other tool's settings and each of specrun's modes as a
        ratio to it: per prompt the median over runs of the speedup over plain (each run
        against its own plain run), then the geometric mean over the class's prompts."""
        out = {}
        for cls, ms in self.summaries().items():
            score = {m: geomean([statistics.median(v) for v in s.by_prompt.values()]) for m, s in ms.items() if s.by_prompt}
            theirs = {m: x for m, x in score.items() if m.startswith(OUTSIDE)}
            if not theirs:
                continue
            best = max(theirs, key=lambda m: theirs[m])
            out[cls] = {
                "best": best,
                "best_speedup": round(theirs[best], 4),
                "ratio": {m: round(x / theirs[best], 4) for m, x in score.items() if not m.startswith(OUTSIDE) and m != BASELINE},
            }
        return out

    def to_json(self) -> dict:
        sums = self.summaries()
        overall = sums.get("overall", {})
        c1 = self.cost.verify_cost(1)
        curve = self.cost.curve()
        return {
            "meta": self.meta,
            "modes": self.modes,
            "classes": {c: {m: s.to_json() for m, s in ms.items()} for c, ms in sums.items()},
            "verdict": self.verdict(),
            "against_llama_cpp": self.against_outside(),
            "cost_model": {
                "verify_s_by_batch": {str(b): round(v, 6) for b, v in curve.items()},
                "verify_relative": {str(b): round(v / c1, 3) for b, v in curve.items()},
                "draft_s_per_token": self.draft_per_token,
                "draft_relative": round(self.draft_per_token / c1, 3) if self.draft_per_token else None,
                # a perfect drafter: every round verifies the batch with the best tokens per second
                "perfect_drafter_speedup": round(max(b * c1 / v for b, v in curve.items()), 3) if curve else None,
            },
            "predicted_vs_measured": {
                m: {"predicted": round(self.predicted_speedup(m), 3), "measured": overall[m].to_json()["speedup"] if m in overall else None}
                for m in self.modes
                if m != BASELINE and not m.startswith(OUTSIDE)
            },
        }


def parse_mode(spec: str) -> tuple[str, int | None]:
    """``hybrid`` -> ("hybrid", None), adaptive; ``model:4`` -> ("model", 4): exactly 4 drafts
    every round (fixed, p-min 0), to set beside the adaptive modes."""
    name, sep, k = spec.partition(":")
    if name not in DRAFT_MODES or (sep and (name == "none" or not (k.isdigit() and 1 <= int(k) <= 256))):
        raise UsageError(
            f"{{mode}} takes modes from {', '.join(DRAFT_MODES)}, each optionally :K for a fixed draft length, got {spec!r}",
            "e.g. hybrid,model:4,ngram:8",
            "draft",
        )
    return name, int(k) if sep else None


def mode_settings(settings: Settings, spec: str) -> Settings:
    name, k = parse_mode(spec)
    if k is None:
        return dataclasses.replace(settings, mode=name)
    # exactly K every round: no early stop on the draft's confidence either
    return dataclasses.replace(settings, mode=name, fixed=True, draft_max=k, draft_min=min(settings.draft_min, k), p_min=0.0)


def run_bench(
    target,
    draft,
    prompts: list[BenchPrompt],
    modes: list[str],
    sampler: Sampler,
    settings: Settings,
    tokenize,
    n_predict: int,
    runs: int,
    cost: CostModel,
    on_sample=None,
    heads=None,
    eagle3=None,
    dflash=None,
    outside: dict[str, Callable[[int, int], RunStats]] | None = None,
) -> BenchResult:
    """``tokenize(prompt) -> tokens`` applies the chat template; ``settings`` gives the knobs
    (draft-max etc.) and each mode (see ``parse_mode``) replaces its ``draft`` field, or
    fixes K. ``heads`` (the target's MTP heads), ``eagle3`` (an EAGLE-3 head) and ``dflash`` (a
    block drafter), attached to the target, are sources for the modes that draft with them. Attached, they follow every
    target decode, plain decoding's too: they keep the target's state row per token and catch
    up once their queue fills a batch, which a prompt's reset empties first. ``outside`` adds
    another tool's settings (``llama.cpp:draft-simple@8``: ``llamacpp.LlamaCpp``), each a
    ``run(prompt index, n) -> RunStats`` that takes its turn among the modes like one of them."""
    if runs < 1:
        raise UsageError("{runs} must be >= 1", "e.g. 2", "runs")
    own = [BASELINE] + [m for m in modes if m != BASELINE]
    outside = outside or {}
    all_modes = own + list(outside)
    engines = {}
    for m in own:
        s = mode_settings(settings, m)
        engines[m] = Engine(
            target,
            draft if "model" in s.sources else None,
            s,
            sampler,
            cost,
            heads=heads if "mtp" in s.sources else None,
            eagle3=eagle3 if "eagle3" in s.sources else None,
            dflash=dflash if "dflash" in s.sources else None,
        )
    token_lists = [tokenize(p) for p in prompts]
    if not cost.verify:
        engines[own[-1]].calibrate()
    # warm-up: one short generation per mode, discarded
    for m in own:
        e = engines[m]
        e.reset()
        for _ in stream_generate(e, token_lists[0], min(16, n_predict)):
            pass
    samples = []
    for run in range(runs):
        for i, (p, toks) in enumerate(zip(prompts, token_lists)):
            # interleaved, the order turned round every other sample (A B C, C B A, ...), so
            # that running first or last (a warmer cache, a busier neighbour) favours no mode
            for m in all_modes if (run * len(prompts) + i) % 2 == 0 else all_modes[::-1]:
                n = p.n_predict or n_predict
                if m in outside:
                    sample = Sample(p.cls, i, m, run, outside[m](i, n), None)
                else:
                    e = engines[m]
                    e.reset()
                    out: list[int] = []
                    stats = RunStats()
                    for event in stream_generate(e, toks, n):
                        out.extend(event.tokens)
                        stats = event.stats
                    sample = Sample(p.cls, i, m, run, stats, out)
                samples.append(sample)
                if on_sample:
                    on_sample(sample)
    plain_cost = cost.verify_cost(1)
    draft_cost = next((e.draft_cost() for e in engines.values() if e.draft_cost() is not None), None)
    return BenchResult(all_modes, samples, cost, plain_cost, draft_per_token=draft_cost)
