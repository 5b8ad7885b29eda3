"""``GET /``: the playground page (plain HTML and JavaScript, a package data file).

The page holds no secrets, so it is served without the API key (``auth.OPEN_PATHS``); the API
calls it makes send the key typed into it.
"""

from __future__ import annotations

from functools import cache
from importlib import resources

from fastapi import APIRouter
from fastapi.responses import HTMLResponse

router = APIRouter()


@cache
def page() -> str:
    """The playground's HTML, read once from ``omnistep/server/static/playground.html``."""
    return resources.files("omnistep.server").joinpath("static/playground.html").read_text("utf-8")


@router.get("/", include_in_schema=False)
async def playground() -> HTMLResponse:
    """Text box, model and voice, Speak (streamed pcm, played and its waveform drawn as it
    arrives; then the time to first audio and the real-time factor) and Download."""
    return HTMLResponse(page())
