"""The n-gram source: prompt lookup, free to draft, its acceptance learned by copy length.

N-gram guesses are copies of an earlier span, and a copy that has already matched L tokens is
far likelier to go on than a fresh two-token match (code editing returns whole files; chat
rarely repeats itself). So the chance that position j of a copy is accepted is the rate of its
copy-length bin, ``a_j = rate(L + j - 1)``. Edits come in lines, though: a docstring, a logging
call or a comment is inserted between lines, so a copy that runs on across a line break is a
different bet from one that runs on inside a line. A position that starts a new line has a
rate of its own (with the length bin's as its prior). Guesses cost no model time, so every
round scores the copy on offer against what the target actually wrote, drafted or not, and the
copies it would have offered along the rest of a long round another source drafted: the rates
learn from every token, and a copy that starts to pay is taken up at once. A copy ends
where its source's turn ended (a file quoted in the prompt is followed by the end of the user's
turn): the target stops there too, so nothing past that token could ever be kept.

Texts disagree on copies (a copy of 3 tokens goes on about 0.9 of the time in a whole-file edit,
0.1-0.3 in chat), so what earlier replies taught is kept as two kinds, not pooled: the prior of a
new reply's copy rates is a mixture of the two, each weighted by how well it foretold the
reply's copies so far (Bayes' rule on a mixture of Beta priors). One copy that goes on or
breaks moves every length bin towards the kind it fits, where a pooled prior would learn bin by
bin. A reply ends in the kind that foretold it best, so kinds form as replies come: a reply
that the first kind foretells worse than an untaught one starts the second. A kind's rates count
as a prior (``PRIOR_WEIGHT`` observations a bin), not as a draft model's stored rates do: texts
of one kind still differ (a summary copies phrases, an edit whole lines; counted as 8, the first
summary after the edits ran 1.3x plain, not 1.7x).
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Callable, Sequence
from dataclasses import replace
from functools import lru_cache

import numpy as np

from specrun.decode.round import Proposal, Round
from specrun.decode.sampling import Dist
from specrun.decode.sources.base import DECAY, PRIOR_WEIGHT, Rate, RateTable

# What makes a copy, in the prompt lookup here and in the lookup of earlier replies (suffix.py):
MATCH_CAP = 64  # how far back a match is measured (trades: telling long copies apart, against a
# lookup's work); the copy-length bins run up to it
OCCURRENCES = 32  # the latest places an n-gram is kept for; of them, the one matching furthest back
# is copied, and an earlier reply's continuation is what most of them went on with (trades: finding
# the best places of a common n-gram, against a lookup's work)
MIN_MATCH = 4  # the fewest tokens a match must hold to be more than chance: a copy must have
# matched this many before a break is learned as an edit, and an earlier reply is looked up by
# this many (trades: places found, against places that match by chance)

# the copy-length bins' lower edges: half an octave apart up to MATCH_CAP (0: a copy just past
# an edit the drafter learned, which has matched nothing yet)
COPY_BINS = (0, *sorted({b for k in range(1, MATCH_CAP.bit_length()) for b in (1 << k, 3 << (k - 1)) if b <= MATCH_CAP}))
COPY_KINDS = 2  # kinds of text earlier replies are kept as: in practice, those that copy their
# context (edits, summaries) and those that do not (trades: a reply's prior from texts like it,
# against learning more kinds from fewer replies each)


def copy_bin(length: int) -> int:
    return max(0, bisect_right(COPY_BINS, length) - 1)


class NgramSource:
    """The chooser's view of the n-gram lookup: the copy on offer and how often copies go on."""

    name = "ngram"

    def __init__(
        self,
        n_min: int = 2,
        n_max: int = 6,
        ends_line: Callable[[int], bool] | None = None,
        ends_turn: Callable[[int], bool] | None = None,
    ):
        """``ends_line(token)``: does the token's text hold a line break? (None: lines unknown);
        ``ends_turn(token)``: does the target stop generating at it? (None: never)"""
        self.drafter = NgramDrafter(n_min, n_max)
        self.copy = RateTable(len(COPY_BINS))  # this reply's: a copy goes on, inside a line, by its length
        self.line = Rate()  # ... and at the start of a new line
        self.kinds = [(RateTable(len(COPY_BINS)), Rate()) for _ in range(COPY_KINDS)]  # earlier replies', as priors
        self.fit = [0.0] * COPY_KINDS  # the log-likelihood of this reply's copies under each kind
        self.ends_line = lru_cache(maxsize=None)(ends_line) if ends_line is not None else (lambda t: False)
        self.ends_turn = ends_turn if ends_turn is not None else (lambda t: False)
        self.offer = Proposal()
        self.last = -1  # the sequence's last token, before the copy on offer
        self.before = 0  # the length of the sequence the copy on offer follows

    def begin(self, prompt: list[int], may_draft: Callable[[], bool]) -> None:
        """A new reply is a new text: the last one joins the kind that foretold it, as a prior
        for this one's copies (a summary's copied phrases say little of an explanation's)."""
        self.offer = Proposal()
        self.kinds = self._kinds_after_reply()
        self.copy, self.line, self.fit = RateTable(len(COPY_BINS)), Rate(), [0.0] * COPY_KINDS

    def _kinds_after_reply(self) -> list[tuple[RateTable, Rate]]:
        """The kinds once this reply's copies join the one that foretold them best."""
        if not _learned(self.copy, self.line):
            return self.kinds
        best = max(range(COPY_KINDS), key=lambda k: self.fit[k])  # (a tie: the first)
        out = list(self.kinds)
        out[best] = self._with_reply(*out[best], PRIOR_WEIGHT)
        return out

    def _with_reply(self, table: RateTable, line: Rate, keep: float = float("inf")) -> tuple[RateTable, Rate]:
        """A kind's counts and this reply's together, worth at most ``keep`` observations a bin."""
        out = RateTable(len(COPY_BINS))
        out.bins = [Rate.stored(a.hits + b.hits, a.n + b.n, keep) for a, b in zip(table.bins, self.copy.bins)]
        return out, Rate.stored(line.hits + self.line.hits, line.n + self.line.n, keep)

    def _posterior(self) -> list[tuple[float, list[float], Rate]]:
        """Each kind's weight given this reply's copies so far, and its rates with them. A kind
        no reply has taught has no rates to price a copy by (its flat prior would halve every
        copy's chance to go on at a reply's start): it prices nothing until a reply joins it,
        though its fit is kept, as the place a reply that the taught kinds foretell worse goes."""
        learned = self.learned_kinds()
        learned = learned if any(learned) else [True] * COPY_KINDS
        top = max(f for f, t in zip(self.fit, learned) if t)
        w = [float(np.exp(f - top)) if t else 0.0 for f, t in zip(self.fit, learned)]
        out = []
        for wk, kind in zip(w, self.kinds):
            table, line = self._with_reply(*kind)
            out.append((wk / sum(w), table.means(), line))
        return out

    def learned_kinds(self) -> list[bool]:
        """Which kinds a reply has taught (the others price no copy)."""
        return [_learned(table, line) for table, line in self.kinds]

    def prepare(self, tokens: list[int], room: int, left: int) -> int:
        self.offer = self.drafter.propose(tokens, room)
        self.offer = self.offer.cut(self._to_turn_end(self.offer.tokens))
        self.last = tokens[-1] if tokens else -1
        self.before = len(tokens)
        return len(self.offer)

    def _to_turn_end(self, copy: Sequence[int]) -> int:
        """How much of a copy could be kept: up to a token that ends the target's turn."""
        return next((i + 1 for i, t in enumerate(copy) if self.ends_turn(t)), len(copy))

    def acceptance(self, k: int, rng: np.random.Generator | None) -> list[float]:
        """The means, never a draw: every round scores the copy on offer, drafted or not, so
        drafting a copy teaches nothing that watching it does not, and a hopeful draw would
        only buy a long verify for a lesson already free."""
        return self._rates(self.offer.tokens[:k], self.offer.match, self.last)

    def _rates(self, copy: Sequence[int], match: int, last: int) -> list[float]:
        """a_j for a copy that has matched ``match`` tokens, after ``last``: each kind's, by its
        weight."""
        kinds = self._posterior()
        out = []
        for j, before in enumerate([last, *copy][: len(copy)]):  # the token before each
            b, starts_line = copy_bin(match + j), self.ends_line(before)
            out.append(sum(w * _goes_on(rates, line, b, starts_line) for w, rates, line in kinds))
        return out

    def peek(self, seq: list[int], room: int) -> list[float]:
        """a_1.. of the copy it would offer after ``seq`` (at most ``room``), found without
        preparing: ``seq`` may end in another source's drafts."""
        src, match = self.drafter.lookup(seq)
        copy = self.drafter.span(seq, src, room) if match else []
        return self._rates(copy[: self._to_turn_end(copy)], match, seq[-1])

    def rates(self) -> list[list[float]]:
        """Each kind's mean rate by copy-length bin, with this reply's copies (for `specrun costs`)."""
        return [rates for _, rates, _ in self._posterior()]

    def cost(self, k: int | np.ndarray) -> float:
        return 0.0

    def propose(
        self, tokens: list[int], k: int, worth: float, offered: int = 0, verify: Sequence[float] = (),
        rival: Callable[[list[int]], float] | None = None,
    ) -> Proposal:  # fmt: skip
        return self.offer.cut(k)

    def branch(self, tokens: list[int], chain: Proposal, nodes: int, branches: int) -> Proposal:
        """The other places the sequence's tail occurred, each copy (as long as the trunk at most,
        to the end of a turn) a branch where it goes on differently from the trunk and the
        branches before it: the copies matching furthest back first, while nodes and branches
        last. A copy's q is one-hot, so the target's law is kept (``sampling.accept_among``).

        Each node's chance to be on the target's path (``Proposal.reach``): the trunk's, its copy
        rates' product; a branch's first node, its parent's times the chance the parent's first
        child there is rejected times the branch's own copy rate; its next ones, times theirs."""
        tree = replace(chain, reach=[float(r) for r in np.cumprod(self.acceptance(len(chain), None))])
        for copy, match in self.drafter.continuations(tokens, len(chain)):
            if nodes <= 0:
                break
            copy = copy[: self._to_turn_end(copy)]
            grown = tree.grow(copy, [Dist.one_hot(t) for t in copy], most=nodes)
            added = len(grown) - len(tree)
            if not added:
                continue
            if sum(not kids for node, kids in grown.children().items() if node >= 0) > branches:
                break
            first = len(tree)
            parent, depth = grown.parents[first], len(grown.path(first)) - 1
            up = tree.reach[parent] if parent >= 0 else 1.0
            sibling = next((c for c in tree.children().get(parent, [])), None)
            rest = 1.0 - (tree.reach[sibling] / up if sibling is not None and up > 0 else 0.0)
            chance, reach = up * rest, []
            for a in self._rates(copy, match, self.last)[depth : depth + added]:
                chance *= a
                reach.append(chance)
            tree = replace(grown, reach=[*tree.reach, *reach])
            nodes -= added
        return tree

    def observe(self, outcome: Round) -> None:
        """Score the copy on offer (used or not) against the tokens that really followed, up to
        the first miss; and where the round wrote more than that (another source's long draft),
        the copies the lookup would have offered along the rest, as a run of copy rounds would
        have drafted them: copy rates learn from every token written, however it was drafted."""
        self.copy.decay()
        self.line.decay()
        self.fit = [f * DECAY for f in self.fit]
        kinds = self._posterior()  # each kind as the round began
        written, p = outcome.emitted, 0
        copy, match, last, src = self.offer.tokens, self.offer.match, self.last, self.offer.start
        while p < len(written):
            n = self._score(copy, match, last, written[p:], kinds) if copy else 1  # no copy: a plain step
            if copy:
                self._followed(src, written[p : p + n - 1])
            p += n
            if p >= len(written) or len(self.drafter.seen) != self.before:  # the lookup did not index it
                break
            seq = self.drafter.seen + written[:p]
            src, match = self.drafter.lookup(seq)
            copy = self.drafter.span(seq, src, len(written) - p) if match else []
            copy, last = copy[: self._to_turn_end(copy)], seq[-1]

    def _score(
        self, copy: Sequence[int], match: int, last: int, written: Sequence[int], kinds: list[tuple[float, list[float], Rate]]
    ) -> int:
        """Score a copy against what was written, up to its first miss, and each kind by how
        likely it found that; the tokens a copy round would have written (its accepted tokens
        and the target's own)."""
        for j, (x, y) in enumerate(zip(copy, written)):
            b, starts_line = copy_bin(match + j), self.ends_line(copy[j - 1] if j else last)
            for k, (_, rates, line) in enumerate(kinds):
                a = min(max(_goes_on(rates, line, b, starts_line), 1e-3), 1.0 - 1e-3)
                self.fit[k] += float(np.log(a if x == y else 1.0 - a))
            (self.line if starts_line else self.copy.bins[b]).add(x == y)
            if x != y:
                return j + 1
        return min(len(copy), len(written)) + 1

    def _followed(self, start: int, written: Sequence[int]) -> None:
        """The copy from source position ``start`` on was written as ``written`` (its tokens up to
        the first miss; edits applied): a source that counts what the reply followed counts it."""

    def rollback(self, keep: int) -> None:
        pass  # the lookup rebuilds itself from the sequence

    def to_json(self) -> dict:
        """The kinds, this reply's copies in the one that foretold them."""
        kinds = [{**t.to_json(), "line": [round(line.hits, 3), round(line.n, 3)]} for t, line in self._kinds_after_reply()]
        return {"bins": list(COPY_BINS), "kinds": kinds}

    def load(self, d: dict, keep: float = PRIOR_WEIGHT) -> None:
        """Stored kinds as priors worth at most ``keep`` observations a bin (an older store's
        pooled rates: the first kind); anything malformed is left out."""
        if not isinstance(d, dict) or list(d.get("bins", ())) != list(COPY_BINS):
            return
        kinds = d.get("kinds")
        for i, k in enumerate((kinds if isinstance(kinds, list) else [d])[:COPY_KINDS]):
            table, line = self.kinds[i]
            table.load(k, keep)
            v = k.get("line") if isinstance(k, dict) else None
            if isinstance(v, list) and len(v) == 2 and all(isinstance(x, (int, float)) for x in v) and 0 <= v[0] <= v[1]:
                line = Rate.stored(v[0], v[1], keep)
            self.kinds[i] = (table, line)


