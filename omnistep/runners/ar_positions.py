"""Rope positions of a ``PagedARModel``'s rows: a prompt's own (the family's
``_prompt_positions`` hook: Qwen's TMRoPE of media rows), else each row's index; decode steps
continue at ``index + delta``.

Imports torch and the AR loop's payload types (``omnistep.loops.ar_decode``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from omnistep.loops.ar_decode import ARPrefillInput


class PromptPositions:
    """The positions collaborator of a ``PagedARModel`` (``model.positions``).

    Args:
        model: the owner; its ``_prompt_positions`` hook, ``position_rows``, ``device`` and
            ``lengths`` (tokens per sequence) are read at each call.

    Attributes:
        deltas: ``seq_id -> delta`` of the held sequences whose decode positions are not their
            row index (``_prompt_positions`` gave a nonzero offset).
    """

    def __init__(self, model: Any):
        self.model = model
        self.deltas: dict[str, int] = {}

    def rows(self, prompt: Any, start: int, end: int) -> torch.Tensor:
        """Rope positions of rows ``start .. end - 1`` of a sequence with ``prompt``:
        LongTensor ``[n]``, or ``[position_rows, n]`` for an M-RoPE family, on the device."""
        model = self.model
        given = model._prompt_positions(prompt)
        if given is None:
            return self.plain(start, end)
        table, delta = given
        num_prompt = table.shape[-1]
        head = table[..., start : min(end, num_prompt)].to(model.device)
        tail = torch.arange(max(start, num_prompt), end, device=model.device) + delta
        positions = torch.cat([head, tail.expand(*head.shape[:-1], -1)], dim=-1)
        if model.position_rows > 1 and positions.ndim == 1:
            positions = positions.expand(model.position_rows, -1)
        return positions

    def plain(self, start: int, end: int) -> torch.Tensor:
        """Positions ``start .. end - 1`` shaped as ``rows`` shapes them, for rows without a
        prompt of their own (a guided request's unconditional rows)."""
        model = self.model
        positions = torch.arange(start, end, device=model.device)
        return positions.expand(model.position_rows, -1) if model.position_rows > 1 else positions

    def step(self, seq_ids: Sequence[str]) -> torch.Tensor:
        """Positions of each sequence's next row (its last cached one), ``[B]`` or
        ``[position_rows, B]``."""
        model = self.model
        positions = torch.tensor(
            [model.lengths[s] - 1 + self.deltas.get(s, 0) for s in seq_ids], device=model.device
        )
        if model.position_rows > 1:
            positions = positions.expand(model.position_rows, -1)
        return positions

    def note(self, unit: ARPrefillInput) -> None:
        """Remember the decode offset of a sequence whose prompt has its own positions."""
        given = self.model._prompt_positions(unit.prompt)
        if given is None or given[1] == 0:
            self.deltas.pop(unit.seq_id, None)
        else:
            self.deltas[unit.seq_id] = given[1]

    def forget(self, seq_id: str) -> None:
        """Drop a freed sequence's offset (idempotent)."""
        self.deltas.pop(seq_id, None)
