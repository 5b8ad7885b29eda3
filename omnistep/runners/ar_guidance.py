"""Classifier-free guidance of a ``PagedARModel``: a guided request's second, unconditional
sequence (``uncond_id``), admitted, grown, preempted and freed with the conditional one, and
the guided logits ``cond + w * (cond - uncond)`` the sampler sees (Chatterbox T3, upstream
``t3.py``). The family names the weight (``_guidance``) and the unconditional rows
(``_unconditional_inputs``); see ``omnistep.runners.paged_ar``'s module docstring.

Imports torch and the AR loop's payload types (``omnistep.loops.ar_decode``).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

import torch

from omnistep.loops.ar_decode import ARPrefillInput

UNCOND_SUFFIX = "#uncond"
"""The unconditional sequence of a guided request is its ``seq_id`` plus this suffix."""


def uncond_id(seq_id: str) -> str:
    """The KV sequence id of ``seq_id``'s unconditional (classifier-free guidance) row."""
    return seq_id + UNCOND_SUFFIX


class Guidance:
    """The guidance collaborator of a ``PagedARModel`` (``model.guidance``).

    Args:
        model: the owner; its ``table``, ``_admit`` and ``_head`` are used.

    Attributes:
        weights: ``seq_id -> w`` of each guided sequence while it holds blocks.
        uncond_last: ``seq_id ->`` the unconditional row's last hidden state ``[hidden]``,
            from a step's forward to its sampling (emptied by ``guide``).
    """

    def __init__(self, model: Any):
        self.model = model
        self.weights: dict[str, float] = {}
        self.uncond_last: dict[str, torch.Tensor] = {}

    def with_uncond(self, seq_ids: Sequence[str]) -> list[str]:
        """``seq_ids`` with each guided one's unconditional sequence right after it."""
        out = []
        for seq_id in seq_ids:
            out.append(seq_id)
            if seq_id in self.weights:
                out.append(uncond_id(seq_id))
        return out

    def admit(
        self, unit: ARPrefillInput, num_rows: int, weight: float, pinned: set[Hashable]
    ) -> bool:
        """Take the blocks of a guided prefill's conditional and unconditional sequences
        together (``num_rows`` each, whole prompts, no sharing); False: neither is held."""
        model = self.model
        uncond = uncond_id(unit.seq_id)
        if model._admit(unit.seq_id, num_rows, pinned):
            if model._admit(uncond, num_rows, pinned):
                self.weights[unit.seq_id] = weight
                return True
            model.table.free(unit.seq_id)
        return False

    def preempt(self, seq_id: str) -> int:
        """Free a preempted guided sequence's unconditional row (not marked preempted: only
        the request's own step answers); the blocks freed (0 for an unguided one)."""
        if self.weights.pop(seq_id, None) is None:
            return 0
        table, uncond = self.model.table, uncond_id(seq_id)
        freed = table.preemption_frees(uncond)
        table.free(uncond)
        return freed

    def forget(self, seq_id: str) -> None:
        """Drop a freed sequence's weight (idempotent; its blocks are freed by the caller)."""
        self.weights.pop(seq_id, None)

    def guide(self, logits: torch.Tensor, units: Sequence[Any]) -> torch.Tensor:
        """Classifier-free guidance of the guided rows of ``logits`` ``[B, C, V]`` float32:
        ``cond + w * (cond - uncond)`` with the unconditional rows' head logits (their hidden
        states kept by this step's forward in ``uncond_last``)."""
        guided = [j for j, u in enumerate(units) if u.seq_id in self.uncond_last]
        if not guided:
            return logits
        uncond = torch.stack([self.uncond_last.pop(units[j].seq_id) for j in guided])
        uncond_logits = self.model._head(uncond, units[guided[0]].seq_id).float()
        index = torch.tensor(guided, device=logits.device)
        weight = torch.tensor(
            [self.weights[units[j].seq_id] for j in guided], device=logits.device
        ).view(-1, 1, 1)
        cond = logits[index]
        logits = logits.clone()
        logits[index] = cond + weight * (cond - uncond_logits)
        return logits
