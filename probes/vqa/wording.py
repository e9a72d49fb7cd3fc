"""How a reply's words are read before the answer grammar (:mod:`.parse`) sees them.

Three small tables, applied by :func:`localise` to the normalised reply, each only when
the options it reads are shown (so no word is read as an option the question did not offer):

* **Languages** (:data:`PHRASES`, :data:`OPTION_WORDS`): the short replies that MLLMs fall
  back to in Chinese, German, French and Spanish. The answer's grammar (``Die Antwort lautet
  C``, ``La respuesta es C``, ``La réponse est C``, ``答案是C``, ``选C``, ``Antwort: C``),
  hedges (``ich denke``, ``je pense``, ``creo que``, ``vielleicht``) and negations
  (``nicht``, ``不是``) become their English words; yes / no (``ja``, ``nein``, ``oui``,
  ``non``, ``sí``, ``是``, ``否``) and the option words of direction, size, distance and
  count (``links``, ``gauche``, ``izquierda``, ``左``; ``klein``, ``grand``; ``nah``,
  ``lejos``; ``zwei``, ``trois``) become the option they translate. A Chinese word counts
  only standing alone (not inside a longer Chinese word): ``是`` is yes, ``但是`` is not.
* **Directions** (orientation's options): ``in front`` / ``front`` / ``ventral`` /
  ``anteriorly`` are *anterior*, ``behind`` / ``back`` / ``dorsal`` / ``posteriorly``
  *posterior*; a lateral and a front/back direction joined by *and* are the two-part
  direction (``left and anterior``, ``posterior and to the right`` = right-posterior);
  an organ named with its side (``the left kidney``) is not a direction.
* **Counts** (counting's options, ``0``, ``1``, ``2``, ``3+``): number words are numbers
  (``three``, ``a single``), ``no lesions`` and ``none`` are 0, a number at or above the
  open option is that option (``5`` is ``3+``), and a bound names every option it allows
  (``at least 2`` = ``2 or 3+``: several, never a guess).

:data:`PROSE_WORDS` holds the words a prose answer of such a question may use beside the
option (``There are 2 lesions visible on this slice``, ``The spleen lies posterior of the
liver``); :mod:`.parse` reads such a statement only when no explicit answer decides.
"""

from __future__ import annotations

import re

_CJK = "\u4e00-\u9fff"
#: CJK punctuation as ASCII.
_PUNCT = str.maketrans({"\uff1a": ": ", "\u3002": ". ", "\uff0c": ", ", "\uff08": " (", "\uff09": ") ",
                        "\uff01": "! ", "\uff1f": "? ", "\uff1b": "; ", "\u3001": ", "})

#: Answer grammar in other languages -> English (regex, replacement); applied in order.
PHRASES: tuple[tuple[str, str], ...] = (
    # Chinese
    ("正确答案(?:是|为)", " the correct answer is "), ("答案(?:是|为)", " the answer is "),
    ("答案", " answer "), ("选项", " option "), ("我选择|我选|选择|选", " I choose "),
    ("因为", " because "), ("但是|而是", " but "), ("所以|因此", " so "), ("我认为|我觉得", " I think "), ("可能", " maybe "),
    ("无法(?:确定|判断)|不能(?:确定|判断)", " cannot determine "), ("不确定", " not sure "),
    (f"(?<=[{_CJK}])不是|不是(?=[{_CJK}A-Za-z])", " is not "),
    # German
    (r"\bdie (?:richtige |korrekte )?antwort (?:lautet|ist)\b", "the answer is"),
    (r"\bantwort\b", "answer"), (r"\bich w[äa]hle\b", "I choose"),
    (r"\bich (?:denke|glaube|vermute)\b", "I think"), (r"\bich bin (?:mir )?nicht sicher\b", "I'm not sure"),
    (r"\bvielleicht\b", "maybe"), (r"\bwahrscheinlich\b", "probably"), (r"\bes ist\b", "it is"),
    (r"\bist\b", "is"), (r"\bnicht\b", "not"), (r"\boder\b", "or"), (r"\bund\b", "and"),
    (r"\brichtig\b", "correct"), (r"\bfalsch\b", "wrong"), (r"\bsondern\b|\baber\b", "but"),
    # French
    (r"\bla (?:bonne )?r[ée]ponse (?:correcte )?est\b", "the answer is"), (r"\br[ée]ponse\b", "answer"),
    (r"\bje choisis\b", "I choose"), (r"\bje (?:pense|crois)(?: que)?\b", "I think"),
    (r"\bje ne suis pas s[ûu]re?\b", "I'm not sure"), (r"\bpeut-[êe]tre\b", "maybe"),
    (r"\bprobablement\b", "probably"), (r"\bce n'est pas\b", "it is not"), (r"\bc'est\b", "it is"),
    (r"\bou\b", "or"), (r"\bet\b", "and"), (r"\bmais\b", "but"),
    # Spanish
    (r"\bla respuesta (?:correcta )?es(?: la)?\b", "the answer is"), (r"\brespuesta\b", "answer"),
    (r"\bopci[óo]n\b", "option"), (r"\belijo\b", "I choose"), (r"\bcreo que\b", "I think"),
    (r"\bquiz[áa]s?\b|\btal vez\b", "maybe"), (r"\bprobablemente\b", "probably"),
    (r"\bno estoy segur[oa]\b", "I'm not sure"), (r"\bsino\b|\bpero\b", "but"),
)

