"""The Realtime API's data for ``/v1/realtime`` (``omnistep.server.realtime``): the session
settings a ``session.update`` carries (``SessionFields`` parsed, ``SessionConfig`` kept) and the
conversation items, with their OpenAI JSON and their chat-history form; pcm16 helpers and the
transcript truncation rule.

Imports numpy, pydantic, ``omnistep.core`` and the server's ``protocol`` and ``realtime_vad``.
"""

from __future__ import annotations

import base64
import binascii
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
from pydantic import ConfigDict, Field, field_validator

from omnistep.core import ChatMessage, InvalidRequestError, MediaItem
from omnistep.server.protocol import OpenAIBody
from omnistep.server.realtime_vad import SAMPLE_RATE, VadSettings

PCM_FORMAT = {"type": "audio/pcm", "rate": SAMPLE_RATE}
"""The one audio format of the API here: pcm16 mono at 24 kHz."""


def new_id(prefix: str) -> str:
    """A fresh id, ``prefix_<24 hex>`` (``item``, ``resp``, ``event``, ``sess``)."""
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


def bad(message: str, param: str | None = None, code: str = "invalid_value") -> InvalidRequestError:
    """The ``InvalidRequestError`` an event gets as its ``error`` event."""
    return InvalidRequestError(message, param=param, code=code)


def truncate_transcript(text: str, played_samples: int, total_samples: int) -> str:
    """The part of an assistant turn's ``text`` the user heard when ``played_samples`` of its
    ``total_samples`` of audio were played: the same fraction of its characters, cut back to
    the last whole word (an estimate: the text is assumed spoken at an even rate)."""
    if total_samples <= 0 or played_samples >= total_samples:
        return text
    keep = int(len(text) * max(played_samples, 0) / total_samples)
    if keep < len(text) and keep > 0 and not text[keep].isspace():
        keep = text.rfind(" ", 0, keep) + 1  # drop the partly heard word
    return text[:keep].rstrip()


def pcm16_to_float(data: bytes, param: str) -> np.ndarray:
    """float32 ``[n]`` in [-1, 1) from base64-decoded little-endian 16-bit PCM.

    Raises:
        InvalidRequestError: an odd number of bytes.
    """
    if len(data) % 2:
        raise bad(f"'{param}' must hold 16-bit samples (an even number of bytes)", param)
    return np.frombuffer(data, dtype="<i2").astype(np.float32) / 32768.0


def b64_audio(value: str, param: str) -> np.ndarray:
    """Samples of a base64 pcm16 string (``pcm16_to_float``).

    Raises:
        InvalidRequestError: not base64, or an odd number of bytes.
    """
    try:
        data = base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raise bad(f"'{param}' is not valid base64", param) from None
    return pcm16_to_float(data, param)


# ----------------------------------------------------------------------------- session config


class _Body(OpenAIBody):
    model_config = ConfigDict(extra="ignore")


class _Format(_Body):
    type: Literal["audio/pcm"] = "audio/pcm"
    rate: Literal[24000] = 24000


class _TurnDetection(_Body):
    type: Literal["server_vad"]
    threshold: float | None = Field(default=None, ge=0, le=1)
    prefix_padding_ms: int | None = Field(default=None, ge=0, le=10_000)
    silence_duration_ms: int | None = Field(default=None, ge=20, le=10_000)
    create_response: bool | None = None
    interrupt_response: bool | None = None

    def settings(self) -> VadSettings:
        given = {k: v for k, v in self.model_dump(exclude={"type"}).items() if v is not None}
        return VadSettings(**given)


class _AudioInput(_Body):
    format: _Format | None = None
    turn_detection: _TurnDetection | None = None


class _AudioOutput(_Body):
    format: _Format | None = None
    voice: str | None = Field(default=None, min_length=1, max_length=4096)


class _Audio(_Body):
    input: _AudioInput | None = None
    output: _AudioOutput | None = None


class SessionFields(_Body):
    """``session`` of a ``session.update`` (the fields used; others are ignored)."""

    type: Literal["realtime"] = "realtime"
    model: str | None = None
    instructions: str | None = Field(default=None, max_length=65_536)
    output_modalities: list[Literal["text", "audio"]] | None = Field(
        default=None, min_length=1, max_length=1
    )
    audio: _Audio | None = None
    max_output_tokens: int | Literal["inf"] | None = None

    @field_validator("max_output_tokens", mode="before")
    @classmethod
    def _token_cap(cls, value: object) -> object:
        """1..32768 (the chat API's cap; OpenAI's is 4096) or "inf": 0 or -1 were kept and
        failed every later response."""
        if value is None or value == "inf":
            return value
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 32768:
            raise ValueError("must be an integer in 1..32768 or 'inf'")
        return value


