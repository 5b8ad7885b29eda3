"""ChatTTS speakers: the official compressed speaker-string format and seeded random speakers.

A speaker is a ``[hidden]`` vector written (L2-normalised) at every ``[spk_emb]`` position of the
code prompt. Its string form, as ChatTTS shares voices, is base16384 text of the raw-LZMA2
(preset 9 | extreme) compression of the vector as little-endian float16. A random speaker is
``randn(hidden) * std + mean`` with ``(std, mean)`` from the model's speaker statistics
(``spk_stat``, ``[2 * hidden]`` = std then mean), drawn here from a ``torch.Generator`` seeded by
the request, never from the global RNG.

Source: ChatTTS 0.2.5 ``ChatTTS/model/speaker.py`` (``Speaker._encode``, ``_decode``,
``_sample_random``, ``apply``). Imports: numpy, torch, pybase16384.
"""

from __future__ import annotations

import lzma

import numpy as np
import torch

from omnistep.core import InvalidRequestError

_LZMA_FILTERS = [{"id": lzma.FILTER_LZMA2, "preset": 9 | lzma.PRESET_EXTREME}]


def encode_speaker(vector: torch.Tensor | np.ndarray) -> str:
    """A ``[hidden]`` speaker vector as the official speaker string (float16, LZMA2, base16384)."""
    import pybase16384 as b14

    arr = np.asarray(torch.as_tensor(vector).detach().cpu(), dtype="<f2").reshape(-1)
    return b14.encode_to_string(
        lzma.compress(arr.tobytes(), format=lzma.FORMAT_RAW, filters=_LZMA_FILTERS)
    )


def decode_speaker(text: str, hidden_size: int) -> torch.Tensor:
    """The float32 ``[hidden_size]`` vector of a speaker string.

    Raises:
        InvalidRequestError: (param ``voice``) the string does not decode to ``hidden_size``
            finite values.
    """
    import pybase16384 as b14

    try:
        raw = lzma.decompress(
            b14.decode_from_string(text), format=lzma.FORMAT_RAW, filters=_LZMA_FILTERS
        )
        vec = np.frombuffer(raw, dtype="<f2").astype(np.float32)
    except (lzma.LZMAError, ValueError, TypeError) as exc:
        raise InvalidRequestError(
            f"voice is not a valid ChatTTS speaker string: {exc}",
            param="voice",
            code="invalid_voice",
        ) from None
    if vec.size != hidden_size or not np.isfinite(vec).all():
        raise InvalidRequestError(
            f"speaker string decodes to {vec.size} values; this model needs {hidden_size}",
            param="voice",
            code="invalid_voice",
        )
    return torch.from_numpy(vec.copy())


def random_speaker(spk_stat: torch.Tensor, seed: int) -> torch.Tensor:
    """A random speaker ``[hidden]`` (float32): ``randn * std + mean`` drawn from ``seed``.

    Args:
        spk_stat: ``[2 * hidden]``, std then mean (float16 or float32).
        seed: the draw's seed; the same seed gives the same speaker.
    """
    std, mean = spk_stat.float().chunk(2)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    return torch.randn(std.shape, generator=gen, dtype=torch.float32) * std + mean


def normalize_speaker(vector: torch.Tensor) -> torch.Tensor:
    """L2-normalise as upstream does before writing it at ``[spk_emb]``: in float16 (the
    speaker format's precision; upstream normalises the decoded fp16 vector), eps 1e-12.
    Returns float32 ``[hidden]``."""
    return torch.nn.functional.normalize(vector.half(), p=2.0, dim=0, eps=1e-12).float()
