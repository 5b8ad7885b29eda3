"""``PackedLinear``: an ``nn.Linear`` whose CPU inference runs on a oneDNN pre-packed weight.

Imports torch only. On CPU, ``F.linear`` hands each call to a GEMM that re-reads the weight in
its stored ``[out, in]`` layout. oneDNN can reorder the weight once into the blocked layout its
kernels read (``torch.ops.mkldnn._reorder_linear_weight``, the call PyTorch's Inductor makes when
it freezes a CPU graph) and then run ``torch.ops.mkldnn._linear_pointwise`` on plain dense inputs.
Measured on this project's 2-core AVX2 machine, the 7 GEMMs of one ChatTTS layer (hidden 768,
MLP 3072) take 3.4 ms instead of 4.2 ms for 1 input row and 6.6 ms instead of 11 ms for 16 rows.

The packed kernels were also found batch-invariant on that machine: with the weight packed for
64 rows, every row's result was bit-identical for every row count from 1 to 600, in every row
position (``F.linear`` gives a row one result at M = 1, another at M = 2..3, a third at M >= 4).
That is a property of the kernels oneDNN picks for a CPU and thread count, not a promise, so each
layer checks it on a probe when it packs (``batch_invariant``) and callers that need invariance
(``LlamaModel`` in batch-invariant mode) fall back to fixed-size row chunks when it fails.

The packed copy is made lazily on the first CPU float32 call, and again whenever the weight or
bias changes in place (``load_state_dict`` and optimizer steps included: tensors carry a version
counter). It is an extra copy of the weight: weights take twice the memory on CPU. Every other
case (CUDA, other dtypes, oneDNN missing) is plain ``F.linear``.

Calls that build an autograd graph (a trainer's teacher-forced ``score``) run the same packed
kernel forward, so their outputs are bit-identical to serving's, through ``_PackedLinearFn``,
whose backward is the plain linear gradient (``grad_x = g @ W``, ``grad_W = g^T x``,
``grad_b = sum g``; no double backward).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Hashable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

#: Rows the weight is packed for; oneDNN picks its blocking from it (any row count still runs).
PACK_ROWS = 64
#: Row counts of the batch-invariance probe: a row's result must be the same in all of them.
_PROBE_ROWS = (1, 2, 5, 17, 40)
#: Guards lazy packing when two executor threads call one layer (a module-level lock keeps the
#: module picklable and deep-copyable).
_PACK_LOCK = threading.Lock()


def _mkldnn_linear_available() -> bool:
    ops = getattr(torch.ops, "mkldnn", None)
    return (
        torch.backends.mkldnn.is_available()
        and ops is not None
        and hasattr(ops, "_reorder_linear_weight")
        and hasattr(ops, "_linear_pointwise")
    )


_AVAILABLE = _mkldnn_linear_available()


def tensor_version(t: torch.Tensor) -> tuple[int, int, int, int]:
    """Identifies a tensor's current values: the tensor, its data pointer, its in-place version
    counter (an optimizer step, ``copy_`` or ``load_state_dict`` bumps it; a ``fused=True``
    optimizer step does not, torch 2.13) and its storage. Keys of copies derived from weights.

    A cache keyed by it must hold ``pin_storage(t)`` while the key is in use: ``t.data = new``
    keeps the version counter, and a storage freed and made again can land at the same
    addresses; a weak reference to the storage keeps its identity from being reused. Changes
    that bypass the version counter (``t.data.copy_(...)``) are not seen."""
    return (id(t), t.data_ptr(), t._version, t.untyped_storage()._cdata)


def pin_storage(t: torch.Tensor) -> StorageWeakRef:
    """A weak reference to ``t``'s storage: while it lives, no other storage gets the identity
    ``tensor_version`` records (it does not keep the storage's memory)."""
    return StorageWeakRef(t.untyped_storage())


class _PackedLinearFn(torch.autograd.Function):
    """The packed oneDNN kernel forward, the plain linear gradient backward."""

    @staticmethod
    def forward(ctx, x, weight, bias, packed):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        b = None if bias is None else bias.detach()
        return torch.ops.mkldnn._linear_pointwise(x, packed, b, "none", [], "")

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        g = grad.reshape(-1, grad.shape[-1])  # [M, out]
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = (g @ weight).reshape(x.shape)
        if ctx.needs_input_grad[1]:
            grad_w = g.T @ x.reshape(-1, x.shape[-1])
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = g.sum(0)
        return grad_x, grad_w, grad_b, None


def _run_packed(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, packed: torch.Tensor
) -> torch.Tensor:
    """The packed kernel on ``x``; through ``_PackedLinearFn`` when autograd needs a graph."""
    if torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (x, weight, bias)
    ):
        return _PackedLinearFn.apply(x, weight, bias, packed)
    bias = None if bias is None else bias.detach()
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


