"""The answer-statement grammar of the MLLM parser (``probes/vqa/parse.py``), case by kind.

Each case: (reply text, option set, expected). Expected is the displayed position credited
(an int) or, for an unparseable reply, the reason (one of ``parse.REASONS``). The cases
are written by hand, grouped by the form they exercise; the table in docs/PROTOCOL.md §11
summarises them.
"""

from __future__ import annotations

import pytest

from spar_bench.probes.vqa.parse import REASONS, classify, normalise, parse_answer, statements

YN = (("A", "B"), ("no", "yes"))
NY = (("A", "B"), ("yes", "no"))  # rotated: B is "no"
SEC = (tuple("ABCDEFGH"), ("left", "left-anterior", "anterior", "right-anterior", "right",
                           "right-posterior", "posterior", "left-posterior"))
SYM = (("A", "B", "C"), ("the left one is larger", "they are similar in size", "the right one is larger"))
SIZE = (("A", "B", "C"), ("small", "medium", "large"))
DIST = (("A", "B", "C"), ("near", "medium", "far"))
COUNT = (("A", "B", "C", "D"), ("0", "1", "2", "3+"))

CASES: dict[str, list[tuple[str, tuple, int | str]]] = {
    "plain_letter": [
        ("A", YN, 0), ("B", YN, 1), ("B.", YN, 1), ("(B)", YN, 1), ("[B]", YN, 1), ("B)", YN, 1),
        ("B:", YN, 1), ("  B  ", YN, 1), ("B\n", YN, 1), ("Option B", YN, 1), ("Option B.", YN, 1),
        ("Choice A", YN, 0), ("Letter B", YN, 1), ("H", SEC, 7), ("E", SEC, 4), ("C", SYM, 2),
        ("D", COUNT, 3), ("A", COUNT, 0), ("Answer B", YN, 1), ("Answer: B", YN, 1),
        ("Answer: (A)", YN, 0), ("The answer is B.", YN, 1), ("The correct answer is (B)", YN, 1),
        ("The correct answer is (B).", YN, 1), ("The correct option is C.", SYM, 2),
        ("The answer would be A.", YN, 0), ("Final answer: B", YN, 1), ("My answer: A", YN, 0),
        ("I choose B.", YN, 1), ("I would pick C.", SIZE, 2), ("I'll go with D.", COUNT, 3),
        ("B is correct.", YN, 1), ("B is the correct answer.", YN, 1), ("B is right.", YN, 1),
        ("A is the answer.", YN, 0), ("So the answer is B.", YN, 1), ("Therefore, B.", YN, 1),
        ("Answer = B", YN, 1), ("Answer - B", YN, 1), ("I", SEC, "no_option"),
        ("Z", YN, "no_option"), ("(C)", YN, "no_option"), ("The correct answer is (C).", YN, "no_option"),
    ],
    "option_text": [
        ("yes", YN, 1), ("Yes", YN, 1), ("YES", YN, 1), ("Yes.", YN, 1), ("No", YN, 0), ("no.", YN, 0),
        ("yes", NY, 0), ("no", NY, 1), ("The answer is yes.", YN, 1), ("The answer is no.", YN, 0),
        ("Answer: yes", YN, 1), ("left-anterior", SEC, 1), ("posterior", SEC, 6), ("right", SEC, 4),
        ("left", SEC, 0), ("The answer is right-posterior.", SEC, 5), ("medium", SIZE, 1),
        ("Large.", SIZE, 2), ("far", DIST, 2), ("3+", COUNT, 3), ("0", COUNT, 0), ("The answer is 2.", COUNT, 2),
        ("They are similar in size.", SYM, 1), ("The right one is larger.", SYM, 2),
        ("the left one is larger", SYM, 0), ("It is medium.", SIZE, 1), ("It's near.", DIST, 0),
        ("Yes, the left kidney is to the patient's left of the spleen.", YN, 1),
        ("No, the liver lies on the right.", YN, 0), ("Yes - it lies in front.", YN, 1),
        ("No answer.", YN, "no_option"), ("No option is correct.", YN, "no_option"),
        ("small or medium", SIZE, "several"), ("huge", SIZE, "no_option"),
    ],
    "letter_with_text": [
        ("B. yes", YN, 1), ("B) yes", YN, 1), ("(B) yes", YN, 1), ("B: yes", YN, 1), ("B - yes", YN, 1),
        ("A. no", YN, 0), ("B) no", NY, 1), ("B) left-anterior", SEC, 1), ("(H) left-posterior", SEC, 7),
        ("The answer is (H) left-posterior", SEC, 7), ("C. the right one is larger", SYM, 2),
        ("Answer: B. medium", SIZE, 1), ("Option D: 3+", COUNT, 3), ("B (yes)", YN, 1),
        ("yes (B)", YN, 1), ("The answer is B, yes.", YN, 1),
        ("B) no", YN, "several"), ("B) left", SEC, "several"), ("A. yes", YN, "several"),
        ("C: they are similar in size", SYM, "several"),
    ],
    "separators": [
        ("left anterior", SEC, 1), ("left_anterior", SEC, 1), ("leftanterior", SEC, 1),
        ("left - anterior", SEC, 1), ("Left-Anterior", SEC, 1), ("LEFT ANTERIOR", SEC, 1),
        ("anterior left", SEC, 1), ("anterior-left", SEC, 1), ("anterior_left", SEC, 1),
        ("posterior right", SEC, 5), ("right posterior", SEC, 5), ("posterior-left", SEC, 7),
        ("anterior right", SEC, 3), ("The answer is anterior left.", SEC, 1),
        ("The direction is: left anterior", SEC, 1), ("Answer: right posterior", SEC, 5),
        ("left/posterior", SEC, 7), ("B) left anterior", SEC, 1), ("B) anterior-left", SEC, 1),
        ("they are similar-in-size", SYM, 1), ("the_right_one_is_larger", SYM, 2),
        ("left, anterior", SEC, "several"), ("left or anterior", SEC, "several"),
        ("left-anterior-ish", SEC, "no_option"),
    ],
    "boxed": [
        ("\\boxed{B}", YN, 1), ("\\boxed{A}", YN, 0), ("$\\boxed{B}$", YN, 1), ("\\( \\boxed{B} \\)", YN, 1),
        ("The answer is \\boxed{B}.", YN, 1), ("\\boxed{\\text{B}}", YN, 1), ("\\boxed{yes}", YN, 1),
        ("\\boxed{\\text{left-anterior}}", SEC, 1), ("\\boxed{(C)}", SYM, 2), ("\\boxed {D}", COUNT, 3),
        ("Reasoning: the spleen is left.\n\\boxed{B}", SEC, 1),
        ("A looks plausible, but \\boxed{B}", YN, 1), ("\\boxed{A}\nWait, \\boxed{B}", YN, 1),
        ("\\boxed{A or B}", YN, "several"), ("\\boxed{}", YN, "no_option"), ("\\boxed{Z}", YN, "no_option"),
        ("Perhaps \\boxed{B}", YN, 1),  # a box is its own statement: the hedge before it is not
    ],
    "think": [
        ("<think>The liver is on the right... so A? or B</think>\nB", YN, 1),
        ("<think>\nhmm A\n</think>\n\nThe answer is (A).", YN, 0),
        ("<think>the answer is no</think>yes", YN, 1),
        ("...so the answer is no.\n</think>\n\nB", YN, 1),
        ("The kidney is left. Answer: A\n</think>\n\nB", YN, 1),
        ("A? no, B? </think> A", YN, 0),
        ("<THINK>x</THINK> B", YN, 1), ("<thinking>A</thinking>B", YN, 1),
        ("<reasoning>A is wrong</reasoning>\nAnswer: B", YN, 1),
        ("<think>A</think><think>B</think>A", YN, 0),
        ("<think>A looks right", YN, "empty"), ("<think>The answer is B", YN, "empty"),
        ("<think>long reasoning</think>", YN, "empty"), ("reasoning </think>", YN, "empty"),
        ("<think>B</think>\nI cannot tell.", YN, "refusal"),
        ("so it is left-anterior\n</think>\nanterior", SEC, 2),
        ("<think>\n\n</think>\n\nB", YN, 1), ("<answer>B</answer>", YN, 1),
        ("<think>A?</think>\n<answer>\nB\n</answer>", YN, 1),
    ],
    "self_correction": [
        ("The answer is A. Actually, the answer is B.", YN, 1),
        ("The answer is A.\nThe answer is B.", YN, 1),
        ("A. Wait, no: B.", SYM, 1),
        ("Answer: A\nCorrection: the answer is B.", YN, 1),
        ("B. Actually, A.", YN, 0),
        ("Initially I chose A, but the answer is B.", YN, 1),
        ("I first thought A. On a closer look the answer is C.", SYM, 2),
        ("The answer is left. No wait, the answer is left-anterior.", SEC, 1),
        ("Answer: B\nFinal answer: A", YN, 0),
        ("A\nB", YN, 1),
        ("The answer is B. Option A is wrong.", YN, 1),
        ("The answer is A. Option B is wrong.", YN, 0),
        ("The answer is B. But it might be A.", YN, "hedged"),
        ("The answer is B, or perhaps A.", YN, "several"),
    ],
    "negation": [
        ("not A", YN, "negated"), ("Not B.", YN, "negated"), ("The answer is not A.", YN, "negated"),
        ("It is not B.", YN, "negated"), ("It isn't A.", YN, "negated"), ("Definitely not C.", SYM, "negated"),
        ("A is incorrect.", YN, "negated"), ("Option A is wrong.", YN, "negated"),
        ("A is not correct.", YN, "negated"), ("A can be ruled out.", YN, "negated"),
        ("We can rule out A.", YN, "negated"), ("neither A nor B", YN, "negated"),
        ("The answer is neither A nor B.", YN, "negated"), ("not left-anterior", SEC, "negated"),
        ("The direction is not posterior.", SEC, "negated"), ("A is unlikely.", SYM, "negated"),
        ("It cannot be B.", YN, "negated"), ("Anything except C.", SYM, "negated"),
        ("B, not A", YN, 1), ("B, not A.", YN, 1), ("The answer is B, not A.", YN, 1),
        ("The answer is not A but B.", YN, 1), ("Not A but B.", YN, 1), ("Not A; B.", YN, 1),
        ("B rather than A", YN, 1), ("Option A is incorrect. The answer is B.", YN, 1),
        ("A is wrong, so B.", YN, 1), ("C, rather than A or B", SYM, 2),
        ("Not A, not B: C.", SYM, 2), ("Instead of A, the answer is B.", YN, 1),
        ("A is incorrect and B is incorrect.", SYM, "negated"),
        ("The answer is not yes.", YN, "negated"), ("not left", SEC, "negated"),
        ("B is not the answer, A is.", YN, 0),
    ],
    "hedging": [
        ("perhaps B", YN, "hedged"), ("Perhaps B.", YN, "hedged"), ("Maybe A.", YN, "hedged"),
        ("Possibly C.", SYM, "hedged"), ("Probably B.", YN, "hedged"), ("B, probably.", YN, "hedged"),
        ("Most likely B.", YN, "hedged"), ("The answer is likely B.", YN, "hedged"),
        ("It might be B.", YN, "hedged"), ("It could be A.", YN, "hedged"), ("It may be C.", SIZE, "hedged"),
        ("It seems to be B.", YN, "hedged"), ("The answer appears to be B.", YN, "hedged"),
        ("I think the answer is B.", YN, "hedged"), ("I believe B is correct.", YN, "hedged"),
        ("I guess B.", YN, "hedged"), ("B?", YN, "hedged"), ("Is it B?", YN, "hedged"),
        ("B. I'm not sure.", YN, "hedged"), ("I'm not sure, but B.", YN, "hedged"),
        ("B, though I am not certain.", YN, "hedged"), ("It is hard to tell; B.", YN, "hedged"),
        ("Presumably left-anterior.", SEC, "hedged"), ("Maybe yes.", YN, "hedged"),
        ("I'm not sure.", YN, "hedged"), ("Hard to tell from this slice.", YN, "hedged"),
        ("Probably medium.", SIZE, "hedged"), ("The left one seems larger: A?", SYM, "hedged"),
        ("It might be A. The answer is B.", YN, 1),
        ("A seems plausible at first. Final answer: B", YN, 1),
        ("The answer is B because the liver appears on the left.", YN, 1),
        ("Let me think step by step: B is correct.", YN, 1), ("I would say B.", YN, 1),
    ],
    "mention": [
        ("The spleen lies left-anterior of the liver.", SEC, "mention"),
        ("The left kidney is left of the spine.", SEC, "mention"),
        ("Option A says yes.", YN, "mention"), ("A is tempting.", YN, "mention"),
        ("There is no lesion near the liver.", DIST, "mention"),
        ("The lesion is small.", SIZE, "mention"),
        ("The kidneys look medium sized and near each other.", SIZE, "mention"),
        ("I see 2 lesions.", COUNT, "mention"),
        ("Option B describes the anterior direction.", SEC, "mention"),
        ("The organ on the right of the image is the patient's left.", SEC, "mention"),
        ("Comparing A and B is hard to do from a slice.", YN, "mention"),
        ("A is tempting, but the answer is B", YN, 1),
        ("The spleen lies left-anterior of the liver. The answer is B.", SEC, 1),
        ("The answer is B. The spleen lies left of the liver.", SEC, 1),
        ("A kidney is usually on the left.", YN, "no_option"),
        ("A large mass is visible.", SIZE, "mention"),
        ("Is the spleen left of the liver? B", SEC, 1),  # the question echoed, then the answer
        ("Based on the image, the left kidney appears to lie left of the spleen. Therefore, the answer is B.",
         YN, 1),
    ],
    "several": [
        ("A or B", YN, "several"), ("Either A or B", YN, "several"), ("The answer is A or B.", YN, "several"),
        ("A and B", YN, "several"), ("Both A and B.", YN, "several"), ("A/B", YN, "several"),
        ("yes and no", YN, "several"), ("yes or no", YN, "several"), ("left or right", SEC, "several"),
        ("B or C", SYM, "several"), ("Answer: A, B", YN, "several"), ("A, B or C", SYM, "several"),
        ("The answer is B or D.", COUNT, "several"), ("small/medium", SIZE, "several"),
        ("I choose A and C.", SYM, "several"), ("(A) or (B)", YN, "several"),
        ("near or far", DIST, "several"), ("A. no\nB. yes\nThe answer is A or B.", YN, "several"),
    ],
    "refusal_empty": [
        ("", YN, "empty"), ("   ", YN, "empty"), ("\n\n", YN, "empty"), ("**", YN, "empty"),
        ("I cannot determine this from the image.", YN, "refusal"),
        ("I can't tell from this slice.", SEC, "refusal"),
        ("I'm sorry, but I can't help with that.", YN, "refusal"),
        ("As an AI, I cannot interpret medical images.", YN, "refusal"),
        ("I am unable to assess the image.", SIZE, "refusal"),
        ("It is not possible to answer without more slices.", YN, "refusal"),
        ("No image was provided.", YN, "refusal"),
        ("I do not know.", YN, "no_option"), ("The image shows an abdomen.", YN, "no_option"),
        ("Hello", YN, "no_option"), ("...", YN, "no_option"), ("?", YN, "no_option"),
    ],
    "lowercase": [
        ("b", YN, 1), ("a", YN, 0), ("b.", YN, 1), ("(b)", YN, 1), ("b)", YN, 1), ("b) yes", YN, 1),
        ("c) anterior", SEC, 2), ("the answer is b", YN, 1), ("the answer is b.", YN, 1),
        ("answer: a", YN, 0), ("option b", YN, 1), ("the correct option is c", SYM, 2), ("h", SEC, 7),
        ("a or b", YN, "several"), ("not a", YN, "negated"),
        ("a kidney is on the left", YN, "no_option"), ("the answer is a kidney", YN, "no_option"),
        ("i think b", YN, "hedged"), ("b is correct", YN, 1),
    ],
    "punctuation_markup": [
        ("**B**", YN, 1), ("**B.**", YN, 1), ("`A`", YN, 0), ("\"B\"", YN, 1), ("'B'", YN, 1),
        ("\u201cB\u201d", YN, 1), ("**Answer:** B", YN, 1), ("## Answer\nB", YN, 1),
        ("B!", YN, 1), ("B...", YN, 1), ("(B).", YN, 1), ("-> B", YN, 1), ("=> B", YN, 1),
        ("Answer:\nA", YN, 0), ("Answer:\n\n**B**", YN, 1), ("**The correct answer is B**", YN, 1),
        ("*left-anterior*", SEC, 1), ("_B_", YN, 1), ("B \u2014 yes", YN, 1), ("B \u2013 yes", YN, 1),
        ("The answer is: **(C)**", SYM, 2), ("Answer - 3+", COUNT, 3),
    ],
    "multiline_explanation": [
        ("Answer: B\nExplanation: the liver lies on the patient's right.", YN, 1),
        ("B\n\nExplanation: the spleen is not A, since it lies left.", YN, 1),
        ("B\n\nExplanation: the organ is not on the left, so not A.", YN, 1),
        ("B\n\nThe left kidney is lower, so it lies anterior.", SEC, 1),
        ("B. The liver is on the right.", SEC, 1),
        ("Yes.\nThe left kidney is to the left of the spleen.", YN, 1),
        ("Looking at the image, the left kidney is larger.\nAnswer: A", SYM, 0),
        ("Step 1: find the liver.\nStep 2: find the spleen.\nThe answer is B.", YN, 1),
        ("The liver is large.\nThe spleen is small.\nAnswer: C", SIZE, 2),
        ("B\n\nReason: A would mean the kidney is anterior, which it is not.", YN, 1),
        ("Answer: B\n\nNote: I am not sure about this.", YN, "hedged"),
        ("Answer: C\nA is wrong because the organ is small.\nB is wrong.", SYM, 2),
        ("The lesions:\n1. near the liver\n2. near the spleen\nAnswer: C", COUNT, 2),
        ("Explanation first: the kidney is left.\nSo the answer is A.\nThat is my final answer.", SEC, 0),
        ("A. no\nB. yes", YN, "mention"), ("Options:\nA. no\nB. yes\nAnswer: B", YN, 1),
        ("A. small\nB. medium\nC. large", SIZE, "mention"),
        ("B\nA", YN, 0),
    ],
}

