"""Versioned question templates of the MLLM track, one per Level 3 probe.

A prompt is filled from the stored question fields (``q_organ_a``, ``q_organ_b``,
``q_axis``) and lists the probe's class names (``LEVEL3_CLASS_NAMES``) as lettered
options in a given order (a rotation, for CircularEval). Every "left/right" is the
PATIENT's; by default the prompt also states the display convention of the slice
(``hint=False`` drops that sentence, to measure convention confusion).

Change any wording here and bump :data:`TEMPLATE_VERSION`: the version is recorded with
every answer and is part of the response cache's key (together with the sha256 of the
rendered text, so an unbumped edit still cannot reuse old answers).
"""

from __future__ import annotations

import string
from dataclasses import dataclass

from spar_bench.builder.schema import LEVEL3_PROBES, ORGANS
from spar_bench.errors import ConfigError

TEMPLATE_VERSION = "1"

#: Organ names as a radiologist says them (left/right are the patient's).
ORGAN_TEXT: dict[str, str] = {
    "kidney_left": "left kidney",
    "kidney_right": "right kidney",
    "intestine": "small intestine",
    "adrenal": "adrenal glands",
    "head_of_femur_left": "left femoral head",
    "head_of_femur_right": "right femoral head",
}

CONVENTION_HINT = (
    "The image is an axial CT slice shown in the radiological convention: the patient's "
    "left is on the right side of the image, the patient's right on the left side, and "
    "the front of the patient (anterior) is at the top."
)
FRAME = "Left and right always mean the patient's left and right."
INSTRUCTION = "Answer with the letter of the correct option only."

QUESTIONS: dict[str, str] = {
    "relative_position.0": "Is the {a} to the patient's left of the {b}?",
    "relative_position.1": "Is the {a} anterior of (in front of) the {b}?",
    "orientation": (
        "Looking from the centre of the {a} to the centre of the {b}, in which direction "
        "does the {b} lie, in the patient's frame (left = the patient's left, anterior = "
        "towards the patient's front)?"
    ),
    "symmetry": (
        "Compare the cross-sections of the {a} (on the patient's left) and the {b} (on the "
        "patient's right) on this slice. Which is larger?"
    ),
    "size": (
        "How large is the cross-section of the {a} on this slice, compared with the "
        "{a} on axial slices in general (small, medium or large: the lower, middle or upper "
        "third of its usual areas)?"
    ),
    "distance": (
        "How far apart are the centres of the {a} and the {b} on this slice, compared with "
        "that pair of organs in general (near, medium or far: the lower, middle or upper "
        "third of their usual distances)?"
    ),
    "counting": "How many separate lesions (tumours) are visible on this slice?",
}

#: Option texts shown for class names that are not plain words.
OPTION_TEXT: dict[str, str] = {"left_larger": "the left one is larger",
                               "similar": "they are similar in size",
                               "right_larger": "the right one is larger"}


def organ_text(index: int) -> str:
    name = ORGANS[index]
    return ORGAN_TEXT.get(name, name.replace("_", " "))


def option_text(class_name: str) -> str:
    return OPTION_TEXT.get(class_name, class_name)


def template_version(probe: str) -> str:
    """``"<probe>@<version>"``, recorded with every answer."""
    return f"{probe}@{TEMPLATE_VERSION}"


def rotations(n: int) -> list[tuple[int, ...]]:
    """The n cyclic orders of n options; rotation 0 is the class order."""
    return [tuple((i + r) % n for i in range(n)) for r in range(n)]


@dataclass(frozen=True)
class Prompt:
    """One rendered question: ``text`` (the user message) and what its letters mean.

    Attributes:
        text: the whole user message (hint, question, lettered options, instruction).
        letters: ``("A", "B", ...)``, one per displayed option.
        options: the displayed option texts, in displayed order.
        order: ``order[p]`` = class index shown at position ``p``.
        version: the template version (``"<probe>@<n>"``).
    """

    text: str
    letters: tuple[str, ...]
    options: tuple[str, ...]
    order: tuple[int, ...]
    version: str

    def class_of(self, position: int | None) -> int:
        """Class index of a displayed position; -1 for no answer."""
        return -1 if position is None else self.order[position]


def question_text(probe: str, organ_a: int, organ_b: int, axis: int) -> str:
    if probe not in LEVEL3_PROBES:
        raise ConfigError(f"no prompt template for probe {probe!r}; templates: {', '.join(LEVEL3_PROBES)}")
    key = f"{probe}.{axis}" if probe == "relative_position" else probe
    a = organ_text(organ_a) if organ_a >= 0 else ""
    b = organ_text(organ_b) if organ_b >= 0 else ""
    return QUESTIONS[key].format(a=a, b=b)


def render(probe: str, organ_a: int, organ_b: int, axis: int, order: tuple[int, ...],
           hint: bool = True) -> Prompt:
    """The prompt of one question with its options shown in ``order``."""
    from ..tasks import get_probe

    names = get_probe(f"level3.{probe}").class_names
    if sorted(order) != list(range(len(names))):
        raise ValueError(f"order {order} is not a permutation of {len(names)} options")
    letters = tuple(string.ascii_uppercase[: len(names)])
    options = tuple(option_text(names[c]) for c in order)
    lines = [CONVENTION_HINT] if hint else []
    lines += [FRAME, question_text(probe, organ_a, organ_b, axis), "Options:"]
    lines += [f"{letter}. {text}" for letter, text in zip(letters, options, strict=True)]
    lines.append(INSTRUCTION)
    return Prompt("\n".join(lines), letters, options, tuple(order), template_version(probe))
