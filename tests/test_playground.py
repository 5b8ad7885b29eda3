"""The playground page at ``GET /`` in a real browser (Debian's chromium, driven by playwright).

Chromium is not downloaded by playwright: ``.ci/run`` installs Debian's package, so a missing
``/usr/bin/chromium`` fails these tests instead of skipping them. One server serves the default
card (``DEFAULT_MODEL``, first in the model picker, so the page opens on it) and the toy card
(exact, seeded audio). The test of the default card keeps a screenshot at
``tests/artifacts/playground.png`` (git-ignored).
"""

import io
import json
import re
import shutil
from pathlib import Path

import httpx
import numpy as np
import pytest
import soundfile as sf
from playwright.sync_api import sync_playwright

from omnistep.models.registry import DEFAULT_MODEL
from tests.serving import running_server

CHROMIUM = "/usr/bin/chromium"
ARTIFACTS = Path(__file__).parent / "artifacts"
# The toy card makes up to 2 tokens of 10 ms audio per input character, until it samples EOS:
# this text and seed give 1.84 s of audio.
TEXT = (
    "Hello from the omnistep playground. This sentence streams as raw pcm and plays at once. Bye."
)
SEED = "1"
TIMEOUT_MS = 15_000
# Three sentences: the default card streams them as separate chunks.
# Twelve sentences: synthesis of the whole takes a few hundred ms, longer than the page's start
# of reading can lag on a loaded machine, so the stream reaches it in several reads (three
# short sentences were made in ~60 ms and once arrived in one read: one chunk drawn).
DEFAULT_TEXT = " ".join(
    ["The playground draws this.", "It streams in parts.", "Then it stops.",
     "Each part is one sentence of speech."] * 3
)  # fmt: skip

# Per canvas column (x): the height in pixels of what is drawn (alpha > 0: the canvas is
# transparent where nothing is drawn, the background is its CSS's).
INK_HEIGHTS_JS = """(canvas) => {
  const {width: w, height: h} = canvas;
  const px = canvas.getContext("2d").getImageData(0, 0, w, h).data;
  const heights = new Array(w).fill(0);
  for (let y = 0; y < h; y++)
    for (let x = 0; x < w; x++) if (px[4 * (y * w + x) + 3] > 0) heights[x] += 1;
  return heights;
}"""


@pytest.fixture(scope="module")
def base():
    with running_server("--model", DEFAULT_MODEL, "--model", "toy") as url:
        yield url


@pytest.fixture(scope="module")
def pw():
    """One playwright driver for the module (a second one in the same process fails)."""
    with sync_playwright() as driver:
        yield driver


@pytest.fixture(scope="module")
def browser(pw):
    assert Path(CHROMIUM).exists(), f"{CHROMIUM} is missing: apt-get install -y chromium"
    browser = pw.chromium.launch(
        executable_path=CHROMIUM,
        args=[
            "--autoplay-policy=no-user-gesture-required",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--no-first-run",
        ],
    )
    yield browser
    browser.close()


@pytest.fixture
def page(browser, base):
    context = browser.new_context(accept_downloads=True)
    page = context.new_page()
    problems: list[str] = []
    page.on("console", lambda m: problems.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: problems.append(str(e)))
    page.goto(base + "/")
    page.wait_for_function("document.querySelectorAll('#model option').length > 0")
    page.problems = problems
    yield page
    context.close()


def test_speak_streams_and_plays_at_least_a_second(page, tmp_path):
    assert page.title() == "omnistep playground"
    models = page.eval_on_selector_all("#model option", "os => os.map(o => o.value)")
    assert {"toy", "toy-tts", DEFAULT_MODEL} <= set(models)
    page.select_option("#model", "toy")
    page.wait_for_function("document.querySelectorAll('#voices option').length > 0")
    assert page.eval_on_selector_all("#voices option", "os => os.map(o => o.value)") == ["default"]
    page.fill("#text", TEXT)
    page.fill("#seed", SEED)
    page.click("#speak")
    page.wait_for_function("window.playground.done", timeout=TIMEOUT_MS)
    stats = page.evaluate("window.playground")
    assert stats["lastError"] is None and page.inner_text("#error") == ""
    assert stats["playedSeconds"] >= 1.0, stats
    assert stats["chunks"] >= 1 and stats["seed"] == SEED
    # the page scheduled exactly the audio of the same request made directly
    direct = httpx.post(
        page.url.rstrip("/") + "/v1/audio/speech",
        json={"model": "toy", "input": TEXT, "seed": int(SEED), "response_format": "pcm"},
        timeout=30,
    )
    assert stats["playedSeconds"] == pytest.approx(len(direct.content) / 2 / 24000, abs=1e-3)
    assert page.problems == []


