"""Chatterbox voices cloned from a reference clip, and their spec strings.

``ChatterboxTTS.prepare_conditionals`` (``chatterbox-tts`` 0.1.7), step by step:

1. the clip at 24 kHz (``librosa.load(sr=24000)``: soxr ``HQ`` from its own rate, length fixed
   to ``ceil(n * 24000 / rate)``) and at 16 kHz (``librosa.resample`` of that, the same way);
2. S3Gen's half (``S3Token2Mel.embed_ref`` on the first 10 s at 24 kHz): the prompt mel
   (``clip_features.s3gen_mel``), the clip at 16 kHz by torchaudio's sinc resampler
   (``clip_features.resample_sinc``), CAMPPlus's x-vector of its Kaldi fbank and the S3
   tokenizer's tokens of its log mel, cut to ``mel frames // 2`` when longer;
3. T3's half: the S3 tokenizer's tokens of the first 6 s at 16 kHz (step 1's resampling),
   at most 150 (``T3Config.speech_cond_prompt_len``), and the voice encoder's embedding of the
   whole 16 kHz clip; the emotion exaggeration is upstream's default, 0.5 (a request's
   ``exaggeration`` or the card's option wins, as for the default voice).

A cloned voice travels as a spec string (``SPEC_PREFIX`` + base64 of an ``.npz`` of the six
fields), which ``POST /v1/audio/voices`` saves under a name and the inline ``ref_audio``
fields produce per request; ``voice_from_spec`` reads it back.

Imports torch, numpy, soxr, ``omnistep.core`` and this family's modules.
"""

from __future__ import annotations

import base64
import io
import math

import numpy as np
import torch

from omnistep.core import InvalidRequestError
from omnistep.models.chatterbox.campplus import CAMPPlus
from omnistep.models.chatterbox.clip_features import (
    S3_RATE,
    S3GEN_RATE,
    kaldi_fbank,
    resample_sinc,
    s3_log_mel,
    s3gen_mel,
)
from omnistep.models.chatterbox.frontend import DEFAULT_EXAGGERATION, SPEC_PREFIX, Voice
from omnistep.models.chatterbox.s3_tokenizer import S3Tokenizer
from omnistep.models.chatterbox.voice_encoder import VoiceEncoder

MIN_REF_SECONDS, MAX_REF_SECONDS = 0.5, 60.0
"""Clip lengths enrollment accepts (upstream has no bounds; 0.5 s gives CAMPPlus and the
tokenizer a few frames)."""
DEC_COND_SECONDS, ENC_COND_SECONDS = 10, 6
"""Upstream ``DEC_COND_LEN`` (S3Gen's prompt) and ``ENC_COND_LEN`` (T3's prompt tokens)."""
PROMPT_TOKENS = 150
"""Upstream ``T3Config.speech_cond_prompt_len``."""
_FIELDS = ("speaker", "prompt_tokens", "exaggeration", "gen_tokens", "gen_mel", "gen_embedding")


def resample_like_librosa(samples: np.ndarray, rate: int, target: int) -> np.ndarray:
    """``librosa.resample(res_type="soxr_hq")``: soxr ``HQ``, then zero padded or cut to
    ``ceil(n * target / rate)`` samples; float32."""
    if rate == target:
        return samples.astype(np.float32)
    import soxr

    out = soxr.resample(samples, rate, target, quality="HQ").astype(np.float32)
    size = math.ceil(samples.shape[0] * target / rate)
    return np.pad(out, (0, max(0, size - out.shape[0])))[:size]


