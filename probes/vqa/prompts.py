"""Versioned question templates of the MLLM track, one per Level 3 probe.

A prompt is filled from the stored question fields (``q_organ_a``, ``q_organ_b``,
``q_axis``) and lists the probe's class names (``LEVEL3_CLASS_NAMES``) as lettered
options in a given order (a rotation, for CircularEval). Every "left/right" is the
PATIENT's; by default the prompt also states the display convention of the slice
(``hint=False`` drops that sentence, to measure convention confusion).

Every question can be answered by a perfect reader of the image (protocol 1.2): the
prompt says what is compared (organ centres are the centroids of their cross-sections),
states the symmetry band, the smallest lesion counted in pixels of the 224 image (protocol
1.4), and gives the size and distance thresholds in mm^2 and mm with the image's pixel size (:class:`PromptContext`, filled per question by
:meth:`spar_bench.probes.vqa.questions.Questions.context`). A blind prompt (no image sent)
says that no image is shown instead of describing one.

Change any wording here and bump :data:`TEMPLATE_VERSION`: the version is recorded with
every answer and is part of the response cache's key (together with the sha256 of the
rendered text, so an unbumped edit still cannot reuse old answers).
"""

from __future__ import annotations

import string
from dataclasses import dataclass

from spar_bench.builder.samples.pixels import stated, stated_band
from spar_bench.builder.schema import LEVEL3_PROBES, LEVEL4_CLASS_NAMES, LEVEL4_PROBES, ORGANS
from spar_bench.errors import ConfigError

from ..tasks import get_probe
from .volume import frame_indices, grid_shape, n_frames

TEMPLATE_VERSION = "3"

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
#: Replaces every sentence about the image when none is sent (the blind control).
BLIND_NOTE = (
    "No image is shown to you. The question is about one axial CT slice of the abdomen; "
    "answer as well as you can without seeing it."
)
FRAME = "Left and right always mean the patient's left and right."
INSTRUCTION = "Answer with the letter of the correct option only."
#: The image's scale, for the questions in mm^2 and mm (``{n}``: shown size in pixels).
PIXEL_SIZE = (
    "The image is {n} x {n} pixels and shows a square field of view {fov:.1f} mm wide: one "
    "pixel is {mpp:.3f} mm wide and covers {mpp2:.3f} mm^2."
)
CENTRE = "An organ's centre is the centroid of its cross-section on this slice."

QUESTIONS: dict[str, str] = {
    "relative_position.0": "Is the centre of the {a} to the patient's left of the centre of the {b}?",
    "relative_position.1": "Is the centre of the {a} anterior of (in front of) the centre of the {b}?",
    "orientation": (
        "Looking from the centre of the {a} to the centre of the {b}, in which direction "
        "does the {b} lie, in the patient's frame (left = the patient's left, anterior = "
        "towards the patient's front)? Each direction stands for a 45-degree sector "
        "centred on it."
    ),
    "symmetry": (
        "Compare the cross-sectional areas of the {a} (on the patient's left) and the {b} "
        "(on the patient's right) on this slice. They are similar when their difference is "
        "at most {band}% of their mean area. Which is larger?"
    ),
    "size": (
        "What is the cross-sectional area of the {a} on this slice? small: below {t0} mm^2; "
        "medium: from {t0} mm^2 to below {t1} mm^2; large: {t1} mm^2 or more."
    ),
    "distance": (
        "How far apart are the centres of the {a} and the {b} on this slice? near: below "
        "{t0} mm; medium: from {t0} mm to below {t1} mm; far: {t1} mm or more."
    ),
    "counting": (
        "How many separate lesions (tumours) are visible on this slice? Lesion regions that "
        "touch, even only at a corner, count as one; a region covering fewer than {min_pixels} "
        "pixels of the image at 224 x 224 pixels is not counted."
    ),
}
#: Probes whose prompt compares organ centres (the :data:`CENTRE` sentence is added).
CENTRE_PROBES = ("relative_position", "orientation", "distance")
#: Probes whose prompt states thresholds in mm^2 / mm (they need ``PromptContext.cuts``).
THRESHOLD_PROBES = ("size", "distance")

#: Option texts shown for class names that are not plain words.
OPTION_TEXT: dict[str, str] = {"left_larger": "the left one is larger",
                               "similar": "they are similar in size",
                               "right_larger": "the right one is larger"}


