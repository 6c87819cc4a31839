"""The statistics and graders behind the accuracy benchmarks, against published values and hand-built cases."""

from __future__ import annotations

import random

import pytest

from kvcompact.tools import evaluation as ev


def test_wilson_matches_published_values():
    # Newcombe (1998), Table I: 81/263 -> 0.2553-0.3662; 15/148 -> 0.0624-0.1605; 0/20 -> 0-0.1611
    for (k, n), (lo, hi) in {(81, 263): (0.2553, 0.3662), (15, 148): (0.0624, 0.1605),
                             (0, 20): (0.0, 0.1611)}.items():
        got = ev.wilson(k, n)
        assert got == pytest.approx((lo, hi), abs=6e-4), (k, n, got)


def test_paired_difference_counts_discordant_items():
    full = [True] * 10 + [False] * 10
    cell = [True] * 7 + [False] * 3 + [True] * 1 + [False] * 9
    d = ev.paired_difference(full, cell)
    assert (d["only_full"], d["only_cell"]) == (3, 1)
    assert d["diff"] == pytest.approx(-2 / 20)
    assert d["ci95"][0] < d["diff"] < d["ci95"][1]


def test_noninferiority_needs_enough_items():
    """Identical answers on 400 problems bound the loss below 2 points; on 20 problems they cannot (the interval
    is too wide to claim it), and a cell that loses 12 of 400 is not non-inferior either."""
    rng = random.Random(0)
    full = [rng.random() < 0.6 for _ in range(400)]
    assert ev.paired_difference(full, full)["noninferior"]
    assert not ev.paired_difference(full[:20], full[:20])["noninferior"]
    worse = list(full)
    for i in [i for i, f in enumerate(full) if f][:12]:
        worse[i] = False
    assert not ev.paired_difference(full, worse)["noninferior"]


def test_extract_number():
    assert ev.extract_number("so 3 + 4 = 7.\nAnswer: 1,250") == "1250"
    assert ev.extract_number("The answer is $42.") == "42"
    assert ev.extract_number("we get \\boxed{18}") == "18"
    assert ev.extract_number("first 3, then 12 apples") == "12"
    assert ev.extract_number("Answer: 12.0") == "12"
    assert ev.extract_number("no digits here") is None


def test_loop_detector():
    looping = list(range(40)) + [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20] * 6
    assert ev.loops(looping)
    rng = random.Random(1)
    assert not ev.loops([rng.randrange(30000) for _ in range(600)])
    assert not ev.loops([1, 2, 3] * 5)  # too short to judge
    assert not ev.loops(list(range(100)) * 2)  # a phrase said twice is not a loop
    assert not ev.loops(looping + [rng.randrange(30000) for _ in range(300)])  # the loop ended: only the tail counts


def test_graders():
    words = ("lorem ipsum dolor sit amet " * 800).split()
    pk = ev.passkey_task(3, words, seed=1, min_words=100, max_words=200)
    item = pk.items[0]
    assert f"The pass key is {item.answer}." in item.messages[0]["content"]
    assert pk.grade(item, f"{item.answer}") == (True, item.answer)
    assert pk.grade(item, "12345" if item.answer != "12345" else "54321")[0] is False
    rc = ev.recall_task(2, seed=1, count_to=5)
    it = rc.items[0]
    assert rc.grade(it, f"1, 2, 3, 4, 5\nCode: {it.answer}") == (True, it.answer)
    assert rc.grade(it, f"1, 2, 3\nCode: {it.answer}")[0] is False  # did not count: no credit
    assert rc.grade(it, "1, 2, 3, 4, 5\nCode: nothing-000")[0] is False


def test_report_and_explore_sets_differ():
    a = ev.recall_task(4, seed=ev.REPORT_SEED)
    b = ev.recall_task(4, seed=ev.EXPLORE_SEED)
    assert [i.answer for i in a.items] != [i.answer for i in b.items]
    assert [i.answer for i in a.items] == [i.answer for i in ev.recall_task(4, seed=ev.REPORT_SEED).items]


def test_chain_grader_reads_each_problem_in_place_and_restated():
    """Built from the items' own answers: a right transcript scores every problem twice; a restated line that
    swaps two results, misses one, or is absent loses exactly those problems while the in-place answers stand."""
    task = ev.chain_task(2, 3, seed=1)
    item = task.items[0]
    truth = item.meta["answers"]
    assert len(truth) == 3 and len({i.id for i in task.items}) == 2
    body = "".join(f"Problem {k + 1}\nsome steps\nAnswer {k + 1}: {a}\n\n" for k, a in enumerate(truth))
    right = body + "Final answers: " + "; ".join(truth)
    assert ev.chain_units(item, right) == [(True, True)] * 3
    assert task.grade(item, right)[0]
    swapped = body + "Final answers: " + "; ".join([truth[1], truth[0], truth[2]])
    expect_swapped = [(truth[1] == truth[0], True), (truth[0] == truth[1], True), (True, True)]
    assert ev.chain_units(item, swapped) == expect_swapped
    assert ev.chain_units(item, body + "Final answers: " + "; ".join(truth[:2])) == [(True, True)] * 2 + [
        (False, True)]
    assert ev.chain_units(item, body) == [(False, True)] * 3
    assert not task.grade(item, body)[0]
    wrong_in_place = body.replace(f"Answer 2: {truth[1]}", "Answer 2: -1") + "Final answers: " + "; ".join(truth)
    assert [u[1] for u in ev.chain_units(item, wrong_in_place)] == [True, truth[1] == "-1", True]
    # thousands separators inside an entry are one number, not two entries
    big = ev.Item("x", [], 10, "1250; 7", {"answers": ["1250", "7"]})
    assert ev.chain_units(big, "Final answers: 1,250; 7") == [(True, False), (True, False)]


def test_chain_copies_compares_the_final_line_with_the_answer_given_in_place():
    """A wrong result restated as given is copied; a right one restated wrong is not; a result never given in place
    has nothing to copy. Control: the same transcripts graded against the truth (chain_units) say otherwise."""
    item = ev.Item("x", [], 10, "1250; 7; 3", {"answers": ["1250", "7", "3"]})
    text = "Answer 1: 1,250\nAnswer 2: 8\nFinal answers: 1250; 8; 3"
    assert ev.chain_copies(item, text) == [True, True, None]
    assert [u[0] for u in ev.chain_units(item, text)] == [True, False, True]
    miscopied = "Answer 1: 46.875\nAnswer 2: 7\nAnswer 3: 3\nFinal answers: 46.25; 7"
    assert ev.chain_copies(item, miscopied) == [False, True, False]
    assert ev.chain_copies(item, "Answer 1: 1250\nAnswer 2: 7") == [False, False, None]


def test_chain_sets_differ_between_seeds():
    a = ev.chain_task(2, 4, seed=ev.REPORT_SEED)
    b = ev.chain_task(2, 4, seed=ev.EXPLORE_SEED)
    assert [i.answer for i in a.items] != [i.answer for i in b.items]
