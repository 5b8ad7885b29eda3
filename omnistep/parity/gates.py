"""Run requests alone or interleaved through an engine and collect their streams
(``collect`` lives in the engine plane, which the offline API uses too)."""

from __future__ import annotations

import asyncio
import dataclasses

from omnistep.core import Request
from omnistep.core.request import new_request_id
from omnistep.engine import AsyncEngine
from omnistep.engine.collect import Collected, collect


def _fresh(request: Request) -> Request:
    """A copy with a new request id and arrival time (a Request can be submitted once)."""
    return dataclasses.replace(request, request_id=new_request_id())


async def run_alone(engine: AsyncEngine, requests: list[Request]) -> list[Collected]:
    """Run each request by itself, one after another. Requests need explicit seeds."""
    return [await collect(engine, _fresh(r)) for r in requests]


async def run_interleaved(engine: AsyncEngine, requests: list[Request]) -> list[Collected]:
    """Submit all requests at once and run them concurrently."""
    return list(await asyncio.gather(*(collect(engine, _fresh(r)) for r in requests)))
