"""The ChatTTS card's kernel nodes: ``frontend`` (voice -> speaker vector, text -> code
prompt) and ``refine_frontend`` (text -> the refine-text prompt).

Imports: torch, ``omnistep.core``, this family's ``prompt``, ``speaker``, ``gpt``.
"""

from __future__ import annotations

import torch

from omnistep.core import OPENAI_VOICES, InvalidRequestError, ProgramContext
from omnistep.models.chattts.gpt import ChatTTSPromptInput
from omnistep.models.chattts.prompt import ChatTTSTokenizer
from omnistep.models.chattts.speaker import (
    SHIPPED_STATS_HIDDEN,
    decode_speaker,
    normalize_speaker,
    random_speaker,
)

SPEAKER_SEED_BASE = 1000


class ChatTTSFrontend:
    """The ``frontend`` kernel node: speaker and code prompt."""

    def __init__(self, tokenizer: ChatTTSTokenizer, spk_stat: torch.Tensor | None, hidden: int):
        """``spk_stat``: float16 ``[2 * hidden]`` (std then mean), or None: no random speakers."""
        self.tokenizer = tokenizer
        self.spk_stat = spk_stat
        self.hidden = hidden

    def speaker(self, voice: str | None, seed: int) -> torch.Tensor | None:
        if voice is not None and voice in OPENAI_VOICES:
            voice = f"seed:{SPEAKER_SEED_BASE + OPENAI_VOICES.index(voice)}"
        if voice is not None and not voice.startswith("seed:"):
            return decode_speaker(voice, self.hidden)
        if self.spk_stat is None:
            if voice is None:
                return None
            raise InvalidRequestError(
                f"this ChatTTS checkpoint has no speaker statistics (its hidden size {self.hidden} "
                f"is not the {SHIPPED_STATS_HIDDEN} of ChatTTS's, and it has no "
                "asset/spk_stat.pt), so voices must be speaker strings",
                param="voice",
                code="invalid_voice",
            )
        if voice is None:
            return random_speaker(self.spk_stat, seed)
        try:
            return random_speaker(self.spk_stat, int(voice.removeprefix("seed:")))
        except ValueError:
            raise InvalidRequestError(
                f"invalid voice seed '{voice}'", param="voice", code="invalid_voice"
            ) from None

    def check_voice(self, voice: str) -> None:
        """Raise InvalidRequestError (param ``voice``) if a request could not use ``voice``:
        the card's ``voice_validator`` (decodes the speaker string, or draws ``seed:N``)."""
        self.speaker(voice, 0)

    def __call__(self, ctx: ProgramContext) -> None:
        req = ctx.request
        spk = self.speaker(req.voice, int(req.seed or 0))
        text = req.text
        if "refined" in ctx.slots:
            text = self.tokenizer.refined_text([frame[0] for frame in ctx.slots["refined"]])
        prompt = self.tokenizer.code_prompt(text, req.speed, with_speaker=spk is not None)
        ctx.slots["prompt"] = ChatTTSPromptInput(
            prompt.input_ids, prompt.spk_positions, None if spk is None else normalize_speaker(spk)
        )
        ctx.usage["input_tokens"] = len(prompt.input_ids)


def refine_frontend(tokenizer: ChatTTSTokenizer):
    def refine_fn(ctx: ProgramContext) -> None:
        ids = tokenizer.refine_prompt(ctx.request.text)
        ctx.slots["refine_prompt"] = ChatTTSPromptInput(tuple(ids), text_mode=True)

    return refine_fn
