"""``bench/speech.py``: its command line and its summary maths, on hand-made numbers.

Nothing is timed and no server or model runs: the bursts are built with the ``omnistep bench``
client's own ``summarize_level`` from hand-made requests, the own runtime is a fake that yields
fixed arrays.
"""

import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import pytest

from omnistep.bench.client import RequestResult, summarize_level

PATH = Path(__file__).resolve().parents[1] / "bench" / "speech.py"
_spec = importlib.util.spec_from_file_location("bench_speech", PATH)
speech = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = speech  # its dataclasses look their module up
_spec.loader.exec_module(speech)


# --------------------------------------------------------------------------- command line
def test_defaults_cover_the_three_voices_and_the_target_levels():
    args = speech.parse_args([])
    assert args.voices == ["hibari", "kokoro", "piper"]
    assert args.concurrency == [1, 8, 16]
    assert (args.rounds, args.baseline_reps, args.url, args.no_wer) == (3, 2, None, False)
    assert args.kokoro == speech.DEFAULT_KOKORO
    args = speech.parse_args(["--voices", "piper, hibari", "--concurrency", "2,1", "--no-wer"])
    assert args.voices == ["piper", "hibari"] and args.concurrency == [1, 2] and args.no_wer


@pytest.mark.parametrize(
    "argv",
    [
        ["--voices", "piper,espeak"],
        ["--voices", "piper,piper"],
        ["--voices", ","],
        ["--concurrency", "0,8"],
        ["--rounds", "0"],
        ["--baseline-reps", "0"],
        ["--url", "http://127.0.0.1:8000"],  # three voices, one server
    ],
)
def test_bad_arguments_exit_2(argv):
    with pytest.raises(SystemExit) as exc:
        speech.parse_args(argv)
    assert exc.value.code == 2


def test_url_with_one_voice():
    args = speech.parse_args(["--url", "http://127.0.0.1:8000", "--voices", "kokoro"])
    assert args.url == "http://127.0.0.1:8000" and args.voices == ["kokoro"]


def test_target_levels():
    assert speech.target_levels([1, 8, 16]) == {"ttfa": 1, "throughput": 8, "underruns": [8, 16]}
    assert speech.target_levels([1, 2]) == {"ttfa": 1, "throughput": 2, "underruns": [2]}
    assert speech.target_levels([4, 16]) == {"ttfa": 4, "throughput": 16, "underruns": [16]}


def test_first_sentence():
    assert speech.first_sentence(speech.PARAGRAPH).startswith("The old lighthouse keeper")
    assert speech.first_sentence(speech.PARAGRAPH).endswith("the rocks below.")
    assert speech.first_sentence("Is it? Yes.") == "Is it?"
    assert speech.first_sentence(speech.SENTENCE) == speech.SENTENCE


# --------------------------------------------------------------------------- summary maths
def request(k: int, ttfa: float, audio: float, underruns: list[float]) -> RequestResult:
    return RequestResult(
        k, 0, k, ok=True, status=200, ttfa_s=ttfa, e2e_s=ttfa + 1.0, samples=int(audio * 24000),
        audio_s=audio, rtf=(ttfa + 1.0) / audio, underruns_s=underruns,
    )  # fmt: skip


def burst(ttfas: list[float], audio: float, wall: float, underruns=()) -> dict:
    """A burst as ``run_burst`` returns it: the client's level summary plus server CPU."""
    reqs = [request(k, t, audio, list(underruns) if k == 0 else []) for k, t in enumerate(ttfas)]
    level = summarize_level(len(ttfas), reqs, wall_s=wall)
    level["server_cpu_s_per_audio_s"] = 0.5
    return level


def own(first: float, rate: float) -> dict:
    """One own-runtime repetition as ``baseline_run`` returns it (10 s of audio)."""
    return {
        "first_sentence_s": first,
        "first_chunk_s": first,
        "total_s": 10 / rate,
        "audio_s": 10.0,
        "audio_s_per_s": rate,
        "cpu_s_per_audio_s": 0.1,
        "chunks": 3,
    }


def test_pool_bursts_pools_requests_and_takes_the_median_burst_rate():
    bursts = [burst([0.1, 0.3], 10.0, 4.0), burst([0.2, 0.6], 10.0, 5.0, [0.25, 0.5])]
    row = speech.summarize_level(2, bursts)
    assert row["requests"] == 4 and row["errors"] == 0 and row["bursts"] == 2
    assert row["ttfa_p50_s"] == pytest.approx(0.25)  # 0.1 0.2 0.3 0.6
    assert row["ttfa_max_s"] == pytest.approx(0.6)
    assert row["underruns"] == 2 and row["underrun_s"] == pytest.approx(0.75)
    assert row["audio_s_per_s"] == pytest.approx((20 / 4 + 20 / 5) / 2)
    assert row["audio_s_per_s_pooled"] == pytest.approx(40 / 9)
    assert row["audio_s_per_request"] == pytest.approx(10.0)
    assert row["cpu_s_per_audio_s"] == pytest.approx(0.5)
    json.dumps(row, allow_nan=False)


