"""The strict answer parser of the MLLM track, on a table of real-looking answers
(the grammar, case by kind: tests/test_vqa_parser_grammar.py)."""

from __future__ import annotations

import pytest

from spar_bench.probes.vqa.parse import parse_answer, strip_think

YES_NO = (("A", "B"), ("no", "yes"))
SECTORS = (tuple("ABCDEFGH"), ("left", "left-anterior", "anterior", "right-anterior", "right",
                               "right-posterior", "posterior", "left-posterior"))
SYM = (("A", "B", "C"), ("the left one is larger", "they are similar in size", "the right one is larger"))

TABLE = [
    # (answer text, options, expected displayed position or None = unparseable)
    ("B", YES_NO, 1),
    ("b", YES_NO, 1),
    ("(B)", YES_NO, 1),
    ("B.", YES_NO, 1),
    ("B) yes", YES_NO, 1),
    ("B. yes", YES_NO, 1),
    ("**B**", YES_NO, 1),
    ("`A`", YES_NO, 0),
    ("The correct answer is (B)", YES_NO, 1),
    ("The correct answer is (B).", YES_NO, 1),
    ("Answer: B", YES_NO, 1),
    ("the answer is b", YES_NO, 1),
    ("Answer:\nA", YES_NO, 0),
    ("Answer: B\nExplanation: the liver lies on the patient's right.", YES_NO, 1),
    ("A is tempting, but the answer is B", YES_NO, 1),
    ("<think>The liver is on the right... so A? or B</think>\nB", YES_NO, 1),
    ("<think>\nhmm A\n</think>\n\nThe answer is (A).", YES_NO, 0),
    ("yes", YES_NO, 1),
    ("Yes.", YES_NO, 1),
    ("No", YES_NO, 0),
    # hedges and non-answers are never credited
    ("A or B", YES_NO, None),
    ("The answer is A or B", YES_NO, None),
    ("Either A or B", YES_NO, None),
    ("B, not A", YES_NO, 1),  # issue 20: the negated option is not credited, the other is
    ("B) no", YES_NO, None),  # the letter and the text disagree
    ("The answer is A. Option B is wrong.", YES_NO, 0),  # only the statement is read
    ("The answer is A.\nThe answer is B.", YES_NO, 1),  # issue 20: the last answer statement wins
    ("I cannot determine this from the image.", YES_NO, None),
    ("A kidney is usually on the left.", YES_NO, None),  # an article, not a letter
    ("", YES_NO, None),
    ("<think>A looks right", YES_NO, None),  # unclosed reasoning: no answer
    ("yes and no", YES_NO, None),
    # eight sectors: longest option wins over its prefix
    ("left-anterior", SECTORS, 1),
    ("B) left-anterior", SECTORS, 1),
    ("B) left", SECTORS, None),
    ("The answer is (H) left-posterior", SECTORS, 7),
    ("c) anterior", SECTORS, 2),
    # issue 20 read this as a mention; issue 37: a direction in prose answers orientation when
    # nothing else decides (an explicit answer still wins; other prose stays a mention)
    ("The spleen lies left-anterior of the liver.", SECTORS, 1),
    ("The spleen lies left-anterior of the liver, as the image shows.", SECTORS, None),
    ("left or right", SECTORS, None),
    ("I", SECTORS, None),  # not one of the letters shown
    # long option texts
    ("C. the right one is larger", SYM, 2),
    ("They are similar in size.", SYM, 1),
]


@pytest.mark.parametrize("text,opts,expected", TABLE)
def test_parser_table(text, opts, expected):
    letters, options = opts
    assert parse_answer(text, letters, options).position == expected


def test_rotated_options_map_letters_to_what_is_shown():
    # with the options rotated, "B" is "no": the parser returns positions, not classes
    assert parse_answer("B) no", ("A", "B"), ("yes", "no")).position == 1
    assert parse_answer("no", ("A", "B"), ("yes", "no")).position == 1


def test_strip_think():
    assert strip_think("<think>x</think>B").strip() == "B"
    assert strip_think("<THINK>x</THINK> B").strip() == "B"
    assert strip_think("<think>never closed") is None
