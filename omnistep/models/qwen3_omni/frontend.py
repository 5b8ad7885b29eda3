"""The ``frontend`` kernel node of Qwen3-Omni: chat template -> thinker prompt ids, voice ->
the talker's speaker id (``talker_config.speaker_id``), and the folder's tokenizer.

Voices are the published talker's speakers by name (``chelsie``, ``ethan``, ``aiden``; any
case), default ``ethan`` (transformers' ``generate(speaker="Ethan")``). OpenAI voice names map
to them (``OPENAI_SPEAKERS``: by the speakers' published descriptions, Chelsie a female voice,
Ethan and Aiden male ones); a name whose speaker the folder lacks falls back to the default.

Media content parts are not served yet (the thinker runs text prompts): a request with media
is a 400 (``unsupported_modality``).

Imports: ``omnistep.core``; ``transformers`` inside ``load_tokenizer``.
"""

from __future__ import annotations

from collections.abc import Mapping

from omnistep.core import OPENAI_VOICES, InvalidRequestError, ProgramContext

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
    """Chat template -> prompt ids (binds ``chat_ids``, ``speaker``: the speaker's codec id).

    Args:
        tokenizer: the folder's tokenizer (its chat template).
        speakers: ``talker_config.speaker_id`` (lower-case name -> codec id); empty for a
            checkpoint without a talker.
    """

    def __init__(self, tokenizer, speakers: Mapping[str, int]):
        self.tokenizer = tokenizer
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
        if req.media:
            raise InvalidRequestError(
                "Qwen3-Omni serves text prompts only for now (no audio, image or video parts)",
                param=req.media[0].source or "messages",
                code="unsupported_modality",
            )
        messages = [{"role": m.role, "content": m.content} for m in req.messages]
        ids = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=True
        )["input_ids"]
        ctx.slots["chat_ids"] = tuple(int(i) for i in ids)
        if self.speakers:
            ctx.slots["speaker"] = self.speakers[self.speaker_name(req.voice)]
        else:
            ctx.slots["speaker"] = None
        ctx.usage["input_tokens"] = len(ids)


def load_tokenizer(root: str):
    """The folder's tokenizer (``AutoTokenizer``, local files only)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(root, local_files_only=True)
