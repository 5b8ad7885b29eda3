"""The ``frontend`` kernel node of Qwen3-Omni: chat template -> thinker prompt ids, voice ->
the talker's speaker id (``talker_config.speaker_id``), media parts -> placeholders and the
request's media items, and the folder's tokenizer.

Voices are the published talker's speakers by name (``chelsie``, ``ethan``, ``aiden``; any
case), default ``ethan`` (transformers' ``generate(speaker="Ethan")``). OpenAI voice names map
to them (``OPENAI_SPEAKERS``: by the speakers' published descriptions, Chelsie a female voice,
Ethan and Aiden male ones); a name whose speaker the folder lacks falls back to the default.

A message with media parts goes to the chat template as content parts (``{"type": "audio"}``,
``{"type": "text", ...}``, in the request's order: ``runners.media_prompt.template_content``);
the template puts one placeholder per item (``<|audio_start|><|audio_pad|><|audio_end|>``,
``<|vision_start|><|image_pad|><|vision_end|>``, ``<|video_pad|>`` likewise), which the
``media_prompt`` node expands once the items are encoded. The items are checked
against the folder's encoders (``MediaRules``: a kind without its encoder is a 400
``unsupported_modality``); a spoken answer to them is the talker's (``talker_loop``). An
assistant message with ``token_ids`` (a
realtime session's earlier answer) is rendered empty and its ids are spliced in
(``splice_replies``), so the prompt equals the sequence the prefix cache holds.

Imports: ``omnistep.core``, ``omnistep.runners``; ``transformers`` inside ``load_tokenizer``.
"""

from __future__ import annotations

from collections.abc import Mapping

from omnistep.core import (
    OPENAI_VOICES,
    InvalidRequestError,
    MediaKind,
    ProgramContext,
)
from omnistep.runners.media_prompt import (
    MediaRules,
    chat_prompt_ids,
    encode_list,
)

DEFAULT_SPEAKER = "ethan"
"""transformers' ``generate`` default speaker."""

OPENAI_SPEAKERS: dict[str, str] = {
    "alloy": "ethan",
    "ash": "aiden",
    "ballad": "aiden",
    "coral": "chelsie",
    "echo": "ethan",
    "fable": "aiden",
    "onyx": "ethan",
    "nova": "chelsie",
    "sage": "chelsie",
    "shimmer": "chelsie",
    "verse": "aiden",
}
"""OpenAI voice name -> Qwen3-Omni speaker."""


class ChatFrontend:
    """Chat template -> prompt ids (binds ``chat_ids``, ``media``: the items the ENCODE units
    run, ``speaker``: the speaker's codec id).

    Args:
        tokenizer: the folder's tokenizer (its chat template).
        speakers: ``talker_config.speaker_id`` (lower-case name -> codec id); empty for a
            checkpoint without a talker.
        media: what the folder's encoders take (default: nothing).
    """

    def __init__(self, tokenizer, speakers: Mapping[str, int], media: MediaRules | None = None):
        self.tokenizer = tokenizer
        self.media = media or MediaRules()
        self.speakers = dict(speakers)
        first = next(iter(self.speakers), None)
        self.default_speaker = DEFAULT_SPEAKER if DEFAULT_SPEAKER in self.speakers else first

    def speaker_name(self, voice: str | None) -> str:
        """The speaker of ``voice`` (None: the default; OpenAI names: ``OPENAI_SPEAKERS``);
        also the card's ``voice_validator``.

        Raises:
            InvalidRequestError: (code ``unknown_voice``) not a speaker of the checkpoint.
        """
        if not self.speakers:
            raise InvalidRequestError(
                "this checkpoint has no talker: it answers in text only",
                param="voice",
                code="unknown_voice",
            )
        name = (voice or self.default_speaker).lower()
        if voice in OPENAI_VOICES:
            mapped = OPENAI_SPEAKERS.get(voice, self.default_speaker)
            name = mapped if mapped in self.speakers else self.default_speaker
        if name not in self.speakers:
            raise InvalidRequestError(
                f"unknown voice '{voice}'; choose one of {', '.join(self.speakers)} (or an "
                "OpenAI voice name)",
                param="voice",
                code="unknown_voice",
            )
        return name

    def __call__(self, ctx: ProgramContext) -> None:
        req = ctx.request
        if not req.messages:
            raise InvalidRequestError("messages are required", param="messages")
        media = req.media
        for item in media:
            self.media.check(item)
        ids = chat_prompt_ids(self.tokenizer, req.messages)
        self.media.check_prompt(ids, media)
        ctx.slots["chat_ids"] = tuple(ids)
        ctx.slots["media"] = encode_list(media)
        if self.speakers:
            ctx.slots["speaker"] = self.speakers[self.speaker_name(req.voice)]
        else:
            ctx.slots["speaker"] = None
        ctx.usage["input_tokens"] = len(ids)


def load_tokenizer(root: str):
    """The folder's tokenizer (``AutoTokenizer``, local files only)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(root, local_files_only=True)


class CaptionerFrontend(ChatFrontend):
    """The Captioner's frontend: a single-turn chat whose messages hold exactly one audio part
    and no text (Qwen3-Omni-30B-A3B-Captioner's model card: one audio input, no text prompt,
    text output only); then as ``ChatFrontend``.

    Raises (from the node):
        InvalidRequestError: (code ``captioner_input``) text, another media kind, more than one
            clip, an assistant turn, or no clip.
    """

    def __call__(self, ctx: ProgramContext) -> None:
        req = ctx.request
        media = req.media
        texts = [m for m in req.messages if m.content.strip() or m.role != "user"]
        if texts or len(media) != 1 or media[0].kind is not MediaKind.AUDIO:
            raise InvalidRequestError(
                "the Qwen3-Omni Captioner takes one user message holding exactly one audio "
                "part and no text",
                param="messages",
                code="captioner_input",
            )
        super().__call__(ctx)
