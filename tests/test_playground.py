"""The playground page at ``GET /`` in a real browser (Debian's chromium, driven by playwright).

Chromium is not downloaded by playwright: ``.ci/run`` installs Debian's package, so a missing
``/usr/bin/chromium`` fails these tests instead of skipping them. The test keeps a screenshot
at ``tests/artifacts/playground.png`` (git-ignored).
"""

import io
import shutil
from pathlib import Path

import httpx
import pytest
import soundfile as sf
from playwright.sync_api import sync_playwright

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


@pytest.fixture(scope="module")
def base():
    with running_server("--model", "toy") as url:
        yield url


@pytest.fixture(scope="module")
def browser():
    assert Path(CHROMIUM).exists(), f"{CHROMIUM} is missing: apt-get install -y chromium"
    with sync_playwright() as pw:
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
    assert set(models) == {"toy", "toy-tts"}
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
