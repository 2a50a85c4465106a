"""The n-gram drafter on plain token lists: lookup, copies that continue, learned edits."""

from __future__ import annotations

from specrun.decode.round import common_prefix
from specrun.decode.sources.ngram import NgramDrafter

# a "file" of distinct tokens with a repeated identifier (9) that the target will rename to 99
SOURCE = [10, 11, 9, 12, 13, 14, 15, 16, 17, 9, 18, 19, 20, 21, 22, 23, 9, 24, 25]


def step(d: NgramDrafter, seq: list[int], k: int, target: list[int]) -> list[int]:
    """One round: propose, let the target accept the matching prefix and write its own next
    token (as greedy verification does). Returns the proposal."""
    p = d.propose(seq, k)
    pos = len(seq)
    n = common_prefix(p.tokens, target[pos : pos + len(p.tokens)])
    seq.extend(target[pos : pos + n + 1])
    return p.tokens


def test_lookup_proposes_what_followed_the_longest_suffix():
    d = NgramDrafter(2, 4)
    seq = [1, 2, 3, 4, 5, 6, 7, 2, 3]
    p = d.propose(seq, 3)
    assert p.tokens == [4, 5, 6] and p.match == 2
    assert d.propose([1, 2, 3, 4, 5, 9, 8], 3).tokens == []  # no suffix seen before


def test_match_counts_how_far_back_the_copy_already_goes():
    d = NgramDrafter(2, 3)
    seq = [5, 1, 2, 3, 4, 6, 7, 8, 1, 2, 3, 4]  # the suffix matches 4 tokens, more than n_max
    assert d.propose(seq, 2).match == 4


def test_a_copy_continues_without_search_and_its_match_grows():
    d = NgramDrafter()
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 0, 1, 2]
    target = prompt + [3, 4, 5, 6, 7, 8, 9, 10, 11, 12]
    seq = list(prompt)
    step(d, seq, 2, target)  # proposes 3 4, both accepted, the target adds 5
    p = d.propose(seq, 4)
    assert p.tokens == [6, 7, 8, 9] and p.match == 2 + 3


def test_an_edit_is_learned_and_applied_to_later_copies():
    d = NgramDrafter()
    prompt = SOURCE + [0, 10, 11]
    target = prompt + [99, 12, 13, 14, 15, 16, 17, 99, 18, 19, 20, 21, 22, 23, 99, 24, 25]
    seq = list(prompt)
    # the copy "10 11 -> 9 12 ..." is only 2 tokens old when 99 replaces 9: too little evidence
    step(d, seq, 4, target)
    assert seq[-1] == 99 and d.edits == {}
    while len(seq) < len(prompt) + 8:  # copy along, until the target writes 99 again for 9
        step(d, seq, 4, target)
    assert seq[-1] == 99
    # the copy had matched 6 tokens when it broke: the next proposal learns the edit, goes
    # on past it, and writes 99 wherever the source has 9
    proposal = d.propose(seq, 8)
    assert d.edits == {9: 99}
    assert proposal.tokens == [18, 19, 20, 21, 22, 23, 99, 24] and proposal.match == 0
    while len(seq) < len(target):
        step(d, seq, 8, target)
    assert seq == target


def test_a_wrong_edit_is_dropped():
    d = NgramDrafter()
    d.edits = {9: 99}
    prompt = SOURCE + [0, 10, 11, 9, 12]  # the output keeps 9 this time
    target = prompt + SOURCE[4:]
    seq = list(prompt)
    while len(seq) < len(target) - 1 and d.edits:
        step(d, seq, 3, target)
    assert d.edits == {} and seq == target[: len(seq)]


def test_a_rolled_back_sequence_forgets_its_edits():
    d = NgramDrafter()
    d.propose(SOURCE, 4)
    d.edits = {9: 99}
    d.propose([1, 2, 3, 1, 2], 4)  # not an extension of what it saw: a new sequence
    assert d.edits == {}


