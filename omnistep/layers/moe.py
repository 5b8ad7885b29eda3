"""A sparse mixture-of-experts feed-forward layer (the MoE block of Qwen3-MoE and Qwen3-Omni).

Imports torch and ``omnistep.layers`` only. The math is transformers 5.25's
``Qwen3OmniMoeThinkerTextSparseMoeBlock`` and ``Qwen3OmniMoeTalkerTextSparseMoeBlock``
(models/qwen3_omni_moe/modeling_qwen3_omni_moe.py; models/qwen3_moe is the same block):

- router: ``logits = x @ gate.weight.T`` ``[N, E]`` in the input's dtype, ``probs =
  softmax(logits)`` in float32, the ``num_experts_per_tok`` (k) most probable experts, their
  probabilities renormalised to sum to 1 when ``norm_topk_prob`` (config key), then cast to the
  input's dtype;
- each expert is SwiGLU: ``down(silu(gate(x)) * up(x))``, ``moe_intermediate_size`` wide;
- ``out = sum_j w_j * expert_{e_j}(x)``; with a shared expert (the talker's,
  ``shared_expert_intermediate_size`` > 0) ``out += sigmoid(x @ shared_expert_gate.weight.T) *
  shared_expert(x)``.

Ties: the k experts are taken by a stable descending sort of the probabilities, so of equal
probabilities the lower expert id wins, on every device and whatever rows share the call
(``torch.topk`` leaves the order of ties unspecified).

Batching: the (row, slot) assignments of a step are sorted by expert, and each active expert runs
one GEMM for its gate and up projections (fused ``[2 * I, H]``) and one for its down projection,
over all its rows of the step. In ``batch_invariant`` mode a row's output does not depend on
which rows share the call: the router, each expert's GEMMs and the shared expert run on chunks
of exactly ``chunk_rows`` rows (the last one zero-padded; ``layers.batch_invariant``), SiLU on a
width padded to a multiple of 64 (vectorized and scalar-tail paths round differently), and each
row's k expert outputs are summed in slot order with elementwise ops.

Routing replay (Rollout Routing Replay): ``forward(x, expert_ids=recorded)`` uses the recorded
experts instead of the router's choice; their weights are still the router's probabilities at
those experts (renormalised as configured), so gradients reach the router and replaying the
routing the router chose reproduces the output bit for bit.

Weights (``load_hf_state_dict``) by the published names of a layer's ``mlp.``: ``gate.weight``
``[E, H]``, ``experts.{e}.{gate,up,down}_proj.weight`` (the released safetensors) or the fused
form transformers 5 keeps in memory (its ``conversion_mapping`` "qwen2_moe" rule):
``experts.gate_up_proj`` ``[E, 2 * I, H]`` (gate rows first) and ``experts.down_proj``
``[E, H, I]``; the shared expert's ``shared_expert.{gate,up,down}_proj.weight`` and
``shared_expert_gate.weight`` ``[1, H]``. ``state_dict()`` has the fused names.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from omnistep.layers.batch_invariant import DEFAULT_CHUNK_ROWS, map_row_chunks
from omnistep.layers.linear import PackedLinear, stacked_linear
from omnistep.layers.llama import LlamaMLP

#: SiLU's width is padded to a multiple of this in batch-invariant mode, so every row's elements
#: take the vectorized path (AVX-512 processes 32 floats a step; AVX2 16).
_SILU_BLOCK = 64
_EXPERT_KEY = re.compile(r"experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")


@dataclass(frozen=True)
class MoEConfig:
    """The sizes of one MoE layer, by the transformers config key names.

    Attributes:
        hidden_size: H, the model width.
        moe_intermediate_size: I, each expert's SwiGLU width.
        num_experts: E.
        num_experts_per_tok: k, experts per row.
        norm_topk_prob: renormalise the k probabilities to sum to 1.
        shared_expert_intermediate_size: the shared expert's width; 0 for none (the thinker).
        hidden_act: only "silu".

    Raises:
        ValueError: a size <= 0 (the shared width < 0), k > E, another activation.
    """

    hidden_size: int
    moe_intermediate_size: int
    num_experts: int
    num_experts_per_tok: int
    norm_topk_prob: bool = True
    shared_expert_intermediate_size: int = 0
    hidden_act: str = "silu"

    def __post_init__(self) -> None:
        for name in ("hidden_size", "moe_intermediate_size", "num_experts", "num_experts_per_tok"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.shared_expert_intermediate_size < 0:
            raise ValueError(
                f"shared_expert_intermediate_size must be >= 0, got "
                f"{self.shared_expert_intermediate_size}"
            )
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError(
                f"num_experts_per_tok={self.num_experts_per_tok} exceeds "
                f"num_experts={self.num_experts}"
            )
        if self.hidden_act != "silu":
            raise ValueError(f"hidden_act must be 'silu', got {self.hidden_act!r}")

    @classmethod
    def of(cls, cfg: Any) -> MoEConfig:
        """From any object with these attributes (a transformers ``Qwen3OmniMoeTextConfig``, a
        family's parsed config); a missing ``shared_expert_intermediate_size`` means none."""
        names = [f.name for f in dataclasses.fields(cls)]
        values = {n: getattr(cfg, n) for n in names if hasattr(cfg, n)}
        return cls(**values)


class MoEOutput(NamedTuple):
    """What ``MoEFeedForward`` returns.

    Attributes:
        hidden: ``[N, H]`` in the input's dtype.
        expert_ids: LongTensor ``[N, k]``: the experts each row was routed to, most probable
            first (the routing to record; ``forward(expert_ids=...)`` replays it).
    """

    hidden: torch.Tensor
    expert_ids: torch.Tensor


def _silu(x: torch.Tensor, fixed: bool) -> torch.Tensor:
    """``F.silu(x)`` over ``[M, W]``; ``fixed``: on ``W`` padded to a multiple of 64, so a
    row's values do not depend on where in the call it sits (``LlamaMLP``'s note)."""
    pad = -x.shape[-1] % _SILU_BLOCK if fixed else 0
    if not pad:
        return F.silu(x)
    return F.silu(F.pad(x, (0, pad)))[..., : x.shape[-1]]


class MoEExperts(nn.Module):
    """E SwiGLU experts stored stacked (transformers 5's ``Qwen3OmniMoeThinkerTextExperts``);
    each GEMM is ``layers.linear.stacked_linear`` (oneDNN pre-packed per expert on CPU).

    Attributes:
        gate_up_proj: ``[E, 2 * I, H]``: expert e's gate rows then its up rows.
        down_proj: ``[E, H, I]``.
    """

    def __init__(self, config: MoEConfig, **factory: Any):
        super().__init__()
        e, h, i = config.num_experts, config.hidden_size, config.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.zeros(e, 2 * i, h, **factory))
        self.down_proj = nn.Parameter(torch.zeros(e, h, i, **factory))

    def expert(self, expert: int, x: torch.Tensor, fixed: bool = False) -> torch.Tensor:
        """Expert ``expert`` on rows ``[M, H]`` -> ``[M, H]`` (``fixed``: batch-invariant SiLU)."""
        gate, up = stacked_linear(x, self.gate_up_proj, expert).chunk(2, dim=-1)
        return stacked_linear(_silu(gate, fixed) * up, self.down_proj, expert)


