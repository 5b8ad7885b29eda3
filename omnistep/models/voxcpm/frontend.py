"""The VoxCPM2 card's front end: text ids as upstream's tokenizer wrapper makes them, voices
(the zero-shot default and cloned voices' specs), and the ``frontend`` kernel node that binds
the request's ``VoxCPMPrompt``.

- Text: ``VoxCPMTextTokenizer`` is upstream ``voxcpm/model/utils.py:
  mask_multichar_chinese_tokens``'s behaviour: the folder's Llama tokenizer's ``tokenize``
  (no BOS), every token made only of CJK ideographs (U+4E00..U+9FFF, two or more, the "▁"
  word marker ignored) split into its characters, then ``convert_tokens_to_ids``.
- Voices: ``default`` (and every OpenAI voice name, ``OPENAI_VOICES``): zero-shot, upstream's
  prompt ``text, audio_start``; the timbre then comes from the LocDiT noise, i.e. the
  request's seed. A cloned voice (``VoxCPMEncoder.enroll`` -> a spec string, ``SPEC_PREFIX``)
  holds a reference clip's latent patches: upstream's reference-only mode
  (``reference_wav_path``; ``ref_audio_start, patches, ref_audio_end, text, audio_start``).
  The transcript a clone is enrolled with is not used (the reference-only mode takes none).
  A cloned voice's ``R + 2`` rows are the prompt's ``VoxCPMPrompt.voice_rows``: requests of the
  voice share their KV blocks (``ar.VoxCPMAR._prompt_prefix``).
- Cap: ``max_len = min(int(len(text ids) * 6 + 10), max_patches)`` (upstream ``_generate``
  with ``retry_badcase_ratio_threshold`` 6.0).

Imports: ``omnistep.core``, this family's ``ar``, ``lm``, ``audio_vae``, ``vae_weights``.
"""

from __future__ import annotations

import base64
import dataclasses
import functools
import io
from typing import Any

import numpy as np
import torch

from omnistep.core import OPENAI_VOICES, InvalidRequestError, ProgramContext
from omnistep.models.voxcpm.ar import VoxCPMPrompt
from omnistep.models.voxcpm.audio_vae import AudioVAEEncoder
from omnistep.models.voxcpm.lm import build_prompt, encode_reference
from omnistep.models.voxcpm.vae_weights import VAEWeights

DEFAULT_VOICE = "default"
"""The zero-shot voice (no reference clip)."""
SPEC_PREFIX = "voxcpm-ref:"
"""A cloned voice's spec: this prefix, then base64 of an ``.npy`` of float32 ``[R, P, C]``
reference patches."""
ENCODE_RATE = 16000
"""The AudioVAE encoder's input rate (upstream ``_encode_sample_rate``)."""
MAX_REF_SECONDS = 60.0
"""Longest reference clip accepted (1500 latent frames at 25 Hz)."""
TEXT_RATIO, TEXT_SLACK = 6.0, 10
"""Upstream ``_generate``'s cap: ``int(len(text ids) * 6.0 + 10)`` patches."""


def _cjk(token: str) -> bool:
    return len(token) >= 2 and all("\u4e00" <= c <= "\u9fff" for c in token)


class VoxCPMTextTokenizer:
    """Text -> ids as upstream's ``CharTokenizerWrapper`` (see the module docstring).

    Args:
        tokenizer: the folder's transformers tokenizer (``LlamaTokenizerFast``).
    """

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.multichar = {t for t in tokenizer.get_vocab() if _cjk(t)}

    def __call__(self, text: str) -> list[int]:
        tokens: list[str] = []
        for token in self.tokenizer.tokenize(text):
            clean = token.replace("\u2581", "")
            tokens.extend(list(clean) if clean in self.multichar else [token])
        return [int(i) for i in self.tokenizer.convert_tokens_to_ids(tokens)]


def patches_to_spec(patches: np.ndarray) -> str:
    """A cloned voice's spec from its reference patches ``[R, P, C]`` (float32)."""
    buf = io.BytesIO()
    np.save(buf, np.ascontiguousarray(patches, dtype=np.float32), allow_pickle=False)
    return SPEC_PREFIX + base64.b64encode(buf.getvalue()).decode("ascii")


