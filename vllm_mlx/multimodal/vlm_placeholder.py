"""Where an image stands in a prompt, read off the model's processor (``vlm_generic``'s first step).

The engine places each image's run of tokens where the prompt names the image, so it needs, for
any mlx-vlm processor: the text that stands for one image (``find_placeholder``: the first of the
names a processor or tokenizer gives, then the conventional ``<image>``, that the processor expands
*where it stands* in a prompt), where the processor's expansion of it lies against its own ids
(``ImageRun``), a token that can stand for a placeholder of several tokens or for a mark outside
the vocabulary (``stand_in_text``, ``stand_in_for_a_mark``), how many images one prompt takes
(``fails_on_two_images``), placeholders numbered per image (``numbered_placeholder``), a processor's
rewriting where text follows an image (``drops_token_after_image``), and, where mlx-vlm's ``load`` gives
a tokenizer alone, mlx-vlm's own prompt builder as a processor (``SplicingPromptBuilder``). Each is
probed at load on small images; what cannot be found is refused, saying why.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from vllm_mlx.executor.attention import UnsupportedModelError

__all__ = [
    "LAYOUT_TEXT",
    "PROBE_IMAGE_SIZE",
    "SPLICED_BY_THE_MODEL",
    "ImageRun",
    "SplicingPromptBuilder",
    "drops_token_after_image",
    "expanded_ids",
    "fails_on_two_images",
    "find_placeholder",
    "model_run_ids",
    "nth_placeholder",
    "numbered_placeholder",
    "places_images_itself",
    "replace_runs",
    "stand_in_for_a_mark",
    "stand_in_text",
    "text_ids",
    "without_token_after_images",
]


PROBE_IMAGE_SIZE = (64, 48)


SPLICED_BY_THE_MODEL = (
    "{what}: mlx-vlm's model splices an image's features in itself, in place of one mark, where the engine "
    "needs the processor to expand each image into its run of tokens"
)
"""Why a model whose processor does not expand images (LLaVA-style ``image_token_index`` marks) is refused."""


@dataclass(frozen=True)
class ImageRun:
    """Where the processor's expansion of one image stands against the placeholder's own ids."""

    prefix: int
    """Tokens the two share at the start (a BOS the tokenizer adds)."""
    suffix: int
    """Tokens they share at the end."""
    stand_in: int
    """The one token that stands for the placeholder in a tokenized prompt: the placeholder
    itself, or, where the placeholder is text of several tokens (InternVL's ``<image>``, no token
    of its tokenizer), the token its run repeats (``<IMG_CONTEXT>``): ``prompt_text`` writes it
    in the placeholder's stead before tokenizing, as the processor replaces the text."""

    @classmethod
    def of(cls, plain: list[int], expanded: list[int]) -> ImageRun:
        """The run of ``expanded`` that replaces the placeholder tokens of ``plain``: the shared
        start and end, leaving at least one token of ``plain`` between them (a run that repeats
        the placeholder, ``<image>`` -> ``<image> x n``, must not eat it into the prefix).

        Raises:
            ValueError: ``plain`` has no token between what it shares with ``expanded``.
        """
        limit = min(len(plain), len(expanded))
        prefix = 0
        while prefix < limit and plain[prefix] == expanded[prefix]:
            prefix += 1
        suffix = 0
        while suffix < limit - prefix and plain[-1 - suffix] == expanded[-1 - suffix]:
            suffix += 1
        prefix = min(prefix, len(plain) - 1 - suffix)
        if prefix < 0:
            raise ValueError("the image placeholder has no token of its own")
        placeholder = plain[prefix : len(plain) - suffix]
        run = expanded[prefix : len(expanded) - suffix]
        stand_in = placeholder[0] if len(placeholder) == 1 else max(run, key=run.count)
        return cls(prefix, suffix, stand_in)

    def placeholder(self, plain: list[int]) -> list[int]:
        return plain[self.prefix : len(plain) - self.suffix]

    def tokens(self, expanded: list[int]) -> list[int]:
        return expanded[self.prefix : len(expanded) - self.suffix]


