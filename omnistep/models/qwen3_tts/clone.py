"""Base voice cloning: the prompt a reference clip and its transcript give, computed once.

Upstream (``qwen_tts`` 0.1.1, ``inference/qwen3_tts_model.py``):
``Qwen3TTSModel.create_voice_clone_prompt(ref_audio, ref_text)`` (ICL mode, the default) makes a
``VoiceClonePromptItem`` of

- ``ref_code``: ``model.speech_tokenizer.encode(wav, sr)`` (``encoder.py``): int64 ``[T, 16]``
  at 12.5 frames/s of the clip resampled to 24 kHz;
- ``ref_spk_embedding``: ``model.extract_speaker_embedding(wav_24k, 24000)`` (``speaker.py``):
  ``[enc_dim]``;
- ``ref_text``: the transcript, tokenised at generation time as
  ``"<|im_start|>assistant\\n{ref_text}<|im_end|>\\n"``.

Both encoders take the clip resampled to their rate (24 kHz each, from the configs) the way
upstream does: ``librosa.resample`` with its default ``soxr_hq``, i.e. soxr's HQ filter, then
``fix_length`` to ``ceil(N * out / in)`` samples; here ``omnistep.audio.resample.Resampler``
(soxr HQ; bit-identical to ``soxr.resample``) and the same length rule. Channels of a 2-D clip
``[N, C]`` are averaged, as upstream does.

Limits (upstream has none; ours, documented): a clip lasts ``MIN_CLIP_SECONDS`` (1 s) to
``MAX_CLIP_SECONDS`` (60 s: the ICL prompt holds every reference frame, 750 at 60 s, in each
request's context); the transcript is non-empty after stripping whitespace (upstream
rejects only ``""`` / None). Every violation raises ``InvalidRequestError`` with ``param`` set.

A prompt is stored as a saved voice's text: ``VoiceClonePrompt.to_spec()`` (14.8k
characters for a 10 s clip on the 1.7B checkpoints; see ``to_spec``).

Imports: numpy, torch; ``omnistep.core``, ``omnistep.audio``, ``omnistep.layers``, the
family's ``loader``.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from omnistep.audio.resample import Resampler
from omnistep.core.errors import InvalidRequestError
from omnistep.models.qwen3_tts.encoder import TENSOR_PREFIX as SPEECH_PREFIX
from omnistep.models.qwen3_tts.encoder import SpeechTokenizerEncoder
from omnistep.models.qwen3_tts.loader import Qwen3TTSCheckpoint, Qwen3TTSCheckpointError
from omnistep.models.qwen3_tts.speaker import TENSOR_PREFIX as SPEAKER_PREFIX
from omnistep.models.qwen3_tts.speaker import Qwen3TTSSpeakerEncoder

MIN_CLIP_SECONDS = 1.0
"""Shortest reference clip accepted."""
MAX_CLIP_SECONDS = 60.0
"""Longest reference clip accepted."""
SPEC_PREFIX = "qwen3-tts-clone:1:"
"""What every ``to_spec`` string starts with (format version 1)."""
_HEADER = struct.Struct("<IIHHI")  # enc_dim, frames, code groups, bits per code, text bytes


class VoiceCloneUnsupportedError(InvalidRequestError):
    """Voice cloning asked of a checkpoint that has no speaker encoder: only the Base variant
    (``tts_model_type`` "base", with ``speaker_encoder_config`` and ``speaker_encoder.*``) can
    clone; CustomVoice and VoiceDesign cannot. ``param`` is "model"."""

    def __init__(self, message: str):
        super().__init__(message, param="model", code="voice_clone_unsupported")


# ----------------------------------------------------------------------------- the prompt


@dataclass(frozen=True, eq=False)
class VoiceClonePrompt:
    """What a Base-variant request needs from its reference clip (upstream
    ``VoiceClonePromptItem`` in ICL mode).

    Attributes:
        speaker_embedding: float32 ``[enc_dim]`` (x-vector; enc_dim = the talker's hidden size).
        ref_codes: int64 ``[T, num_code_groups]`` (16), the clip's speech-tokenizer codes, each
            in ``[0, codebook_size)``; T = ceil(24 kHz samples / 1920).
        ref_text: the clip's transcript, as given.

    Raises:
        ValueError: wrong rank, dtype or a negative code (``__post_init__``).
    """

    speaker_embedding: np.ndarray
    ref_codes: np.ndarray
    ref_text: str

    def __post_init__(self) -> None:
        emb, codes = self.speaker_embedding, self.ref_codes
        if not isinstance(emb, np.ndarray) or emb.dtype != np.float32 or emb.ndim != 1:
            raise ValueError("speaker_embedding must be a float32 numpy array [enc_dim]")
        if not isinstance(codes, np.ndarray) or codes.dtype != np.int64 or codes.ndim != 2:
            raise ValueError("ref_codes must be an int64 numpy array [T, num_code_groups]")
        if codes.size and int(codes.min()) < 0:
            raise ValueError("ref_codes must be >= 0")
        if not isinstance(self.ref_text, str):
            raise ValueError("ref_text must be a string")

    @property
    def num_frames(self) -> int:
        """T, the reference frames (12.5 per second)."""
        return int(self.ref_codes.shape[0])

    def same_as(self, other: VoiceClonePrompt) -> bool:
        """Exact equality of all three fields (bitwise for the embedding)."""
        return (
            self.ref_text == other.ref_text
            and self.speaker_embedding.shape == other.speaker_embedding.shape
            and self.speaker_embedding.tobytes() == other.speaker_embedding.tobytes()
            and np.array_equal(self.ref_codes, other.ref_codes)
        )

    def check_fits(self, enc_dim: int, num_code_groups: int, codebook_size: int) -> None:
        """Check that this prompt suits a checkpoint of these sizes (a voice saved with a
        0.6B checkpoint has enc_dim 1024 and does not fit a 1.7B one, whose enc_dim is 2048).

        Raises:
            InvalidRequestError: param "voice", naming the mismatch.
        """
        if self.speaker_embedding.shape[0] != enc_dim:
            raise InvalidRequestError(
                f"this cloned voice has a {self.speaker_embedding.shape[0]}-wide speaker "
                f"embedding; the model needs {enc_dim} (it was made with another checkpoint)",
                param="voice",
            )
        if self.ref_codes.shape[1] != num_code_groups:
            raise InvalidRequestError(
                f"this cloned voice has {self.ref_codes.shape[1]} codebooks per frame; the model "
                f"needs {num_code_groups}",
                param="voice",
            )
        if self.ref_codes.size and int(self.ref_codes.max()) >= codebook_size:
            raise InvalidRequestError(
                f"this cloned voice has codes >= the codebook size {codebook_size}", param="voice"
            )

    def to_spec(self) -> str:
        """A compact text form for a saved voice: ``SPEC_PREFIX`` + base64 of (little-endian)
        ``enc_dim`` u32, ``T`` u32, code groups u16, bits per code u16, text length u32, the
        UTF-8 text, the float32 embedding, the codes bit-packed at ``bits`` bits each (MSB
        first; bits = the bit length of the largest code, at least 1: 11 with the 2048-entry
        codebooks). Exact: ``from_spec(to_spec())`` gives the same arrays bit for bit.

        Size: ``len(SPEC_PREFIX) + 4 * ceil((16 + text bytes + 4 * enc_dim
        + ceil(T * 16 * bits / 8)) / 3)``. A 10 s clip (T = 125, 11 bits) with a 100-byte
        transcript: 14,762 characters on the 1.7B checkpoints (enc_dim 2048), 9,302 on the 0.6B
        ones (enc_dim 1024); at the 60 s limit (T = 750): 33,098 / 27,634.
        """
        text = self.ref_text.encode("utf-8")
        codes = self.ref_codes
        top = int(codes.max()) if codes.size else 0
        bits = max(1, top.bit_length())
        shifts = np.arange(bits - 1, -1, -1, dtype=np.int64)
        packed = np.packbits(((codes.reshape(-1, 1) >> shifts) & 1).astype(np.uint8))
        header = _HEADER.pack(
            self.speaker_embedding.shape[0], codes.shape[0], codes.shape[1], bits, len(text)
        )
        emb = self.speaker_embedding.astype("<f4").tobytes()
        payload = header + text + emb + packed.tobytes()
        return SPEC_PREFIX + base64.b64encode(payload).decode("ascii")

    @classmethod
    def from_spec(cls, spec: str) -> VoiceClonePrompt:
        """Parse ``to_spec``'s text.

        Raises:
            InvalidRequestError: param "voice": not a clone spec, or a damaged one.
        """
        if not isinstance(spec, str) or not spec.startswith(SPEC_PREFIX):
            raise InvalidRequestError(
                f"not a Qwen3-TTS cloned voice (it must start with {SPEC_PREFIX!r})", param="voice"
            )
        try:
            payload = base64.b64decode(spec[len(SPEC_PREFIX) :], validate=True)
            enc_dim, frames, groups, bits, text_len = _HEADER.unpack_from(payload)
            pos = _HEADER.size
            text = payload[pos : pos + text_len].decode("utf-8")
            pos += text_len
            emb = np.frombuffer(payload, dtype="<f4", count=enc_dim, offset=pos)
            pos += 4 * enc_dim
            n = frames * groups
            packed = np.frombuffer(payload, dtype=np.uint8, offset=pos)
            if not 1 <= bits <= 62 or packed.size != math.ceil(n * bits / 8) or text_len < 0:
                raise ValueError("bad sizes")
            flat = np.unpackbits(packed, count=n * bits).reshape(n, bits).astype(np.int64)
            codes = flat @ (np.int64(1) << np.arange(bits - 1, -1, -1, dtype=np.int64))
        except (ValueError, struct.error, binascii.Error, UnicodeDecodeError) as exc:
            raise InvalidRequestError(
                f"damaged Qwen3-TTS cloned voice: {exc}", param="voice"
            ) from None
        return cls(
            speaker_embedding=emb.astype(np.float32),
            ref_codes=codes.reshape(frames, groups),
            ref_text=text,
        )


# ----------------------------------------------------------------------------- checks


def check_clip(
    audio: Any,
    sample_rate: Any,
    min_seconds: float = MIN_CLIP_SECONDS,
    max_seconds: float = MAX_CLIP_SECONDS,
) -> np.ndarray:
    """Validate a reference clip and return it as float32 mono ``[N]``.

    Args:
        audio: float ``[N]`` mono or ``[N, C]`` (channels averaged, as upstream), nominally in
            [-1, 1] (decode integer PCM to float first).
        sample_rate: its rate in Hz, a positive int.

    Raises:
        InvalidRequestError: param "sample_rate" (not a positive int); param "audio" (not a 1-D
            or 2-D float array, empty, non-finite samples, shorter than ``min_seconds`` or
            longer than ``max_seconds``).
    """
    if isinstance(sample_rate, bool) or not isinstance(sample_rate, int | np.integer):
        raise InvalidRequestError(
            f"sample_rate must be an int, got {type(sample_rate).__name__}", param="sample_rate"
        )
    if sample_rate <= 0:
        raise InvalidRequestError(
            f"sample_rate must be > 0, got {sample_rate}", param="sample_rate"
        )
    try:
        x = np.asarray(audio)
    except (TypeError, ValueError) as exc:
        raise InvalidRequestError(
            f"audio is not an array of samples: {exc}", param="audio"
        ) from None
    if x.dtype.kind != "f" or x.ndim not in (1, 2):
        raise InvalidRequestError(
            f"audio must be float samples [N] or [N, channels], got {x.dtype} {x.shape}",
            param="audio",
        )
    x = x.astype(np.float32)
    if x.ndim == 2:
        x = x.mean(axis=-1, dtype=np.float32) if x.shape[1] else np.zeros(0, np.float32)
    if x.shape[0] == 0:
        raise InvalidRequestError("the reference audio is empty", param="audio")
    if not np.isfinite(x).all():
        raise InvalidRequestError(
            "the reference audio has NaN or infinite samples", param="audio", code="invalid_audio"
        )
    seconds = x.shape[0] / sample_rate
    if seconds < min_seconds:
        raise InvalidRequestError(
            f"the reference audio lasts {seconds:.2f} s; at least {min_seconds:g} s is needed",
            param="audio",
            code="audio_too_short",
        )
    if seconds > max_seconds:
        raise InvalidRequestError(
            f"the reference audio lasts {seconds:.2f} s; at most {max_seconds:g} s is accepted",
            param="audio",
            code="audio_too_long",
        )
    return np.ascontiguousarray(x)


def check_transcript(transcript: Any) -> str:
    """The transcript as given, if it is a string with non-whitespace text.

    Raises:
        InvalidRequestError: param "transcript".
    """
    if not isinstance(transcript, str) or not transcript.strip():
        raise InvalidRequestError(
            "the transcript of the reference audio is required (voice cloning conditions on "
            "the clip's text and codes)",
            param="transcript",
        )
    return transcript


def resample(audio: np.ndarray, in_rate: int, out_rate: int) -> np.ndarray:
    """``librosa.resample(audio, orig_sr=in_rate, target_sr=out_rate)`` with its defaults
    (``res_type="soxr_hq"``, ``fix=True``): soxr HQ, then cut or zero-pad to
    ``ceil(N * out_rate / in_rate)`` samples. float32 ``[N]`` -> float32 ``[M]``."""
    if in_rate == out_rate:
        return audio
    r = Resampler(in_rate, out_rate, "HQ")
    y = np.concatenate([r.process(audio), r.flush()])
    n = math.ceil(audio.shape[0] * out_rate / in_rate)
    if y.shape[0] >= n:
        return np.ascontiguousarray(y[:n])
    return np.concatenate([y, np.zeros(n - y.shape[0], dtype=np.float32)])


# ----------------------------------------------------------------------------- the encoders


@dataclass(frozen=True)
class VoiceCloneEncoder:
    """The two encoders a Base checkpoint clones with, loaded once (``from_checkpoint``)."""

    speaker: Qwen3TTSSpeakerEncoder
    speech: SpeechTokenizerEncoder
    speaker_rate: int  # speaker_encoder_config.sample_rate (24000)

    @classmethod
    def from_checkpoint(
        cls,
        checkpoint: Qwen3TTSCheckpoint,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        model_tensors: Mapping[str, torch.Tensor] | None = None,
    ) -> VoiceCloneEncoder:
        """Load the speaker encoder (``model.safetensors`` ``speaker_encoder.*``, cast to
        ``dtype``) and the speech tokenizer's encoder (``speech_tokenizer/model.safetensors``
        ``encoder.*``, float32) of an opened published folder.

        Args:
            model_tensors: ``checkpoint.model_tensors()`` when the caller holds them already
                (the card loading the talker); else only ``speaker_encoder.*`` is read.

        Raises:
            VoiceCloneUnsupportedError: not a Base checkpoint (no speaker encoder).
            Qwen3TTSCheckpointError: a tensor missing, unknown or misshapen (named, with its
                file).
        """
        config = checkpoint.config
        spk_config = config.speaker_encoder
        if spk_config is None:
            raise VoiceCloneUnsupportedError(
                f"voice cloning needs a Base checkpoint (Qwen3-TTS-12Hz-*-Base); "
                f"{checkpoint.root} is tts_model_type {config.tts_model_type!r}, which has no "
                "speaker encoder"
            )
        if model_tensors is None:
            model_tensors = checkpoint.model_tensors(prefix=SPEAKER_PREFIX)
        path = checkpoint.root / "model.safetensors"
        try:
            speaker = Qwen3TTSSpeakerEncoder.from_tensors(
                spk_config, model_tensors, device=device, dtype=dtype
            )
        except (ValueError, RuntimeError) as exc:
            raise Qwen3TTSCheckpointError(f"{path}: {exc}") from None
        st = config.speech_tokenizer
        st_dir = checkpoint.root / "speech_tokenizer"
        # MimiConfig takes the whole published dict (the loader's SpeechEncoderConfig holds the
        # sizes only); parse_config has checked the file already.
        mimi = json.loads((st_dir / "config.json").read_text(encoding="utf-8"))["encoder_config"]
        try:
            speech = SpeechTokenizerEncoder.from_tensors(
                mimi,
                checkpoint.speech_tokenizer_tensors(prefix=SPEECH_PREFIX),
                num_quantizers=st.encoder_valid_num_quantizers,
                downsample_rate=st.encode_downsample_rate,
                sample_rate=st.input_sample_rate,
                device=device,
            )
        except (KeyError, RuntimeError, ValueError) as exc:
            raise Qwen3TTSCheckpointError(f"{st_dir / 'model.safetensors'}: {exc}") from None
        return cls(speaker=speaker, speech=speech, speaker_rate=spk_config.sample_rate)

    @classmethod
    def from_pretrained(
        cls,
        root: str | Path,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> VoiceCloneEncoder:
        """``from_checkpoint(Qwen3TTSCheckpoint.open(root), device, dtype)``.

        Raises:
            Qwen3TTSCheckpointError: a missing or bad file, key or tensor (named).
            VoiceCloneUnsupportedError: not a Base checkpoint.
        """
        return cls.from_checkpoint(Qwen3TTSCheckpoint.open(root), device, dtype)

    def __call__(self, audio: Any, sample_rate: Any, transcript: Any) -> VoiceClonePrompt:
        """``compute_clone_prompt(audio, sample_rate, transcript, self)``."""
        return compute_clone_prompt(audio, sample_rate, transcript, self)


def compute_clone_prompt(
    audio: Any,
    sample_rate: Any,
    transcript: Any,
    encoder: VoiceCloneEncoder,
    min_seconds: float = MIN_CLIP_SECONDS,
    max_seconds: float = MAX_CLIP_SECONDS,
) -> VoiceClonePrompt:
    """Upstream ``create_voice_clone_prompt(ref_audio=(audio, sample_rate), ref_text=transcript)``
    (ICL mode) for one clip.

    Args:
        audio: float mono ``[N]`` (or ``[N, C]``, channels averaged) at ``sample_rate``.
        sample_rate: Hz, any positive int (resampled to each encoder's rate).
        transcript: what the clip says.
        encoder: the loaded encoders (``VoiceCloneEncoder.from_pretrained``).

    Returns:
        The prompt: float32 embedding ``[enc_dim]``, int64 codes ``[ceil(N24 / 1920), 16]``
        (N24: samples at 24 kHz), the transcript.

    Raises:
        InvalidRequestError: a bad clip or transcript (``check_clip``, ``check_transcript``).
    """
    text = check_transcript(transcript)
    clip = check_clip(audio, sample_rate, min_seconds, max_seconds)
    rate = int(sample_rate)
    codes = encoder.speech.encode(resample(clip, rate, encoder.speech.sample_rate))
    embedding = encoder.speaker.embed(resample(clip, rate, encoder.speaker_rate))
    return VoiceClonePrompt(
        speaker_embedding=embedding.cpu().numpy().astype(np.float32),
        ref_codes=codes.numpy().astype(np.int64),
        ref_text=text,
    )


# ----------------------------------------------------------------------------- the component


class VoiceCloneComponent:
    """The Base card's ``encoder`` component: the two clone encoders, built once on the
    device; no loop runs units on it, the card's ``voice_enroller`` calls ``enroll`` (through
    ``omnistep.core.call_component``, so it also runs where the component is a remote actor).

    Attributes:
        encoder: the loaded ``VoiceCloneEncoder``.
    """

    def __init__(self, encoder: VoiceCloneEncoder):
        self.encoder = encoder

    def execute(self, kind: Any, payloads: Any) -> list[Any]:
        """Runs no units (voices are enrolled through ``enroll``).

        Raises:
            ValueError: always.
        """
        raise ValueError("the voice-clone encoder runs no work units; call enroll()")

    def enroll(self, audio: Any, sample_rate: Any, transcript: Any) -> str:
        """``compute_clone_prompt(audio, sample_rate, transcript).to_spec()``: a saved
        voice's text.

        Raises:
            InvalidRequestError: a bad clip or transcript (``check_clip``, ``check_transcript``).
        """
        return compute_clone_prompt(audio, sample_rate, transcript, self.encoder).to_spec()
