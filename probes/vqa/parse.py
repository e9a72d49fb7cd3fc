"""Strict parsing of a generated answer into one displayed option, or none.

An answer is credited only when it names exactly one option. Never a guess: an answer
that names no option, or several ("A or B", "B, not A"), is unparseable; the run counts
it wrong and logs it. Handled:

* ``<think> ... </think>`` blocks are dropped (an unclosed one leaves nothing to read);
* markup (``**B**``, backticks, quotes) and case (``b``, ``Yes``);
* a bare letter or option: ``B``, ``(B)``, ``B.``, ``B) left``, ``B. yes``, ``left``;
* an answer statement: ``The correct answer is (B)``, ``Answer: B``, ``answer is b``;
  with a statement, only the statement is read (so ``A is wrong; the answer is B`` is B);
* a letter and option text together must agree (``B) left`` where B is "right" is
  unparseable).
"""

from __future__ import annotations

import re

_THINK = re.compile(r"<think>.*?</think>", re.S | re.I)
_MARKUP = re.compile(r"[*_`\"'\u201c\u201d]+")
_STATEMENT = re.compile(
    r"\b(?:answer|option|choice)\b\s*(?:is|would be|:)?\s*[:\-]?\s*(?P<rest>[^\n]+)", re.I
)


def strip_think(text: str) -> str | None:
    """Text outside ``<think>`` blocks; None when a block never closes."""
    out = _THINK.sub(" ", text)
    if re.search(r"<think>", out, re.I):
        return None
    return out.replace("</think>", " ")


def _leading_letter(text: str, letters: tuple[str, ...]) -> tuple[int | None, str]:
    """A leading option letter and the text after it.

    ``B`` or ``b`` alone, ``(B)``/``(b)`` anywhere at the start, ``B.``/``B)``/``B:``/``B,``
    (upper case) or ``b)``; a bare ``A`` opening a sentence ("A kidney ...") is not a letter.
    """
    m = (re.fullmatch(r"\(?([A-Za-z])\)?", text)
         or re.match(r"\(([A-Za-z])\)\s*(.*)", text, re.S)
         or re.match(r"([A-Z])[.):,]\s*(.*)", text, re.S)
         or re.match(r"([a-z])\)\s*(.*)", text, re.S))
    if not m or m.group(1).upper() not in letters:
        return None, text
    rest = m.group(2) if m.re.groups > 1 else ""
    return letters.index(m.group(1).upper()), rest


def _letters_in(text: str, letters: tuple[str, ...]) -> set[int]:
    """Upper-case option letters standing alone anywhere (``or B``, ``(C)``, ``not A.``)."""
    found = re.findall(r"(?<![\w'])\(?([A-Z])\)?(?![\w'])", text)
    return {letters.index(c) for c in found if c in letters}


def _options_named(text: str, options: tuple[str, ...]) -> set[int]:
    """Positions of option texts occurring as whole words (longest options first)."""
    low = " " + re.sub(r"\s+", " ", text.lower()) + " "
    found = set()
    for i in sorted(range(len(options)), key=lambda j: -len(options[j])):
        pat = r"(?<![\w-])" + re.escape(options[i].lower()) + r"(?![\w-])"
        if re.search(pat, low):
            found.add(i)
            low = re.sub(pat, " ", low)
    return found


def _read(text: str, letters: tuple[str, ...], options: tuple[str, ...]) -> int | None:
    """One option from a short answer (a letter and/or option texts), else None."""
    text = text.strip().rstrip(".!").strip()
    pos, rest = _leading_letter(text, letters)
    if pos is not None:
        others = (_options_named(rest, options) | _letters_in(rest, letters)) - {pos}
        return None if others else pos
    boxed = {letters.index(c.upper()) for c in re.findall(r"\(([A-Za-z])\)", text)
             if c.upper() in letters}
    named = _options_named(text, options) | boxed
    return named.pop() if len(named) == 1 else None


def parse_answer(text: str, letters: tuple[str, ...], options: tuple[str, ...]) -> int | None:
    """The displayed position the answer names, or None (unparseable).

    Args:
        text: the raw generated text.
        letters: the displayed letters (``("A", "B", ...)``).
        options: the displayed option texts, same order.
    """
    body = strip_think(text)
    if body is None:
        return None
    body = _MARKUP.sub("", body).strip()
    if not body:
        return None
    statements = list(_STATEMENT.finditer(body))
    if statements:
        picks = {_read(_first_clause(m.group("rest")), letters, options) for m in statements}
        return picks.pop() if len(picks) == 1 else None
    lines = [ln for ln in body.splitlines() if ln.strip()]
    return _read(" ".join(lines), letters, options)


def _first_clause(rest: str) -> str:
    """The answer part of a statement: up to the first sentence end or line break."""
    return re.split(r"(?<=[.!?])\s|\n|;|, because| because", rest.strip(), maxsplit=1)[0]