def test_voice_targets_ratios_and_paired_rounds():
    rounds = {
        1: [burst([0.10], 5.0, 1.0), burst([0.30], 5.0, 1.0)],
        8: [burst([0.5] * 8, 5.0, 4.0), burst([0.5] * 8, 5.0, 8.0, [0.2])],
        16: [burst([0.9] * 16, 5.0, 8.0), None],  # one burst only at C=16
    }
    levels = {c: speech.summarize_level(c, [b for b in rs if b]) for c, rs in rounds.items()}
    blocks = [[own(0.2, 8.0)], [own(0.2, 12.0)], [own(0.4, 8.0)]]
    rows = speech.voice_targets("hibari", levels, rounds, speech.summarize_baseline(blocks),
                                blocks, {"omnistep": 0.05})  # fmt: skip
    names = [r["name"] for r in rows]
    assert names == [
        "hibari: TTFA p50 (C=1) / own first sentence",
        "hibari: audio-s/s (C=8) / own sequential audio-s/s",
        "hibari: underruns (C=8, EDF)",
        "hibari: underruns (C=16, EDF)",
        "hibari: WER of omnistep's audio",
    ]
    ttfa, rate, under8, under16, wer = rows
    # TTFA p50 of the pooled C=1 requests (0.1, 0.3) over the median own first sentence (0.2)
    assert ttfa["value"] == pytest.approx(0.2 / 0.2) and ttfa["met"]
    # paired: round 0 against blocks 0 and 1 (0.2, 0.2), round 1 against 1 and 2 (0.2, 0.4)
    assert ttfa["paired"] == pytest.approx([0.1 / 0.2, 0.3 / 0.3])
    # the median burst rate (40/4 = 10, 40/8 = 5) over the median own rate (8)
    assert rate["value"] == pytest.approx(7.5 / 8) and not rate["met"]
    assert rate["paired"] == pytest.approx([10 / 10, 5 / 10])
    assert (under8["value"], under8["met"], under8["paired"]) == (1.0, False, [0.0, 1.0])
    assert (under16["value"], under16["met"], under16["paired"]) == (0.0, True, [0.0])
    assert (wer["value"], wer["op"], wer["target"], wer["met"]) == (0.05, "<=", 0.1, True)
    json.dumps(rows, allow_nan=False)


def test_target_row():
    row = speech.target_row("x", 1.23456, ">=", 1.0, [1.5, None])
    assert row == {"name": "x", "value": 1.2346, "op": ">=", "target": 1.0, "met": True,
                   "paired": [1.5, None]}  # fmt: skip
    assert not speech.target_row("x", 1.2, "<=", 1.1, [])["met"]
    assert speech.target_row("x", 0.0, "<=", 0, [])["met"]
    for missing in (None, float("nan")):
        row = speech.target_row("x", missing, "<=", 1.0, [])
        assert row["value"] is None and not row["met"]


# --------------------------------------------------------------------------- own runtime
def test_baseline_run_counts_audio_and_times_the_first_sentence_apart():
    calls = []

    def chunks(text):
        calls.append(text)
        for n in (2400, 4800, 2400):  # 0.1 + 0.2 + 0.1 s at 24 kHz
            yield np.zeros(n, np.float32)

    runtime = speech.Runtime("fake", 24000, chunks)
    run = speech.baseline_run(runtime, speech.PARAGRAPH)
    assert calls == [speech.PARAGRAPH]
    assert run["audio_s"] == pytest.approx(0.4) and run["chunks"] == 3
    assert run["first_sentence_s"] == run["first_chunk_s"] <= run["total_s"]
    assert run["audio_s_per_s"] == pytest.approx(0.4 / run["total_s"])
    calls.clear()
    runtime = speech.Runtime("fake", 24000, chunks, first_sentence_alone=True)
    run = speech.baseline_run(runtime, speech.PARAGRAPH)
    assert calls == [speech.PARAGRAPH, speech.first_sentence(speech.PARAGRAPH)]
    calls.clear()
    speech.baseline_run(runtime, speech.SENTENCE)  # one sentence: its first chunk is the time
    assert calls == [speech.SENTENCE]
    summary = speech.summarize_baseline([[run], [run, run]])
    assert summary["repetitions"] == 3 and summary["audio_s"] == pytest.approx(0.4)