#: ``derived_copy``'s copies: (``id(weight)``, tag) -> (weak reference to it, its version,
#: copy, its storage pinned).
_COPIES: dict[tuple[int, Hashable], tuple[weakref.ref, tuple[int, ...], Any, StorageWeakRef]] = {}


def derived_copy(weight: torch.Tensor, tag: Hashable, make: Callable[[torch.Tensor], Any]) -> Any:
    """``make(weight.detach())`` (a packed layout of a weight), kept per weight tensor and
    ``tag`` (by identity; dropped when the tensor is freed) and made again when the tensor
    changes in place (``tensor_version``).

    Raises:
        whatever ``make`` raises (nothing is kept then).
    """
    version = tensor_version(weight)
    slot = (version[0], tag)
    entry = _COPIES.get(slot)
    if entry is None or entry[0]() is not weight or entry[1] != version:
        with _PACK_LOCK:
            copy = make(weight.detach())
            ref = weakref.ref(weight, lambda _, slot=slot: _COPIES.pop(slot, None))
            entry = (ref, version, copy, pin_storage(weight))
            _COPIES[slot] = entry
    return entry[2]


def packs_on_cpu(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``x`` and ``weight`` can take a oneDNN pre-packed path: CPU float32, oneDNN
    present, a weight with a version counter (not an inference tensor)."""
    return (
        _AVAILABLE
        and x.device.type == "cpu"
        and x.dtype == torch.float32
        and weight.dtype == torch.float32
        and not weight.is_inference()  # no version counter: in-place changes go unseen
    )


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for weights held as plain tensors (heads, projections,
    per-codebook tables), on a oneDNN pre-packed copy of ``weight`` where ``PackedLinear``
    would use one (``packs_on_cpu``): ``[..., in]`` -> ``[..., out]``, the same values as
    ``PackedLinear`` with that weight (autograd included).

    The packed copy is a ``derived_copy``. A 2048 x 1024 head at 4 rows: 0.2 ms instead of
    0.7-0.9 ms through ``F.linear`` (this project's AVX-512 box).
    """
    return _linear_of(x, weight, bias, weight, "linear", lambda w: w)


def stacked_linear(x: torch.Tensor, stacked: torch.Tensor, index: int) -> torch.Tensor:
    """``F.linear(x, stacked[index])`` for weights kept stacked ``[n, out, in]`` (a MoE
    layer's experts), as ``linear`` does it: on a pre-packed copy of ``stacked[index]`` kept
    per (``stacked``, ``index``) where ``packs_on_cpu``; gradients reach ``stacked``."""
    return _linear_of(x, stacked[index], None, stacked, ("stacked", index), lambda w: w[index])


def _linear_of(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    owner: torch.Tensor,
    tag: Hashable,
    pick: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, on the packed ``pick(owner)`` (== ``weight``) when it can."""
    if not (packs_on_cpu(x, weight) and weight.dim() == 2):
        return F.linear(x, weight, bias)
    try:
        packed = derived_copy(
            owner,
            tag,
            lambda w: torch.ops.mkldnn._reorder_linear_weight(pick(w).contiguous(), PACK_ROWS),
        )
    except RuntimeError:  # a CPU without the kernels this dtype needs
        return F.linear(x, weight, bias)
    return _run_packed(x, weight, bias, packed)


class PackedLinear(nn.Linear):
    """``nn.Linear`` (same parameters, same ``state_dict``) with pre-packed CPU inference.

    Input ``[..., in_features]`` float32 on CPU -> ``[..., out_features]`` float32, equal to
    ``F.linear`` within float32 rounding (about 1e-6 relative); with autograd on, the same
    values, differentiable (module docstring). Other devices and dtypes run ``F.linear``.
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._packed: torch.Tensor | None = None
        self._packed_key: tuple[int, ...] | None = None
        self._pinned: tuple[StorageWeakRef, ...] = ()
        self._invariant: bool | None = None
        self._pack_failed = False

    def __getstate__(self) -> dict:
        """Pickle and deepcopy without the packed copy (an opaque mkldnn tensor); it is made
        again on the next call."""
        state = dict(super().__getstate__())
        state.update(_packed=None, _packed_key=None, _invariant=None, _pinned=())
        return state

    def _packable(self, x: torch.Tensor) -> bool:
        w = self.weight
        return (
            _AVAILABLE
            and not self._pack_failed
            and x.device.type == "cpu"
            and x.dtype == torch.float32
            and w.dtype == torch.float32
        )

    def version_key(self) -> tuple[int, ...]:
        """Identifies the current weight and bias values (``tensor_version`` of each). A copy
        derived from them is fresh while this key is unchanged."""
        key = tensor_version(self.weight)
        return key if self.bias is None else (*key, *tensor_version(self.bias))

    def packed_weight(self) -> torch.Tensor | None:
        """The oneDNN-packed weight (an mkldnn tensor), made or refreshed if stale; None when
        packing is not possible here."""
        key = self.version_key()
        if self._packed is not None and self._packed_key == key:
            return self._packed
        with _PACK_LOCK:
            if self._packed is None or self._packed_key != key:
                try:
                    w = self.weight.detach().contiguous()
                    self._packed = torch.ops.mkldnn._reorder_linear_weight(w, PACK_ROWS)
                except RuntimeError:  # a CPU without the kernels this dtype needs
                    self._pack_failed = True
                    self._packed = None
                    return None
                self._packed_key = key
                self._pinned = tuple(
                    pin_storage(t) for t in (self.weight, self.bias) if t is not None
                )
                self._invariant = None
        return self._packed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[..., in_features]`` -> ``[..., out_features]``."""
        if self._packable(x):
            packed = self.packed_weight()
            if packed is not None:
                return _run_packed(x, self.weight, self.bias, packed)
        return F.linear(x, self.weight, self.bias)

    @torch.inference_mode()
    def batch_invariant(self) -> bool:
        """Whether a CPU float32 row's output here does not depend on the other rows of its call.

        Checked once per packed weight on random rows: each row computed inside calls of
        ``_PROBE_ROWS`` rows, at the first and last positions, must agree bit for bit with the
        same row in the largest call. False when the packed path is not used here (then
        ``F.linear`` serves, which is not invariant).
        """
        w = self.weight
        if not (_AVAILABLE and w.device.type == "cpu" and w.dtype == torch.float32):
            return False
        if self.packed_weight() is None:
            return False
        if self._invariant is None:
            generator = torch.Generator().manual_seed(0)
            probe = torch.randn(max(_PROBE_ROWS), self.in_features, generator=generator)
            full = self.forward(probe)
            ok = True
            for rows in _PROBE_ROWS:
                for start in (0, max(_PROBE_ROWS) - rows):
                    part = self.forward(probe[start : start + rows])
                    ok = ok and torch.equal(part, full[start : start + rows])
            self._invariant = ok
        return self._invariant


def linears_batch_invariant(module: nn.Module) -> bool:
    """True when ``module`` has ``PackedLinear`` layers and every one is batch-invariant here
    (see ``PackedLinear.batch_invariant``); False if any is not, or if it has plain
    ``nn.Linear`` layers."""
    layers = [m for m in module.modules() if isinstance(m, nn.Linear)]
    return bool(layers) and all(isinstance(m, PackedLinear) and m.batch_invariant() for m in layers)
