"""transformers' Higgs Audio v2 on a folder, run in a subprocess (``call``).

``HiggsAudioV2TokenizerModel``'s module imports torchaudio, which has no build for this torch;
only its encoder's 24 -> 16 kHz resampling uses it, so the subprocess puts a stub module in its
place before importing it (decode never calls it; encode gets omnistep's resampler).
Arguments and results cross by pickle.

Functions (each loads from ``root`` and returns numpy arrays):

- ``logits(root, ids, audio)``: ``HiggsAudioV2ForConditionalGeneration`` forward logits of a
  prompt (``input_ids`` with audio placeholders and ``audio_input_ids``): ``[L, C, V]``.
- ``generate(root, ids, audio, max_new_tokens)``: greedy ``generate`` (its delay-pattern logits
  processor) -> the generated delayed frames ``[T, C]`` and the waveform
  ``HiggsAudioV2Processor.batch_decode`` makes of them with the folder's audio tokenizer.
- ``decode(root, codes)``: ``HiggsAudioV2TokenizerModel.decode`` of codes ``[T, C]``.
- ``encode(root, wave)``: ``HiggsAudioV2TokenizerModel.encode`` of a 24 kHz clip (the stub's
  resampler is omnistep's ``resample_sinc``, see ``_stub_torchaudio``).

``Session`` keeps one subprocess for many calls (``bench/families.py``): ``bench_load`` loads
the model and audio tokenizer once into module globals, ``bench_generate`` times one greedy
``generate`` + ``batch_decode`` with them.
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from tests.ref_overlay import REPO, Overlay, ReferenceRunError, ReferenceSession

__all__ = ["REPO", "VENV", "ReferenceRunError", "Session", "call"]


def _stub_torchaudio() -> None:
    """Stand-in ``torchaudio`` modules; ``functional.resample`` is omnistep's
    ``resample_sinc`` (torchaudio's formula), so ``encode`` compares everything after the
    resampler (HuBERT features, semantic and DAC encoders, RVQ, padding rule)."""
    import importlib.machinery
    import types

    import transformers  # noqa: F401  (its availability checks run before the stub exists)

    from omnistep.models.higgs_audio_v2.encoder import resample_sinc

    for name in ("torchaudio", "torchaudio.functional"):
        module = types.ModuleType(name)
        module.__spec__ = importlib.machinery.ModuleSpec(name, None)
        sys.modules[name] = module
    functional = sys.modules["torchaudio.functional"]
    functional.resample = lambda x, a, b: resample_sinc(x.reshape(-1, x.shape[-1]), a, b).reshape(
        *x.shape[:-1], -1
    )
    sys.modules["torchaudio"].functional = functional


def _lm(root: str):
    from transformers import HiggsAudioV2ForConditionalGeneration

    return HiggsAudioV2ForConditionalGeneration.from_pretrained(root).eval()


def _codec(root: str):
    _stub_torchaudio()
    from transformers.models.higgs_audio_v2_tokenizer.modeling_higgs_audio_v2_tokenizer import (
        HiggsAudioV2TokenizerModel,
    )

    return HiggsAudioV2TokenizerModel.from_pretrained(str(Path(root) / "audio_tokenizer")).eval()


def _inputs(ids: list[int], audio: list[list[int]]) -> dict[str, Any]:
    import torch

    out: dict[str, Any] = {"input_ids": torch.tensor([ids])}
    if audio:
        out["audio_input_ids"] = torch.tensor([audio])
        out["audio_input_ids_mask"] = torch.ones(1, len(audio), dtype=torch.bool)
    return out


def logits(root: str, ids: list[int], audio: list[list[int]]):
    import torch

    model = _lm(root)
    with torch.no_grad():
        out = model(**_inputs(ids, audio)).logits[0]
    c = model.config.num_codebooks
    return out.view(out.shape[0], c, -1).numpy()


def generate(root: str, ids: list[int], audio: list[list[int]], max_new_tokens: int):
    import torch
    from transformers import HiggsAudioV2Processor

    model = _lm(root)
    with torch.no_grad():
        seq = model.generate(**_inputs(ids, audio), do_sample=False, max_new_tokens=max_new_tokens)
    cfg = model.config
    proc = SimpleNamespace(
        audio_stream_bos_id=cfg.audio_stream_bos_id,
        audio_stream_eos_id=cfg.audio_stream_eos_id,
        audio_tokenizer=_codec(root),
    )
    proc.revert_delay_pattern = lambda x: HiggsAudioV2Processor.revert_delay_pattern(proc, x)
    wav = HiggsAudioV2Processor.batch_decode(proc, seq)[0]
    return {"frames": seq[0, len(audio) :].numpy(), "wav": wav.numpy()}


def decode(root: str, codes):
    import torch

    codec = _codec(root)
    with torch.no_grad():
        wav = codec.decode(torch.as_tensor(codes)[None].transpose(1, 2)).audio_values
    return wav[0, 0].numpy()


def encode(root: str, wave):
    """``HiggsAudioV2TokenizerModel.encode`` of a 24 kHz clip ``[N]``: codes ``[T, Q]``."""
    import torch

    codec = _codec(root)
    with torch.no_grad():
        codes = codec.encode(torch.as_tensor(wave)[None, None]).audio_codes
    return codes[0].T.numpy()


_LOADED: dict[str, Any] = {}


def bench_load(root: str, threads: int) -> dict[str, Any]:
    """Load the model and the audio tokenizer of ``root`` once (float32, ``threads`` torch
    intra-op threads) for ``bench_generate``; returns the load seconds and versions."""
    import time

    import torch
    import transformers

    torch.set_num_threads(threads)
    start = time.perf_counter()
    _LOADED["model"] = _lm(root).float()
    _LOADED["codec"] = _codec(root).float()
    return {
        "load_s": round(time.perf_counter() - start, 2),
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "dtype": str(next(_LOADED["model"].parameters()).dtype),
    }


def bench_generate(ids: list[int], audio: list[list[int]], max_new_tokens: int) -> dict[str, Any]:
    """One greedy ``generate`` (``max_new_tokens`` steps at most) and
    ``HiggsAudioV2Processor.batch_decode`` of its frames on the model ``bench_load`` loaded.

    Returns: ``seconds`` (the whole call: transformers returns audio only at its end),
    ``generate_s``, ``decode_s``, ``steps`` (generated delayed steps), ``samples`` (24 kHz
    waveform length) and ``frames`` (the delayed steps ``[T, C]``, int64).
    """
    import time

    import torch
    from transformers import HiggsAudioV2Processor

    model, codec = _LOADED["model"], _LOADED["codec"]
    cfg = model.config
    inputs = _inputs(ids, audio)
    start = time.perf_counter()
    with torch.no_grad():
        seq = model.generate(**inputs, do_sample=False, max_new_tokens=max_new_tokens)
        mid = time.perf_counter()
        proc = SimpleNamespace(
            audio_stream_bos_id=cfg.audio_stream_bos_id,
            audio_stream_eos_id=cfg.audio_stream_eos_id,
            audio_tokenizer=codec,
        )
        proc.revert_delay_pattern = lambda x: HiggsAudioV2Processor.revert_delay_pattern(proc, x)
        wav = HiggsAudioV2Processor.batch_decode(proc, seq)[0]
    end = time.perf_counter()
    frames = seq[0, len(audio) :].numpy()
    return {
        "seconds": end - start,
        "generate_s": mid - start,
        "decode_s": end - mid,
        "steps": int(len(frames)),
        "samples": int(wav.numel()),
        "frames": frames,
    }


VENV = Overlay(folder=None, package=None, env_module="tests.higgs_ref.reference")
"""transformers' Higgs Audio v2 runs on the venv itself, in its own process (no overlay)."""


class Session(ReferenceSession):
    """One long-lived subprocess running this module's functions (``call("bench_load", ...)``;
    ``tests.ref_overlay.ReferenceSession``): what a function keeps in module globals stays
    between calls. Use as a context manager or ``close`` it.
    """

    def __init__(self) -> None:
        super().__init__(VENV, module="tests.higgs_ref.reference")


def call(function: str, **kwargs: Any) -> Any:
    """Run ``function`` of this module with ``kwargs`` in a fresh subprocess.

    Raises:
        ReferenceRunError: the subprocess failed (its stderr tail in the message).
    """
    return VENV.call(f"tests.higgs_ref.reference:{function}", **kwargs)


if __name__ == "__main__":
    VENV.serve_main(sys.argv[1:])
