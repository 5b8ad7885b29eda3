"""Functions that run INSIDE the qwen-tts reference subprocess (``tests.qwen3_tts_ref.env``) for
the Base voice-clone prompt (``omnistep.models.qwen3_tts.clone``).

Call them only through ``call_reference("tests.qwen3_tts_ref.upstream_clone:<name>", ...)``.
They need the real librosa in the overlay (its mel filters and ``resample``), which
``make install-test`` puts there.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def _model(root: str | Path) -> Any:
    import torch
    from qwen_tts import Qwen3TTSModel

    return Qwen3TTSModel.from_pretrained(str(root), dtype=torch.float32)


def clone_prompt(root: str | Path, audio: Any, sample_rate: int, ref_text: str) -> dict[str, Any]:
    """``Qwen3TTSModel.create_voice_clone_prompt(ref_audio=(audio, sample_rate), ref_text)``
    (ICL mode; upstream resamples with ``librosa.resample`` itself).

    Returns:
        ``ref_code`` int64 ``[T, 16]``, ``ref_spk_embedding`` float32 ``[enc_dim]``,
        ``ref_text``, ``icl_mode``.
    """
    import numpy as np

    tts = _model(root)
    (item,) = tts.create_voice_clone_prompt(
        ref_audio=(np.asarray(audio, dtype=np.float32), int(sample_rate)), ref_text=ref_text
    )
    return {
        "ref_code": item.ref_code.detach().cpu().long().numpy(),
        "ref_spk_embedding": item.ref_spk_embedding.detach().cpu().float().numpy(),
        "ref_text": item.ref_text,
        "icl_mode": bool(item.icl_mode),
    }


def speaker_parts(root: str | Path, audio_24k: Any) -> dict[str, Any]:
    """``extract_speaker_embedding(audio_24k, 24000)``, its mel (upstream ``mel_spectrogram``
    with extract_speaker_embedding's arguments, frames first) and librosa's filter bank."""
    import numpy as np
    import torch
    from librosa.filters import mel as librosa_mel
    from qwen_tts.core.models.modeling_qwen3_tts import mel_spectrogram

    tts = _model(root)
    audio = np.asarray(audio_24k, dtype=np.float32)
    mel = mel_spectrogram(
        torch.from_numpy(audio).unsqueeze(0),
        n_fft=1024,
        num_mels=128,
        sampling_rate=24000,
        hop_size=256,
        win_size=1024,
        fmin=0,
        fmax=12000,
    ).transpose(1, 2)
    emb = tts.model.extract_speaker_embedding(audio=audio, sr=24000)
    return {
        "embedding": emb.detach().float().numpy(),
        "mel": mel[0].numpy(),
        "filters": librosa_mel(sr=24000, n_fft=1024, n_mels=128, fmin=0, fmax=12000),
    }


def encode(root: str | Path, audio: Any, sample_rate: int) -> Any:
    """``model.speech_tokenizer.encode(audio, sr=sample_rate)`` of one clip: int64 ``[T, 16]``."""
    import numpy as np

    tts = _model(root)
    enc = tts.model.speech_tokenizer.encode(np.asarray(audio, dtype=np.float32), sr=sample_rate)
    return enc.audio_codes[0].detach().cpu().long().numpy()
