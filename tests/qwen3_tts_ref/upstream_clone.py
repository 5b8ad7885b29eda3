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


def generate_clone(
    root: str | Path,
    text: str,
    ref_code: Any,
    ref_spk_embedding: Any,
    ref_text: str,
    language: str = "Auto",
    max_new_tokens: int = 8,
    non_streaming_mode: bool | None = None,
) -> dict[str, Any]:
    """Greedy ``Qwen3TTSModel.generate_voice_clone(text, voice_clone_prompt=[item])`` with the
    ICL ``VoiceClonePromptItem`` of these arrays (``do_sample=False``,
    ``subtalker_dosample=False``); ``non_streaming_mode`` None leaves it out (the public
    call's default, False).

    Returns:
        ``codes``: int64 ``[T, 16]``, the talker's codes (EOS excluded; the reference codes
        upstream prepends for decoding are cut off); ``wav``: float32, upstream's waveform
        with the reference's share cut (``int(ref_len / total_len * len(wav))`` samples);
        ``cut``: that number of samples.
    """
    import numpy as np
    import torch
    from qwen_tts.inference.qwen3_tts_model import VoiceClonePromptItem

    tts = _model(root)
    captured: list[Any] = []
    decode = tts.model.speech_tokenizer.decode

    def _capture(encoded: Any) -> Any:
        captured.extend(item["audio_codes"] for item in encoded)
        wavs, sr = decode(encoded)
        captured.append(wavs[0])
        return wavs, sr

    tts.model.speech_tokenizer.decode = _capture
    ref = torch.as_tensor(np.asarray(ref_code), dtype=torch.long)
    item = VoiceClonePromptItem(
        ref_code=ref,
        ref_spk_embedding=torch.as_tensor(np.asarray(ref_spk_embedding, dtype=np.float32)),
        x_vector_only_mode=False,
        icl_mode=True,
        ref_text=ref_text,
    )
    layout = {} if non_streaming_mode is None else {"non_streaming_mode": non_streaming_mode}
    wavs, _ = tts.generate_voice_clone(
        text=text,
        language=language,
        voice_clone_prompt=[item],
        **layout,
        max_new_tokens=max_new_tokens,
        do_sample=False,
        subtalker_dosample=False,
    )
    all_codes = captured[0].detach().cpu().long().numpy()
    whole = np.asarray(captured[1], dtype=np.float32)
    wav = np.asarray(wavs[0], dtype=np.float32)
    return {
        "codes": all_codes[ref.shape[0] :],
        "wav": wav,
        "cut": int(whole.shape[0] - wav.shape[0]),
    }


def generate_clone_many(requests: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``generate_clone(**request)`` for each request, in one subprocess."""
    return [generate_clone(**request) for request in requests]