def organ_text(index: int) -> str:
    name = ORGANS[index]
    return ORGAN_TEXT.get(name, name.replace("_", " "))


def option_text(class_name: str) -> str:
    return OPTION_TEXT.get(class_name, class_name)




@dataclass(frozen=True)
class PromptContext:
    """What one question's prompt states beyond its organs: the image's scale, the
    symmetry band and the size / distance thresholds.

    Attributes:
        mm_per_pixel: the stored 224 slice's pixel size (mm).
        image_size: the side of the image as shown, in pixels (224, or an upscale).
        cuts: the two stated thresholds (mm^2 for size, mm for distance), or None.
        band: the symmetry band as a fraction (0.15), or None.
        min_pixels: the smallest lesion component counted (pixels of the 224 image), or None.
    """

    mm_per_pixel: float | None = None
    image_size: int = 224
    cuts: tuple[float, float] | None = None
    band: float | None = None
    min_pixels: int | None = None

    def pixel_sentence(self) -> str:
        fov = float(self.mm_per_pixel) * 224
        mpp = fov / self.image_size
        return PIXEL_SIZE.format(n=self.image_size, fov=fov, mpp=mpp, mpp2=mpp * mpp)


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


def question_text(probe: str, organ_a: int, organ_b: int, axis: int,
                  context: PromptContext | None = None) -> str:
    if probe not in LEVEL3_PROBES:
        raise ConfigError(f"no prompt template for probe {probe!r}; templates: {', '.join(LEVEL3_PROBES)}")
    ctx = context or PromptContext()
    key = f"{probe}.{axis}" if probe == "relative_position" else probe
    fill = {"a": organ_text(organ_a) if organ_a >= 0 else "",
            "b": organ_text(organ_b) if organ_b >= 0 else ""}
    if probe in THRESHOLD_PROBES:
        if ctx.cuts is None:
            raise ConfigError(f"the {probe} prompt states its thresholds: give PromptContext.cuts")
        fill["t0"], fill["t1"] = (f"{stated(c):.1f}" for c in ctx.cuts)
    if probe == "symmetry":
        if ctx.band is None:
            raise ConfigError("the symmetry prompt states its band: give PromptContext.band")
        fill["band"] = f"{stated_band(ctx.band):g}"
    if probe == "counting":
        if ctx.min_pixels is None:
            raise ConfigError("the counting prompt states the smallest lesion counted: give PromptContext.min_pixels")
        fill["min_pixels"] = str(int(ctx.min_pixels))
    return QUESTIONS[key].format(**fill)


def _preamble(probe: str, hint: bool, blind: bool, context: PromptContext | None) -> list[str]:
    """The sentences before the question: the image (or that none is shown) and the frame."""
    if blind:
        lines = [BLIND_NOTE, FRAME]
    else:
        lines = ([CONVENTION_HINT] if hint else []) + [FRAME]
        if probe in THRESHOLD_PROBES and context is not None and context.mm_per_pixel:
            lines.append(context.pixel_sentence())
    if probe in CENTRE_PROBES:
        lines.append(CENTRE)
    return lines


def render(probe: str, organ_a: int, organ_b: int, axis: int, order: tuple[int, ...],
           hint: bool = True, *, blind: bool = False, context: PromptContext | None = None) -> Prompt:
    """The prompt of one question with its options shown in ``order``.

    ``blind``: the prompt of the no-image control (no sentence describes an image);
    ``context``: the question's scale, band, thresholds and smallest lesion (required by
    size, distance, symmetry and counting, whose prompts state them).
    """

    names = get_probe(f"level3.{probe}").class_names
    if sorted(order) != list(range(len(names))):
        raise ValueError(f"order {order} is not a permutation of {len(names)} options")
    letters = tuple(string.ascii_uppercase[: len(names)])
    options = tuple(option_text(names[c]) for c in order)
    lines = _preamble(probe, hint, blind, context)
    lines += [question_text(probe, organ_a, organ_b, axis, context), "Options:"]
    lines += [f"{letter}. {text}" for letter, text in zip(letters, options, strict=True)]
    lines.append(INSTRUCTION)
    return Prompt("\n".join(lines), letters, options, tuple(order), template_version(probe))