def test_after_an_insertion_the_copy_resumes_where_it_broke():
    """A docstring or a logging call inserted into a copied file: the copy breaks, the target
    writes new tokens, then comes back to the source where it left off. The copy resumes
    there, though the same two tokens also occur elsewhere (later, so the lookup alone would
    copy from there), and the replacement guessed at the break is dropped."""
    source = [10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24]
    prompt = source + [30, 15, 16, 31, 32] + [0, 10, 11]  # "15 16" once more after the file, followed by other tokens
    inserted = [40, 41, 42]
    target = prompt + [12, 13, 14] + inserted + source[5:]
    d, seq = NgramDrafter(), list(prompt)
    while len(seq) < len(prompt) + 3 + len(inserted) + 2:  # copy, break at 15, insert, write 15 16 again
        step(d, seq, 4, target)
    assert seq[-2:] == [15, 16]
    p = d.propose(seq, 4)
    assert p.tokens == [17, 18, 19, 20]
    assert 15 not in d.edits
    while len(seq) < len(target):
        step(d, seq, 8, target)
    assert seq == target


# --- copies from a reference (a predicted output) -------------------------------------------

PROMPT_END = [1, 2, 3, 4, 5, 6]  # the prompt's last tokens, which open the reference


def referring(prediction: list[int]) -> NgramDrafter:
    d = NgramDrafter()
    d.refer(PROMPT_END + prediction, len(PROMPT_END))
    return d


def test_a_reference_is_offered_from_its_start_and_only_it_is_copied():
    """The reply's first tokens are the prediction's first; the prompt, though it holds a copy
    of the same tokens, is not copied from (that is the n-gram source's)."""
    prediction = [10, 11, 12, 13, 14, 15]
    d = referring(prediction)
    prompt = [10, 11, 12, 13, 14, 99, *PROMPT_END]
    p = d.propose(prompt, 4)
    assert p.tokens == [10, 11, 12, 13] and p.start == len(PROMPT_END) and p.match == len(PROMPT_END)
    seq = prompt + [10, 11]
    assert d.propose(seq, 8).tokens == [12, 13, 14, 15]  # it goes on to the reference's end, no further
    d.refer(None)
    assert d.propose(prompt + [10, 11], 3).tokens == [12, 13, 14]  # the sequence's own copy again


def test_a_reference_copy_resumes_after_an_insertion_and_finds_its_place_after_a_deletion():
    prediction = list(range(10, 40))
    reply = prediction[:8] + [50, 51, 52] + prediction[8:20] + prediction[24:]  # 3 inserted after 17, 30..33 deleted
    prompt = [7, *PROMPT_END]
    target = prompt + reply
    d, seq = referring(prediction), list(prompt)
    offered = {}  # the sequence's last two tokens -> the copy offered after them
    while len(seq) < len(target):
        last = tuple(seq[-2:])
        offered[last] = step(d, seq, 8, target)
    assert seq == target
    assert offered[(5, 6)] == prediction[:8]
    assert offered[(18, 19)] == prediction[10:18]  # back at the break after the insertion: resumed there
    assert offered[(34, 35)] == prediction[26:30]  # past the deletion: found its place again


def test_a_reference_is_read_forward():
    """After a deletion the sequence's suffix occurs behind (what the reply already wrote) and
    twice ahead, each matching as far back: the copy goes on from the nearest ahead (the
    sequence's own lookup would take the latest)."""
    prediction = [10, 11, 12, 13, 14, 15, 50, 51, 12, 13, 60, 61, 12, 13, 70]
    prompt = [7, *PROMPT_END]
    target = prompt + [10, 11, 12, 13, 14, 15, 12, 13, 60, 61, 12, 13, 70]  # 50 51 deleted
    d, seq = referring(prediction), list(prompt)
    while seq[-2:] != [12, 13] or len(seq) < len(prompt) + 8:
        step(d, seq, 6, target)
    assert len(seq) == len(prompt) + 8
    p = d.propose(seq, 3)
    assert p.tokens == [60, 61, 12] and p.start == len(PROMPT_END) + 10