class MoEFeedForward(nn.Module):
    """The sparse MoE block (module docstring): ``[N, H]`` -> ``MoEOutput``.

    Args:
        config: the layer's ``MoEConfig``.
        chunk_rows: rows per kernel call in batch-invariant mode.
        device, dtype: of the parameters.

    Attributes:
        gate: the router, ``PackedLinear(H, E)``; experts: ``MoEExperts``; shared_expert: a
        ``LlamaMLP`` or None; shared_expert_gate: ``PackedLinear(H, 1)`` or None.
    """

    def __init__(
        self,
        config: MoEConfig,
        chunk_rows: int = DEFAULT_CHUNK_ROWS,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ):
        super().__init__()
        if chunk_rows <= 0:
            raise ValueError(f"chunk_rows must be > 0, got {chunk_rows}")
        self.config, self.chunk_rows = config, chunk_rows
        factory = {"device": device, "dtype": dtype}
        h = config.hidden_size
        self.gate = PackedLinear(h, config.num_experts, bias=False, **factory)
        self.experts = MoEExperts(config, **factory)
        self.shared_expert: LlamaMLP | None = None
        self.shared_expert_gate: PackedLinear | None = None
        if config.shared_expert_intermediate_size:
            self.shared_expert = LlamaMLP(h, config.shared_expert_intermediate_size, **factory)
            self.shared_expert_gate = PackedLinear(h, 1, bias=False, **factory)

    # ------------------------------------------------------------ routing
    def _rows(self, fn: Any, x: torch.Tensor, batch_invariant: bool) -> torch.Tensor:
        return map_row_chunks(fn, x, self.chunk_rows) if batch_invariant else fn(x)

    def router_probs(self, x: torch.Tensor, batch_invariant: bool = False) -> torch.Tensor:
        """``softmax(x @ gate.weight.T)`` float32 ``[N, E]`` (logits in ``x``'s dtype)."""
        return self._rows(lambda r: F.softmax(self.gate(r).float(), dim=-1), x, batch_invariant)

    def select(
        self, probs: torch.Tensor, expert_ids: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The experts and their float32 weights ``[N, k]`` from router probabilities.

        Args:
            probs: float32 ``[N, E]``.
            expert_ids: integer ``[N, k]`` to replay instead of choosing (the probabilities of
                those experts are taken); None: the k most probable, lower id first on ties.

        Raises:
            ValueError: ``expert_ids`` of another shape, a non-integer dtype, or an id outside
                ``[0, E)``.
        """
        k = self.config.num_experts_per_tok
        if expert_ids is None:
            expert_ids = torch.sort(probs, dim=-1, descending=True, stable=True).indices[:, :k]
        else:
            expert_ids = self._check_routing(expert_ids, probs.shape[0])
        weights = probs.gather(1, expert_ids)
        if self.config.norm_topk_prob:
            total = weights[:, 0]
            for j in range(1, k):  # a fixed order: each row's sum ignores the batch
                total = total + weights[:, j]
            weights = weights / total[:, None]
        return expert_ids, weights

    def _check_routing(self, expert_ids: torch.Tensor, num_rows: int) -> torch.Tensor:
        shape = (num_rows, self.config.num_experts_per_tok)
        if tuple(expert_ids.shape) != shape:
            raise ValueError(f"expert_ids must be {list(shape)}, got {list(expert_ids.shape)}")
        if expert_ids.dtype.is_floating_point or expert_ids.dtype.is_complex:
            raise ValueError(f"expert_ids must be integers, got {expert_ids.dtype}")
        expert_ids = expert_ids.to(device=self.gate.weight.device, dtype=torch.long)
        if expert_ids.numel() and not (
            int(expert_ids.min()) >= 0 and int(expert_ids.max()) < self.config.num_experts
        ):
            raise ValueError(f"expert_ids must be in [0, {self.config.num_experts})")
        return expert_ids

    # ------------------------------------------------------------ experts
    def run_experts(
        self, x: torch.Tensor, expert_ids: torch.Tensor, batch_invariant: bool = False
    ) -> torch.Tensor:
        """Every (row, slot)'s expert output ``[N, k, H]``: assignments sorted by expert, one
        call of each active expert on all its rows (``chunk_rows`` chunks when
        ``batch_invariant``)."""
        num_rows, k = expert_ids.shape
        flat = expert_ids.reshape(-1)
        order = torch.argsort(flat, stable=True)  # assignments grouped by expert
        counts = torch.bincount(flat, minlength=self.config.num_experts).tolist()
        inputs = x.index_select(0, order // k)
        outputs, start = [], 0
        for expert, count in enumerate(counts):
            if not count:
                continue
            rows = inputs[start : start + count]

            def fn(r: torch.Tensor, e: int = expert) -> torch.Tensor:
                return self.experts.expert(e, r, batch_invariant)

            outputs.append(self._rows(fn, rows, batch_invariant))
            start += count
        if not outputs:
            return x.new_zeros(num_rows, k, x.shape[-1])
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel(), device=order.device)
        return torch.cat(outputs).index_select(0, inverse).view(num_rows, k, -1)

    def _shared(self, x: torch.Tensor, batch_invariant: bool) -> torch.Tensor:
        """``sigmoid(shared_expert_gate(x)) * shared_expert(x)`` on rows ``[M, H]``."""
        m = self.shared_expert
        inner = _silu(m.gate_proj(x), batch_invariant) * m.up_proj(x)
        return torch.sigmoid(self.shared_expert_gate(x)) * m.down_proj(inner)

    def forward(
        self,
        x: torch.Tensor,
        expert_ids: torch.Tensor | None = None,
        batch_invariant: bool = False,
    ) -> MoEOutput:
        """The block on rows ``x`` ``[N, H]`` (float32, bfloat16, ...; autograd works).

        Args:
            expert_ids: integer ``[N, k]`` to replay a recorded routing (see ``select``).
            batch_invariant: a row's output is bit-identical whatever rows share the call.

        Raises:
            ValueError: ``x`` not ``[N, H]``, or a malformed ``expert_ids``.
        """
        if x.dim() != 2 or x.shape[1] != self.config.hidden_size:
            raise ValueError(f"x must be [N, {self.config.hidden_size}], got {list(x.shape)}")
        if not x.shape[0]:
            if expert_ids is not None:
                self._check_routing(expert_ids, 0)
            k = self.config.num_experts_per_tok
            return MoEOutput(x.clone(), torch.zeros(0, k, dtype=torch.long, device=x.device))
        probs = self.router_probs(x, batch_invariant)
        expert_ids, weights = self.select(probs, expert_ids)
        weights = weights.to(x.dtype)
        per_slot = self.run_experts(x, expert_ids, batch_invariant)  # [N, k, H]
        out = per_slot[:, 0] * weights[:, :1]
        for j in range(1, expert_ids.shape[1]):  # slot order, elementwise: batch-invariant
            out = out + per_slot[:, j] * weights[:, j : j + 1]
        if self.shared_expert is not None:
            out = out + self._rows(lambda r: self._shared(r, batch_invariant), x, batch_invariant)
        return MoEOutput(out, expert_ids)

    # ------------------------------------------------------------ weights
    def load_hf_state_dict(self, state: Mapping[str, torch.Tensor], prefix: str = "") -> None:
        """Load a layer's tensors by their published names under ``prefix`` (e.g.
        ``"thinker.model.layers.0.mlp."``), per-expert or fused (module docstring); other keys
        are ignored.

        Raises:
            KeyError: a missing tensor (named). RuntimeError: a mis-shaped one (from
            ``nn.Module.load_state_dict``).
        """
        selected = {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}
        fused = fuse_expert_tensors(selected, self.config.num_experts)
        wanted = self.state_dict().keys()
        missing = sorted(prefix + k for k in wanted if k not in fused)
        if missing:
            raise KeyError(f"missing MoE tensors: {missing[:5]}")
        self.load_state_dict({k: fused[k] for k in wanted}, strict=True)


def expert_views(layer: MoEFeedForward) -> dict[str, torch.Tensor]:
    """The published per-expert names of a layer's fused experts, relative to its ``mlp.``,
    each a view sharing the fused tensor's storage and version counter (an in-place
    ``copy_`` into it changes the layer, and its pre-packed copies refresh):
    ``experts.{e}.gate_proj.weight`` ``gate_up_proj[e, :I]``, ``experts.{e}.up_proj.weight``
    ``gate_up_proj[e, I:]`` (``[I, H]`` each) and ``experts.{e}.down_proj.weight``
    ``down_proj[e]`` (``[H, I]``). Views for writing (weight updates), not for training:
    gradients land on the fused parameters."""
    inner = layer.config.moe_intermediate_size
    gate_up = layer.experts.gate_up_proj.detach()
    down = layer.experts.down_proj.detach()
    views: dict[str, torch.Tensor] = {}
    for e in range(layer.config.num_experts):
        views[f"experts.{e}.gate_proj.weight"] = gate_up[e, :inner]
        views[f"experts.{e}.up_proj.weight"] = gate_up[e, inner:]
        views[f"experts.{e}.down_proj.weight"] = down[e]
    return views


def fuse_expert_tensors(state: Mapping[str, torch.Tensor], num_experts: int) -> dict[str, Any]:
    """``state`` (one layer's ``mlp.`` tensors, prefix stripped) with per-expert
    ``experts.{e}.{gate,up,down}_proj.weight`` replaced by the fused ``experts.gate_up_proj``
    ``[E, 2 * I, H]`` and ``experts.down_proj`` ``[E, H, I]``; already fused tensors pass
    through.

    Raises:
        KeyError: some experts' tensors given but not all (the missing ones named).
    """
    out: dict[str, Any] = {}
    per_expert: dict[tuple[int, str], torch.Tensor] = {}
    for key, value in state.items():
        match = _EXPERT_KEY.fullmatch(key)
        if match:
            per_expert[(int(match[1]), match[2])] = value
        else:
            out[key] = value
    if not per_expert:
        return out
    names = ("gate_proj", "up_proj", "down_proj")
    missing = [
        f"experts.{e}.{n}.weight"
        for e in range(num_experts)
        for n in names
        if (e, n) not in per_expert
    ]
    if missing:
        raise KeyError(f"missing MoE expert tensors: {missing[:5]}")
    gate_up = [
        torch.cat([per_expert[(e, "gate_proj")], per_expert[(e, "up_proj")]])
        for e in range(num_experts)
    ]
    out["experts.gate_up_proj"] = torch.stack(gate_up)
    out["experts.down_proj"] = torch.stack(
        [per_expert[(e, "down_proj")] for e in range(num_experts)]
    )
    return out