ALL = [(kind, *case) for kind, cases in CASES.items() for case in cases]


@pytest.mark.parametrize("kind,text,opts,expected", ALL,
                         ids=[f"{k}-{i}" for k, cases in CASES.items() for i in range(len(cases))])
def test_grammar(kind, text, opts, expected):
    letters, options = opts
    got = parse_answer(text, letters, options)
    if isinstance(expected, int):
        assert (got.position, got.reason) == (expected, None), text
    else:
        assert expected in REASONS
        assert (got.position, got.reason) == (None, expected), text


def test_a_few_hundred_cases_of_every_kind():
    assert len(ALL) >= 300
    assert all(len(cases) >= 10 for cases in CASES.values())
    reasons = {e for _, _, _, e in ALL if isinstance(e, str)}
    assert reasons == set(REASONS)  # every reason is reached by some case


def test_positions_are_displayed_not_classes():
    # under a rotation "B" is whatever is shown at B: the parser returns positions
    assert parse_answer("B) no", *NY).position == 1
    assert parse_answer("no", *NY).position == 1 and parse_answer("no", *YN).position == 0


def test_steps_are_exposed():
    assert normalise("x </think> **B**") == "B"
    assert normalise("<think>never closed") is None
    assert statements("A is wrong; the answer is B. Because x.") == ["A is wrong", "the answer is B.", "x."]
    assert statements("B. yes", YN[1]) == ["B. yes"] and statements("B. yes") == ["B.", "yes"]
    st = classify("B, not A", *YN)
    assert (st.kind, st.position) == ("answer", 1)
    assert classify("not A", *YN).kind == "negated" and classify("perhaps B", *YN).kind == "hedged"