class SplicingPromptBuilder:
    """mlx-vlm's prompt builder as a processor, for a model whose ``load`` gives the tokenizer alone
    with the model's own image processor attached (Bunny, Janus: ``prepare_inputs`` builds their
    prompts itself): the text split at ``<image>``, each piece tokenized as a prompt (a tokenizer
    that adds a BOS adds it to every piece, as mlx-vlm's does), the model's ``image_token_index``
    between the first two pieces, the image processor's pixels stacked. mlx-vlm keeps the first two
    pieces only (a second image drops the text after it), so a second image is refused here: the
    check at load then serves one image a prompt (``fails_on_two_images``)."""

    image_token = "<image>"

    def __init__(self, tokenizer, image_processor, mark: int) -> None:
        self.tokenizer = tokenizer
        self.image_processor = image_processor
        self.mark = mark

    @classmethod
    def around(cls, model, processor):
        """``processor``, or the builder around it where mlx-vlm builds the prompt itself."""
        from mlx_vlm.models.base import BaseImageProcessor

        image_processor = getattr(processor, "image_processor", None)
        mark = getattr(getattr(model, "config", None), "image_token_index", None)
        if getattr(processor, "tokenizer", None) is not None or not isinstance(image_processor, BaseImageProcessor):
            return processor
        return processor if mark is None else cls(processor, image_processor, mark)

    def __call__(self, text, images, return_tensors="np"):
        [prompt] = text
        pieces = prompt.split(self.image_token)
        if len(pieces) != 2 or len(images) != 1:
            raise ValueError("mlx-vlm's prompt builder places one image a prompt (it drops the text after a second)")
        ids = [*self.tokenizer(pieces[0])["input_ids"], self.mark, *self.tokenizer(pieces[1])["input_ids"]]
        pixels = np.stack(self.image_processor.preprocess(images=[image.convert("RGB") for image in images]))
        return {"input_ids": np.array([ids]), "pixel_values": pixels}


def stand_in_for_a_mark(processor, mark: int) -> int:
    """The token that stands for an image whose processor marks it with a negative id (``mark``,
    LLaVA's -200: no token) where its placeholder text is several tokens: the id of the processor's
    or the tokenizer's ``image_token`` where that is one token, else the tokenizer's pad token (a
    token prompts do not write; one that does gets a placeholder too many, refused by count). The
    run's rows are the model's whatever the id, and the image's hash keys the prefix cache.

    Raises:
        UnsupportedModelError: The tokenizer has neither.
    """
    tokenizer = processor.tokenizer
    for owner in (processor, tokenizer):
        text = getattr(owner, "image_token", None)
        ids = tokenizer.encode(text, add_special_tokens=False) if isinstance(text, str) and text else []
        if len(ids) == 1:
            return ids[0]
    if isinstance(getattr(tokenizer, "pad_token_id", None), int):
        return tokenizer.pad_token_id
    raise UnsupportedModelError(f"its processor marks an image with the id {mark}, and its tokenizer has no "
                                "image or pad token to stand for it in a prompt")  # fmt: skip


def find_placeholder(processor, known: tuple[str, ...] = ()) -> tuple[str, list[int], ImageRun]:
    """The text that stands for one image (the first the processor expands of
    ``known`` then ``_candidate_texts`` where it stands in a prompt), its ids, and where the
    processor puts an image's run against them.

    Raises:
        UnsupportedModelError: The processor expands none of them.
    """
    from PIL import Image

    if getattr(processor, "tokenizer", None) is None:  # a tokenizer alone with no image processor
        raise UnsupportedModelError(SPLICED_BY_THE_MODEL.format(what="its processor is a tokenizer alone"))
    probe = Image.new("RGB", PROBE_IMAGE_SIZE)
    failures = []
    for text in dict.fromkeys([*known, *_candidate_texts(processor)]):
        try:
            expanded = expanded_ids(processor, text, probe)
            plain = text_ids(processor, text)
            if expanded == plain:  # left as text (Phi-3-vision's processor with "<image>"): ImageRun.of would
                failures.append(f"{text!r}: its processor leaves it as text")  # take a text token for the run
                continue
            run = ImageRun.of(plain, expanded)
            if _expands_in_place(processor, text, run.tokens(expanded), probe):
                return text, plain, run
            failures.append(f"{text!r}: its run is not put where the placeholder stands in a prompt")
        except Exception as exc:  # noqa: BLE001 -- a processor refuses a text its own way
            failures.append(f"{text!r}: {exc}".splitlines()[0])
    if _places_images_itself(processor, probe):
        failures.append(PLACES_IMAGES_ITSELF)
    raise UnsupportedModelError(
        "its processor expands no image placeholder it names" + (f" ({'; '.join(failures)})" if failures else "")
    )


PLACES_IMAGES_ITSELF = "it puts an image's tokens into a prompt that has no placeholder, where it chooses"
"""Why a processor that names no placeholder is refused, where it places images itself (PLaMo 2 VL's
writes every image at the start of a fixed instruction template): the engine places an image's run
where the prompt names it, so it cannot follow such a processor."""


