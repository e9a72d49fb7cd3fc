"""Strict parsing of a generated answer: a small grammar of answer statements.

An answer is credited only when the reply's LAST decisive statement names exactly one
option as the answer; never a guess. The reply is read in four steps:

1. **Normalise** (:func:`normalise`): reasoning is dropped (``<think> ... </think>``
   blocks; with a lone closing ``</think>``, as left by chat templates that open the block
   in the prompt, only what follows it is read; a block never closed leaves nothing);
   ``\\boxed{X}`` and a JSON object with an answer key (``{"answer": "C"}``, fenced or
   not; keys ``final_answer``, ``answer``, ``choice``, ``option``, ``letter``) become the
   statement ``final answer: X``; markdown and quotes go. Then
   :func:`~.wording.localise` reads other languages' answer words (Chinese, German,
   French, Spanish), and direction and count words, in the options' English terms.
2. **Split** into statements (:func:`statements`): lines, sentences (``B. yes`` stays one:
   a letter label and its text), then clauses at ``;`` and at ``but``, ``however``,
   ``because``, ``since``, ``although``, ``though``, ``whereas``, ``while``.
3. **Classify** each statement (:func:`classify`). Its references to options are found
   first: option texts (case and separators folded: ``left-anterior`` = ``left anterior``
   = ``left_anterior`` = ``leftanterior``; a two-part option also in reversed order,
   ``anterior-left``), then letters (``(B)``, ``[b]``, ``option B``, an upper-case ``B``
   standing alone, except an article ``A`` before a noun; a lower-case ``b`` only where a
   letter is expected: alone, ``b)``, ``answer is b``). A reference is *negated* when a
   negation governs it (``not B``, ``isn't B``, ``neither``/``nor``, ``rather than``,
   ``instead of``, ``except``, ``rule out``; ``B is incorrect``/``wrong``/``not correct``/
   ``unlikely``/``ruled out``). The statement is then

   * an **answer form** when it holds nothing but references and grammar words (the
     answer's own words, connectives, hedges, negations: ``The correct answer is (B).``,
     ``B is correct``, ``Option B``, ``B. yes``, ``B, not A``), or when a cue (``answer
     is``, ``answer:``, ``final answer``, ``I choose``) is followed by references, or when
     its opening answer form ends at a separator (``Yes, the kidney ...``, ``B. The
     liver ...``, ``B - ...``), or when an answer form is all that follows its last colon,
     dash or conclusion (``..., so A``, ``therefore``, ``thus``, ``hence``). Its
     non-negated references decide: one -> **answer** (or
     **hedged** when the statement hedges: ``perhaps``, ``maybe``, ``probably``,
     ``likely``, ``might``, ``could``, ``seems``, ``appears``, ``I think``, ``I believe``,
     ``I guess``, ``not sure``, a question mark); several -> **several**; none (all
     negated) -> **negated**;
   * a **prose** answer of a counting or orientation question when it holds nothing but
     references, grammar words and the question's own words
     (:data:`~.wording.PROSE_WORDS`: ``There are 2 lesions visible on this slice``, ``The
     spleen lies behind the liver``); decided as above, but only when no other statement
     decides;
   * else a **mention** (options named in prose, ``The spleen lies left of the liver, as
     shown``) or, when every reference is negated, **negated**; neither decides anything.

   A statement without options may still express doubt (``I'm not sure``, ``hard to
   tell``) or refuse (``I cannot determine ...``, ``I'm sorry``).
4. **Decide** (:func:`decide`): the last answer / hedged / several statement wins (``The
   answer is A. Actually, the answer is B.`` is B; prose answers only when no other
   statement decides); an answer in a reply that also expresses doubt is hedged, and one
   a later statement negates (``A. ..., so it is not A.``) is negated. Without a deciding statement the reason is, in order:
   negated, refusal, hedged (doubt), mention, no_option. Two or more statements that are
   each a letter label with its own option's text (the options echoed as a list) are
   mentions, not answers.

:func:`parse_answer` returns a :class:`Parsed`: the displayed position, or None with a
reason among :data:`REASONS` (the run logs it per answer and counts it per run).
docs/PROTOCOL.md §11 has the table of forms and results.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, replace
from functools import lru_cache

from .wording import PROSE_WORDS, localise, question_kind

#: Why an answer is unparseable.
REASONS = ("empty", "refusal", "no_option", "mention", "negated", "hedged", "several")

ANSWER, HEDGED, SEVERAL, NEGATED, MENTION, NONE = "answer", "hedged", "several", "negated", "mention", "none"


@dataclass(frozen=True)
class Parsed:
    """The displayed position named, or None and why (one of :data:`REASONS`)."""

    position: int | None
    reason: str | None = None


@dataclass(frozen=True)
class Statement:
    """One classified statement: its kind, the position it names, and its flags."""

    kind: str
    position: int | None = None
    listing: bool = False  # exactly a letter label with its own option's text ("B. yes")
    doubt: bool = False  # no option, but uncertainty ("I'm not sure")
    refusal: bool = False  # no option, but a refusal ("I cannot determine ...")
    prose: bool = False  # an answer only in the question's own prose words ("I count 3 lesions")
    negates: frozenset[int] = frozenset()  # the positions a negated statement rules out


# --------------------------------------------------------------------------- 1. normalise
_TAGS = r"(?:think|thinking|reasoning)"
_THINK_BLOCK = re.compile(rf"<{_TAGS}>.*?</{_TAGS}>", re.S | re.I)
_THINK_OPEN = re.compile(rf"<{_TAGS}>", re.I)
_THINK_CLOSE = re.compile(rf"</{_TAGS}>", re.I)
_LATEX_TEXT = re.compile(r"\\(?:text|textbf|mathrm|mathbf)\s*\{([^{}]*)\}")
_BOXED = re.compile(r"\\boxed\s*\{([^{}]*)\}")
_JSON_OBJECT = re.compile(r"\{[^{}]*\}")
#: Keys of a JSON answer (``{"answer": "C"}``), first found wins.
_ANSWER_KEYS = ("final_answer", "answer", "choice", "option", "letter")
_LOOSE_ANSWER = re.compile(r"[\"']?(?:final[_ ])?answer[\"']?\s*:\s*[\"']?([^\"'{},\n]*)", re.I)


def strip_think(text: str) -> str | None:
    """The text after reasoning: outside ``<think>`` blocks and after a lone ``</think>``;
    None when a block never closes (the reasoning was cut off: nothing to read)."""
    out = _THINK_BLOCK.sub("\n", text)
    closes = list(_THINK_CLOSE.finditer(out))
    if closes:  # the template opened the block in the prompt: only the tail is the answer
        out = out[closes[-1].end():]
    return None if _THINK_OPEN.search(out) else out


def normalise(text: str) -> str | None:
    """The readable answer: no reasoning, ``\\boxed{X}`` as a statement, no markup."""
    body = strip_think(text)
    if body is None:
        return None
    body = _LATEX_TEXT.sub(r"\1", body)
    body = _BOXED.sub(r"\nfinal answer: \1\n", body)
    body = _JSON_OBJECT.sub(_json_answer, body)
    body = re.sub(r"\\[()\[\]]|\$", " ", body)  # math delimiters
    body = body.replace("\u2019", "'").replace("\u2018", "'")
    body = re.sub(r"[*`\"\u201c\u201d\u00ab\u00bb]+|^\s*#+\s*|(?<!\w)['_]+|['_]+(?!\w)", "", body, flags=re.M)
    return body.strip()


def _json_answer(m: re.Match) -> str:
    """A JSON object as the statement ``final answer: X`` when it has an answer key (the rest
    of it, reasoning included, goes); else unchanged."""
    try:
        obj = json.loads(m.group(0))
    except ValueError:
        loose = _LOOSE_ANSWER.search(m.group(0))  # {'answer': 'C'}: JSON in Python's quotes
        return f"\nfinal answer: {loose.group(1)}\n" if loose else m.group(0)
    if isinstance(obj, dict):
        keys = {str(k).lower().replace(" ", "_"): v for k, v in obj.items()}
        for k in _ANSWER_KEYS:
            if isinstance(keys.get(k), (str, int)) and not isinstance(keys[k], bool):
                return f"\nfinal answer: {keys[k]}\n"
    return m.group(0)


# --------------------------------------------------------------------------- 2. split
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")
_LABEL_ONLY = re.compile(r"\W*(?:(?:option|choice|letter)\s+)?\(?[A-Za-z]\)?\W*", re.I)
#: A sentence that ends with the answer's letter label (``The answer is: C.``).
_LABEL_END = re.compile(r".*(?:[:=]|\bis|\banswer)\s*\(?[A-Za-z]\)?[.)]?", re.I | re.S)
_CLAUSE_BREAK = re.compile(
    r"\s*;\s*|(?:^|,?\s+)\b(?:but|however|because|since|although|though|whereas|while)\b,?\s*", re.I)


def statements(body: str, options: tuple[str, ...] = ()) -> list[str]:
    """Lines, sentences and clauses of the answer, in order (empty ones dropped); a
    sentence that is only a letter label stays with a next one that opens with an option."""
    out: list[str] = []
    for line in body.splitlines():
        sentences: list[str] = []
        for s in _SENTENCE_END.split(line.strip()):
            if sentences and (_LABEL_ONLY.fullmatch(sentences[-1]) or _LABEL_END.fullmatch(sentences[-1])) and any(
                    p.match(s) for _, p in _option_patterns(tuple(options))):
                sentences[-1] += " " + s  # "B. yes": a letter label and its text
            else:
                sentences.append(s)
        for s in sentences:
            out += [c.strip() for c in _CLAUSE_BREAK.split(s) if c and c.strip(" .,!")]
    return out


# --------------------------------------------------------------------------- 3. classify
_SEP = r"[\s\-_/]*"
_DETERMINED = re.compile(r"\s+([a-z][\w']*)", re.I)
_NOT_DETERMINER = frozenset("answer options option choices choice letter one correct".split())
_UPPER_LETTER = re.compile(r"(?<![\w'\-])([A-Z])(?![\w'\-])")
_MARKED_LETTER = re.compile(r"[(\[]\s*([A-Za-z])\s*[)\]]|\b(?:option|choice|letter)\s+([A-Za-z])\b", re.I)
_LOWER_LETTER = re.compile(r"(?<![\w'\-])([a-z])(?![\w'\-])")
_LOWER_BEFORE = re.compile(
    r"(?:^|\b(?:answer|is|be|or|and|not|option|choice|letter|think|guess|maybe|perhaps|probably)|[:,(\[])\s*$",
    re.I)
_LOWER_AFTER = re.compile(r"\s*(?:$|[).:,!\]]|\s(?:is|or|and)\b)")
#: After an upper-case "A", a word that makes it a letter ("A is ...") not an article ("A kidney").
_LETTER_VERBS = frozenset(
    "is was or and nor would seems seem appears looks must should could might may can will fits "
    "matches corresponds describes best correct vs versus but because since as being does doesn't "
    "isn't with".split())
_NEG_BEFORE = re.compile(
    r"(?:\bnot|n't|\bcannot|\bnever|\bneither|\bnor|\brather than|\binstead of|\bother than|"
    r"\bexcept(?: for)?|\bexcluding|\brule out|\bruled out|\bexclude|\beliminate|\bwithout)"
    r"(?:\s+(?:the|option|choice|letter|answer|be|is|it)\b|\s*[(\[:])*\s*$")
_NEG_AFTER = re.compile(
    r"[\s)\]:,\-\u2013\u2014]*(?:(?:is|are|was|seems|appears|looks|would be|must be|can be|could be|"
    r"should be)\s+(?:(?:definitely|clearly|certainly|also|both)\s+)?(?:not|never)\b|"
    r"(?:(?:is|are|was|seems|appears|looks|would be|must be|can be|could be)\s+)?"
    r"(?:(?:definitely|clearly|certainly|also|both)\s+)?(?:the\s+)?"
    r"(?:incorrect|wrong|false|unlikely|impossible|ruled out|excluded|eliminated|isn't|wasn't|"
    r"aren't|doesn't|does not|can't|cannot)\b)")
_CUE = re.compile(
    r"\b(?:answer|option|choice|letter|selection)\s*(?:is|would be|will be|should be|must be|[:=\-\u2013\u2014])"
    r"|\bfinal answer\b|\b(?:choose|chose|pick|picked|select|selected|go with|going with|opt for)\b")
_POST_CUE = frozenset({"correct", "right", "true", "best", "accurate", "answer"})
_GRAMMAR = frozenset("""
the it it's its is are was be been being would will should must can i i'd i'll i'm we my me
option options choice choices letter answer answers final correct true best accurate
so thus therefore hence then actually wait ok okay no yes right
or and either both vs versus nor neither
not isn't aren't wasn't cannot can't never incorrect wrong false unlikely impossible
ruled rule out excluded exclude eliminated rather than instead of other except excluding
perhaps maybe possibly probably likely most more might may could seems seem appears appear
looks look like to think believe guess suspect presumably say sure definitely clearly
go with pick choose select opt going chose picked selected
""".split())
_SEPARATORS = frozenset(",:.)-\u2013\u2014")
_HEDGE = re.compile(
    r"\b(?:perhaps|maybe|possibly|probably|likely|might|may|could|seems?|seemingly|appears?|"
    r"apparently|looks like|presumably|guess|(?:i|we) (?:think|believe|suspect|suppose)|not sure|unsure|"
    r"uncertain|not certain|not confident|hard to (?:tell|say)|difficult to (?:tell|say|determine))\b|\?")
_DOUBT = re.compile(
    r"\b(?:not (?:sure|certain|confident)|unsure|uncertain|unclear|hard to (?:tell|say)|"
    r"difficult to (?:tell|say|determine)|(?:can't|cannot) be (?:sure|certain)|guess(?:ing)?)\b")
_REFUSAL = re.compile(
    r"\b(?:(?:cannot|can't|can not|unable to|not able to|impossible to|not possible to)\s+"
    r"(?:\w+\s+){0,2}?(?:determine|tell|answer|see|assess|say|identify|provide|view|access|"
    r"evaluate|judge|interpret|make)|i'm sorry|i am sorry|i apologi[sz]e|as an ai|no image)\b")


@dataclass(frozen=True)
class _Ref:
    position: int
    start: int
    end: int
    negated: bool = False
    kind: str = "text"  # "text" or "letter"


@lru_cache(maxsize=256)
def _option_patterns(options: tuple[str, ...]) -> tuple[tuple[int, re.Pattern], ...]:
    """One pattern per option (longest first): separators folded, a two-part option also reversed."""
    texts = {o.lower() for o in options}
    out = []
    for i in sorted(range(len(options)), key=lambda j: -len(options[j])):
        parts = [p for p in re.split(r"[\s\-_/]+", options[i].lower()) if p]
        forms = [_SEP.join(map(re.escape, parts))]
        if len(parts) == 2 and f"{parts[1]}-{parts[0]}" not in texts and f"{parts[1]} {parts[0]}" not in texts:
            forms.append(_SEP.join(map(re.escape, parts[::-1])))
        out.append((i, re.compile(r"(?<![\w\-])(?:" + "|".join(forms) + r")(?![\w\-])", re.I)))
    return tuple(out)


def _determiner(clause: str, end: int) -> bool:
    """Whether the word "no" ending at ``end`` is a determiner: a noun-like word follows."""
    m = _DETERMINED.match(clause, end)
    return bool(m) and (m.group(1).lower() in _NOT_DETERMINER or m.group(1).lower() not in _GRAMMAR)


def _free(spans: list[_Ref], a: int, b: int) -> bool:
    return all(b <= r.start or a >= r.end for r in spans)


def _text_refs(clause: str, options: tuple[str, ...]) -> list[_Ref]:
    refs: list[_Ref] = []
    for i, pat in _option_patterns(options):
        for m in pat.finditer(clause):
            if not _free(refs, m.start(), m.end()):
                continue
            if options[i].lower() == "no" and _determiner(clause, m.end()):
                continue  # "no answer", "no image": a determiner, not the option "no"
            refs.append(_Ref(i, m.start(), m.end()))
    return refs


def _letter_refs(clause: str, letters: tuple[str, ...], taken: list[_Ref]) -> list[_Ref]:
    """Letters outside option texts: marked ones, upper-case ones standing alone, and
    lower-case ones where a letter is expected."""
    refs: list[_Ref] = []

    def add(c: str, a: int, b: int) -> None:
        if c.upper() in letters and _free(taken + refs, a, b):
            refs.append(_Ref(letters.index(c.upper()), a, b, kind="letter"))

    for m in _MARKED_LETTER.finditer(clause):
        g = 1 if m.group(1) else 2
        add(m.group(g), m.start(), m.end())
    for m in _UPPER_LETTER.finditer(clause):
        nxt = re.match(r"\s+([a-z][\w']*)", clause[m.end():])
        if m.group(1) == "A" and nxt and nxt.group(1) not in _LETTER_VERBS:
            continue  # an article: "A kidney ..."
        add(m.group(1), m.start(), m.end())
    for m in _LOWER_LETTER.finditer(clause):
        if _LOWER_BEFORE.search(clause[:m.start()]) and _LOWER_AFTER.match(clause[m.end():]):
            add(m.group(1), m.start(), m.end())
    return refs


def _with_polarity(clause: str, refs: list[_Ref]) -> list[_Ref]:
    """Each reference negated or not; a negation carries over ``or``/``nor``/``and``
    (``rather than A or B``)."""
    low = clause.lower()
    out: list[_Ref] = []
    for r in sorted(refs, key=lambda r: r.start):
        neg = bool(_NEG_BEFORE.search(low[:r.start]) or _NEG_AFTER.match(low, r.end))
        if out and out[-1].negated and re.fullmatch(r"\s*(?:or|nor|and)\s*", low[out[-1].end:r.start]):
            neg = True
        out.append(_Ref(r.position, r.start, r.end, neg, r.kind))
    return out


def find_refs(clause: str, letters: tuple[str, ...], options: tuple[str, ...]) -> list[_Ref]:
    """Every option the clause refers to, in order, each with its polarity."""
    texts = _text_refs(clause, options)
    return _with_polarity(clause, texts + _letter_refs(clause, letters, texts))


def _tokens(clause: str, refs: list[_Ref]) -> list[str | _Ref]:
    """Words (lower case), punctuation and the references, in order."""
    out: list[str | _Ref] = []
    pos = 0
    for r in refs + [None]:
        gap = clause[pos:r.start if r else len(clause)].lower()
        out += re.findall(r"[a-z0-9+]+(?:'[a-z]+)?|[^\w\s]", gap)
        if r is not None:
            out.append(r)
            pos = r.end
    return out


def _answer_run(toks: list[str | _Ref], words: frozenset[str] = _GRAMMAR) -> tuple[list[_Ref], bool, bool]:
    """The opening answer form of ``toks`` (made of references and ``words``): its references,
    whether it is all of ``toks``, and whether it closes as an answer (a separator after it,
    or ``correct``/``answer``)."""
    refs: list[_Ref] = []
    cue = sep = False
    for t in toks:
        if isinstance(t, _Ref):
            refs.append(t)
            sep = False
        elif t in words or t.removesuffix("'s") in words or not t[0].isalnum():
            cue = cue or (t in _POST_CUE and bool(refs))
            sep = sep or (t in _SEPARATORS and bool(refs))
        else:
            return refs, False, bool(refs) and (cue or sep)
    return refs, True, bool(refs)


def _cue_refs(clause: str, refs: list[_Ref]) -> list[_Ref]:
    """The references a cue (``answer is``, ``final answer``, ``I choose``) names: the
    answer form right after the last cue that is followed by one."""
    low = clause.lower()
    for m in reversed(list(_CUE.finditer(low))):
        after = [r for r in refs if r.start >= m.end()]
        if after:
            named, _, _ = _answer_run(_tokens(clause[m.end():], [_shift(r, m.end()) for r in after]))
            if named:
                return named
    return []


_CONCLUSION = re.compile(r"\b(?:so|thus|therefore|hence)\b", re.I)


def _after_colon(clause: str, refs: list[_Ref], words: frozenset[str] = _GRAMMAR) -> tuple[list[_Ref], bool, bool]:
    """The answer form after the clause's last colon, dash or conclusion (``..., so A``),
    when it is all that follows."""
    cut = max(clause.rfind(":"), clause.rfind(" - "), clause.rfind("\u2014"), clause.rfind("\u2013")) + 1
    cut = max([cut] + [m.end() for m in _CONCLUSION.finditer(clause)])
    after = [_shift(r, cut) for r in refs if r.start >= cut] if cut > 0 else []
    if not after:
        return [], False, False
    run, whole, _ = _answer_run(_tokens(clause[cut:], after), words)
    return (run, True, True) if whole else ([], False, False)


def _shift(r: _Ref, by: int) -> _Ref:
    return _Ref(r.position, r.start - by, r.end - by, r.negated, r.kind)


def _decided(named: list[_Ref], hedged: bool) -> Statement:
    positive = {r.position for r in named if not r.negated}
    if len(positive) > 1:
        return Statement(SEVERAL)
    if not positive:
        return Statement(NEGATED, negates=frozenset(r.position for r in named))
    (p,) = positive
    return Statement(HEDGED if hedged else ANSWER, p)


def classify(clause: str, letters: tuple[str, ...], options: tuple[str, ...]) -> Statement:
    """What one statement says: answer / hedged / several / negated / mention / none."""
    low = clause.lower()
    refs = find_refs(clause, letters, options)
    if not refs:
        return Statement(NONE, doubt=bool(_DOUBT.search(low)), refusal=bool(_REFUSAL.search(low)))
    hedged = bool(_HEDGE.search(low))
    named = _cue_refs(clause, refs)
    if named:
        return _decided(named, hedged)
    toks = _tokens(clause, refs)
    run, whole, closed = _answer_run(toks)
    if not (whole or closed):  # "The direction is: left anterior": an answer form after a colon
        run, whole, closed = _after_colon(clause, refs)
    if whole or closed:
        st = _decided(run, hedged)
        listing = (whole and len(run) == 2 and run[0].kind == "letter" and run[1].kind == "text"
                   and run[0].position == run[1].position and st.kind == ANSWER)
        return replace(st, listing=listing)
    prose = _prose(clause, refs, toks, options, hedged)
    if prose is not None:
        return prose
    if all(r.negated for r in refs):
        return Statement(NEGATED, negates=frozenset(r.position for r in refs))
    return Statement(MENTION, doubt=bool(_DOUBT.search(low)))


def _prose(clause: str, refs: list[_Ref], toks: list, options: tuple[str, ...], hedged: bool) -> Statement | None:
    """A counting or orientation answer in the question's own words (``There are 2 lesions
    visible``, ``The spleen lies posterior of the liver``): the statement, or what follows its
    colon or conclusion, is references, grammar and :data:`~.wording.PROSE_WORDS` only."""
    kind = question_kind(options)
    if kind is None:
        return None
    words = _GRAMMAR | PROSE_WORDS[kind]
    run, whole, _ = _answer_run(toks, words)
    if not whole:
        run, whole, _ = _after_colon(clause, refs, words)
    if not whole:
        return None
    st = _decided(run, hedged)
    return replace(st, prose=True)


# --------------------------------------------------------------------------- 4. decide
def decide(sts: list[Statement]) -> Parsed:
    """The last deciding statement wins; otherwise the reason the reply has no answer."""
    listed = {s.position for s in sts if s.listing}
    if len(listed) > 1:  # the options echoed as a list: mentions, not answers
        sts = [Statement(MENTION) if s.listing else s for s in sts]
    doubt = any(s.doubt for s in sts)
    deciding = [s for s in sts if s.kind in (ANSWER, HEDGED, SEVERAL)]
    deciding = [s for s in deciding if not s.prose] or deciding  # prose answers only when nothing else decides
    if deciding:
        last = deciding[-1]
        later = sts[sts.index(last) + 1:]
        if last.kind == ANSWER and any(last.position in s.negates for s in later):
            return Parsed(None, NEGATED)  # "A. ..., so it is not A": the answer taken back
        if last.kind == ANSWER:
            return Parsed(last.position) if not doubt else Parsed(None, HEDGED)
        return Parsed(None, last.kind)
    kinds = {s.kind for s in sts}
    for reason, hit in ((NEGATED, NEGATED in kinds), ("refusal", any(s.refusal for s in sts)),
                        (HEDGED, doubt), (MENTION, MENTION in kinds)):
        if hit:
            return Parsed(None, reason)
    return Parsed(None, "no_option")


def parse_answer(text: str, letters: tuple[str, ...], options: tuple[str, ...]) -> Parsed:
    """The displayed position the answer names, or None and why.

    Args:
        text: the raw generated text.
        letters: the displayed letters (``("A", "B", ...)``).
        options: the displayed option texts, same order.
    """
    letters, options = tuple(letters), tuple(options)
    body = normalise(text or "")
    if body:
        body = localise(body, options).strip()
    if not body:
        return Parsed(None, "empty")
    return decide([classify(s, letters, options) for s in statements(body, options)])
