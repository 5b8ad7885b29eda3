"""The pieces of a family's ``build_card`` that are the same in every family.

- ``require_weights``: a family that serves a checkpoint folder refuses a card without one
  (``--model family`` alone), with the command line that names it;
- ``ar_decode_loop`` / ``audio_decode_loop`` / ``denoise_loop``: the ``LoopSpec`` of a generic
  loop, its id and component read from the loop's own config (so the two cannot disagree);
- ``component_enroller``: a card's ``voice_enroller`` that asks a component to ``enroll`` a
  reference clip (a voice spec), through ``call_component`` (a Ray actor's too);
- ``output_usage``: the ``usage`` node that counts one slot's entries as ``output_tokens``;
- ``request_sampling``: a request's sampling fields over the family's defaults, as a
  ``SamplingRow``.

Imports: ``omnistep.core``, ``omnistep.loops``, ``omnistep.sampling``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from omnistep.core import (
    InvalidRequestError,
    LoopKind,
    LoopSpec,
    ModelInstance,
    ProgramContext,
    Request,
    WorkUnitKind,
    call_component,
)
from omnistep.core.contracts import Loop
from omnistep.loops import AudioDecodeLoop
from omnistep.loops.ar_decode import ARDecodeLoop
from omnistep.loops.audio_decode import AudioDecodeConfig
from omnistep.loops.denoise import DenoiseConfig, DenoiseLoop
from omnistep.sampling import SamplingRow

INT_FIELDS = frozenset({"top_k", "min_new_tokens"})
"""``SamplingParams`` fields that are counts (the others a request may set are floats)."""
AR_UNITS = (WorkUnitKind.PREFILL, WorkUnitKind.AR_TOKEN)
"""The units of an AR_DECODE loop that prefills its prompt, then decodes a token a step."""


def require_weights(family: str, path: str | None, example: str = "/path/to/dir") -> str:
    """``path``, checked to be given.

    Raises:
        InvalidRequestError: ``path`` is None (``param="model"``; the message shows
            ``--model family=example``).
    """
    if path is None:
        raise InvalidRequestError(
            f"the {family} family needs weights: --model {family}={example}", param="model"
        )
    return path


def ar_decode_loop(
    config: Any, make: Callable[[Any], Loop] = ARDecodeLoop, units: tuple = AR_UNITS
) -> LoopSpec:
    """The AR_DECODE ``LoopSpec`` of ``config`` (an ``ARDecodeConfig``, or any config with the
    ``loop_id`` and ``component`` it runs on): ``make(config)`` builds the loop
    (``ARDecodeLoop``, or a family's loop class or closure); ``units``: the WorkUnitKinds its
    plans use (``AR_UNITS``)."""
    return LoopSpec(
        config.loop_id, LoopKind.AR_DECODE, units, (config.component,), lambda: make(config)
    )


def audio_decode_loop(config: AudioDecodeConfig) -> LoopSpec:
    """The AUDIO_DECODE ``LoopSpec`` running ``AudioDecodeLoop(config)`` (AUDIO_CHUNK units)."""
    return LoopSpec(
        config.loop_id,
        LoopKind.AUDIO_DECODE,
        (WorkUnitKind.AUDIO_CHUNK,),
        (config.component,),
        lambda: AudioDecodeLoop(config),
    )


def denoise_loop(config: DenoiseConfig) -> LoopSpec:
    """The DENOISE ``LoopSpec`` running ``DenoiseLoop(config)`` (DENOISE_STEP units)."""
    return LoopSpec(
        config.loop_id,
        LoopKind.DENOISE,
        (WorkUnitKind.DENOISE_STEP,),
        (config.component,),
        lambda: DenoiseLoop(config),
    )


def component_enroller(component: str) -> Callable[[ModelInstance, Any, int, str], str]:
    """A card's ``voice_enroller``: ``component``'s ``enroll(audio, sample_rate, transcript)``
    (the clone spec of a reference clip), through ``call_component``."""

    def enroll(model: ModelInstance, audio: Any, sample_rate: int, transcript: str) -> str:
        return call_component(model.components[component], "enroll", audio, sample_rate, transcript)

    return enroll


def output_usage(slot: str) -> Callable[[ProgramContext], None]:
    """The ``usage`` kernel node: ``output_tokens`` = how many entries ``slot`` holds (frames,
    codes, text ids)."""

    def usage(ctx: ProgramContext) -> None:
        ctx.usage["output_tokens"] = len(ctx.slots[slot])

    return usage


def request_sampling(
    req: Request, defaults: Mapping[str, float | int], **fixed: Any
) -> SamplingRow:
    """``SamplingRow`` with each field of ``defaults`` (``temperature``, ``top_p``, ``top_k``,
    ``repetition_penalty``, ``min_new_tokens``, ...) taken from the request's
    ``SamplingParams`` where it sets it, else the default (an int for ``INT_FIELDS``, a float
    otherwise), and the ``fixed`` fields (EOS id, penalty window, ``min_keep``, ...) as
    given."""
    sp = req.sampling
    chosen = {
        name: (int if name in INT_FIELDS else float)(sp.or_default(name, default))
        for name, default in defaults.items()
    }
    return SamplingRow(**chosen, **fixed)


__all__ = [
    "AR_UNITS",
    "ar_decode_loop",
    "audio_decode_loop",
    "component_enroller",
    "denoise_loop",
    "output_usage",
    "request_sampling",
    "require_weights",
]
