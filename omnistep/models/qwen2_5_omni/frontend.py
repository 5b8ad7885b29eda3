"""The ``frontend`` kernel node of Qwen2.5-Omni (chat template -> thinker prompt ids, voice ->
speaker entry of ``spk_dict.pt``; media parts -> placeholders and the request's media items)
and the folder's tokenizer.

A message with media parts (``ChatMessage.parts``) goes to the chat template as a list of
content parts, ``{"type": "audio"}``, ``{"type": "image"}``, ``{"type": "video"}`` and
``{"type": "text", "text": ...}``, in the request's order, as ``Qwen2_5OmniProcessor``'s
callers write it; the template puts one placeholder (``<|AUDIO|>``, ``<|IMAGE|>``,
``<|VIDEO|>``) per item, which the ``media_prompt`` node expands once the items are encoded.
The ``media`` slot holds the items the ENCODE units run (``encode_list``): a video read with
``use_audio_in_video`` (``MediaItem.audio``) is followed by its audio track.

Imports: ``omnistep.core``; ``transformers`` inside ``load_tokenizer``.
"""

from __future__ import annotations

import logging
from typing import Any

from omnistep.core import OPENAI_VOICES, InvalidRequestError, ProgramContext
from omnistep.runners.media_prompt import (
    MediaRules,
    chat_prompt_ids,
    encode_list,
    splice_replies,
)

__all__ = ["ChatFrontend", "MediaRules", "load_tokenizer", "splice_replies"]


class ChatFrontend:
    """Chat template -> prompt ids (binds ``chat_ids``, ``media``, ``speaker``); voice ->
    speaker entry of ``spk_dict.pt``.

    An assistant message with ``token_ids`` (a realtime session's earlier answer, as the
    thinker generated it) is rendered empty and its ids are put in its place
    (``splice_replies``): re-tokenizing its text may split it otherwise, and the prompt
    would then differ from the sequence whose KV blocks the prefix cache holds."""

    def __init__(self, tokenizer, speakers: dict[str, dict[str, Any]], media: MediaRules):
        self.tokenizer = tokenizer
        self.speakers = speakers
        self.default_speaker = next(iter(speakers))
        self.media = media

    def speaker_name(self, voice: str | None) -> str:
        """The speaker of ``voice`` (None and OpenAI voice names: the first speaker); also the
        card's ``voice_validator``.

        Raises:
            InvalidRequestError: (code ``unknown_voice``) not a speaker of the checkpoint.
        """
        voice = voice or self.default_speaker
        if voice in OPENAI_VOICES:
            voice = self.default_speaker
        if voice not in self.speakers:
            raise InvalidRequestError(
                f"unknown voice '{voice}'; choose one of {', '.join(self.speakers)} (or an "
                "OpenAI voice name)",
                param="voice",
                code="unknown_voice",
            )
        return voice

    def __call__(self, ctx: ProgramContext) -> None:
        req = ctx.request
        if not req.messages:
            raise InvalidRequestError("messages are required", param="messages")
        voice = self.speaker_name(req.voice)
        media = req.media
        for item in media:
            self.media.check(item)
        ids = chat_prompt_ids(self.tokenizer, req.messages)
        self.media.check_prompt(ids, media)
        ctx.slots["chat_ids"] = tuple(ids)
        ctx.slots["media"] = encode_list(media)
        ctx.slots["speaker"] = self.speakers[voice]
        ctx.usage["input_tokens"] = len(ids)


class _QuietTokenIdChecks(logging.Filter):
    """Drops transformers' ``Model config: X_token_id must be None or an integer within the
    vocabulary`` warnings (14 of them for a Qwen2.5-Omni folder)."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not (
            message.startswith("Model config: ")
            and "_token_id must be `None` or an integer within the vocabulary" in message
        )


def load_tokenizer(root: str):
    """The folder's tokenizer (``AutoTokenizer``, local files only), without transformers'
    warnings about the config's token ids.

    Loading the tokenizer makes transformers read ``config.json`` and check every
    ``*_token_id`` of each sub-config against that sub-config's ``vocab_size``. The official
    talker config holds the thinker's ids (``tts_text_*``, ``vision_*``, ``audio_*``: 151647
    and up) beside its own codec vocabulary of 8448, so seven warnings come for the talker
    (and, in the tests' tiny folders, seven more for their tiny thinker vocabulary). They are
    harmless: those ids index the thinker's text embedding, never the talker's codec
    vocabulary, and omnistep reads config.json itself (transformers' config objects are not
    used).
    """
    from transformers import AutoTokenizer

    logger = logging.getLogger("transformers.configuration_utils")
    quiet = _QuietTokenIdChecks()
    logger.addFilter(quiet)
    try:
        return AutoTokenizer.from_pretrained(root, local_files_only=True)
    finally:
        logger.removeFilter(quiet)
