"""The speculative engine: one round as in the paper, and the loop that runs rounds.

Plain decoding is the same loop with no drafter (K = 0 every round), so every comparison
(tests, bench) is plain against speculative on identical code.

Invariant between rounds: the target's KV cache holds every token of the sequence but the
last one, which is still pending (``target.n_past == len(tokens) - 1``). A round feeds that
token plus K drafts in one decode, keeps what the target agrees with, appends one token of the
target's own, and rolls the caches back so the invariant holds again.

With ``Settings.tree`` a source that can branch (``sources.base.Branching``) may make the round's
draft a token tree (SpecInfer, EAGLE-2, Sequoia): second candidates beside its chain, all
verified in the same ONE decode (``Model.eval_tree``), and the round keeps the longest path the
target agrees with. The target's cache then keeps that path as its sequence and frees the rest;
a source's cache keeps what it holds of the trunk, as far as the path followed the trunk.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
from collections.abc import Callable, Generator, Sequence
from typing import TYPE_CHECKING, cast

import numpy as np

from specrun.decode import sources as draft_sources
from specrun.decode.chooser import Chooser, Plan, tree_nodes
from specrun.decode.costs import CALIBRATION_SIZES, CostModel, CpuWatch, calibrate, now
from specrun.decode.learned import Learned
from specrun.decode.round import Continuations, History, Prediction, Proposal, Round, common_prefix
from specrun.decode.sampling import Sampler, accept_among, accept_or_resample
from specrun.decode.sources import ModelSource, Source
from specrun.decode.sources.base import STORED_WEIGHT, Branching, Rate
from specrun.decode.sources.model import Autoregressive
from specrun.decode.stats import RoundStats, RunStats
from specrun.errors import PromptTooLong, UsageError

if TYPE_CHECKING:  # the engine never imports llama_cpp itself
    from specrun.llama import DFlashHead, Eagle3Head, Model, MtpHeads

DRAFT_MODES = ("model", "ngram", "mtp", "eagle3", "dflash", "hybrid", "none")
# adaptive: the chooser picks K up to it, here as far as one verify returns rows of logits for
# (n_outputs_max, less one). Trades: a long pure copy ran 1.09-1.13x faster than at 32 on the demo
# pair, where a 64-token verify costs 1.5 times a 33-token one; each long copy that breaks costs
# more (a snapshot target stays at its ROLLBACK_DEPTH)
DRAFT_MAX_ADAPTIVE, DRAFT_MAX_FIXED = 63, 8
# llama.cpp's batched kernels can differ from its one-token kernels by up to ~0.5 logit on
# quantized CPU weights (by 0.02 on F16): a near-tie closer than that may flip between them
TIE_MARGIN = 0.5  # the guard when the gap was not measured, and its most
TIE_SAFETY = 3.0  # the guard as a multiple of the measured gap (a calibration sees a few rows only)
# the sources that draft from what a reply brings besides its prompt (a prediction, earlier replies, a shared
# corpus), in every mode that drafts: each joins the others at the first reply that brings it (an engine that
# never gets one, the CLI's, has none to explain in its idle reasons)
PREDICTED, REMEMBERED, CORPUS = "prediction", "suffix", "corpus"


@dataclasses.dataclass(frozen=True)
class Settings:
    """How to draft. Every front end builds one of these; its defaults are the defaults."""

    # model | ngram | mtp (the target's own heads) | eagle3 (an EAGLE-3 head) | dflash (a block drafter:
    # DFlash, DSpark, DFlash2) | hybrid | none
    mode: str = "hybrid"
    # the most drafts a round; left out (None), the mode's default, set at construction, so it is
    # an int from then on
    draft_max: int = cast(int, None)
    draft_min: int = 1
    p_min: float = 0.6  # fixed mode: the draft model stops below this confidence, as llama.cpp's p-min
    # (adaptive: its stop rule)
    fixed: bool = False
    ngram_min: int = 2
    ngram_max: int = 6
    # greedy: near-ties closer than this are settled by a plain step; None: TIE_SAFETY times the
    # gap measured between the target's batched and one-token logits, at most TIE_MARGIN
    tie_margin: float | None = None
    # token trees: a source that can branch adds second candidates to its draft, verified in the
    # same decode (needs a target opened with LoadOptions.tree_branches; otherwise chains)
    tree: bool = False

    def __post_init__(self):
        if self.draft_max is None:
            object.__setattr__(self, "draft_max", DRAFT_MAX_FIXED if self.fixed else DRAFT_MAX_ADAPTIVE)
        if self.mode not in DRAFT_MODES:
            raise UsageError(f"{{mode}} must be one of {', '.join(DRAFT_MODES)}, got {self.mode!r}", "pick one", "mode")
        if self.draft_max < 1:
            raise UsageError(f"{{draft_max}} must be >= 1, got {self.draft_max}", "use {mode} none for no drafting", "draft_max")
        if not 0 <= self.draft_min <= self.draft_max:
            raise UsageError(
                f"{{draft_min}} must be in [0, {self.draft_max}] ({{draft_max}}), got {self.draft_min}", "lower it", "draft_min"
            )
        if not 0.0 <= self.p_min <= 1.0:
            raise UsageError(f"{{p_min}} must be in [0, 1], got {self.p_min}", "e.g. 0.6", "p_min")
        if self.tie_margin is not None and not self.tie_margin >= 0:
            raise UsageError(f"{{tie_margin}} must be >= 0, got {self.tie_margin}", "use 0 to turn the guard off", "tie_margin")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise UsageError("{ngram_min} and {ngram_max} need 1 <= min <= max", "e.g. 2 and 6", "ngram_min")

    @property
    def sources(self) -> list[str]:
        hybrid = ["ngram", "mtp", "model", "eagle3", "dflash"]  # those at hand
        alone = {m: [m] for m in ("model", "ngram", "mtp", "eagle3", "dflash")}
        return {**alone, "hybrid": hybrid, "none": []}[self.mode]

    def without_draft_model(self, heads: bool = False) -> Settings:
        """These settings when no draft model is at hand: hybrid is the n-gram lookup alone,
        or with the draft heads when some are loaded (``heads``: the target's MTP heads, an
        EAGLE-3 head, a block drafter)."""
        return dataclasses.replace(self, mode="ngram") if self.mode == "hybrid" and not heads else self


@dataclasses.dataclass(frozen=True)
class Step:
    """What one round adds to the output, as the engine's generator yields it."""

    tokens: list[int]
    n_from_draft: int  # the first n tokens were drafts the target accepted
    round: RoundStats
    stats: RunStats