LAYOUT_TEXT = ""
"""The text an image is processed with where its processor places images itself: its run is then cut
at the ends found for this text (``GenericVisionModel._processor_layout``)."""


def places_images_itself(processor) -> bool:
    """Whether ``processor`` puts an image's tokens into a prompt that has no placeholder (a probe image)."""
    from PIL import Image

    return _places_images_itself(processor, Image.new("RGB", PROBE_IMAGE_SIZE))


def replace_runs(ids: list[int], run: list[int], stand_in: int) -> list[int]:
    """``ids`` with each occurrence of ``run`` (left to right, not overlapping) one ``stand_in``."""
    out, i = [], 0
    while i < len(ids):
        if run and ids[i : i + len(run)] == run:
            out.append(stand_in)
            i += len(run)
        else:
            out.append(ids[i])
            i += 1
    return out


def _places_images_itself(processor, image) -> bool:
    """Whether the processor expands an image for a prompt with no placeholder (more ids than the
    text alone), which tells a user why no placeholder of theirs can work."""
    try:
        return len(expanded_ids(processor, IN_PLACE_HEAD, image)) > len(text_ids(processor, IN_PLACE_HEAD))
    except Exception:  # noqa: BLE001 -- a processor that wants a placeholder refuses a text without one
        return False


def model_run_ids(run: list[int], length: int, stand_in: int) -> list[int]:
    """The ids of an image's run of ``length`` rows that the model expands from the processor's
    ``run``: the stand-in for the image's rows, with the text tokens at the run's ends (neither the
    stand-in nor a negative mark) kept as themselves, for the model leaves them its own rows there.
    Why: mlx-vlm's prompt builder (Janus's) tokenizes the text after an image as a prompt, with a
    BOS, so the run of ``<image>`` alone ends with that BOS; mlx-vlm's ids there are the model's
    image tokens, then the BOS (``add_image_token``), and so are the engine's."""
    is_text = [token >= 0 and token != stand_in for token in run]
    lead = next((i for i, text in enumerate(is_text) if not text), len(run))
    trail = next((i for i, text in enumerate(reversed(is_text)) if not text), 0)
    if lead + trail >= len(run):  # no image token in it: the model's rows stand in whole
        return [stand_in] * length
    return [*run[:lead], *[stand_in] * (length - lead - trail), *run[len(run) - trail :]]


def expanded_ids(processor, text: str, image) -> list[int]:
    return np.asarray(processor(text=[text], images=[image], return_tensors="np")["input_ids"])[0].tolist()


def fails_on_two_images(processor, text: str) -> str:
    """Why the processor cannot take two images in one prompt ("" where it can): PaddleOCR-VL's
    stacks a prompt's images as one array (two sizes raise, one size becomes one grid of two
    frames, whose second placeholder then finds no grid). mlx-vlm's own generation fails the same
    way, so such a model takes one image a prompt (``VisionLanguageModel.max_images_per_prompt``).
    The two probe images differ in size, as a prompt's images may."""
    from PIL import Image

    width, height = PROBE_IMAGE_SIZE
    images = [Image.new("RGB", (width, height)), Image.new("RGB", (height, width))]
    try:
        # The text alone, as mlx-vlm's generation passes it (DeepSeek-VL2's takes a list as a batch).
        processor(text=text + nth_placeholder(text, 2), images=images, return_tensors="np")
    except Exception as exc:  # noqa: BLE001 -- any failure: the processor cannot take the pair
        return f"its processor, {type(processor).__name__}, fails on two: {exc}".splitlines()[0]
    return ""


IN_PLACE_HEAD, IN_PLACE_TAIL = "Look:", " Then."
"""The text around a placeholder in ``_expands_in_place``'s prompt."""


def drops_token_after_image(processor, text: str) -> bool:
    """Whether the processor drops the first token of the text after an image: the probe prompt's ids end
    with its tail's ids but the first. mlx-vlm's Phi-3-vision processor tokenizes the text after each image
    alone, without special tokens, and still drops its first token as the BOS it no longer adds there."""
    from PIL import Image

    tokenizer = getattr(processor, "tokenizer", processor)
    try:
        tail = list(tokenizer.encode(IN_PLACE_TAIL, add_special_tokens=False))
        ids = expanded_ids(processor, IN_PLACE_HEAD + text + IN_PLACE_TAIL, Image.new("RGB", PROBE_IMAGE_SIZE))
    except Exception:  # noqa: BLE001 -- a processor that refuses the probe keeps the text as it is
        return False
    return len(tail) > 1 and ids[-len(tail) :] != tail and ids[1 - len(tail) :] == tail[1:]