#: Option words in other languages, by the English option they translate (used only when it is shown).
OPTION_WORDS: dict[str, tuple[str, ...]] = {
    "yes": ("ja", "oui", "sí", "是", "是的", "对"),
    "no": ("nein", "non", "否", "不是", "不"),
    "left-anterior": ("左前", "左前方"), "right-anterior": ("右前", "右前方"),
    "left-posterior": ("左后", "左后方"), "right-posterior": ("右后", "右后方"),
    "left": ("links", "gauche", "izquierda", "左", "左侧", "左边"),
    "right": ("rechts", "droite", "derecha", "右", "右侧", "右边"),
    "anterior": ("vorne", "vorn", "antérieur", "antérieure", "前", "前方"),
    "posterior": ("hinten", "postérieur", "postérieure", "后", "后方"),
    "small": ("klein", "petit", "petite", "pequeño", "pequeña", "小"),
    "medium": ("mittel", "mittelgroß", "moyen", "moyenne", "mediano", "mediana", "medio", "中", "中等"),
    "large": ("groß", "gross", "grand", "grande", "大"),
    "near": ("nah", "nahe", "proche", "cerca", "cercano", "近"),
    "far": ("fern", "weit", "loin", "lointain", "lejos", "lejano", "远"),
}
#: Number words (English, German, French, Spanish, Chinese) -> their value.
NUMBER_WORDS: dict[str, int] = {
    **{w: i for i, w in enumerate("zero one two three four five six seven eight nine ten eleven twelve".split())},
    **{w: i for i, w in enumerate("null eins zwei drei vier fünf".split())},
    **{w: i for i, w in enumerate("zéro un deux trois quatre cinq".split()) if w != "un"},
    **{w: i for i, w in enumerate("cero uno dos tres cuatro cinco".split())},
    **{w: i for i, w in enumerate("零一二三四五")}, "两": 2, "a single": 1, "single": 1,
}
DIRECTIONS = ("left", "left-anterior", "anterior", "right-anterior", "right", "right-posterior", "posterior",
              "left-posterior")
_COUNT_NOUN = r"(?:separate |distinct |visible |individual |discrete )*(?:lesions?|tumou?rs?|masses|mass|regions?)"
#: Organs named with a side: the side belongs to the organ, it is no direction.
_SIDED = re.compile(r"\b(left|right)(?=\s+(?:kidneys?|femoral|femur|adrenals?|lobe|lung|ovary|ureter|"
                    r"hemidiaphragm|iliac)\b)", re.I)

#: Words a prose answer may use beside the option, by the kind of question.
PROSE_WORDS: dict[str, frozenset[str]] = {
    "count": frozenset("""there here i we can see count counted identify find found observe notice spot total
        lesion lesions tumour tumours tumor tumors mass masses region regions separate distinct visible
        individual discrete present seen shown appear in on of this the slice image scan a an exactly only""".split()),
    "direction": frozenset("""from to of relative towards toward the a its it is lies lie located situated
        positioned sits points pointing direction orientation sector side centre center centroid patient's
        patient organ liver spleen kidney kidneys stomach gallbladder pancreas esophagus oesophagus
        duodenum colon intestine bladder adrenal adrenals glands femoral head rectum aorta
        left right""".split()),  # "left", "right" as tokens: only the side of an organ (``left_kidney``)
}