def speculative_round(
    target: Model,
    drafter: Source | None,
    tokens: list[int],
    plan: Plan,
    sampler: Sampler,
    rng: np.random.Generator,
    draft_min: int = 1,
    tie_margin: float = 0.0,
    others: list[Source] | None = None,
    rival: Callable[[list[int]], float] | None = None,
    branches: int = 0,
) -> Round:
    """One round of speculative decoding (Leviathan et al. 2023, Algorithm 1).

    ``tokens`` is the sequence; the target's cache holds all of it but the last token.
    ``others`` are the sources whose caches must follow the target's back (the drafter among
    them); ``rival(sequence)``: the most tokens a second the other sources could make of a
    round after it (a drafter that decides how far as it goes stops where that is more).

    At temperature 0 a position whose top-two logits are closer than ``tie_margin`` is left
    undecided (``Round.deferred``): llama.cpp's batched kernels differ from its one-token
    kernels by up to ~0.5 logit on quantized CPU weights, so only a one-token decode, as plain
    decoding does it, can settle such a near-tie. The engine makes the next round a plain step.

    ``branches`` > 1 (a target opened for trees): a drafter that can branch adds up to as many
    nodes again as its chain has, in at most that many branches (see ``tree_round``); where the
    plan has a rate (adaptive), only those that pay at it are kept (``chooser.tree_nodes``).
    """
    t0 = now()
    # Step 1: the drafter proposes up to K tokens
    proposal = (
        drafter.propose(tokens, plan.k, plan.rate, plan.offered, plan.verify, rival) if drafter is not None and plan.k > 0 else Proposal()
    )
    draft = proposal.cut(max(plan.k, plan.offered))  # a stop rule may draft on past K, up to the offer
    if len(draft) < max(draft_min, 1):
        draft = Proposal()  # too short to pay for itself: this round is a plain decode step
    if branches > 1 and draft.tokens and isinstance(drafter, Branching):
        rows = min(target.opts.n_outputs_max, target.n_batch) - 1 - len(draft)  # a verify's rows, the pending token's first
        draft = drafter.branch(tokens, draft, min(len(draft), rows), branches)
        if draft.is_tree and plan.rate > 0 and plan.verify and len(draft.reach) == len(draft):
            # the chooser's price: the nodes beyond the trunk that make more than the round's worth
            trunk = draft.trunk
            extra = tree_nodes(draft.reach[trunk:], trunk, plan.rate, plan.verify)
            draft = draft.cut(trunk + extra) if extra else draft.chain()
    k = len(draft)
    t1 = now()
    if draft.is_tree:
        return tree_round(target, draft, tokens, plan, sampler, rng, tie_margin, others if others is not None else [drafter], t0, t1)

    # Step 2: the target scores the pending token plus all K drafts in ONE decode;
    # row i holds the target's distribution for the token after draft i-1
    target.checkpoint()  # hybrid/recurrent targets: make this decode undoable (free on attention)
    logits = target.eval([tokens[-1], *draft.tokens], logits="all")
    assert logits is not None
    t2 = now()

    # Step 3: accept a prefix of the drafts, then append one token of the target's own
    deferred = False
    if sampler.greedy:
        # temperature 0: keep the longest prefix matching the target's argmax; the argmax at
        # the first mismatch is the correction (after a full accept, it is the bonus token)
        best = np.argmax(logits, axis=1)
        ties = [near_tie(logits[0], int(best[0]), tie_margin)]  # every row checked counts towards the tie rate
        n = 0
        while n < k and draft.tokens[n] == best[n] and not ties[n]:
            n += 1
            ties.append(near_tie(logits[n], int(best[n]), tie_margin))
        deferred = k > 0 and ties[n]  # position n is decided by the next, plain round
        emitted = [*draft.tokens[:n]] if deferred else [*draft.tokens[:n], int(best[n])]
    else:
        ties = [False]
        # exact speculative sampling: accept x_i with probability min(1, p(x_i)/q(x_i));
        # on a rejection, resample from norm(max(0, p - q)); after a full accept, draw from p
        emitted, n = [], 0
        for i, x in enumerate(draft.tokens):
            ok, replacement = accept_or_resample(x, sampler.dist(logits[i]), draft.dists[i], rng)
            if not ok:
                assert replacement is not None
                emitted.append(replacement)
                break
            emitted.append(x)
            n += 1
        else:
            emitted.append(sampler.dist(logits[k]).sample(rng))
    t3 = now()

    # Step 4: both caches forget the rejected drafts (the cache holds the sequence but its
    # last token: the correction, or the last accepted draft if a near-tie was deferred)
    rollback(target, others if others is not None else [drafter] if drafter is not None else [], len(tokens) + n - deferred)
    t4 = now()
    stats = RoundStats(plan.source if k else "none", k, n, len(emitted), t1 - t0, t2 - t1, t3 - t2, len(ties), sum(ties), t4 - t3)
    return Round(stats.source, draft, n, emitted, deferred, stats)


