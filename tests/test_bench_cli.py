"""``omnistep bench``: the player simulation and statistics by hand, then against the toy server."""

import json

import httpx
import numpy as np
import pytest

from omnistep.bench.client import (
    RequestResult,
    parse_levels,
    percentile,
    quantiles,
    run_bench,
    simulate_playback,
    summarize_level,
)
from omnistep.bench.report import format_table
from omnistep.cli import main
from omnistep.server.launcher import free_port
from tests.serving import running_server


# --------------------------------------------------------------------------- player simulation
def test_one_underrun_when_the_third_chunk_is_late():
    # 0.5 s chunks at t=0, 0.2, 1.5: the buffer holds audio until 1.0, the third comes at 1.5.
    playback = simulate_playback([0.0, 0.2, 1.5], [0.5, 0.5, 0.5])
    assert playback.underruns == pytest.approx((0.5,))
    assert playback.count == 1 and playback.total_s == pytest.approx(0.5)
    assert playback.played_until_s == pytest.approx(2.0)


def test_chunks_in_time_never_underrun():
    # arrivals before (and exactly at) the moment the buffer empties: 0.3 < 1.0, 1.0 == 1.0
    playback = simulate_playback([0.0, 0.3, 1.0, 1.2], [1.0, 0.0, 0.5, 0.25])
    assert playback.underruns == () and playback.total_s == 0
    assert playback.played_until_s == pytest.approx(1.75)


def test_playback_resumes_at_the_late_chunk_and_counts_each_stall():
    # starts at 2.0 (first arrival) -> empty at 2.25; stall 0.75 until 3.0 -> empty at 3.5;
    # 3.4 arrives in time -> empty at 4.5; stall 1.0 until 5.5 -> empty at 5.6.
    playback = simulate_playback([2.0, 3.0, 3.4, 5.5], [0.25, 0.5, 1.0, 0.1])
    assert playback.underruns == pytest.approx((0.75, 1.0))
    assert playback.total_s == pytest.approx(1.75)
    assert playback.played_until_s == pytest.approx(5.6)


def test_empty_chunks_do_not_start_or_resume_playback():
    # the 0-duration chunk at 0.0 starts nothing; the one at 2.0 (after the buffer ran dry at
    # 1.5) does not end the stall: the 3.0 chunk does, so one underrun of 1.5 s.
    playback = simulate_playback([0.0, 1.0, 2.0, 3.0], [0.0, 0.5, 0.0, 0.5])
    assert playback.underruns == pytest.approx((1.5,))
    assert simulate_playback([], []).underruns == ()
    assert simulate_playback([0.4], [0.0]).played_until_s == 0.0


def test_simulation_rejects_bad_timelines():
    with pytest.raises(ValueError, match="durations"):
        simulate_playback([0.0, 1.0], [0.5])
    with pytest.raises(ValueError, match=">= 0"):
        simulate_playback([0.0], [-0.1])
    with pytest.raises(ValueError, match="decrease"):
        simulate_playback([1.0, 0.5], [0.1, 0.1])


# --------------------------------------------------------------------------- statistics
def test_percentiles_interpolate_linearly():
    values = [4.0, 1.0, 3.0, 2.0]  # sorted 1, 2, 3, 4: rank q/100 * 3
    assert percentile(values, 50) == pytest.approx(2.5)
    assert percentile(values, 90) == pytest.approx(3.7)
    assert percentile(values, 99) == pytest.approx(3.97)
    assert percentile(values, 0) == 1.0 and percentile(values, 100) == 4.0
    assert percentile([7.0], 99) == 7.0
    assert percentile([], 50) is None
    assert quantiles(list(range(101))) == {"p50": 50.0, "p90": 90.0, "p99": 99.0}
    assert quantiles([]) == {"p50": None, "p90": None, "p99": None}


def test_level_summary_counts_errors_and_uses_only_good_requests():
    def good(k, ttfa, e2e, audio, underruns):
        return RequestResult(
            k,
            0,
            None,
            ok=True,
            status=200,
            ttfa_s=ttfa,
            e2e_s=e2e,
            samples=int(audio * 24000),
            audio_s=audio,
            rtf=e2e / audio,
            gaps_s=[0.1, 0.3],
            underruns_s=underruns,
        )

    results = [
        good(0, 0.1, 1.0, 2.0, []),
        good(1, 0.3, 3.0, 1.5, [0.2, 0.4]),
        RequestResult(2, 0, None, status=404, error="HTTP 404: no model", e2e_s=0.01),
        RequestResult(3, 0, None, status=404, error="HTTP 404: no model", e2e_s=0.01),
        RequestResult(4, 0, None, error="ConnectError: refused", e2e_s=0.01),
    ]
    level = summarize_level(2, results, wall_s=3.5)
    assert level["requests"] == 5 and level["ok"] == 2 and level["errors"] == 3
    assert level["error_messages"] == {"HTTP 404: no model": 2, "ConnectError: refused": 1}
    assert level["audio_s"] == pytest.approx(3.5)
    assert level["audio_s_per_s"] == pytest.approx(1.0)
    assert level["ttfa_s"]["p50"] == pytest.approx(0.2)
    assert level["e2e_s"]["p90"] == pytest.approx(2.8)
    assert level["rtf"]["p50"] == pytest.approx((0.5 + 2.0) / 2)
    assert level["underruns"] == 2 and level["underrun_s"] == pytest.approx(0.6)
    assert level["gap_s"]["max"] == pytest.approx(0.3)
    assert [r["underruns"] for r in level["results"]] == [0, 2, 0, 0, 0]
    json.dumps(level, allow_nan=False)
    empty = summarize_level(1, results[2:], wall_s=0.1)
    assert empty["ttfa_s"]["p50"] is None and empty["audio_s_per_s"] == 0
    assert "2 x HTTP 404: no model" in format_table({"levels": [level]})


