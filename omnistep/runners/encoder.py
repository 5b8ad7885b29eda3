"""The media-encoder component every family with audio/image/video inputs configures.

``MediaEncoderRunner`` runs ENCODE units: each payload is one ``MediaItem`` and each output is
what the family's ``encode`` makes of it (e.g. its rows in the LM's width). One ``execute``
call holds items of one kind (the encode loop's ``ShapeSignature`` tags units by kind), and
the family's ``encode`` runs them as one batch; in ``batch_invariant`` mode each item runs
alone, so its output does not depend on what else was batched.

Outputs are kept in an LRU keyed by the item's ``sha256`` (``MediaItem.sha256``: its decoded
content), so a conversation that repeats a clip or an image in later turns (a chat resends
every earlier turn) encodes it once: a repeated item costs a dictionary look-up. The encoders
take no weight updates (``update_weights`` reaches the LMs), so kept outputs stay valid;
``clear`` drops them.

Imports ``omnistep.core`` only (the family's ``encode`` does the tensor work).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

from omnistep.core import MediaItem, WorkUnitKind


class MediaEncoderRunner:
    """ENCODE component over a family's batched encoder (see module docstring).

    Args:
        encode: ``items -> outputs`` for items of one kind, in order (one forward).
        batch_invariant: encode each item alone.
        cache_items: encoder outputs kept (least recently used dropped first); 0 keeps none.

    Attributes:
        num_encoded: items the encoder ran on; ``num_reused``: items answered from the cache.
    """

    def __init__(
        self,
        encode: Callable[[Sequence[MediaItem]], list[Any]],
        batch_invariant: bool = False,
        cache_items: int = 64,
    ):
        if cache_items < 0:
            raise ValueError(f"cache_items must be >= 0, got {cache_items}")
        self.encode = encode
        self.batch_invariant = batch_invariant
        self.cache_items = cache_items
        self._cache: OrderedDict[str, Any] = OrderedDict()
        self.num_encoded = 0
        self.num_reused = 0

    @property
    def num_cached(self) -> int:
        """Encoder outputs kept now."""
        return len(self._cache)

    def execute(self, kind: WorkUnitKind, payloads: Sequence[MediaItem]) -> list[Any]:
        """Encode a batch of media items (one kind); one output per item, in order.

        Raises:
            ValueError: a kind other than ENCODE, or what the family's ``encode`` raises for a
                malformed item (the engine then retries item by item to fail its request
                only).
        """
        if kind is not WorkUnitKind.ENCODE:
            raise ValueError(f"{type(self).__name__} runs ENCODE units, got {kind}")
        out: dict[str, Any] = {}
        missing: dict[str, MediaItem] = {}
        for item in payloads:
            if item.sha256 in self._cache:
                self._cache.move_to_end(item.sha256)
                out[item.sha256] = self._cache[item.sha256]
                self.num_reused += 1
            else:
                missing.setdefault(item.sha256, item)
        todo = list(missing.values())
        groups = [[item] for item in todo] if self.batch_invariant else [todo] if todo else []
        for group in groups:
            for item, encoded in zip(group, self.encode(group), strict=True):
                out[item.sha256] = encoded
                self._remember(item.sha256, encoded)
        self.num_encoded += len(todo)
        return [out[item.sha256] for item in payloads]

    def clear(self) -> None:
        """Forget every kept output."""
        self._cache.clear()

    def _remember(self, key: str, encoded: Any) -> None:
        if self.cache_items == 0:
            return
        self._cache[key] = encoded
        while len(self._cache) > self.cache_items:
            self._cache.popitem(last=False)
