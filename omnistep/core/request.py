"""Requests and sampling parameters, as the engine sees them (the server builds them)."""

from __future__ import annotations

import hashlib
import math
import numbers
import time
import uuid
from dataclasses import dataclass, field

import numpy as np

from omnistep.core.enums import ExecutionProfile, MediaKind, Modality
from omnistep.core.errors import InvalidRequestError

MAX_SEED = 2**63 - 1
MAX_FLOW_NOISE = 4.0
"""The largest ``SamplingParams.flow_noise_level`` (Flow-GRPO trains with 0.7)."""


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Sampling settings of one request; None means "the card's default" (ChatTTS's defaults
    differ from an LLM's). Cards without a sampler ignore them.

    Attributes:
        temperature: logits are divided by it; 0 means greedy.
        top_p: nucleus mass kept, in (0, 1].
        top_k: most-likely tokens kept; 0 disables.
        repetition_penalty: >= 1; 1 disables.
        max_new_tokens: upper bound on generated tokens.
        min_new_tokens: EOS is masked before this many tokens.
        flow_noise_level: the noise scale ``a`` of a flow-matching decoder's SDE sampler
            (Flow-GRPO, arXiv 2505.05470: each solver step a Gaussian transition around the
            ODE step, std ``a sqrt((1 - t) / t)`` per unit time), in [0, ``MAX_FLOW_NOISE``];
            None or 0 runs the deterministic ODE. Cards without one (every card but
            Qwen2.5-Omni's DiT) ignore it.
        subtalker_temperature, subtalker_top_p, subtalker_top_k: the same settings for a
            card's sub-stage sampler, where one frame's later codebooks are drawn by a second
            model inside the step (Qwen3-TTS's code predictor, codebooks 1..15; upstream
            ``generate``'s names). None: the card's default (the checkpoint's
            ``generation_config.json``), or greedy when ``temperature`` is 0. Cards without a
            sub-stage ignore them.
        exaggeration: Chatterbox's emotion-exaggeration scalar in [0, 2] (upstream
            ``generate``'s name and its demo's range; 0.5 neutral). Other cards ignore it.
        cfg_weight: the classifier-free guidance weight of a guided AR stage in [0, 2]
            (Chatterbox's T3; upstream ``generate``'s name; 0 samples the conditional row
            alone). Other cards ignore it.

    Raises:
        InvalidRequestError: a value out of range or of the wrong type (a bool, a string; a
            float for ``top_k``, ``max_new_tokens``, ``min_new_tokens``), ``min_new_tokens``
            above ``max_new_tokens``; ``param`` names the field.
    """

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    repetition_penalty: float | None = None
    max_new_tokens: int | None = None
    min_new_tokens: int | None = None
    flow_noise_level: float | None = None
    subtalker_temperature: float | None = None
    subtalker_top_p: float | None = None
    subtalker_top_k: int | None = None
    exaggeration: float | None = None
    cfg_weight: float | None = None

    def __post_init__(self) -> None:
        checks = {
            "exaggeration": lambda v: math.isfinite(v) and 0 <= v <= 2,
            "cfg_weight": lambda v: math.isfinite(v) and 0 <= v <= 2,
            "subtalker_temperature": lambda v: math.isfinite(v) and v >= 0,
            "subtalker_top_p": lambda v: math.isfinite(v) and 0 < v <= 1,
            "subtalker_top_k": lambda v: v >= 0,
            "flow_noise_level": lambda v: math.isfinite(v) and 0 <= v <= MAX_FLOW_NOISE,
            "temperature": lambda v: math.isfinite(v) and v >= 0,
            "top_p": lambda v: math.isfinite(v) and 0 < v <= 1,
            "top_k": lambda v: v >= 0,
            "repetition_penalty": lambda v: math.isfinite(v) and v >= 1,
            "max_new_tokens": lambda v: v >= 1,
            "min_new_tokens": lambda v: v >= 0,
        }
        integers = ("top_k", "max_new_tokens", "min_new_tokens", "subtalker_top_k")
        for name, ok in checks.items():
            value = getattr(self, name)
            kind = numbers.Integral if name in integers else numbers.Real
            # a bool is an int to Python but never a sampling value; a str would fail in ok()
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, kind) or not ok(value)
            ):
                raise InvalidRequestError(
                    f"Invalid value for '{name}': {value!r}", param=name, code="invalid_value"
                )
        low, high = self.min_new_tokens, self.max_new_tokens
        if low is not None and high is not None and low > high:  # as POST /v1/rollouts says
            raise InvalidRequestError(
                f"min_new_tokens ({low}) must not exceed max_new_tokens ({high})",
                param="min_new_tokens",
                code="invalid_value",
            )

    def or_default(self, name: str, default: float | int) -> float | int:
        """The field's value, or ``default`` when the request left it unset."""
        value = getattr(self, name)
        return default if value is None else value


def derived_seed(seed: int, *keys: int) -> int:
    """A seed in [0, 2**63) for the random draws that ``keys`` name (a sentence index; a solver
    step and a block) of a request seeded ``seed``: ``numpy.random.SeedSequence([seed,
    *keys])``'s first 64-bit word, halved; independent streams for different keys."""
    state = np.random.SeedSequence([seed, *keys]).generate_state(1, dtype=np.uint64)[0]
    return int(state >> np.uint64(1))


def new_request_id() -> str:
    """A fresh unique request id, ``req-<32 hex>``."""
    return f"req-{uuid.uuid4().hex}"


def check_text(text: object, param: str) -> None:
    """Raise ``InvalidRequestError`` unless ``text`` is a ``str`` that UTF-8 can encode (JSON
    and Python allow lone surrogates such as ``"\\ud800"``; tokenizers fail on them)."""
    if not isinstance(text, str):
        raise InvalidRequestError(
            f"'{param}' must be a string, got {type(text).__name__}",
            param=param,
            code="invalid_type",
        )
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            raise InvalidRequestError(
                f"'{param}' contains a lone surrogate (invalid Unicode)",
                param=param,
                code="invalid_value",
            ) from None


@dataclass(frozen=True, slots=True, eq=False)
class MediaItem:
    """One decoded media item of a chat message (an audio clip, an image, a video).

    Attributes:
        kind: audio, image or video.
        data: audio: float32 ``[num_samples]`` mono in [-1, 1] at ``sample_rate``; image: uint8
            ``[height, width, 3]`` RGB; video: uint8 ``[num_frames, height, width, 3]`` RGB
            frames at ``fps``.
        sha256: hex digest of the decoded data (its bytes, shape, dtype and rate): equal media
            have equal hashes whatever file format carried them (encoder outputs are reused by
            it).
        sample_rate: audio samples per second (audio only).
        fps: frames per second of ``data`` (video only; the sampled rate, not the file's).
        source: the request part it came from, e.g. ``messages[1].content[2]``.
        audio: a video's audio track (an AUDIO item), present when the caller asked for
            ``use_audio_in_video``: a card that supports it interleaves the track's tokens
            with the frames' (Qwen2.5-Omni: 2-second chunks); None otherwise (always for
            audio and images).
    """

    kind: MediaKind
    data: np.ndarray
    sha256: str
    sample_rate: int | None = None
    fps: float | None = None
    source: str = ""
    audio: MediaItem | None = None

    @classmethod
    def of(
        cls,
        kind: MediaKind,
        data: np.ndarray,
        sample_rate: int | None = None,
        fps: float | None = None,
        source: str = "",
        audio: MediaItem | None = None,
    ) -> MediaItem:
        """An item with its ``sha256`` computed from ``data`` (and its shape, dtype, rate,
        and the hash of its audio track when it has one); the item holds a read-only view of
        ``data``, so the hash keeps describing it.

        Raises:
            ValueError: ``audio`` on an item that is not a video, or not an AUDIO item.
        """
        if audio is not None and (kind is not MediaKind.VIDEO or audio.kind is not MediaKind.AUDIO):
            raise ValueError("only a video item carries an audio track, and it must be audio")
        data = np.ascontiguousarray(data).view()
        data.flags.writeable = False
        track = audio.sha256 if audio is not None else None
        header = f"{kind}|{data.dtype}|{data.shape}|{sample_rate}|{fps}|"
        digest = hashlib.sha256((header + (f"audio={track}|" if track else "")).encode())
        digest.update(data.reshape(-1).view(np.uint8))  # the buffer itself, no copy
        return cls(kind, data, digest.hexdigest(), sample_rate, fps, source, audio)

    @property
    def seconds(self) -> float | None:
        """Duration of audio or video; None for an image."""
        if self.kind is MediaKind.AUDIO and self.sample_rate:
            return self.data.shape[0] / self.sample_rate
        if self.kind is MediaKind.VIDEO and self.fps:
            return self.data.shape[0] / self.fps
        return None


@dataclass(frozen=True, slots=True)
class ChatMessage:
    """One chat message: ``role`` (system, user, assistant), its text ``content`` and, for
    messages with media, ``parts``: its text pieces (``str``) and ``MediaItem``s in the order
    the request gave them (empty for a text-only message; ``content`` is then the text).

    ``token_ids``: an assistant turn as the model generated it (its reply's token ids, which
    detokenize to ``content``), or None. A card whose chat template can place them uses them
    instead of tokenizing ``content`` again, so the next turn's prompt repeats the previous
    sequence token for token (re-tokenized text may split differently) and its KV blocks are
    found by prefix caching (``Request.cache_salt``)."""

    role: str
    content: str
    parts: tuple[str | MediaItem, ...] = ()
    token_ids: tuple[int, ...] | None = None

    @property
    def media(self) -> tuple[MediaItem, ...]:
        """The message's media items, in order."""
        return tuple(p for p in self.parts if isinstance(p, MediaItem))


@dataclass(slots=True)
class Request:
    """One generation request.

    Attributes:
        model: a served card id or alias.
        text: the input text (TTS) or the rendered prompt.
        voice: a voice name the card accepts; None for the card's default.
        speed: playback speed factor in [0.25, 4.0]; cards map it to their own control.
        seed: seeds the request's own random generator; None draws one (reported back).
        sampling: sampling settings.
        profile: SERVE, or ROLLOUT to record trajectories.
        messages: the conversation, for chat cards (they render it with their template).
        output_modalities: what the caller wants streamed: AUDIO for speech, TEXT and/or AUDIO
            for chat; program nodes that produce only unwanted outputs are skipped.
        instructions: how to speak (OpenAI's ``instructions``): a voice description for cards
            that design voices from text (Qwen3-TTS VoiceDesign) or a style prompt; cards
            without one ignore it.
        language: the language of ``text`` for cards that take one (Qwen3-TTS: a language
            name such as ``english``, or ``auto``); None means the card's default.
        normalize_text: run the card's text front-end on ``text`` first (``omnistep.text``:
            numbers, dates, times, money and abbreviations to words); False reads the text as
            given. Cards without a front-end ignore it.
        request_id: unique id; generated when not given.
        arrival_time: ``time.monotonic()`` at creation, in seconds.
        text_input: the text is still arriving: ``text`` is its beginning (may be empty),
            ``RequestStream.append_text`` adds to it while the request runs and
            ``RequestStream.end_text`` ends it; the card's loops wait for text they need (no
            step runs meanwhile). Needs a card with ``Capability.STREAMING_TEXT_INPUT``. The
            result equals a request with the whole text and the same seed.
        group: the sample group the request belongs to (a rollout's n samples of one input):
            AR components prefill a prompt once per group and share its KV blocks by reference
            between the group's requests whose prompts are equal; None shares nothing. Sharing
            never changes what a request samples.
        cache_salt: the prefix-caching scope of the request (vLLM's ``cache_salt``): an AR
            component with prefix caching keeps its sequences' full KV blocks after they end,
            hashed with this salt, in the block manager's evictable cache, and a later request
            with the same salt starts on the longest cached prefix of its prompt instead of
            computing it (a realtime session's turns: the session id). Reuse changes the
            floating-point path of the reused rows (they were computed in other forwards), so
            None, the default, reuses nothing: a request's numbers then never depend on what
            ran before it.
        non_streaming_mode: for cards with two prompt layouts (Qwen3-TTS; upstream's
            ``non_streaming_mode``): True puts the whole text in the prompt (the request
            starts once its text is complete), False feeds it one token per step (text may
            stream in); None lets the card choose (Qwen3-TTS: its upstream public call's
            default for a whole text, the streaming layout for ``text_input``). Other cards
            ignore it.

    Raises:
        InvalidRequestError: ``text`` or a message's content not a string or not valid
            Unicode (a lone surrogate), ``sampling`` not a ``SamplingParams``, ``speed`` or
            ``seed`` out of range.
    """

    model: str
    text: str = ""
    voice: str | None = None
    speed: float = 1.0
    seed: int | None = None
    sampling: SamplingParams = field(default_factory=SamplingParams)
    profile: ExecutionProfile = ExecutionProfile.SERVE
    messages: tuple[ChatMessage, ...] = ()
    output_modalities: frozenset[Modality] = frozenset({Modality.AUDIO})
    instructions: str | None = None
    language: str | None = None
    normalize_text: bool = True
    request_id: str = field(default_factory=new_request_id)
    arrival_time: float = field(default_factory=time.monotonic)
    group: str | None = None
    text_input: bool = False
    non_streaming_mode: bool | None = None
    cache_salt: str | None = None

    @property
    def media(self) -> tuple[MediaItem, ...]:
        """Every media item of ``messages``, in conversation order."""
        return tuple(item for message in self.messages for item in message.media)

    def __post_init__(self) -> None:
        check_text(self.text, "input")
        if not isinstance(self.non_streaming_mode, bool | None):
            raise InvalidRequestError(
                f"'non_streaming_mode' must be a bool or None, got {self.non_streaming_mode!r}",
                param="non_streaming_mode",
                code="invalid_type",
            )
        for name in ("instructions", "language"):
            if getattr(self, name) is not None:
                check_text(getattr(self, name), name)
        for message in self.messages:
            check_text(getattr(message, "content", None), "messages")
            for part in getattr(message, "parts", ()):
                if not isinstance(part, MediaItem):
                    check_text(part, "messages")
        if not isinstance(self.sampling, SamplingParams):
            raise InvalidRequestError(
                f"'sampling' must be a SamplingParams, got {type(self.sampling).__name__}",
                param="sampling",
                code="invalid_type",
            )
        if not (
            isinstance(self.speed, int | float)
            and math.isfinite(self.speed)
            and 0.25 <= self.speed <= 4.0
        ):
            raise InvalidRequestError(
                f"'speed' must be between 0.25 and 4.0, got {self.speed!r}",
                param="speed",
                code="invalid_value",
            )
        if self.seed is not None and not (
            isinstance(self.seed, int) and 0 <= self.seed <= MAX_SEED
        ):
            raise InvalidRequestError(
                f"'seed' must be an integer in [0, 2**63-1], got {self.seed!r}",
                param="seed",
                code="invalid_value",
            )
