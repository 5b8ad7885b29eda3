"""MoE routing of a ``PagedARModel``: what a recorded step carries (``ARStepOutput.routing``,
a prefill's ``prompt_routing``) and the recorded routing ``score`` replays (Rollout Routing
Replay). A MoE stack's forward leaves the experts of each of its rows in
``PagedARModel.last_routing``; a prompt whose first rows were not computed by its prefill (a
cached or kept prefix) takes theirs from what was recorded when they were computed.

Imports torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


class RoutingRecorder:
    """The routing collaborator of a ``PagedARModel`` (``model.routing``).

    Args:
        model: the owner; its ``llama`` (``config.moe``), ``device``, ``lengths`` and
            ``last_routing`` are read at each call.
    """

    def __init__(self, model: Any):
        self.model = model

    def prefill_rows(
        self, inputs: Sequence[torch.Tensor], prefixes: Sequence[torch.Tensor | None]
    ) -> list[torch.Tensor | None] | None:
        """The routing ``[rows, layers, k]`` (device) of every row of each sequence of the
        prefill forward just run (``last_routing``, its computed rows in ``inputs``' order),
        after ``prefixes[i]``, the recorded routing of the rows it did not compute (a cached
        or kept prefix; None: none, or unknown). None for a dense stack; an entry is None
        where some row's routing is unknown."""
        model = self.model
        if model.last_routing is None:
            return None
        out: list[torch.Tensor | None] = []
        start = 0
        for rows, prefix in zip(inputs, prefixes, strict=True):
            n = rows.shape[0]
            computed = model.last_routing[start : start + n]
            start += n
            out.append(computed if prefix is None else torch.cat([prefix, computed]))
        return out

    def whole(self, seq_id: str, rows: torch.Tensor | None) -> torch.Tensor | None:
        """``rows`` when they are the routing of every row the sequence holds, else None."""
        if rows is None or rows.shape[0] != self.model.lengths.get(seq_id, -1):
            return None
        return rows

    @staticmethod
    def fields(rows: torch.Tensor | None, prefill: bool) -> dict[str, Any]:
        """A recorded step's ``ARStepOutput`` routing fields from its sequence's rows'
        routing ``[n, layers, k]``: ``routing`` (the last row's) and, for a prefill,
        ``prompt_routing`` (the others'), int16 on the CPU; empty for ``rows`` None."""
        if rows is None:
            return {}
        host = rows.to("cpu", torch.int16).numpy()
        return {"routing": host[-1], "prompt_routing": host[:-1] if prefill else None}

    def replay_rows(self, routing: Any, num_rows: int, index: int) -> torch.Tensor:
        """Trajectory ``index``'s recorded routing as LongTensor ``[num_rows, layers, k]`` on
        the device.

        Raises:
            ValueError: a dense stack, or another number of rows.
        """
        model = self.model
        if model.llama.config.moe is None:
            raise ValueError(f"{type(model).__name__} has no MoE layers: no routing to replay")
        experts = torch.as_tensor(routing).to(model.device, torch.long)
        if experts.ndim != 3 or experts.shape[0] != num_rows:
            raise ValueError(
                f"routing of trajectory {index} must be [{num_rows} rows (prompt rows + frames - "
                f"1), MoE layers, k], got {list(experts.shape)}"
            )
        return experts