# --------------------------------------------------------------------------- in a run
#: Replies of the stub model, one per question in turn: every reason and a credited one.
STUB_REPLIES = ("The answer is {last}.", "perhaps A", "not A", "A or B", "I cannot determine this.",
                "The kidney is {first}.", "")


def test_reasons_are_recorded_per_answer_per_run_and_in_the_report(pipeline, tmp_path, monkeypatch):
    """A stub generating model answers in every form: each answer's reason is in
    answers.jsonl, the counts in metrics.json (``unparsed``), and the report's MLLM row."""
    import json

    from spar_bench.probes.cli import cli
    from spar_bench.probes.vqa.base import Reply
    from spar_bench.probes.vqa.dummy import DummyBackend

    from helpers import run_cmd

    def answer(self, requests):
        return [Reply(text=STUB_REPLIES[i % len(STUB_REPLIES)].format(first=r.options[0], last=r.letters[-1]))
                for i, r in enumerate(requests)]

    monkeypatch.setattr(DummyBackend, "answer", answer)
    runs = tmp_path / "runs"
    assert run_cmd(cli, ["vqa", "--bootstrap", 20, "--model", "dummy", "--generate", "--data",
                         pipeline["shards"], "--out", runs, "--probe", "relative_position"]) == 0
    (rd,) = [p.parent for p in runs.rglob("metrics.json")]
    recs = [json.loads(line) for line in (rd / "answers.jsonl").read_text().splitlines()]
    m = json.loads((rd / "metrics.json").read_text())
    expect = dict(zip(STUB_REPLIES[1:], ("hedged", "negated", "several", "refusal", "mention", "empty"), strict=True))
    for r in recs:  # the stub's batches may start anywhere in the cycle: check reply by reply
        form = next((f for f in STUB_REPLIES[1:] if r["text"] == f.format(first="no", last="B")
                     or r["text"] == f.format(first="yes", last="B")), None)
        assert (r["choice"] is None) == (form is not None)
        assert r["reason"] == (expect[form] if form is not None else None)
    every = {}
    for r in recs:
        if r["choice"] is None:
            every[r["reason"]] = every.get(r["reason"], 0) + 1
    assert m["unparsed"]["all"] == dict(sorted(every.items())) and m["unparsed"]["n_answers"] == len(recs)
    assert set(every) == {"hedged", "negated", "several", "refusal", "mention", "empty"}
    assert sum(m["unparsed"]["test"].values()) == m["test"]["n_unparsed"]
    out = tmp_path / "report"
    assert run_cmd(cli, ["report", runs, "--out", out]) == 0
    md = (out / "report.md").read_text()
    row = next(line for line in md.splitlines() if "| vqa-generate |" in line)
    assert "unparsed (why)" in md and ", ".join(f"{k} {v}" for k, v in m["unparsed"]["test"].items()) in row