class VoiceCloner:
    """The card's ``cloner`` component: the clip encoders. No loop runs units on it; the
    card's ``voice_enroller`` calls ``enroll`` (through ``call_component``).

    Args:
        tokenizer: the S3 tokenizer.
        campplus: S3Gen's speaker encoder.
        voice_encoder: T3's speaker encoder.
    """

    def __init__(self, tokenizer: S3Tokenizer, campplus: CAMPPlus, voice_encoder: VoiceEncoder):
        self.tokenizer, self.campplus, self.voice_encoder = tokenizer, campplus, voice_encoder

    def execute(self, kind, payloads) -> list:
        """Runs no units.

        Raises:
            ValueError: always.
        """
        raise ValueError("the Chatterbox cloner runs no work units; call enroll()")

    def enroll(self, audio, sample_rate, transcript: str = "") -> str:
        """The spec of the voice cloned from a mono float clip ``[N]`` at ``sample_rate`` Hz
        (``transcript`` is not used: Chatterbox conditions on the audio only).

        Raises:
            InvalidRequestError: param ``audio``: not 1-D finite samples, shorter than
                ``MIN_REF_SECONDS`` (code ``audio_too_short``), longer than
                ``MAX_REF_SECONDS`` (``audio_too_long``) or silent (``invalid_audio``); a
                sample rate below 1.
        """
        samples, rate = np.asarray(audio, dtype=np.float32), int(sample_rate)
        if rate < 1:
            raise InvalidRequestError(f"bad sample rate {sample_rate}", param="audio")
        if samples.ndim != 1 or not np.isfinite(samples).all():
            raise InvalidRequestError("the reference clip must be finite mono samples", "audio")
        seconds = samples.size / rate
        if seconds < MIN_REF_SECONDS:
            raise InvalidRequestError(
                f"the reference clip lasts {seconds:.2f} s; Chatterbox needs at least "
                f"{MIN_REF_SECONDS} s",
                param="audio",
                code="audio_too_short",
            )
        if seconds > MAX_REF_SECONDS:
            raise InvalidRequestError(
                f"the reference clip lasts {seconds:.1f} s; at most {MAX_REF_SECONDS:.0f} s",
                param="audio",
                code="audio_too_long",
            )
        return voice_to_spec(self.clone(samples, rate))

    def clone(self, samples: np.ndarray, rate: int) -> Voice:
        """The cloned ``Voice`` of a clip (module docstring's steps; no length checks).

        Raises:
            InvalidRequestError: a silent clip (param ``audio``, code ``invalid_audio``).
        """
        wav24 = resample_like_librosa(samples, rate, S3GEN_RATE)
        wav16 = resample_like_librosa(wav24, S3GEN_RATE, S3_RATE)
        if not np.any(wav16):
            raise InvalidRequestError("the reference clip is silent", "audio", "invalid_audio")
        device = self.tokenizer.encoder.conv1.weight.device
        ref24 = torch.from_numpy(wav24[: DEC_COND_SECONDS * S3GEN_RATE]).to(device)
        mel = s3gen_mel(ref24)  # [F, 80]
        ref16 = resample_sinc(ref24, S3GEN_RATE, S3_RATE)
        embedding = self.campplus(kaldi_fbank(ref16))
        gen_tokens = self.tokenizer(s3_log_mel(ref16))
        if mel.shape[0] != 2 * gen_tokens.numel():
            gen_tokens = gen_tokens[: mel.shape[0] // 2]
        head = torch.from_numpy(wav16[: ENC_COND_SECONDS * S3_RATE]).to(device)
        prompt = self.tokenizer(s3_log_mel(head)[:, : 4 * PROMPT_TOKENS])
        try:
            speaker = self.voice_encoder(wav16)
        except ValueError as exc:  # silent after trimming
            raise InvalidRequestError(str(exc), param="audio", code="invalid_audio") from None
        return Voice(
            speaker=speaker.float().cpu(),
            prompt_tokens=tuple(int(t) for t in prompt.tolist()),
            exaggeration=DEFAULT_EXAGGERATION,
            gen_tokens=gen_tokens.long().cpu(),
            gen_mel=mel.float().cpu(),
            gen_embedding=embedding.float().cpu(),
        )


def voice_to_spec(voice: Voice) -> str:
    """A cloned voice's spec string (``SPEC_PREFIX`` + base64 of an ``.npz``)."""
    arrays = {
        "speaker": voice.speaker.numpy().astype(np.float32),
        "prompt_tokens": np.asarray(voice.prompt_tokens, dtype=np.int64),
        "exaggeration": np.asarray([voice.exaggeration], dtype=np.float32),
        "gen_tokens": voice.gen_tokens.numpy().astype(np.int64),
        "gen_mel": voice.gen_mel.numpy().astype(np.float32),
        "gen_embedding": voice.gen_embedding.numpy().astype(np.float32),
    }
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    return SPEC_PREFIX + base64.b64encode(buf.getvalue()).decode("ascii")


def voice_from_spec(spec: str, speaker_dim: int, mel_dim: int = 80) -> Voice:
    """The ``Voice`` of a spec string.

    Raises:
        InvalidRequestError: param ``voice``: not base64 of an ``.npz`` with the six fields,
            or fields of the wrong shape (a speaker embedding not ``[speaker_dim]``, an x-vector
            not 1-D, a prompt mel not ``[2p or 2p + 1, mel_dim]``, token ids outside
            ``[0, 6561)``).
    """

    def bad(why: str) -> InvalidRequestError:
        return InvalidRequestError(f"damaged Chatterbox voice spec ({why})", "voice")

    try:
        raw = base64.b64decode(spec[len(SPEC_PREFIX) :], validate=True)
        with np.load(io.BytesIO(raw), allow_pickle=False) as data:
            arrays = {name: data[name] for name in _FIELDS}
    except (ValueError, OSError, EOFError, KeyError) as exc:
        raise bad(str(exc)[:80]) from None
    tokens, gen_tokens, mel = arrays["prompt_tokens"], arrays["gen_tokens"], arrays["gen_mel"]
    if arrays["speaker"].shape != (speaker_dim,) or arrays["exaggeration"].shape != (1,):
        raise bad("speaker embedding or exaggeration of the wrong shape")
    if arrays["gen_embedding"].ndim != 1 or arrays["gen_embedding"].size == 0:
        raise bad("x-vector of the wrong shape")
    if (
        mel.ndim != 2
        or mel.shape[1] != mel_dim
        or mel.shape[0]
        not in (
            2 * gen_tokens.size,
            2 * gen_tokens.size + 1,
        )
    ):
        raise bad(f"prompt mel {mel.shape} for {gen_tokens.size} prompt tokens")
    for ids in (tokens, gen_tokens):
        if ids.ndim != 1 or ids.size == 0 or ids.min() < 0 or ids.max() >= 6561:
            raise bad("speech token ids outside [0, 6561)")
    return Voice(
        speaker=torch.from_numpy(arrays["speaker"]),
        prompt_tokens=tuple(int(t) for t in tokens.tolist()),
        exaggeration=float(arrays["exaggeration"][0]),
        gen_tokens=torch.from_numpy(gen_tokens),
        gen_mel=torch.from_numpy(mel),
        gen_embedding=torch.from_numpy(arrays["gen_embedding"]),
    )
