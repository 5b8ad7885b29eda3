"""ChatTTS speakers: the official compressed speaker-string format and seeded random speakers.

A speaker is a ``[hidden]`` vector written (L2-normalised) at every ``[spk_emb]`` position of the
code prompt. Its string form, as ChatTTS shares voices, is base16384 text of the raw-LZMA2
(preset 9 | extreme) compression of the vector as little-endian float16. A random speaker is
``randn(hidden) * std + mean``, all in float16, with ``(std, mean)`` from the model's speaker
statistics (``spk_stat``, ``[2 * hidden]`` = std then mean), drawn here from a CPU
``torch.Generator`` seeded by the request, never from the global RNG: seed N gives the speaker
upstream's ``torch.manual_seed(N); Chat.sample_random_speaker()`` gives on CPU.

Statistics: chattts 0.2.x keeps them in its package config (``Config.spk_stat``, base16384 of
float16 ``[std(768), mean(768)]``), not in the published checkpoint folder. omnistep ships that
string verbatim as ``spk_stat.txt`` beside this module (model data under the ChatTTS model's
licence, CC BY-NC 4.0; see its header); a folder's own ``asset/spk_stat.pt`` (older layout, or a
user's override) takes precedence (:func:`speaker_statistics`).

Source: ChatTTS 0.2.5 ``ChatTTS/model/speaker.py`` (``Speaker.__init__``, ``_encode``,
``_decode``, ``_sample_random``, ``apply``). Imports: numpy, torch, pybase16384.
"""

from __future__ import annotations

import functools
import importlib.resources
import lzma

import numpy as np
import torch

from omnistep.core import InvalidRequestError

_LZMA_FILTERS = [{"id": lzma.FILTER_LZMA2, "preset": 9 | lzma.PRESET_EXTREME}]

SHIPPED_STATS_FILE = "spk_stat.txt"
SHIPPED_STATS_HIDDEN = 768
"""The hidden size the shipped statistics are for (the official ChatTTS GPT's)."""


def decode_spk_stat(text: str) -> torch.Tensor:
    """Speaker statistics from their base16384 string (upstream ``Speaker.__init__``): float16
    ``[2 * hidden]``, std then mean.

    Raises:
        ValueError: not base16384 text of an even number of float16 values.
    """
    import pybase16384 as b14

    raw = b14.decode_from_string(text)
    if not raw or len(raw) % 4:
        raise ValueError(f"speaker statistics: {len(raw)} bytes is not 2 * hidden float16 values")
    return torch.from_numpy(np.frombuffer(raw, dtype=np.float16).copy())


@functools.cache
def _shipped_spk_stat() -> torch.Tensor:
    text = importlib.resources.files(__package__).joinpath(SHIPPED_STATS_FILE).read_text("utf-8")
    body = "".join(line.strip() for line in text.splitlines() if not line.startswith("#"))
    stat = decode_spk_stat(body)
    assert stat.numel() == 2 * SHIPPED_STATS_HIDDEN, stat.shape
    return stat


def shipped_spk_stat() -> torch.Tensor:
    """chattts 0.2.5's speaker statistics (``Config.spk_stat``), shipped as ``spk_stat.txt``:
    float16 ``[1536]`` = std ``[768]`` then mean ``[768]`` (a new tensor each call)."""
    return _shipped_spk_stat().clone()


def speaker_statistics(folder_stat: torch.Tensor | None, hidden: int) -> torch.Tensor | None:
    """The statistics random speakers of a checkpoint with GPT width ``hidden`` are drawn from:
    the folder's own (``asset/spk_stat.pt``) when it has them, else the shipped ones when
    ``hidden`` is theirs (768), else None (no random speakers).

    Returns float16 ``[2 * hidden]`` (std then mean) or None.

    Raises:
        ValueError: ``folder_stat`` does not hold ``2 * hidden`` values.
    """
    if folder_stat is not None:
        if folder_stat.numel() != 2 * hidden:
            raise ValueError(
                f"asset/spk_stat.pt holds {folder_stat.numel()} values; this checkpoint's hidden "
                f"size {hidden} needs {2 * hidden} (std then mean)"
            )
        return folder_stat.reshape(-1).to(torch.float16)
    if hidden == SHIPPED_STATS_HIDDEN:
        return shipped_spk_stat()
    return None


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
    """A random speaker ``[hidden]``: upstream ``Speaker._sample_random`` with the CPU generator
    seeded ``seed``: ``randn(hidden, float16).mul_(std).add_(mean)`` in float16, so seed N equals
    ``torch.manual_seed(N); Chat.sample_random_speaker()`` (on CPU) once decoded.

    Args:
        spk_stat: ``[2 * hidden]``, std then mean (used as float16, as upstream).
        seed: the draw's seed; the same seed gives the same speaker.

    Returns:
        float32 ``[hidden]`` holding float16 values.

    Raises:
        ValueError: ``seed`` is out of the generator's range (from torch).
    """
    std, mean = spk_stat.to(torch.float16).reshape(-1).chunk(2)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    spk = torch.randn(std.shape, generator=gen, dtype=torch.float16)
    return spk.mul_(std).add_(mean).float()


def normalize_speaker(vector: torch.Tensor) -> torch.Tensor:
    """L2-normalise as upstream does before writing it at ``[spk_emb]``: in float16 (the
    speaker format's precision; upstream normalises the decoded fp16 vector), eps 1e-12.
    Returns float32 ``[hidden]``."""
    return torch.nn.functional.normalize(vector.half(), p=2.0, dim=0, eps=1e-12).float()