# --------------------------------------------------------------------------- Level 4
#: Level 4 (volume) templates; a Level 4 prompt's version is ``level4.<probe>@<n>``.
VOLUME_TEMPLATE_VERSION = "1"
#: How each ``--volume-as`` shows the volume (``{n}`` frames, ``{rows}`` x ``{cols}`` grid,
#: ``{step}`` mm between frames). The display convention is :data:`VOLUME_CONVENTION`.
VOLUME_SHOWN: dict[str, str] = {
    "video": (
        "The video shows one CT volume of the abdomen as {n} axial slices, one per frame, in "
        "order from the most inferior slice (towards the feet) to the most superior (towards "
        "the head); consecutive frames are {step} mm apart."
    ),
    "montage": (
        "The image is a grid of {n} axial slices of one CT volume of the abdomen ({rows} rows "
        "of {cols}), read row by row from the top left to the bottom right, from the most "
        "inferior slice (towards the feet) to the most superior (towards the head); "
        "consecutive slices are {step} mm apart."
    ),
    "views": (
        "The image shows three orthogonal slices through the centre of one CT volume of the "
        "abdomen, side by side: on the left an axial slice, in the middle a coronal slice, on "
        "the right a sagittal slice. An organ may lie outside all three slices."
    ),
}
VOLUME_CONVENTION: dict[str, str] = {
    "video": ("Every frame is shown in the radiological convention: the patient's left is on the "
              "right side of the image and the front of the patient (anterior) is at the top."),
    "views": ("The axial slice has the patient's left on the right of the image and anterior at the "
              "top; the coronal slice has the patient's left on the right and superior (the head) at "
              "the top; the sagittal slice has anterior on the left and superior at the top."),
}
VOLUME_CONVENTION["montage"] = VOLUME_CONVENTION["video"].replace("Every frame", "Every slice")
#: The volume's scale (every shown slice spans the cube's side).
VOLUME_SCALE = ("The volume is a cube {fov:.1f} mm wide ({side} voxels of {mpv:.3f} mm per side); "
                "each slice is shown as {size} x {size} pixels.")
BLIND_NOTE_VOLUME = (
    "No image is shown to you. The question is about one CT volume of the abdomen; answer as "
    "well as you can without seeing it."
)
CENTRE_VOLUME = "An organ's centre is the centroid of its whole three-dimensional volume."
#: Level 4 questions (``relative_position.<axis>``: 0 left/right, 1 anterior/posterior,
#: 2 superior/inferior; see ``VOLUME_AXES``).
VOLUME_QUESTIONS: dict[str, str] = {
    "relative_position.0": "Is the centre of the {a} to the patient's left of the centre of the {b}?",
    "relative_position.1": "Is the centre of the {a} anterior of (in front of) the centre of the {b}?",
    "relative_position.2": "Is the centre of the {a} superior to (nearer the head than) the centre of the {b}?",
    "distance": "Is the centre of the {a} closer to the centre of the {b} or to the centre of the {c}?",
    "volume": "Is the volume of the {a} larger than the volume of the {b}?",
    "symmetry": (
        "Compare the volumes of the {a} (on the patient's left in this volume) and the {b} (on "
        "the patient's right). They are similar when their difference is at most {band}% of "
        "their mean volume. Which is larger?"
    ),
    "adjacency": (
        "Do the {a} and the {b} touch? They touch when the gap between them is at most {adj} mm; "
        "the gap is the shortest distance between a voxel centre of one and a voxel centre of "
        "the other, less one voxel (voxels sharing a face have no gap)."
    ),
    "containment": (
        "Does the largest lesion (tumour) in this volume lie inside the {a}, that is, does the "
        "{a} hold more than half of its voxels? Lesion voxels that touch, even only at a "
        "corner, belong to one lesion; the largest lesion is the one with the most voxels."
    ),
    "counting": (
        "How many separate lesions (tumours) does this volume hold? Lesion voxels that touch, "
        "even only at a corner, belong to one lesion; a lesion of fewer than {min_voxels} "
        "voxels of this volume is not counted."
    ),
}
VOLUME_CENTRE_PROBES = ("relative_position", "distance")


