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
        ("The spleen lies left-anterior of the liver, as the image shows.", SEC, "mention"),
        ("The left kidney is left of the spine.", SEC, "mention"),
        ("Option A says yes.", YN, "mention"), ("A is tempting.", YN, "mention"),
        ("There is no lesion near the liver.", DIST, "mention"),
        ("The lesion is small.", SIZE, "mention"),
        ("The kidneys look medium sized and near each other.", SIZE, "mention"),
        ("I see 2 lesions near the liver.", COUNT, "mention"),
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
    "prose_self_correction": [
        ("A. Hmm, the kidney is actually larger than that, so C.", SIZE, 2),
        ("Yes. Hmm, wait: the liver is on the patient's right, so no.", YN, 0),
        ("B? On reflection the centres are far apart, therefore C.", DIST, 2),
        ("C. Looking again, the two areas differ by less than 15%, hence B.", SYM, 1),
        ("The answer is A. Then again, the organ is bigger, thus B.", SIZE, 1),
        ("B. So A is incorrect.", YN, 1),
        ("A. Rechecking, the area is borderline, so perhaps B.", SIZE, "hedged"),
        ("A. Then again the spleen is close, so A or B.", DIST, "several"),
        ("A. The spleen is larger, so it is not A.", SIZE, "negated"),
        ("The answer is B, so the liver lies anterior.", SEC, 1),
        ("The kidney is left of the spine, so the answer must be yes.", YN, 1),
        ("A. The lesion is 3 mm, so the answer is unclear.", COUNT, "hedged"),
    ],
    "counting_words": [
        ("Two.", COUNT, 2), ("zero", COUNT, 0), ("One lesion.", COUNT, 1), ("There are 4 lesions.", COUNT, 3),
        ("There are no lesions.", COUNT, 0), ("No lesions are visible.", COUNT, 0), ("None.", COUNT, 0),
        ("I can see exactly two separate lesions on this slice.", COUNT, 2),
        ("There is a single lesion.", COUNT, 1), ("3 or more", COUNT, 3), ("At least 3 lesions.", COUNT, 3),
        ("More than two lesions are visible.", COUNT, 3), ("There are 2 or 3 lesions.", COUNT, "several"),
        ("At least one lesion is visible.", COUNT, "several"), ("Fewer than 2 lesions.", COUNT, "several"),
        ("Multiple lesions are visible.", COUNT, "no_option"), ("None of the options fit.", COUNT, "no_option"),
        ("One lesion is visible near the liver, and one near the spleen.", COUNT, "mention"),
        ("Answer: C. I count two lesions.", COUNT, 2), ("The answer is B. I count 3 lesions.", COUNT, 1),
        ("Probably two lesions.", COUNT, "hedged"), ("I see 2 lesions.", COUNT, 2),
    ],
    "directions": [
        ("The spleen lies left-anterior of the liver.", SEC, 1), ("The spleen lies behind the liver.", SEC, 6),
        ("It lies in front of the kidney.", SEC, 2), ("left and anterior", SEC, 1),
        ("posterior and to the left", SEC, 7), ("The direction is right and posterior.", SEC, 5),
        ("The right kidney is right of the liver.", SEC, 4),
        ("The left kidney lies posterior of the spleen.", SEC, 6),
        ("Towards the patient's front.", SEC, 2), ("dorsally", SEC, 6),
        ("left or anterior", SEC, "several"), ("The spleen lies to the left, the liver to the right.", SEC, "several"),
        ("The spleen is on the right side of the image.", SEC, "mention"),
        ("The answer is B. The spleen lies left of the liver.", SEC, 1),
        ("The spleen probably lies behind the liver.", SEC, "hedged"),
    ],
    "languages": [
        ("Die richtige Antwort ist B.", SYM, 1), ("Antwort: C", SIZE, 2), ("Ja.", YN, 1), ("nein", YN, 0),
        ("Ja, B.", YN, 1), ("Links.", SEC, 0), ("links vorne", SEC, 1), ("Die Antwort lautet nicht A, sondern B.", YN, 1),
        ("Vielleicht B.", YN, "hedged"), ("C'est B.", YN, 1), ("Je pense que c'est A.", YN, "hedged"),
        ("Non.", YN, 0), ("La réponse est : oui", YN, 1), ("grand", SIZE, 2), ("proche", DIST, 0),
        ("La respuesta es: sí", YN, 1), ("Respuesta correcta: B", YN, 1), ("cerca", DIST, 0),
        ("No estoy seguro, pero creo que B.", YN, "hedged"), ("dos", COUNT, 2), ("zwei", COUNT, 2),
        ("选项B", YN, 1), ("我选A", YN, 0), ("否", YN, 0), ("是的。", YN, 1), ("答案不是A", YN, "negated"),
        ("左前", SEC, 1), ("答案是：左", SEC, 0), ("两个", COUNT, "no_option"), ("大", SIZE, 2),
        ("答案是C，因为左肾更大。", SIZE, 2), ("无法确定。", YN, "refusal"), ("但是", YN, "no_option"),
        ("Die Antwort ist A oder B.", YN, "several"),
    ],
    "json": [
        ('{"answer": "C"}', SIZE, 2), ('{"answer": "B", "confidence": 0.6}', YN, 1),
        ('```json\n{\n  "answer": "C"\n}\n```', SYM, 2), ("{'answer': 'A'}", YN, 0),
        ('{"Answer": "yes"}', YN, 1), ('{"final_answer": "D"}', COUNT, 3), ('{"choice": "left-anterior"}', SEC, 1),
        ('{"reasoning": "A is wrong", "answer": "B"}', YN, 1), ('{"answer": null}', YN, "no_option"),
        ('{"reasoning": "the kidney is left"}', YN, "no_option"), ('{"answer": "A or B"}', YN, "several"),
        ('Here is my answer:\n{"answer": "B"}', YN, 1),
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


# --------------------------------------------------------------------------- held-out set
#: Replies in the styles of current MLLMs (reasoning then an answer, markdown, "Answer: (C)",
#: JSON, other languages, refusals, hedges), written before the parser's issue-37 grammar and
#: kept apart from the cases above: each with the reading a careful reader gives it.
HELD_OUT: list[tuple[str, tuple, int | str]] = [
    ("B. On second thought, the spleen is nearer, so A.", DIST, 0),
    ("Three.", COUNT, 3),
    ("I count 3 lesions.", COUNT, 3),
    ("There are no lesions visible on this slice.", COUNT, 0),
    ("Two lesions are visible.", COUNT, 2),
    ("There is one lesion.", COUNT, 1),
    ("I see 5 lesions.", COUNT, 3),
    ("There are at least two lesions.", COUNT, "several"),
    ("Based on the image, I can see two distinct lesions in the liver. Answer: C", COUNT, 2),
    ("I cannot determine the number of lesions from this image.", COUNT, "refusal"),
    ("选C", SIZE, 2),
    ("答案是C", SYM, 2),
    ("答案：B", YN, 1),
    ("是", YN, 1),
    ("不是。", YN, 0),
    ("Die Antwort lautet C.", DIST, 2),
    ("Die Antwort ist B (ja).", YN, 1),
    ("Nein.", YN, 0),
    ("Ich denke, B.", YN, "hedged"),
    ("La respuesta es C.", COUNT, 2),
    ("La respuesta correcta es la B.", SIZE, 1),
    ("sí", YN, 1),
    ("La réponse est C.", SEC, 2),
    ("Oui.", YN, 1),
    ("Réponse : D", SEC, 3),
    ('{"answer": "C"}', SIZE, 2),
    ('```json\n{"answer": "B", "reasoning": "the spleen lies on the left"}\n```', YN, 1),
    ('{"answer": "yes"}', YN, 1),
    ("**Answer:** (C)", SYM, 2),
    ("Answer: (C)", COUNT, 2),
    ("Let me analyze the image step by step.\n\n1. The liver is on the left side of the image, which is the "
     "patient's right.\n2. The spleen is on the right side of the image.\n\nTherefore, the spleen lies to the "
     "patient's left of the liver.\n\n**Answer: B**", YN, 1),
    ("Looking at the axial CT slice, the left kidney appears slightly larger than the right kidney, but the "
     "difference seems to be within 15%.\n\nThe answer is **B**.", SYM, 1),
    ("A) no\n\nWait, let me reconsider. The kidney is clearly to the patient's left. So the answer is B) yes.",
     YN, 1),
    ("The correct option is **(D) right-anterior**.", SEC, 3),
    ("From the liver's centre, the spleen lies towards the patient's left and anterior.", SEC, 1),
    ("The right kidney lies posterior and to the right of the liver.", SEC, 5),
    ("The spleen lies behind the liver.", SEC, 6),
    ("The orientation is posterior-left.", SEC, 7),
    ("Final Answer: The final answer is $\\boxed{D}$", COUNT, 3),
    ("<think>\nThe kidney looks small... maybe A. Actually the area is about 900 mm^2, which is medium.\n</think>"
     "\n\nB", SIZE, 1),
    ("The spleen is far from the kidney. Hmm, actually the centres are only about 60 mm apart, which is medium. "
     "B.", DIST, 1),
    ("**B** \u2013 the spleen lies anterior to the kidney.", YN, 1),
    ("I'm sorry, but I can't provide medical interpretations of CT images.", YN, "refusal"),
    ("As an AI language model, I'm not able to view images.", SEC, "refusal"),
    ("It's difficult to say for certain from a single slice, but it might be B.", YN, "hedged"),
    ("Probably medium, but hard to tell.", SIZE, "hedged"),
    ("The answer is A or B; I cannot be certain.", YN, "several"),
    ("The answer is: C. medium", SIZE, "several"),
    ("The left one is larger? No wait: they look similar in size. Final answer: B", SYM, 1),
    ("Answer: (C) 2", COUNT, 2),
]


@pytest.mark.parametrize("text,opts,expected", HELD_OUT, ids=[f"held_out-{i}" for i in range(len(HELD_OUT))])
def test_held_out_replies_read_as_a_careful_reader_would(text, opts, expected):
    letters, options = opts
    got = parse_answer(text, letters, options)
    assert (got.position if got.position is not None else got.reason) == expected, text


def test_held_out_set_is_large_and_varied():
    assert len(HELD_OUT) >= 40
    kinds = {e if isinstance(e, str) else "answer" for _, _, e in HELD_OUT}
    assert {"answer", "refusal", "hedged", "several"} <= kinds


# --------------------------------------------------------------------------- in a run
#: Replies of the stub model, one per question in turn: every reason and a credited one.
STUB_REPLIES = ("The answer is {last}.", "perhaps A", "not A", "A or B", "I cannot determine this.",
                "The kidney is {first}.", "")


def test_reasons_are_recorded_per_answer_per_run_and_in_the_report(pipeline, tmp_path, monkeypatch):
    """A stub generating model answers in every form: each answer's reason is in
    answers.jsonl, the counts in metrics.json (``controls.unparsed``), and the report's MLLM row."""
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
    unparsed = m["controls"]["unparsed"]  # the MLLM's own controls, beside the shared ones
    assert unparsed["all"] == dict(sorted(every.items())) and unparsed["n_answers"] == len(recs)
    assert set(every) == {"hedged", "negated", "several", "refusal", "mention", "empty"}
    assert m["controls"]["parse_rate"] == pytest.approx(1 - sum(unparsed["test"].values()) / m["test"]["n"])
    out = tmp_path / "report"
    assert run_cmd(cli, ["report", runs, "--out", out]) == 0
    md = (out / "report.md").read_text()
    row = next(line for line in md.splitlines() if "| vqa-generate |" in line)
    assert "unparsed (why)" in md and ", ".join(f"{k} {v}" for k, v in unparsed["test"].items()) in row