def tree_round(
    target: Model,
    draft: Proposal,
    tokens: list[int],
    plan: Plan,
    sampler: Sampler,
    rng: np.random.Generator,
    tie_margin: float,
    sources: Sequence[Source | None],
    t0: float,
    t1: float,
) -> Round:
    """Steps 2-4 of a round whose draft is a token tree (SpecInfer, Miao et al. 2024).

    Greedy: from the pending token, follow the child that holds the target's argmax while one
    does; the argmax where none does is the correction (the output is plain decoding's). At
    T > 0, each node's children are tried in turn by exact multi-candidate sampling
    (``sampling.accept_among``): the first accepted is followed; if none is, the token is drawn
    from what is left of the target's law; a leaf's is the bonus token."""
    # Step 2: the pending token (the root) and every node in ONE decode; row 0 is the root's,
    # row i + 1 node i's
    logits = target.eval_tree([tokens[-1], *draft.tokens], [-1, *(p + 1 for p in draft.parents)])
    t2 = now()

    # Step 3: walk down the tree
    kids = draft.children()
    path: list[int] = []
    emitted: list[int] = []
    node, deferred = -1, False
    ties: list[bool] = []
    while True:
        row = logits[node + 1]
        if sampler.greedy:
            best = int(np.argmax(row))
            ties.append(near_tie(row, best, tie_margin))
            nxt = next((c for c in kids[node] if draft.tokens[c] == best), None)
            if ties[-1] or nxt is None:
                deferred = ties[-1]
                emitted += [] if deferred else [best]
                break
        else:
            i, replacement = accept_among([(draft.tokens[c], draft.dists[c]) for c in kids[node]], sampler.dist(row), rng)
            if i is None:
                assert replacement is not None
                emitted.append(replacement)
                break
            nxt = kids[node][i]
        path.append(nxt)
        emitted.append(draft.tokens[nxt])
        node = nxt
    n = len(path)
    t3 = now()

    # Step 4: the target keeps the path as its sequence (its cache: all but the last token) and
    # frees the other nodes; a source's cache holds the trunk at most, so it keeps what of the
    # trunk the path followed
    target.keep_branch([0, *(c + 1 for c in path)])
    keep = len(tokens) + n - deferred
    on_trunk = next((j for j, c in enumerate(path) if c != j), n)
    rollback(target, [s for s in sources if s is not None], keep, min(keep, len(tokens) + on_trunk))
    t4 = now()
    k = len(draft)
    stats = RoundStats(
        plan.source, k, n, len(emitted), t1 - t0, t2 - t1, t3 - t2, len(ties) or 1, sum(ties), t4 - t3,
        tree=True, on_branch=n - on_trunk, depth=draft.depth,
    )  # fmt: skip
    return Round(stats.source, draft, n, emitted, deferred, stats, tuple(path))