def test_parse_levels():
    assert parse_levels("8,1,4,4") == [1, 4, 8]
    for bad in ("", "0,1", "a,2", "-1"):
        with pytest.raises(ValueError):
            parse_levels(bad)


# --------------------------------------------------------------------------- against the server
TEXTS = ["hello there, general.", "a second, somewhat longer text for the toy card."]


@pytest.fixture(scope="module")
def base():
    with running_server("--model", "toy") as url:
        yield url


def test_bench_against_the_toy_server(base):
    lines = []
    result = run_bench(base, "toy", [1, 2], 3, texts=TEXTS, seed=5, warmup=1, progress=lines.append)
    json.loads(json.dumps(result, allow_nan=False))
    assert result["concurrency"] == [1, 2] and result["sample_rate"] == 24000
    assert result["warmup"][0]["ok"]
    assert [lv["concurrency"] for lv in result["levels"]] == [1, 2]
    assert len(lines) == 1 + 2 * 3  # warm-up, then one line per request
    for level in result["levels"]:
        assert level["requests"] == level["ok"] == 3, level["error_messages"]
        assert level["errors"] == 0 and level["error_messages"] == {}
        for key in ("ttfa_s", "e2e_s", "rtf"):
            assert set(level[key]) == {"p50", "p90", "p99"}
            assert 0 < level[key]["p50"] <= level[key]["p90"] <= level[key]["p99"]
        assert level["audio_s_per_s"] > 0 and level["wall_s"] > 0
        assert level["underruns"] >= 0 and level["underrun_s"] >= 0
        for r in level["results"]:
            assert r["ok"] and r["status"] == 200 and r["error"] is None
            assert 0 < r["ttfa_s"] <= r["e2e_s"]
            assert r["chunks"] >= 1 and len(r["gaps_s"]) == r["chunks"] - 1
            assert r["seed"] == 5 + r["index"] and r["text_index"] == r["index"] % 2
            assert r["rtf"] == pytest.approx(r["e2e_s"] / r["audio_s"])
    # the audio seconds are the decoded PCM length of the same request, sent non-streamed
    for r in result["levels"][1]["results"][:2]:
        body = {
            "model": "toy",
            "input": TEXTS[r["text_index"]],
            "response_format": "pcm",
            "seed": r["seed"],
            "stream": False,
        }
        pcm = np.frombuffer(httpx.post(base + "/v1/audio/speech", json=body).content, "<i2")
        assert pcm.size == r["samples"] > 0
        assert r["audio_s"] == pcm.size / 24000
    assert format_table(result).count("\n") >= 3


def test_unknown_model_and_dead_server_are_counted_not_raised(base):
    result = run_bench(base, "no-such-model", [1, 2], 2, texts=TEXTS, warmup=0)
    for level in result["levels"]:
        assert level["ok"] == 0 and level["errors"] == 2
        ((message, count),) = level["error_messages"].items()
        assert message.startswith("HTTP 404:") and "no-such-model" in message and count == 2
        assert level["ttfa_s"]["p50"] is None and level["audio_s"] == 0
    dead = f"http://127.0.0.1:{free_port()}"
    result = run_bench(dead, "toy", [2], 3, texts=TEXTS, warmup=0)  # a failed warm-up stops it
    assert result["warmup"] == []
    level = result["levels"][0]
    assert level["errors"] == 3 and level["ok"] == 0
    assert all(m.startswith("ConnectError") for m in level["error_messages"])


def test_cli_writes_json_and_plot(base, tmp_path, capsys):
    out = tmp_path / "r.json"
    texts = tmp_path / "texts.txt"
    texts.write_text("first line of text.\n\n  second line.  \n")
    argv = ["bench", "--url", base, "--model", "toy", "--concurrency", "2,1", "--requests", "2"]
    argv += ["--text-file", str(texts), "--seed", "1", "--warmup", "0", "--out", str(out)]
    assert main(argv) == 0
    result = json.loads(out.read_text())
    assert result["texts"] == ["first line of text.", "second line."]
    assert [lv["concurrency"] for lv in result["levels"]] == [1, 2]
    captured = capsys.readouterr()
    assert "audio-s/s" in captured.out and "[C=2] 2/2" in captured.err
    png = out.with_suffix(".png")
    try:
        import matplotlib  # noqa: F401
    except ImportError:  # the plot is skipped with a note, the run still succeeds
        assert "matplotlib is not installed" in captured.err and not png.exists()
    else:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    dead = f"http://127.0.0.1:{free_port()}"
    assert main(["bench", "--url", dead, "--requests", "1", "--out", str(out)]) == 1
    assert main(["bench", "--url", "localhost:8000"]) == 2
    assert main(["bench", "--url", base, "--concurrency", "0,2"]) == 2