def test_default_model_voices_waveform_and_figures(page, base, tmp_path):
    models = httpx.get(base + "/v1/models").json()["data"]
    default = models[0]["id"]
    assert DEFAULT_MODEL in {m["id"] for m in models if m["root"] == models[0]["root"]}
    assert page.input_value("#model") == default
    # the voice suggestions are the default card's voices, as the API lists them
    listed = httpx.get(base + "/v1/audio/voices", params={"model": default}).json()["data"]
    builtin = [v["name"] for v in listed if v["builtin"]]
    assert builtin, listed
    page.wait_for_function("document.querySelectorAll('#voices option').length > 0")
    options = page.eval_on_selector_all("#voices option", "os => os.map(o => o.value)")
    assert options == [v["name"] for v in listed]
    voice = builtin[-1]
    page.fill("#voice", voice)
    page.fill("#text", DEFAULT_TEXT)
    page.fill("#seed", "")
    # every redraw (one per chunk), the number of canvas columns with something drawn
    page.evaluate(
        """(inkHeights) => {
          const canvas = document.getElementById("wave");
          const heights = eval(inkHeights);
          window.inkedColumns = [];
          canvas.addEventListener("drawn", () =>
            window.inkedColumns.push([
              heights(canvas).filter((n) => n > 0).length, window.playground.playedSeconds,
            ]));
        }""",
        INK_HEIGHTS_JS,
    )
    with page.expect_request(
        lambda r: r.url.endswith("/v1/audio/speech") and r.method == "POST"
    ) as sent:
        page.click("#speak")
    assert json.loads(sent.value.post_data)["voice"] == voice
    page.wait_for_function("window.playground.done", timeout=TIMEOUT_MS)
    stats = page.evaluate("window.playground")
    assert stats["lastError"] is None and page.inner_text("#error") == ""
    assert stats["playedSeconds"] > 1.0, stats

    # the drawn waveform: a signal (columns taller than the 1-pixel silence line) across the
    # canvas, in proportion to the audio received (it spans MIN_SPAN = 4 s, or all the audio)
    heights = page.eval_on_selector("#wave", INK_HEIGHTS_JS)
    inked = sum(1 for n in heights if n > 0)
    expected = len(heights) * min(1.0, stats["playedSeconds"] / 4)
    assert inked == pytest.approx(expected, abs=2), (inked, expected)
    assert sum(1 for n in heights if n >= 5) >= len(heights) // 10, heights
    assert max(heights) >= 20
    # ... drawn as it streamed in: redrawn at each chunk, growing with the audio received (a
    # redraw with under 4 s received inks that share of the canvas; past 4 s the canvas spans
    # all the audio, so a fast server whose first read brings >= 4 s draws it whole at once)
    drawn = page.evaluate("window.inkedColumns")
    assert len(drawn) == stats["chunks"] >= 2, (drawn, stats["chunks"])
    grown = [n for n, _ in drawn]
    assert grown == sorted(grown) and grown[-1] == inked, drawn
    for n, seconds in drawn:
        assert n == pytest.approx(len(heights) * min(1.0, seconds / 4), abs=2), drawn

    # the figures: time to first audio < the whole request's time; RTF = that time / audio
    ttfa, total, rtf = stats["firstChunkMs"], stats["totalMs"], stats["rtf"]
    assert 0 < ttfa < total < TIMEOUT_MS, stats
    assert rtf == pytest.approx(total / 1000 / stats["playedSeconds"], rel=1e-9)
    assert re.fullmatch(r"\d+ ms", page.inner_text("#ttfa"))
    # toFixed(0) and Python's round() differ on halves (half up vs half to even)
    assert abs(int(page.inner_text("#ttfa").split()[0]) - ttfa) <= 0.5 + 1e-9
    shown_rtf = re.fullmatch(r"(\d+\.\d{3}) \((\d+\.\d)× real time\)", page.inner_text("#rtf"))
    assert shown_rtf, page.inner_text("#rtf")
    assert float(shown_rtf[1]) == pytest.approx(rtf, abs=5e-4)
    assert float(shown_rtf[2]) == pytest.approx(1 / rtf, abs=0.051)
    shot = tmp_path / "playground.png"
    page.screenshot(path=shot, full_page=True)
    ARTIFACTS.mkdir(exist_ok=True)
    shutil.copy(shot, ARTIFACTS / "playground.png")
    assert page.problems == []