def near_tie(row: np.ndarray, top: int, margin: float) -> bool:
    """Is the runner-up within ``margin`` of the top logit? (Reads the row, never writes it.)"""
    if margin <= 0:
        return False
    second = max(row[:top].max(initial=-np.inf), row[top + 1 :].max(initial=-np.inf))
    return bool(row[top] - second < margin)


def rollback(target: Model, sources: list[Source], keep: int, sources_keep: int | None = None) -> None:
    """Keep the first ``keep`` positions of the target's cache and of every source's (of the
    sources', ``sources_keep`` if given: after a tree, what they hold of the trunk). The
    engine moves caches back only through here; the backend's ``Model.rollback`` does the work
    for one model."""
    target.rollback(keep)
    for s in sources:
        s.rollback(keep if sources_keep is None else sources_keep)


class Engine:
    """A target, its draft sources and the chooser; keeps the sequence between calls (chat)."""

    def __init__(
        self,
        target: Model,
        draft: Model | None,
        settings: Settings,
        sampler: Sampler,
        cost: CostModel | None = None,
        learned: Learned | None = None,
        heads: MtpHeads | None = None,
        eagle3: Eagle3Head | None = None,
        dflash: DFlashHead | None = None,
    ):
        """``cost``: the verify curve to start from; ``learned``: what an earlier run stored
        (its curve, unless ``cost`` is given, what each source learned, the near-tie rate);
        ``heads``: the target's MTP heads, ``eagle3``: an EAGLE-3 head, ``dflash``: a block
        drafter, each attached to it (a source of its own)."""
        if settings.mode == "mtp" and heads is None:
            raise UsageError("{mode} mtp needs the target's MTP heads loaded", "use another {mode}", "mode")
        if settings.mode == "eagle3" and eagle3 is None:
            raise UsageError("{mode} eagle3 needs an EAGLE-3 head", "give one ({draft_model}) or use another {mode}", "mode")
        if settings.mode == "dflash" and dflash is None:
            raise UsageError("{mode} dflash needs a block drafter", "give one ({draft_model}) or use another {mode}", "mode")
        if settings.mode == "model" and draft is None:
            raise UsageError(f"{{mode}} {settings.mode} needs a draft model", "give one ({draft_model}) or use {mode} ngram", "draft_model")
        cap = target.opts.n_outputs_max - 1  # a verify returns a row of logits per draft and one more
        if target.draft_limit is not None:  # a snapshot target undoes at most this many drafts
            cap = min(cap, target.draft_limit)
        if cap < settings.draft_max:
            settings = dataclasses.replace(settings, draft_max=cap, draft_min=min(settings.draft_min, cap))
        self.target = target
        self.settings = settings
        # token trees need a target opened for them (LoadOptions.tree_branches): a recurrent or
        # hybrid one cannot branch its state, so it keeps chains, and says why
        self.branches = target.tree_branches if settings.tree else 0
        self.tree_note = (
            f"{target.path.name} cannot verify token trees (a recurrent state, several sequences or not opened for them): chains"
            if settings.tree and not self.branches
            else None
        )
        self.sampler = sampler
        self.rng = sampler.rng()
        self.choice_rng = np.random.default_rng(0)  # the chooser's draws: the same choices for the same numbers, run after run
        self.cost = cost if cost is not None else learned.cost if learned is not None else CostModel()
        self.prediction, self.history = Prediction(), History()  # the reply's (see generate)
        self.inputs = draft_sources.SourceInputs(
            target, draft, heads, eagle3, dflash, sampler, self.rng, self.cost, settings.draft_max,
            (settings.ngram_min, settings.ngram_max), self.prediction, self.history,
        )  # fmt: skip
        self.sources: dict[str, Source] = draft_sources.build(settings.sources, self.inputs)
        for src in self.sources.values():
            if isinstance(src, Autoregressive) and settings.fixed:
                src.p_min = settings.p_min
            if isinstance(src, ModelSource):
                src.keep_rows = self.branches > 1  # its second candidates come from the rows it drafted from
        self.chooser = Chooser(self.sources, self.cost, draft_min=settings.draft_min, draft_max=settings.draft_max, fixed=settings.fixed)
        self.stored = learned.sources if learned is not None else {}  # what each source learned before
        if learned is not None:
            for name, src in self.sources.items():
                src.load(learned.sources.get(name) or {})
            if learned.tie_rate is not None:
                self.chooser.ties = Rate(learned.tie_rate * STORED_WEIGHT, STORED_WEIGHT)  # a prior, as every stored rate
        self.tokens: list[int] = []  # the sequence: the target's cache holds all but the last

    @property
    def draft_model(self) -> Model | None:
        model = self.sources.get("model")
        return model.model if isinstance(model, ModelSource) else None

    def draft_cost(self) -> float | None:
        """The draft model's measured seconds per drafted token (None: no draft model, or not yet)."""
        model = self.sources.get("model")
        return model.per_token if isinstance(model, ModelSource) else None

    # --- the sequence -------------------------------------------------------------------

    def prefill(self, prompt: list[int]) -> int:
        """Make the target's cache hold ``prompt[:-1]``, reusing the common prefix with what
        it already holds. Returns how many tokens were evaluated."""
        if not prompt:
            raise UsageError("the prompt is empty", "give some text", "prompt")
        if len(prompt) > self.target.n_ctx:
            raise PromptTooLong(
                f"the prompt has {len(prompt)} tokens but the context holds {self.target.n_ctx}",
                f"raise {{n_ctx}} to {_round_up(len(prompt) + 256)} or shorten the prompt",
                "n_ctx",
            )
        n = common_prefix(self.target.tokens, prompt, limit=len(prompt) - 1)
        rollback(self.target, list(self.sources.values()), n)
        todo = prompt[n:-1]
        if todo:
            self.target.eval(todo, logits="none")
        for src in self.sources.values():
            src.begin(prompt, functools.partial(self._may_draft, src))
        self.tokens = list(prompt)
        return len(todo) + 1  # the pending last token is evaluated by the first round

    def _may_draft(self, src: Source) -> bool:
        return self.settings.fixed or self.chooser.pays(src, self.settings.draft_max)

    def reseed(self, seed: int | None) -> None:
        """Restart the random stream (a request's own seed, say); the draft model shares it."""
        self.rng = np.random.default_rng(seed)
        for src in self.sources.values():
            if isinstance(src, Autoregressive):
                src.rng = self.rng

    def warm_up(self, prompt: list[int]) -> None:
        """Pay before the first request what a process's first prompt pays once (each source that
        drafts step by step times its step at it: ``begin``), on as much of ``prompt`` as a step
        is timed past, then empty the caches. A server calls it before it listens, so its first
        client does not wait for the timing; with no such source there is nothing to pay."""
        if not any(isinstance(src, Autoregressive) for src in self.sources.values()):
            return
        self.prefill(prompt[: min(CALIBRATION_SIZES[-1] + 1, self.target.n_ctx - 1)])
        self.reset()

    def reset(self) -> None:
        self.target.reset()
        if self.draft_model is not None:
            self.draft_model.reset()
        self.tokens = []

    def calibrate(self) -> CostModel:
        """Measure the target's verify cost by batch size at the current position, leaving
        both caches as they were (a drafting source times its own step at the first prompt,
        where it drafts: ``ModelSource.begin``). A measurement taken while the machine was
        busy comes back ``provisional`` (see ``costs.calibrate``). Every batch's first row is
        the same position as the one-token decode: how far the two differ is the kernels' gap,
        which sets the near-tie guard."""
        base = self.target.n_past
        pad = self.tokens[-1] if self.tokens else 0
        room = self.target.n_ctx - base
        single: list[np.ndarray] = []
        gap = 0.0

        def measure(b: int) -> float:
            nonlocal gap
            self.target.checkpoint(full=True)  # hybrid/recurrent targets: the whole decode is undone
            t = now()
            logits = self.target.eval([pad] * b, logits="all")
            dt = now() - t
            assert logits is not None
            if not single:
                single.append(np.array(logits[0]))
            elif b > 1:
                gap = max(gap, float(np.max(np.abs(logits[0] - single[0]))))
            self.target.rollback(base)
            return dt

        measure(1)  # the first decode after a load or a pause is slow: not part of the curve
        watch = CpuWatch()
        sizes = [b for b in CALIBRATION_SIZES if b <= min(room, self.settings.draft_max + 1)]
        measured = calibrate(measure, sizes, others=watch.others)
        if any(b > 1 for b in sizes):
            measured.kernel_gap = gap
        self.cost.adopt(measured)
        return self.cost

    @property
    def tie_margin(self) -> float:
        """The near-tie guard: as set, else TIE_SAFETY times the measured kernel gap (at most
        TIE_MARGIN, which is also the guard before any measurement)."""
        if self.settings.tie_margin is not None:
            return self.settings.tie_margin
        gap = self.cost.kernel_gap
        return TIE_MARGIN if gap is None else min(TIE_MARGIN, TIE_SAFETY * gap)

    def learned(self) -> Learned:
        """What this engine has learned, to store for the next run."""
        return Learned(self.cost, {name: s.to_json() for name, s in self.sources.items()}, self.chooser.tie_rate)

    # --- generation ---------------------------------------------------------------------

    def generate(
        self,
        prompt: list[int],
        max_tokens: int,
        stop: threading.Event | None = None,
        stats: RunStats | None = None,
        prediction: Sequence[int] = (),
        history: Continuations | None = None,
        corpus: Continuations | None = None,
    ) -> Generator[Step, None, None]:
        """Yield one Step per round until EOG, ``max_tokens``, a full context or ``stop``.
        ``stats`` (a fresh one if not given) is filled in as the run goes, also when it ends
        before its first round. ``prediction``: the tokens the reply is expected to be, mostly;
        ``history``: what earlier replies went on with; ``corpus``: what a corpus of files went on
        with (each a draft source of its own, so that what each is worth is counted apart; the
        output is the same with or without)."""
        stats = stats if stats is not None else RunStats()
        for name, brought in ((PREDICTED, bool(prediction)), (REMEMBERED, history is not None), (CORPUS, corpus is not None)):
            if brought and self.sources and name not in self.sources:  # (the chooser shares the dict)
                for made, src in draft_sources.build([name], self.inputs).items():
                    src.load(self.stored.get(made) or {})
                    self.sources[made] = src
        # before prefill: the sources' begin reads them
        self.prediction.tokens, self.prediction.followed = tuple(prediction), 0
        self.history.index, self.history.corpus = history, corpus
        stats.n_predicted = len(prediction)
        t0 = now()
        stats.n_prompt_tokens = self.prefill(prompt)
        stats.n_cached_tokens = len(prompt) - stats.n_prompt_tokens
        stats.prompt_s = now() - t0
        tokens = self.tokens
        sources = list(self.sources.values())
        t_start = now()
        reason = None
        force_plain = False
        self.chooser.begin_reply()
        try:
            while reason is None:
                if stop is not None and stop.is_set():
                    reason = "interrupted"
                    break
                remaining = max_tokens - stats.n_generated
                room = self.target.n_ctx - len(tokens)  # a round needs len(tokens) + K <= n_ctx
                if remaining <= 0:
                    reason = "length"
                    break
                if room < 0:
                    reason = "context"
                    break
                k_room = max(0, min(room, remaining - 1, self.target.n_batch - 1, self.settings.draft_max))
                # what is left of the reply to use a lesson on, or to spread a one-off cost over:
                # the budget at most, and, since nothing else is known of where a reply ends, no
                # more than it has run so far (a reply n tokens long is as likely to end before 2n
                # as after)
                left = min(room, remaining, stats.n_generated)
                # every source gets ready (the n-gram lookup finds its copy), then one choice
                caps = {name: src.prepare(tokens, k_room, left) for name, src in self.sources.items()}
                plan = Plan("none", 0) if force_plain else self.chooser.choose(caps, self.choice_rng, left=left)
                drafter = self.sources.get(plan.source)
                rivals = [s for s in sources if s is not drafter]
                r = speculative_round(
                    self.target, drafter, tokens, plan, self.sampler, self.rng,
                    self.settings.draft_min, self.tie_margin, sources, functools.partial(self.chooser.rival, sources=rivals),
                    self.branches,
                )  # fmt: skip
                settling_tie, force_plain = force_plain, r.deferred
                self.cost.observe_verify(r.stats.drafted + 1, r.stats.verify_s)
                if r.stats.drafted > r.accepted:
                    self.cost.observe_rollback(r.stats.rollback_s)
                for src in sources:
                    src.observe(r)
                stats.n_prediction_followed = self.prediction.followed
                if not settling_tie:  # a settling step's row is the near-tie that deferred it, counted already
                    self.chooser.observe_ties(r.stats.checked, r.stats.ties)
                emitted = r.emitted
                for i, t in enumerate(emitted):
                    if self.target.is_eog(t):
                        emitted = emitted[: i + 1]
                        reason = "stop"
                        break
                tokens.extend(emitted)
                if reason == "stop":  # drop any accepted tokens past the end of generation
                    rollback(self.target, sources, min(self.target.n_past, len(tokens) - 1))
                rnd = dataclasses.replace(r.stats, emitted=len(emitted))
                self.chooser.observe_round(plan, rnd.draft_s + rnd.verify_s + rnd.sample_s)
                stats.add(rnd)
                stats.wall_s = now() - t_start
                if stats.n_rounds % 8 == 0:  # words for a stretch of rounds: worked out now and then
                    stats.idle_reason = self.chooser.idle_reason(stats)
                yield Step(emitted, min(r.accepted, len(emitted)), rnd, stats)
        finally:
            stats.wall_s = now() - t_start
            stats.idle_reason = self.chooser.idle_reason(stats)
            stats.finish_reason = reason or "interrupted"


def _round_up(n: int, to: int = 512) -> int:
    return -(-n // to) * to
