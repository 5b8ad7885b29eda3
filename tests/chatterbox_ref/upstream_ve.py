"""The reference's voice encoder (``chatterbox.models.voice_encoder``, real librosa and scipy
from the overlay) on a random ``ve.safetensors`` it writes. Runs inside the reference
subprocess (``tests.chatterbox_ref.env``)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from tests.chatterbox_ref.env import bare_package


def embed(root: str, wavs: list[np.ndarray], seed: int = 0) -> dict:
    """Write ``ve.safetensors`` (upstream ``VoiceEncoder`` at its published size, random
    weights seeded ``seed``) under ``root``; return, per 16 kHz clip, upstream's speaker
    embedding as ``ChatterboxTTS.prepare_conditionals`` computes it
    (``embeds_from_wavs([wav], sample_rate=16000)`` then the mean over clips), and its mel."""
    from safetensors.torch import save_file

    bare_package("chatterbox.models", "models")
    from chatterbox.models.voice_encoder import VoiceEncoder
    from chatterbox.models.voice_encoder.melspec import melspectrogram

    torch.manual_seed(seed)
    ve = VoiceEncoder().eval()
    Path(root).mkdir(parents=True, exist_ok=True)
    save_file(
        {k: v.contiguous() for k, v in ve.state_dict().items()}, Path(root) / "ve.safetensors"
    )
    embeds = [ve.embeds_from_wavs([w], sample_rate=16000).mean(axis=0) for w in wavs]
    mels = [melspectrogram(w, ve.hp).T.astype(np.float32) for w in wavs]
    return {"embeds": embeds, "mels": mels}
