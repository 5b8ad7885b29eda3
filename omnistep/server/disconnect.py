"""Abort a request whose client goes away before its response has started.

A streamed response notices a gone client by itself: Starlette's ``StreamingResponse`` listens
for ``http.disconnect`` and closes its body iterator, whose ``finally`` cancels the engine
request. Before a response exists nothing listens: a non-streamed request collecting its whole
output, or a streamed one waiting for its first audio, would run to the end for nobody.
``abort_on_disconnect`` listens during that time. Either way a client that leaves is logged in
one line (``log_client_gone``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

from fastapi import Request as HttpRequest

from omnistep.engine import RequestStream

log = logging.getLogger("omnistep.server")


def log_client_gone(request_id: str) -> None:
    """The one log line (INFO) of a client that left before its response ended."""
    log.info("client of %s disconnected; aborting it", request_id)


async def _cancel_when_disconnected(http: HttpRequest, stream: RequestStream) -> None:
    try:
        while (await http.receive())["type"] != "http.disconnect":
            pass  # the body is read already: nothing else should come
    except Exception as exc:  # noqa: BLE001 - watching is best effort; the request goes on
        log.debug("disconnect watch of %s stopped: %r", stream.request_id, exc)
        return
    log_client_gone(stream.request_id)
    stream.cancel()


@contextlib.asynccontextmanager
async def abort_on_disconnect(http: HttpRequest, stream: RequestStream) -> AsyncIterator[None]:
    """While the block runs, abort ``stream``'s request if the client disconnects.

    The request's stream then raises ``RequestAbortedError`` in the block. Use it only before
    the response starts: a ``StreamingResponse`` listens for the disconnect itself.
    """
    watcher = asyncio.create_task(_cancel_when_disconnected(http, stream))
    try:
        yield
    finally:
        watcher.cancel()
        await asyncio.wait({watcher})  # done before anyone else listens for the disconnect
