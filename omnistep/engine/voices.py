"""Voices a running engine makes and forgets: cloning a voice from a reference clip (the card's
``voice_enroller``) and freeing what a card keeps for a deleted voice (its
``voice_forgetter``).

``Voices`` is the ``AsyncEngine``'s collaborator behind ``clone_voice`` and ``forget_voice``.
Enrollment runs on a thread of its own, one at a time, beside the running requests; forgetting
pauses the model between steps through ``WeightUpdates`` (a card's kept rows must not change
under a running batch). Imports ``omnistep.core``, numpy and the engine's weight gates only.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from omnistep.core import Capability, InvalidRequestError, ModelInstance
from omnistep.engine.openmp import releasing
from omnistep.engine.weights import WeightUpdates

log = logging.getLogger("omnistep.engine")


class Voices:
    """Clones and forgets voices of an engine's models.

    Args:
        resolve: the engine's ``resolve`` (a card id or alias -> its model).
        weights: the engine's weight gates (``forget`` pauses the model with them).
    """

    def __init__(self, resolve: Callable[[str], ModelInstance], weights: WeightUpdates):
        self._resolve = resolve
        self._weights = weights
        self._enroll_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="omnistep-enroll")

    async def forget(self, model_id: str, spec: str) -> None:
        """``AsyncEngine.forget_voice``: the model's units pause, running batches finish, the
        card's ``voice_forgetter`` runs (nothing when it has none), work resumes. See there
        for the errors raised."""
        model = self._resolve(model_id)
        forget = model.card.voice_forgetter
        if forget is None:
            return
        card_id = model.card.card_id
        async with self._weights.lock(card_id), self._weights.pause(card_id):
            await asyncio.to_thread(releasing(forget), model, spec)

    async def clone(self, model_id: str, audio: Any, sample_rate: int, transcript: str) -> str:
        """``AsyncEngine.clone_voice``: the card's ``voice_enroller`` on the enrollment thread;
        returns the voice's spec. See there for the arguments and the errors raised."""
        model = self._resolve(model_id)
        card = model.card
        if Capability.VOICE_CLONING not in card.capabilities or card.voice_enroller is None:
            raise InvalidRequestError(
                f"model '{card.card_id}' cannot clone voices from a clip (only a voice-cloning "
                "model can, e.g. a Qwen3-TTS Base folder)",
                param="model",
                code="voice_cloning_unsupported",
            )
        samples = np.asarray(audio)
        if samples.ndim != 1 or samples.dtype.kind != "f":
            raise InvalidRequestError(
                f"audio must be float mono samples [N], got {samples.dtype} {samples.shape}",
                param="audio",
            )
        if isinstance(sample_rate, bool) or not isinstance(sample_rate, int) or sample_rate <= 0:
            raise InvalidRequestError(
                f"sample_rate must be a positive int, got {sample_rate!r}", param="sample_rate"
            )
        samples = np.ascontiguousarray(samples, dtype=np.float32)
        enroller = card.voice_enroller
        spec = await asyncio.get_running_loop().run_in_executor(
            self._enroll_pool, releasing(enroller), model, samples, sample_rate, transcript
        )
        log.info(
            "cloned a voice for model %s (%.1f s of audio)",
            card.card_id,
            samples.shape[0] / sample_rate,
        )
        return spec

    def close(self) -> None:
        """Stop the enrollment thread (a queued enrollment is cancelled)."""
        self._enroll_pool.shutdown(wait=False, cancel_futures=True)