@dataclass
class SessionConfig:
    """A session's settings (see ``SessionFields``; defaults as OpenAI's)."""

    instructions: str = ""
    output_modalities: tuple[str, ...] = ("audio",)
    voice: str | None = None
    turn_detection: VadSettings | None = field(default_factory=VadSettings)
    max_output_tokens: int | None = None

    def update(self, fields: SessionFields, present: Callable[[tuple[str, ...]], bool]) -> None:
        """Apply the fields the client gave (``present(path)``: whether it gave that path)."""
        if fields.instructions is not None:
            self.instructions = fields.instructions
        if fields.output_modalities is not None:
            self.output_modalities = tuple(fields.output_modalities)
        if fields.max_output_tokens is not None:
            cap = fields.max_output_tokens
            self.max_output_tokens = None if cap == "inf" else cap
        audio = fields.audio
        if audio is not None and audio.output is not None and audio.output.voice is not None:
            self.voice = audio.output.voice
        if present(("audio", "input", "turn_detection")):
            detection = audio.input.turn_detection  # type: ignore[union-attr]
            self.turn_detection = detection.settings() if detection is not None else None

    def to_json(self, session_id: str, model: str, default_voice: str | None) -> dict:
        """OpenAI's session object."""
        vad = self.turn_detection
        detection = None
        if vad is not None:
            detection = {
                "type": "server_vad",
                "threshold": vad.threshold,
                "prefix_padding_ms": vad.prefix_padding_ms,
                "silence_duration_ms": vad.silence_duration_ms,
                "create_response": vad.create_response,
                "interrupt_response": vad.interrupt_response,
            }
        return {
            "type": "realtime",
            "object": "realtime.session",
            "id": session_id,
            "model": model,
            "output_modalities": list(self.output_modalities),
            "instructions": self.instructions,
            "audio": {
                "input": {
                    "format": PCM_FORMAT,
                    "turn_detection": detection,
                    "transcription": None,
                    "noise_reduction": None,
                },
                "output": {
                    "format": PCM_FORMAT,
                    "voice": self.voice or default_voice,
                    "speed": 1.0,
                },
            },
            "max_output_tokens": self.max_output_tokens or "inf",
            "tools": [],
            "tool_choice": "auto",
        }


def given(raw: dict, path: tuple[str, ...]) -> bool:
    """Whether the raw JSON object holds ``path`` (a null value counts)."""
    node: object = raw
    for key in path:
        if not isinstance(node, dict) or key not in node:
            return False
        node = node[key]
    return True


# ----------------------------------------------------------------------------- conversation


@dataclass
class Item:
    """One conversation item (a message).

    Attributes:
        id: the item id (``item_...``, or the client's).
        role: ``user``, ``system`` or ``assistant``.
        parts: user/system content in order: text (``str``) and audio (``MediaItem`` at the
            card's media rate).
        text: an assistant turn's text (its transcript with audio output).
        audio_output: the assistant turn spoke (its content is ``output_audio``).
        output_samples: 24 kHz samples of the assistant's audio sent to the client.
        played_samples: of those, what the client played (``conversation.item.truncate``);
            None: all of them.
        status: ``completed``, ``in_progress`` or ``incomplete`` (a cancelled answer).
        token_ids: a finished assistant answer's text as the model generated it
            (``RequestStream.text_ids``), fed back in later prompts so they repeat the
            answer's sequence token for token (prefix caching); None after a truncation, or
            when the card gives none.
    """

    id: str
    role: str
    parts: tuple[str | MediaItem, ...] = ()
    text: str = ""
    audio_output: bool = False
    output_samples: int = 0
    played_samples: int | None = None
    status: str = "completed"
    token_ids: tuple[int, ...] | None = None

    @property
    def audio_seconds(self) -> float:
        return sum(p.seconds or 0.0 for p in self.parts if isinstance(p, MediaItem))

    def chat_message(self) -> ChatMessage | None:
        """The item as chat history; None when it holds nothing."""
        if self.role == "assistant":
            if not self.text and not self.token_ids:
                return None
            return ChatMessage("assistant", self.text, token_ids=self.token_ids)
        text = "".join(p for p in self.parts if isinstance(p, str))
        if all(isinstance(p, str) for p in self.parts):
            return ChatMessage(self.role, text) if text else None
        return ChatMessage(self.role, text, self.parts)

    def content_json(self) -> list[dict]:
        if self.role == "assistant":
            if self.audio_output:
                return [{"type": "output_audio", "transcript": self.text}]
            return [{"type": "output_text", "text": self.text}]
        return [
            {"type": "input_text", "text": p}
            if isinstance(p, str)
            else {"type": "input_audio", "transcript": None}
            for p in self.parts
        ]

    def to_json(self) -> dict:
        """OpenAI's conversation item (audio is not echoed back)."""
        return {
            "id": self.id,
            "object": "realtime.item",
            "type": "message",
            "status": self.status,
            "role": self.role,
            "content": self.content_json(),
        }