@dataclass(frozen=True)
class VolumeContext:
    """What a Level 4 prompt states beside its organs: how the volume is shown
    (``volume_as``, ``size`` px per slice), its ``side`` (voxels) and ``mm_per_voxel``, the
    symmetry ``band``, the adjacency threshold ``adjacency_mm`` and ``min_voxels`` (counting)."""

    volume_as: str = "montage"
    size: int = 224
    side: int = 128
    mm_per_voxel: float | None = None
    band: float | None = None
    adjacency_mm: float | None = None
    min_voxels: int | None = None

    def shown_sentences(self, hint: bool) -> list[str]:
        n = n_frames(self.side)
        rows, cols = grid_shape(n)
        z = [int(v) for v in frame_indices(self.side)]
        steps = {b - a for a, b in zip(z, z[1:], strict=False)} or {self.side}
        mpv = self.mm_per_voxel or 0.0
        step = f"{steps.pop() * mpv:.1f}" if len(steps) == 1 else f"about {self.side / n * mpv:.1f}"
        out = [VOLUME_SHOWN[self.volume_as].format(n=n, rows=rows, cols=cols, step=step)]
        if hint:
            out.append(VOLUME_CONVENTION[self.volume_as])
        if self.mm_per_voxel:
            out.append(VOLUME_SCALE.format(fov=self.side * mpv, side=self.side, mpv=mpv, size=self.size))
        return out


def volume_template_version(probe: str) -> str:
    """``"level4.<probe>@<version>"``, recorded with every Level 4 answer."""
    return f"level4.{probe}@{VOLUME_TEMPLATE_VERSION}"


def volume_option_texts(probe: str, class_names: tuple[str, ...], organ_b: int, organ_c: int) -> tuple[str, ...]:
    """Option texts of a Level 4 probe in class order (distance names organs B and C)."""
    if probe == "distance":
        return (f"the {organ_text(organ_b)}", f"the {organ_text(organ_c)}")
    return tuple(option_text(c) for c in class_names)


def volume_question_text(probe: str, organs: tuple[int, int, int], axis: int, context: VolumeContext) -> str:
    if probe not in LEVEL4_PROBES:
        raise ConfigError(f"no Level 4 prompt template for probe {probe!r}; templates: {', '.join(LEVEL4_PROBES)}")
    fill = {k: organ_text(o) if o >= 0 else "" for k, o in zip("abc", organs, strict=True)}
    need = {"symmetry": ("band", context.band), "adjacency": ("adj", context.adjacency_mm),
            "counting": ("min_voxels", context.min_voxels)}
    if probe in need:
        name, value = need[probe]
        if value is None:
            raise ConfigError(f"the level4 {probe} prompt states its {name}: give VolumeContext a value")
        fill[name] = {"band": f"{100 * float(value):g}", "adj": f"{float(value):g}"}.get(name, str(int(value)))
    key = f"{probe}.{axis}" if probe == "relative_position" else probe
    return VOLUME_QUESTIONS[key].format(**fill)


def render_volume(probe: str, organs: tuple[int, int, int], axis: int, order: tuple[int, ...],
                  hint: bool = True, *, blind: bool = False, context: VolumeContext | None = None) -> Prompt:
    """The prompt of one Level 4 question (``organs``: A, B, C; -1 none) with its options in
    ``order``: how the volume is shown and its display convention (or, ``blind``, that none
    is shown), the patient frame, the question, lettered options."""

    ctx = context or VolumeContext()
    names = LEVEL4_CLASS_NAMES[probe] if probe in LEVEL4_CLASS_NAMES else ()
    if sorted(order) != list(range(len(names))):
        raise ValueError(f"order {order} is not a permutation of {len(names)} options")
    texts = volume_option_texts(probe, names, organs[1], organs[2])
    letters = tuple(string.ascii_uppercase[: len(names)])
    options = tuple(texts[c] for c in order)
    lines = [BLIND_NOTE_VOLUME, FRAME] if blind else [*ctx.shown_sentences(hint), FRAME]
    if probe in VOLUME_CENTRE_PROBES:
        lines.append(CENTRE_VOLUME)
    lines += [volume_question_text(probe, organs, axis, ctx), "Options:"]
    lines += [f"{letter}. {text}" for letter, text in zip(letters, options, strict=True)]
    lines.append(INSTRUCTION)
    return Prompt("\n".join(lines), letters, options, tuple(order), volume_template_version(probe))