def _learned(table: RateTable, line: Rate) -> bool:
    """Has anything been counted in these copy rates?"""
    return any(r.n for r in [*table.bins, line])


def _goes_on(rates: list[float], line: Rate, b: int, starts_line: bool) -> float:
    """The chance a copy goes on in length bin ``b``: at a line's start, the line rate (with the
    bin's as its prior)."""
    return line.mean(rates[b]) if starts_line else rates[b]


class NgramDrafter:
    """Prompt lookup: find the longest recent suffix (n in [n_min, n_max]) that occurred
    earlier in the prompt or output, and propose what followed it. Costs no model time. Of
    the suffix's recent occurrences, the one whose context matches furthest back is copied
    (in an edited file the same line may appear in the source and in what was written).

    Once a copy is under way, the next call continues from the same source span without
    searching, as long as the sequence has kept copying it: in code editing and summarising
    the output copies the input for hundreds of tokens. Each proposal says how long its copy
    already is (``match``): the chooser trusts long copies more.

    Edits are learned: when an established copy breaks because the target wrote Y where the
    source has X, the target either replaced X (a rename, say) or inserted something before it
    (a docstring, a type hint, a logging call). The copy goes on past X as for a replacement,
    and from then on every X in a proposal is written as Y. If instead the target comes back to
    the source at X, that was an insertion: the copy resumes at X, wherever else the same words
    occur, and the edit is dropped. A learned edit that turns out wrong is replaced by what the
    target wrote instead, or dropped.

    Given a ``reference`` (``refer``), copies come from it alone instead of from the sequence:
    the same lookup, continuing, edits and resuming, over a text the reply is expected to
    follow (a predicted output), which the sequence's suffix is matched against.
    """

    name = "ngram"

    def __init__(self, n_min: int = 2, n_max: int = 6):
        if not 1 <= n_min <= n_max:
            raise ValueError("need 1 <= n_min <= n_max")
        self.n_min, self.n_max = n_min, n_max
        self._seen: list[int] = []
        self._index: dict[tuple[int, ...], list[int]] = {}  # n-gram -> positions after its latest occurrences
        self._follow: tuple[int, int, int] | None = None  # (sequence length, source position, match) of a copy
        self.edits: dict[int, int] = {}  # source token -> what the target writes instead
        self._broke: list[int] = []  # where established copies broke since the last resumed (the source positions not written), newest last
        self.reference: list[int] | None = None  # where copies come from (None: the sequence itself) ...
        self._read = 0  # ... and in it, the furthest point a copy reached

    def refer(self, reference: list[int] | None, start: int = 0) -> None:
        """Copy from ``reference`` from now on, not from the sequence (None: from the sequence
        again). Its tokens before ``start`` are context only: a copy starts at ``start`` or later,
        so a reference that opens with the prompt's last tokens is offered from its start."""
        self.reference, self._read = reference, start
        self._seen, self._index, self._follow, self.edits, self._broke = [], {}, None, {}, []
        if reference is not None:
            self._add(reference, max(start, 1))

    def _source(self, tokens: list[int]) -> list[int]:
        """The tokens copies come from, given the sequence."""
        return tokens if self.reference is None else self.reference

    def _add(self, tokens: list[int], first: int) -> None:
        """Index the n-grams that end at ``first`` or later, before the last token (the suffix
        itself is the query)."""
        for end in range(first, len(tokens)):
            for n in range(self.n_min, self.n_max + 1):
                if end - n >= 0:
                    seen = self._index.setdefault(tuple(tokens[end - n : end]), [])
                    seen.append(end)
                    if len(seen) > OCCURRENCES:
                        del seen[0]

    def _update(self, tokens: list[int]) -> None:
        n_old = len(self._seen)
        if tokens[:n_old] != self._seen:  # the sequence was rolled back or replaced: rebuild
            self._follow, n_old, self.edits, self._broke = None, 0, {}, []
            if self.reference is None:
                self._index = {}
        if self.reference is None:
            self._add(tokens, max(n_old, 1))
        self._seen = list(tokens)

    def _copy(self, tokens: list[int], src: int, k: int, match: int) -> Proposal:
        """Propose the k source tokens from ``src`` on, with the learned edits applied."""
        run = self.span(tokens, src, k)
        self._follow = (len(tokens), src, min(match, MATCH_CAP))
        self._read = max(self._read, src)
        return Proposal(run, [Dist.one_hot(t) for t in run], min(match, MATCH_CAP), start=src)

    @property
    def seen(self) -> list[int]:
        """The sequence indexed so far (not to be changed)."""
        return self._seen

    def span(self, tokens: list[int], src: int, k: int) -> list[int]:
        """The k source tokens from ``src`` on, with the learned edits applied."""
        edits, run = self.edits, self._source(tokens)[src : src + k]
        return [edits.get(t, t) for t in run] if edits else run

    def _continue(self, tokens: list[int], k: int) -> Proposal | None:
        """Go on with the copy under way, learning an edit where it broke. None: no copy."""
        if self._follow is None:
            return None
        seq_end, src, match = self._follow
        grown = len(tokens) - seq_end  # what the last round added: drafts accepted, then one token
        nxt = src + grown
        source = self._source(tokens)
        if grown <= 0 or nxt >= len(source):
            return None
        was = [self.edits.get(t, t) for t in source[src:nxt]]
        got = tokens[seq_end:]
        if got == was:
            if self._broke and self._broke[-1] == src - 1:
                self._broke.pop()  # the copy went on past its break: a replacement, not a break to come back to
            return self._copy(tokens, nxt, k, match + grown)
        if got[:-1] != was[:-1]:  # pragma: no cover - a round only ever differs at its last token
            return None
        source_token, written = source[nxt - 1], got[-1]
        if written == source_token:
            self.edits.pop(source_token, None)  # a learned edit was wrong here: the source stands
        elif match + grown - 1 >= MIN_MATCH:  # the copy had matched this much before the break
            self.edits[source_token] = written
            self._broke = [*self._broke, nxt - 1][-OCCURRENCES:]
        else:
            self.edits.pop(source_token, None)
            return None
        return self._copy(tokens, nxt, k, 0)  # past the edit; a fresh edit starts with no evidence

    def _resume(self, tokens: list[int], k: int) -> Proposal | None:
        """If the sequence ends with the source from where a copy broke (``n_min`` tokens of
        it at least), the copy from there: the break was an insertion."""
        end, source = len(tokens), self._source(tokens)
        for p in reversed(self._broke):
            for n in range(self.n_max, self.n_min - 1, -1):
                # something left to copy after the n tokens: in the sequence, before its suffix
                left = p + n < (end - n if self.reference is None else len(source))
                if left and tokens[end - n :] == source[p : p + n]:
                    self.edits.pop(source[p], None)  # the break was not a replacement of source[p]
                    self._broke = []
                    return self._copy(tokens, p + n, k, n)
        return None

    def propose(self, tokens: list[int], k: int, p_min: float = 0.0) -> Proposal:
        """The copy on offer after ``tokens`` (``p_min`` does not apply: a copy has no confidence)."""
        if k <= 0 or len(tokens) < self.n_min + 1:
            return Proposal()
        self._update(tokens)
        # 1. keep copying the span we were following, if the sequence has kept copying it
        out = self._continue(tokens, k)
        if out is not None:
            return out
        # 2. the target came back to the source where a copy broke: it inserted, so resume there
        self._follow = None
        out = self._resume(tokens, k)
        if out is not None:
            return out
        # 3. otherwise look the longest suffix up
        src, match = self.lookup(tokens)
        return self._copy(tokens, src, k, match) if match else Proposal()

    def lookup(self, seq: list[int]) -> tuple[int, int]:
        """Where a copy after ``seq`` would start in the sequence indexed so far (or the
        reference), and how far back its match goes (0: no copy); ``seq`` may run past what is
        indexed (drafts not yet verified). Of the longest suffix's occurrences, the one matching
        furthest back wins, the latest on a tie. A reference is read forward: of the occurrences
        at or past the furthest point a copy reached, the nearest wins (after a deletion, the
        text right after it, not a twin further on or one the reply already wrote); only if
        there are none, the one matching furthest back."""
        found = self._places(seq)
        ahead = [f for f in found if f[0] >= self._read] if self.reference is not None else []
        if ahead:
            return min(ahead)
        if found:
            return max(found, key=lambda f: (f[1], f[0]))
        return 0, 0

    def _places(self, seq: list[int]) -> list[tuple[int, int]]:
        """Where the longest suffix of ``seq`` that occurred before did (the position after
        each occurrence), and how far back each matches."""
        end, source = len(seq), self._source(seq)
        for n in range(self.n_max, self.n_min - 1, -1):
            if end <= n:
                continue
            found = []
            for src in self._index.get(tuple(seq[end - n :]), ()):
                match = n
                while match < MATCH_CAP and match < min(src, end) and seq[end - 1 - match] == source[src - 1 - match]:
                    match += 1
                found.append((src, match))
            if found:
                return found
        return []

    def continuations(self, seq: list[int], k: int) -> list[tuple[list[int], int]]:
        """The copies of up to ``k`` tokens after each place the longest suffix of ``seq``
        occurred, with how far back each matches, the one matching furthest back first (the
        latest on a tie): the alternatives a token tree may branch into."""
        found = sorted(self._places(seq), key=lambda f: (f[1], f[0]), reverse=True)
        return [(run, match) for run, match in ((self.span(seq, src, k), match) for src, match in found) if run]
