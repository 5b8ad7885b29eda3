"""The ``frontend`` kernel node of the Qwen3-TTS card: voice (speaker, cloned voice spec),
language and instructions -> ``Qwen3TTSVoice``, checked at submission.

Imports: ``omnistep.core``, this family's ``prompt``, ``talker``, ``clone``, ``codec``.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any

import torch

from omnistep.core import InvalidRequestError, ProgramContext, Request
from omnistep.models.qwen3_tts.clone import VoiceClonePrompt
from omnistep.models.qwen3_tts.codec import CodecPrefix
from omnistep.models.qwen3_tts.loader import Qwen3TTSConfig
from omnistep.models.qwen3_tts.prompt import (
    REF_TAIL_IDS,
    ROLE_IDS,
    TAIL_IDS,
    build_prompt,
    instruct_text,
    ref_text,
)
from omnistep.models.qwen3_tts.talker import CloneRows

CLONE_CACHE_SIZE = 64
"""Parsed cloned voices (specs) the frontend keeps, most recently used first."""

DEFAULT_SPEAKERS = ("vivian", "ryan", "serena", "aiden")
"""The default CustomVoice speaker: the first of these the folder has (else its first)."""

OPENAI_SPEAKERS: dict[str, tuple[str, ...]] = {
    "alloy": ("vivian",),
    "ash": ("ryan",),
    "ballad": ("uncle_fu",),
    "coral": ("serena",),
    "echo": ("aiden",),
    "fable": ("dylan",),
    "onyx": ("eric",),
    "nova": ("ono_anna",),
    "sage": ("sohee",),
    "shimmer": ("serena",),
    "verse": ("ryan",),
}
"""OpenAI voice name -> CustomVoice speakers, first present wins (the published 12Hz
CustomVoice speakers: vivian, serena, ono_anna, sohee are female; ryan, aiden, uncle_fu, dylan,
eric male)."""


@dataclass(frozen=True)
class Qwen3TTSVoice:
    """What the frontend decided for a request: the speaker (CustomVoice) or None, the
    language name, the tokenised instruction (or None), and for a cloned voice (Base) its
    prompt rows and its transcript's ids (``prompt.ref_text`` tokenised, sliced
    ``[ROLE_IDS:-REF_TAIL_IDS]``)."""

    speaker: str | None
    language: str
    instruct_ids: tuple[int, ...] | None
    clone: CloneRows | None = None
    ref_ids: tuple[int, ...] = ()


class Qwen3TTSFrontend:
    """The ``frontend`` kernel node: voice, language and instructions, checked at submission;
    binds ``voice`` (a ``Qwen3TTSVoice``) and ``codec_prefix`` (a cloned voice's reference
    codes as a ``CodecPrefix``, else None)."""

    def __init__(self, config: Qwen3TTSConfig, tokenizer: Any):
        self.config = config
        self.tokenizer = tokenizer
        speakers = sorted(config.spk_id)
        self.default_speaker = next((s for s in DEFAULT_SPEAKERS if s in config.spk_id), None)
        if self.default_speaker is None and speakers:
            self.default_speaker = speakers[0]
        self.clones = config.tts_model_type == "base"
        self._parse_clone = functools.lru_cache(maxsize=CLONE_CACHE_SIZE)(self._clone_of_spec)

    def _clone_of_spec(self, spec: str) -> tuple[CloneRows, tuple[int, ...], CodecPrefix]:
        """A cloned voice's prompt rows, transcript ids and codec prefix from its spec.

        Raises:
            InvalidRequestError: param "voice": not a spec, a damaged one, or one made with a
                checkpoint of other sizes.
        """
        try:
            prompt = VoiceClonePrompt.from_spec(spec)
        except InvalidRequestError:
            raise InvalidRequestError(
                f"unknown voice '{spec[:64]}': this Qwen3-TTS Base model speaks only in cloned "
                "voices; create one with POST /v1/audio/voices (a reference clip and its "
                "transcript) and name it",
                param="voice",
                code="unknown_voice",
            ) from None
        talker = self.config.talker
        codebook = min(
            talker.code_predictor.vocab_size, self.config.speech_tokenizer.decoder.codebook_size
        )
        prompt.check_fits(talker.hidden_size, talker.num_code_groups, codebook)
        if prompt.num_frames < 1:
            raise InvalidRequestError("this cloned voice has no reference frames", param="voice")
        ids = self.tokenizer.encode(ref_text(prompt.ref_text), add_special_tokens=False)
        ref_ids = tuple(int(i) for i in ids[ROLE_IDS:-REF_TAIL_IDS])
        if not ref_ids:
            raise InvalidRequestError("this cloned voice has an empty transcript", param="voice")
        rows = CloneRows(prompt.speaker_embedding, prompt.ref_codes)
        return rows, ref_ids, CodecPrefix(torch.from_numpy(prompt.ref_codes.copy()))

    def clone(self, voice: str | None) -> tuple[CloneRows, tuple[int, ...], CodecPrefix]:
        """A Base request's cloned voice (see ``_clone_of_spec``; parsed specs are cached).

        Raises:
            InvalidRequestError: no voice (code ``missing_required_parameter``), or a voice
                that is not a cloned voice of this model.
        """
        if not voice:
            raise InvalidRequestError(
                "this Qwen3-TTS Base model speaks only in cloned voices: create one with "
                "POST /v1/audio/voices (multipart: name, model, audio_sample, transcript) and "
                "name it in 'voice', or send the clip with the request as 'ref_audio' and its "
                "transcript as 'ref_text'",
                param="voice",
                code="missing_required_parameter",
            )
        return self._parse_clone(voice)

    def speaker(self, voice: str | None) -> str | None:
        if self.config.tts_model_type != "custom_voice":
            return None  # VoiceDesign: the instruction is the voice
        if voice is None:
            return self.default_speaker
        if voice in OPENAI_SPEAKERS:
            found = next((s for s in OPENAI_SPEAKERS[voice] if s in self.config.spk_id), None)
            return found or self.default_speaker
        if voice.lower() not in self.config.spk_id:
            known = ", ".join(sorted(self.config.spk_id))
            raise InvalidRequestError(
                f"unknown voice '{voice}'; this model's speakers: {known}; or one of the "
                f"OpenAI names {', '.join(OPENAI_SPEAKERS)}",
                param="voice",
                code="unknown_voice",
            )
        return voice.lower()

    def check_voice(self, voice: str) -> None:
        """The card's ``voice_validator``: raises InvalidRequestError for a voice it rejects
        (Base: anything but a cloned voice's spec that fits this checkpoint)."""
        if self.clones:
            self.clone(voice)
        else:
            self.speaker(voice)

    def instruct_ids(self, req: Request) -> tuple[int, ...] | None:
        instructions = (req.instructions or "").strip()
        kind = self.config.tts_model_type
        if kind == "voice_design" and not instructions:
            raise InvalidRequestError(
                "this Qwen3-TTS VoiceDesign model needs 'instructions' describing the voice",
                param="instructions",
                code="missing_required_parameter",
            )
        if not instructions or kind == "base":
            return None  # upstream's clone path takes no instructions
        if kind == "custom_voice" and self.config.tts_model_size == "0b6":
            return None
        ids = self.tokenizer.encode(instruct_text(instructions), add_special_tokens=False)
        return tuple(int(i) for i in ids)

    def __call__(self, ctx: ProgramContext) -> None:
        req = ctx.request
        language = req.language or "auto"
        if self.clones:
            clone, ref_ids, prefix = self.clone(req.voice)
            voice = Qwen3TTSVoice(None, language, None, clone, ref_ids)
        else:
            voice, prefix = Qwen3TTSVoice(self.speaker(req.voice), language, None), None
        # the prompt layout's checks (speaker, language) now, with a stand-in text id
        build_prompt(self.config, [0] * (ROLE_IDS + 1 + TAIL_IDS), voice.speaker, voice.language)
        ctx.slots["voice"] = dataclasses.replace(voice, instruct_ids=self.instruct_ids(req))
        ctx.slots["codec_prefix"] = prefix