def without_token_after_images(token_ids: list[int], placeholder: int) -> list[int]:
    """``token_ids`` without the text token right after each ``placeholder`` (``drops_token_after_image``)."""
    return [token for i, token in enumerate(token_ids)
            if i == 0 or token_ids[i - 1] != placeholder or token == placeholder]  # fmt: skip


def _expands_in_place(processor, text: str, run: list[int], image) -> bool:
    """Whether the processor puts an image's run where its placeholder stands in a longer prompt:
    the text before it kept (all but its last token, which a tokenizer may merge with what
    follows) and the run whole after it. A processor that moves every image to the front
    (Moondream 3's, Molmo's) or wraps the prompt in a conversation of its own (GOT-OCR's) does not:
    the engine places an image's run where the prompt names it."""
    expanded = expanded_ids(processor, IN_PLACE_HEAD + text + IN_PLACE_TAIL, image)
    kept = text_ids(processor, IN_PLACE_HEAD)[:-1]
    if expanded[: len(kept)] != kept:
        return False
    after = expanded[len(kept) :]
    return any(after[i : i + len(run)] == run for i in range(len(after) - len(run) + 1))


CONVENTIONAL_PLACEHOLDERS = ("<image>",)
"""Placeholders tried where the processor names none that it expands: the text LLaVA-style chat
templates write for an image (InternVL-Chat's processor replaces it, and names nothing)."""

NUMBERED_PLACEHOLDERS = ("<|image_1|>", "<image-1>")
"""Placeholders of processors that number a prompt's images from 1, tried after ``CONVENTIONAL_PLACEHOLDERS``
(their processors name none): Phi-3-vision's ``<|image_N|>`` (its processor raises on a number written twice
or skipped, and writes image N's run as ids -N) and LocateAnything's ``<image-N>`` (numbers ignored). Found as
the first image's; a prompt's placeholders are every number's (``numbered_placeholder``): the images go in the
order the placeholders stand, as both models merge them whatever the numbers."""


def numbered_placeholder(text: str) -> re.Pattern | None:
    """Every number's form of ``text``, where it is one of ``NUMBERED_PLACEHOLDERS`` (None: not numbered)."""
    if text not in NUMBERED_PLACEHOLDERS:
        return None
    return re.compile(re.escape(text).replace("1", r"\d+"))


def nth_placeholder(text: str, number: int) -> str:
    """The placeholder of a prompt's ``number``-th image (from 1): ``text`` where it is not numbered."""
    return text.replace("1", str(number)) if text in NUMBERED_PLACEHOLDERS else text


def _candidate_texts(processor):
    """The processor's ``image_token``, its ``boi_token``, its ``image_placeholder_token`` (Molmo
    2's ``<|image|>``), the tokenizer's ``image_token``; then ``CONVENTIONAL_PLACEHOLDERS`` and
    ``NUMBERED_PLACEHOLDERS``. (Not
    the chat template's own image text: rendering it is the engine's, in its guarded workers.)"""
    tokenizer = getattr(processor, "tokenizer", None)
    owners = ((processor, "image_token"), (processor, "boi_token"), (processor, "image_placeholder_token"),
              (tokenizer, "image_token"))  # fmt: skip
    candidates = [getattr(owner, name, None) for owner, name in owners]
    named = (c for c in candidates if isinstance(c, str) and c)
    yield from dict.fromkeys([*named, *CONVENTIONAL_PLACEHOLDERS, *NUMBERED_PLACEHOLDERS])


def stand_in_text(processor, placeholder_text: str, stand_in: int) -> str:
    """The text of the token that stands for a placeholder of several tokens (``ImageRun``).

    Raises:
        UnsupportedModelError: That token's text does not tokenize back to it alone.
    """
    tokenizer = getattr(processor, "tokenizer", processor)
    text = tokenizer.convert_ids_to_tokens(stand_in)
    if tokenizer.encode(text, add_special_tokens=False) != [stand_in]:
        raise UnsupportedModelError(
            f"its image placeholder {placeholder_text!r} is several tokens, and the token of its run "
            f"({text!r}) cannot stand for it in a tokenized prompt"
        )
    return text


def text_ids(processor, text: str) -> list[int]:
    """``text`` tokenized as the processor tokenizes a prompt (special tokens added)."""
    tokenizer = getattr(processor, "tokenizer", processor)
    return list(tokenizer(text)["input_ids"])