def spec_to_patches(spec: str, patch_size: int, feat_dim: int) -> torch.Tensor:
    """The reference patches ``[R, P, C]`` float32 of a spec.

    Raises:
        InvalidRequestError: param ``voice``: not a spec, a damaged one, or patches of another
            shape than ``[R, patch_size, feat_dim]`` with ``R >= 1``.
    """
    try:
        raw = base64.b64decode(spec[len(SPEC_PREFIX) :], validate=True)
        array = np.load(io.BytesIO(raw), allow_pickle=False)
    except (ValueError, OSError, EOFError) as exc:
        raise InvalidRequestError(
            f"damaged VoxCPM2 voice spec ({exc})", param="voice", code="invalid_value"
        ) from None
    if array.ndim != 3 or array.shape[1:] != (patch_size, feat_dim) or array.shape[0] < 1:
        raise InvalidRequestError(
            f"this VoxCPM2 voice holds patches of shape {tuple(array.shape)}; this model needs "
            f"[R >= 1, {patch_size}, {feat_dim}]",
            param="voice",
            code="invalid_value",
        )
    return torch.from_numpy(array.astype(np.float32))


class VoxCPMEncoder:
    """The card's ``encoder`` component: the AudioVAE encoder; no loop runs units on it, the
    card's ``voice_enroller`` calls ``enroll`` (through ``call_component``).

    Args:
        encoder: the loaded ``AudioVAEEncoder`` (16 kHz input).
        patch_size: latent frames per patch.
    """

    def __init__(
        self, encoder: AudioVAEEncoder, patch_size: int, normed: frozenset[str] = frozenset()
    ):
        self.encoder, self.patch_size = encoder, patch_size
        self._weights = VAEWeights(encoder, "encoder", normed)

    def weight_specs(self) -> dict[str, tuple[tuple[int, ...], str]]:
        """The encoder's tensors under the published ``audiovae`` file's names
        (``encoder.*``; see ``vae_weights.VAEWeights``): ``name -> (shape, dtype)``."""
        return self._weights.specs()

    def weight_problems(self, tensors: dict[str, object]) -> list[str]:
        """What ``ModelInstance.check_weights`` refuses beyond names, shapes and dtypes: a
        ``weight_v`` with an output channel of norm 0 (``vae_weights.VAEWeights.problems``)."""
        return self._weights.problems(tensors)

    def update_weights(self, tensors: dict[str, object]) -> None:
        """Copy checked tensors into the encoder in place. Voices enrolled before keep their
        latents (a voice is its patches, not the encoder that made them).

        Raises:
            KeyError: a name ``weight_specs`` does not list.
            WeightNormError: a ``weight_v`` with an output channel of norm 0 (nothing changed).
        """
        self._weights.update(tensors)

    def execute(self, kind: Any, payloads: Any) -> list[Any]:
        """Runs no units.

        Raises:
            ValueError: always.
        """
        raise ValueError("the VoxCPM2 encoder runs no work units; call enroll()")

    def enroll(self, audio: Any, sample_rate: Any, transcript: Any = "") -> str:
        """A cloned voice's spec from a clip: mono float samples ``[N]`` at ``sample_rate`` Hz,
        resampled to 16 kHz with soxr (``HQ``, as librosa's default ``soxr_hq`` that
        upstream's ``librosa.load`` uses), right-padded to whole patches and encoded
        (``lm.encode_reference``). ``transcript`` is not used (reference-only mode).

        Raises:
            InvalidRequestError: param ``audio``: not 1-D, empty, not finite, or longer than
                ``MAX_REF_SECONDS``; a sample rate below 1.
        """
        samples = np.asarray(audio, dtype=np.float32)
        rate = int(sample_rate)
        if rate < 1:
            raise InvalidRequestError(f"bad sample rate {sample_rate}", param="audio")
        if samples.ndim != 1 or samples.size == 0 or not np.isfinite(samples).all():
            raise InvalidRequestError(
                "the reference clip must be non-empty finite mono samples", param="audio"
            )
        if samples.size / rate > MAX_REF_SECONDS:
            raise InvalidRequestError(
                f"the reference clip is {samples.size / rate:.1f} s; at most "
                f"{MAX_REF_SECONDS:.0f} s",
                param="audio",
            )
        if rate != ENCODE_RATE:
            import soxr

            samples = soxr.resample(samples, rate, ENCODE_RATE, quality="HQ").astype(np.float32)
        device = next(self.encoder.parameters()).device
        feat = encode_reference(self.encoder, torch.from_numpy(samples).to(device), self.patch_size)
        return patches_to_spec(feat.float().cpu().numpy())


