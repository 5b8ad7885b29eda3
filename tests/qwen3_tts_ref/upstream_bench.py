"""Timed ``qwen-tts`` synthesis for ``bench/qwen3_tts.py``; runs INSIDE a ``ReferenceSession``
(``tests.qwen3_tts_ref.env``), which keeps this module's loaded model between calls.

- ``load(root, threads)``: ``Qwen3TTSModel.from_pretrained(root, dtype=float32)`` once, with
  ``torch.set_num_threads(threads)``; wraps three upstream callables (instance attributes) to
  time them: ``model.talker.generate`` (the talker's whole HF ``generate``, code predictor
  included), ``model.talker.code_predictor.generate`` (called once per frame inside the talker's
  ``forward``) and ``model.speech_tokenizer.decode`` (the whole utterance's waveform, after the
  talker ends).
- ``synthesize(text, ...)``: one ``generate_custom_voice`` call, timed here (``perf_counter``
  and ``process_time`` of this process), with the codes it decoded and the phase seconds.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

_STATE: dict[str, Any] = {}


def load(root: str | Path, threads: int) -> dict[str, Any]:
    """Load the folder ``root`` with upstream ``Qwen3TTSModel.from_pretrained`` (float32).

    Returns:
        ``load_s`` (seconds), ``torch_threads``, ``qwen_tts`` / ``transformers`` versions,
        ``speakers`` (upstream's supported list).
    """
    import importlib.metadata

    import torch
    import transformers
    from qwen_tts import Qwen3TTSModel

    torch.set_num_threads(threads)
    start = time.perf_counter()
    tts = Qwen3TTSModel.from_pretrained(str(root), dtype=torch.float32)
    load_s = time.perf_counter() - start
    phases: dict[str, float] = {}
    codes: list[Any] = []

    def timed(name: str, fn: Any, capture: bool = False) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if capture:
                codes.extend(item["audio_codes"] for item in args[0])
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                phases[name] = phases.get(name, 0.0) + time.perf_counter() - t0

        return wrapper

    talker = tts.model.talker
    talker.generate = timed("talker_generate", talker.generate)
    talker.code_predictor.generate = timed("code_predictor", talker.code_predictor.generate)
    st = tts.model.speech_tokenizer
    st.decode = timed("codec", st.decode, capture=True)
    _STATE.update(tts=tts, phases=phases, codes=codes)
    try:
        version = importlib.metadata.version("qwen-tts")
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    return {
        "load_s": load_s,
        "torch_threads": torch.get_num_threads(),
        "qwen_tts": version,
        "transformers": transformers.__version__,
        "speakers": tts.get_supported_speakers(),
    }


def synthesize(
    text: str,
    speaker: str,
    language: str,
    max_new_tokens: int,
    greedy: bool = True,
    seed: int = 0,
    non_streaming_mode: bool = False,
) -> dict[str, Any]:
    """One timed ``generate_custom_voice(text, speaker, language, non_streaming_mode, ...)``.

    ``greedy`` passes ``do_sample=False, subtalker_dosample=False`` (else the checkpoint's
    sampling defaults, after ``torch.manual_seed(seed)``).

    Returns:
        ``seconds`` / ``cpu_s``: wall and process CPU seconds of the call; ``frames``: code
        frames decoded; ``samples``: waveform length (24 kHz); ``codes``: int64 ``[frames, 16]``
        (numpy); ``phases_s``: ``talker_generate``, ``code_predictor``, ``codec`` seconds and
        ``talker_forward`` = talker_generate - code_predictor.
    """
    import numpy as np
    import torch

    tts, phases, codes = _STATE["tts"], _STATE["phases"], _STATE["codes"]
    phases.clear()
    codes.clear()
    kwargs: dict[str, Any] = {"max_new_tokens": max_new_tokens}
    if greedy:
        kwargs.update(do_sample=False, subtalker_dosample=False)
    torch.manual_seed(seed)
    cpu0, t0 = time.process_time(), time.perf_counter()
    wavs, sample_rate = tts.generate_custom_voice(
        text=text,
        speaker=speaker,
        language=language,
        non_streaming_mode=non_streaming_mode,
        **kwargs,
    )
    seconds = time.perf_counter() - t0
    cpu_s = time.process_time() - cpu0
    out = {k: float(v) for k, v in phases.items()}
    out["talker_forward"] = out.get("talker_generate", 0.0) - out.get("code_predictor", 0.0)
    frame_codes = codes[0].detach().cpu().long().numpy() if codes else np.zeros((0, 16))
    return {
        "seconds": seconds,
        "cpu_s": cpu_s,
        "frames": int(frame_codes.shape[0]),
        "samples": int(np.asarray(wavs[0]).size),
        "sample_rate": int(sample_rate),
        "codes": frame_codes,
        "phases_s": out,
    }