def _word(w: str) -> str:
    """A pattern of one word standing alone (a Chinese word: not inside a longer one)."""
    if re.match(f"[{_CJK}]", w):
        return f"(?<![{_CJK}]){re.escape(w)}(?![{_CJK}])"
    return rf"(?<![\w\-]){re.escape(w)}(?![\w\-])"


def question_kind(options: tuple[str, ...]) -> str | None:
    """``"count"`` (options are counts), ``"direction"`` (orientation's sectors) or None."""
    low = [o.lower() for o in options]
    if low and all(re.fullmatch(r"\d+\+?", o) for o in low):
        return "count"
    if low and set(low) <= set(DIRECTIONS) and len(low) > 2:
        return "direction"
    return None


def localise(body: str, options: tuple[str, ...]) -> str:
    """``body`` with the other languages' answer words, and (by :func:`question_kind`) the
    direction and count words, in the options' own English terms."""
    shown = {o.lower() for o in options}
    body = body.translate(_PUNCT)
    for pat, rep in PHRASES:
        body = re.sub(pat, rep, body, flags=re.I)
    for english, words in OPTION_WORDS.items():
        if english in shown:
            for w in sorted(words, key=len, reverse=True):
                body = re.sub(_word(w), f" {english} ", body, flags=re.I)
    kind = question_kind(options)
    if kind == "direction":
        body = directions(body)
    elif kind == "count":
        body = counts(body, options)
    return re.sub(r"[ \t]{2,}", " ", body)


def directions(text: str) -> str:
    """Direction synonyms as orientation's words; two joined directions as one two-part direction."""
    text = _SIDED.sub(lambda m: m.group(1) + "_", text)  # "left_ kidney": a side of an organ
    text = re.sub(r"_\s+", "_", text)
    subs = ((r"\bin front\b|\bfront\b|\bventral(?:ly)?\b|\banteriorly\b|\bforwards?\b", "anterior"),
            (r"\bbehind\b|\bback\b|\bdorsal(?:ly)?\b|\bposteriorly\b|\bbackwards?\b", "posterior"),
            (r"\b(left|right)wards?\b", r"\1"))
    for pat, rep in subs:
        text = re.sub(pat, rep, text, flags=re.I)
    side = r"(?:(?:to|towards?) the\s+)?(?:patient's\s+)?"
    text = re.sub(rf"\b(left|right)\s+and\s+{side}(anterior|posterior)\b", r"\1-\2", text, flags=re.I)
    return re.sub(rf"\b(anterior|posterior)\s+and\s+{side}(left|right)\b", r"\2-\1", text, flags=re.I)


def counts(text: str, options: tuple[str, ...]) -> str:
    """Number words as numbers, ``no lesions`` / ``none`` as 0, numbers as the options that hold them."""
    for w in sorted(NUMBER_WORDS, key=len, reverse=True):
        text = re.sub(_word(w), f" {NUMBER_WORDS[w]} ", text, flags=re.I)
    text = re.sub(rf"\bno\s+(?={_COUNT_NOUN}\b)", "0 ", text, flags=re.I)
    text = re.sub(r"\bnone\b(?!\s+of\b)", "0", text, flags=re.I)
    values = [int(o.rstrip("+")) for o in options]
    top = max((v for o, v in zip(options, values, strict=True) if o.endswith("+")), default=None)

    def named(lo: int, hi: int | None) -> str:
        """The options holding ``lo`` .. ``hi`` (None: no upper bound), joined by ``or``."""
        hit = [o for o, v in zip(options, values, strict=True)
               if (v >= lo if hi is None else lo <= v <= hi) or (o.endswith("+") and (hi is None or hi >= v))]
        return " or ".join(hit) if hit else str(lo)

    bounds = ((r"\b(?:at least|no fewer than|no less than)\s+(\d+)\b|\b(\d+)\s+or more\b|\b(\d+)\s*\+",
               lambda n: named(n, None)),
              (r"\b(?:more than|over|above)\s+(\d+)\b", lambda n: named(n + 1, None)),
              (r"\b(?:fewer than|less than|under|below)\s+(\d+)\b", lambda n: named(0, n - 1)))
    for pat, make in bounds:
        text = re.sub(pat, lambda m, make=make: " " + make(int(next(g for g in m.groups() if g))) + " ", text,
                      flags=re.I)
    if top is not None:
        text = re.sub(r"(?<![\w+\-])(?<!\d\.)(\d+)(?![\w+])(?!\.\d)",
                      lambda m: f"{top}+" if int(m.group(1)) >= top else m.group(1), text)
    return text