class VoxCPMFrontend:
    """The ``frontend`` kernel node: binds ``voice`` (the request's ``VoxCPMPrompt``).

    Args:
        tokenizer: a ``VoxCPMTextTokenizer``.
        patch_size, feat_dim: the folder's ``patch_size`` and ``feat_dim``.
        cfg_value, timesteps: the LocDiT guidance scale and Euler steps of every request.
        max_patches: the card's cap on patches (upstream ``max_len``).
    """

    def __init__(
        self,
        tokenizer: VoxCPMTextTokenizer,
        patch_size: int,
        feat_dim: int,
        cfg_value: float,
        timesteps: int,
        max_patches: int,
    ):
        self.tokenizer = tokenizer
        self.patch_size, self.feat_dim = patch_size, feat_dim
        self.cfg_value, self.timesteps, self.max_patches = cfg_value, timesteps, max_patches
        self._clone = functools.lru_cache(maxsize=64)(self._parse)

    def _parse(self, spec: str) -> torch.Tensor:
        return spec_to_patches(spec, self.patch_size, self.feat_dim)

    def reference(self, voice: str | None) -> torch.Tensor | None:
        """The reference patches of ``voice`` (None for the zero-shot voice).

        Raises:
            InvalidRequestError: param ``voice``: neither ``default``, an OpenAI voice name
                nor a cloned voice's spec (code ``unknown_voice``), or a damaged spec.
        """
        if voice is None or voice == DEFAULT_VOICE or voice in OPENAI_VOICES:
            return None
        if not voice.startswith(SPEC_PREFIX):
            raise InvalidRequestError(
                f"unknown voice '{voice[:64]}': VoxCPM2 speaks in the zero-shot voice "
                f"('{DEFAULT_VOICE}' or an OpenAI voice name) or a cloned voice (POST "
                "/v1/audio/voices, or 'ref_audio' with the request)",
                param="voice",
                code="unknown_voice",
            )
        return self._clone(voice)

    def check_voice(self, voice: str) -> None:
        """The card's ``voice_validator`` (see ``reference``)."""
        self.reference(voice)

    def prompt(self, text: str, voice: str | None) -> VoxCPMPrompt:
        """The request's prompt (see the module docstring).

        Raises:
            InvalidRequestError: param ``input``: text with no tokens; param ``voice``: see
                ``reference``.
        """
        ids = self.tokenizer(text)
        if not ids:
            raise InvalidRequestError(
                "the input text has no tokens", param="input", code="invalid_value"
            )
        ref = self.reference(voice)
        rows = build_prompt(ids, self.patch_size, self.feat_dim, ref)
        cap = min(int(len(ids) * TEXT_RATIO + TEXT_SLACK), self.max_patches)
        voice_rows = 0 if ref is None else ref.shape[0] + 2  # ref_audio_start, patches, end
        return VoxCPMPrompt(
            rows, self.cfg_value, self.timesteps, max_len=cap, voice_rows=voice_rows
        )

    def __call__(self, ctx: ProgramContext) -> None:
        req = ctx.request
        prompt = self.prompt(req.text, req.voice)
        level = float(req.sampling.or_default("flow_noise_level", 0.0))
        ctx.slots["voice"] = dataclasses.replace(prompt, noise_level=level)
