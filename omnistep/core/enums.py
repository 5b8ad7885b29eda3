"""Enumerations of the runtime vocabulary. Stdlib only."""

from enum import StrEnum


class LoopKind(StrEnum):
    """What shape of iteration a loop is."""

    AR_DECODE = "ar_decode"
    """Autoregressive decode: a prefill unit, then one token (or codebook frame) per step."""
    DENOISE = "denoise"
    """Diffusion / flow-matching: one ODE step per unit."""
    AUDIO_DECODE = "audio_decode"
    """Codes or text segments to waveform, one chunk per unit."""
    ONESHOT = "oneshot"
    """A single unit."""
    ENCODE = "encode"
    """Media encoders: one ENCODE unit per media item of a request (its rows feed a prefill)."""


class WorkUnitKind(StrEnum):
    """The kind of one step; a component's ``execute`` dispatches on it."""

    PREFILL = "prefill"
    AR_TOKEN = "ar_token"
    DENOISE_STEP = "denoise_step"
    AUDIO_CHUNK = "audio_chunk"
    ONESHOT = "oneshot"
    ENCODE = "encode"
    """A media encoder forward (an audio clip, an image, a video) whose rows feed a prefill."""


class ExecutionProfile(StrEnum):
    """SERVE runs for output; ROLLOUT also records each step's trajectory (tokens, log-probs)."""

    SERVE = "serve"
    ROLLOUT = "rollout"


class Capability(StrEnum):
    """What a card can serve; the server routes endpoints by it."""

    TEXT_TO_SPEECH = "text_to_speech"
    CHAT_TEXT = "chat_text"
    CHAT_AUDIO = "chat_audio"
    STREAMING_TEXT_INPUT = "streaming_text_input"
    """Text may stream into a running request (``Request.text_input``): the card's loops read
    the program slot ``TEXT_INPUT_SLOT`` (a ``Channel`` of text pieces) and wait for text."""
    VOICE_CLONING = "voice_cloning"
    """The card makes a voice from a reference clip and its transcript
    (``ModelCard.voice_enroller``; ``AsyncEngine.clone_voice``, ``POST /v1/audio/voices``)."""
    VOICE_DESIGN = "voice_design"
    """The voice is described in words: a request's ``instructions`` make it (Qwen3-TTS
    VoiceDesign); ``task_type: "VoiceDesign"`` asks for such a card."""
    WORD_TIMESTAMPS = "word_timestamps"
    """The card's audio chunks carry per-word times (``StreamChunk.words``)."""
    AUDIO_INPUT = "audio_input"
    """Chat messages may hold audio (``input_audio``, ``audio_url`` parts): the card's encoders
    feed it to its model (``ChatMessage.parts``)."""
    IMAGE_INPUT = "image_input"
    """Chat messages may hold images (``image_url`` parts)."""
    VIDEO_INPUT = "video_input"
    """Chat messages may hold video (``video_url`` parts)."""
    TRANSCRIPTION = "transcription"
    """The card transcribes audio (``POST /v1/audio/transcriptions``): it hears
    (``AUDIO_INPUT``) and its ``ModelCard.transcription_prompt`` builds the chat its authors
    use for speech recognition; the answer's text is the transcript."""


class MediaKind(StrEnum):
    """What a media item of a request holds (``omnistep.core.request.MediaItem``)."""

    AUDIO = "audio"
    IMAGE = "image"
    VIDEO = "video"

    @property
    def capability(self) -> Capability:
        """The capability a card needs to take this kind of media."""
        return Capability(f"{self.value}_input")


class Modality(StrEnum):
    """What a StreamChunk carries."""

    AUDIO = "audio"
    TEXT = "text"


OPENAI_VOICES: tuple[str, ...] = (
    "alloy",
    "ash",
    "ballad",
    "coral",
    "echo",
    "fable",
    "onyx",
    "nova",
    "sage",
    "shimmer",
    "verse",
    "marin",
    "cedar",
)
"""The voice names of OpenAI's speech API; cards accept them so OpenAI clients work unchanged."""

OPENAI_TTS_MODELS: tuple[str, ...] = ("tts-1", "tts-1-hd", "gpt-4o-mini-tts")
"""OpenAI's speech model ids, which the default voice answers to as aliases."""