def test_download_saves_a_file_that_decodes(page, tmp_path):
    page.select_option("#model", "toy")
    page.fill("#text", TEXT)
    page.fill("#seed", SEED)
    page.select_option("#format", "wav")
    with page.expect_download(timeout=TIMEOUT_MS) as info:
        page.click("#download")
    download = info.value
    assert download.suggested_filename == "speech.wav"
    path = tmp_path / "speech.wav"
    download.save_as(path)
    samples, rate = sf.read(io.BytesIO(path.read_bytes()), dtype="float32")
    assert rate == 24000 and samples.size / rate > 1.0
    assert page.problems == []


def test_errors_from_the_server_show_in_the_page(page):
    page.select_option("#model", "toy")
    page.fill("#voice", "nobody")
    page.click("#speak")
    page.wait_for_function("window.playground.lastError", timeout=TIMEOUT_MS)
    error = page.inner_text("#error")
    assert error.startswith("400: ") and "unknown_voice" in error


def test_the_page_is_public_when_the_api_key_guards_the_api():
    with running_server("--model", "toy", "--api-key", "k3y") as url:
        page = httpx.get(url + "/")
        assert page.status_code == 200 and "omnistep playground" in page.text
        assert httpx.get(url + "/v1/models").status_code == 401
        auth = {"Authorization": "Bearer k3y"}
        assert httpx.get(url + "/v1/models", headers=auth).status_code == 200


# ------------------------------------------------------------------ the microphone
MIC_SECONDS = 1.5


@pytest.fixture(scope="module")
def hearing(pw, tmp_path_factory):
    """``(browser page factory, base URL)``: chromium whose microphone plays a 0.3-amplitude
    440 Hz tone from a WAV file (a fake device; its permission prompt answered yes), and a
    server of ``toy_hear`` (it answers with the duration and RMS it heard) and ``toy``."""
    assert Path(CHROMIUM).exists(), f"{CHROMIUM} is missing: apt-get install -y chromium"
    folder = tmp_path_factory.mktemp("mic")
    tone = 0.3 * np.sin(2 * np.pi * 440 * np.arange(48000 * 4) / 48000)
    sf.write(folder / "question.wav", tone.astype(np.float32), 48000, subtype="PCM_16")
    with running_server("--model", "toy_hear", "--model", "toy") as url:
        browser = pw.chromium.launch(
            executable_path=CHROMIUM,
            args=[
                "--autoplay-policy=no-user-gesture-required",
                "--no-sandbox",
                "--disable-gpu",
                "--use-fake-device-for-media-stream",
                "--use-fake-ui-for-media-stream",
                f"--use-file-for-fake-audio-capture={folder / 'question.wav'}",
            ],
        )
        yield browser, url
        browser.close()


def test_microphone_question_gets_a_spoken_answer(hearing):
    """Record ~1.5 s from the (fake) microphone, send it: the page posts an ``input_audio``
    part to ``/v1/chat/completions``, shows toy_hear's answer (what it heard: about the
    recorded duration, the tone's RMS) and plays its speech; a model that does not hear has
    the button disabled."""
    browser, url = hearing
    context = browser.new_context(permissions=["microphone"])
    page = context.new_page()
    problems: list[str] = []
    page.on("console", lambda m: problems.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: problems.append(str(e)))
    page.goto(url + "/")
    page.wait_for_function("document.querySelectorAll('#model option').length > 0")
    page.select_option("#model", "toy")
    assert page.is_disabled("#mic")
    page.select_option("#model", "toy_hear")
    page.wait_for_function("!document.getElementById('mic').disabled")
    page.click("#mic")
    page.wait_for_function("window.playground.mic.recorder !== null")
    page.wait_for_timeout(MIC_SECONDS * 1000)
    with page.expect_request(lambda r: r.url.endswith("/v1/chat/completions")) as sent:
        page.click("#mic")
    body = json.loads(sent.value.post_data)
    (part,) = body["messages"][0]["content"]
    assert part["type"] == "input_audio" and part["input_audio"]["format"] == "webm"
    assert body["modalities"] == ["text", "audio"] and body["audio"]["voice"] == "default"
    page.wait_for_function("window.playground.mic.done", timeout=TIMEOUT_MS)
    mic = page.evaluate("window.playground.mic")
    assert mic["lastError"] is None and mic["recordedBytes"] > 1000, mic
    heard = re.fullmatch(r"turn 1 heard (\d+\.\d\d) s rms (\d\.\d{3}) after 0 chars", mic["reply"])
    assert heard, mic["reply"]
    assert 0.8 * MIC_SECONDS <= float(heard[1]) <= MIC_SECONDS + 1.0
    assert float(heard[2]) == pytest.approx(0.3 / np.sqrt(2), rel=0.1)
    assert page.inner_text("#reply") == mic["reply"] and mic["replySeconds"] > 0.1
    assert problems == []
    context.close()
