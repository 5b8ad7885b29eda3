"""Weight norm folded into a plain weight: ``w = g * v / ||v||``.

Weight normalization (Salimans & Kingma 2016, arXiv 1602.07868) stores a weight as a magnitude
``g`` and a direction ``v``; ``||v||`` is the L2 norm over every dim of ``v`` but ``dim`` (the
output channels, dim 0, for the convs and linears of every family here). Checkpoints name the
halves either by ``torch.nn.utils.weight_norm``'s hooks (``X.weight_g`` / ``X.weight_v``:
VoxCPM's AudioVAE) or by ``torch.nn.utils.parametrizations.weight_norm``
(``X.parametrizations.weight.original0`` / ``original1``: ChatTTS's heads, Higgs Audio v2's
codec, Chatterbox's HiFT). Both of torch's forms compute the weight with ``torch._weight_norm``;
``fold_weight_norm`` calls it too, so a folded weight equals, bit for bit, what the upstream
model computes from the same tensors.

A ``v`` with an output channel of zero norm (an all-zero slice) folds to NaN, as in torch;
``fold_weight_norm`` refuses it (``WeightNormError``, naming the tensor), and
``weight_norm_problem`` says so without folding (weight-update checks).

Imports torch and ``omnistep.core`` only.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from omnistep.core.errors import OmnistepError

PARAMETRIZED_G = ".parametrizations.weight.original0"
PARAMETRIZED_V = ".parametrizations.weight.original1"
"""The state-dict name suffixes of ``torch.nn.utils.parametrizations.weight_norm``'s ``g`` and
``v`` (of a module's ``weight``)."""


class WeightNormError(OmnistepError, ValueError):
    """A weight-norm ``v`` with an output channel whose norm is zero or not finite (the folded
    weight would be NaN/Inf there), or a ``g`` that does not fit ``v``.

    Attributes:
        name: the offending tensor's checkpoint name.
    """

    def __init__(self, message: str, name: str):
        super().__init__(message)
        self.name = name


def _dim(v: torch.Tensor, dim: int, name: str) -> int:
    """``dim``, checked to be one of ``v``'s. Raises WeightNormError otherwise (a negative
    ``dim`` too: torch's ``-1`` means one norm over the whole tensor, which no checkpoint
    here uses)."""
    if not 0 <= dim < v.ndim:
        raise WeightNormError(
            f"weight-norm tensor '{name}' of shape {list(v.shape)} has no dim {dim}", name
        )
    return dim


def weight_norm_problem(v: object, dim: int = 0, name: str = "weight_v") -> str | None:
    """Why ``v`` cannot be folded, or None: an output channel (index along ``dim``) whose
    ``||v||`` over the other dims is 0 or not finite. A tensor without values (``meta``
    device) has none. ``v``: a torch tensor or numpy array, any floating dtype."""
    v = torch.as_tensor(v)
    if v.device.type == "meta" or v.numel() == 0:
        return None
    axis = _dim(v, dim, name)
    others = [d for d in range(v.ndim) if d != axis]
    with torch.no_grad():
        norms = torch.linalg.vector_norm(v.float(), dim=others) if others else v.float().abs()
        bad = torch.nonzero((norms == 0) | ~torch.isfinite(norms)).flatten().tolist()
    if not bad:
        return None
    shown = ", ".join(str(i) for i in bad[:8]) + (", ..." if len(bad) > 8 else "")
    return (
        f"weight-norm tensor '{name}' has ||v|| = 0 or not finite in {len(bad)} of "
        f"{v.shape[axis]} output channel(s) (dim {axis}: {shown}); g * v / ||v|| would be NaN"
    )


def fold_weight_norm(
    g: torch.Tensor, v: torch.Tensor, dim: int = 0, name: str = "weight_v"
) -> torch.Tensor:
    """The weight ``g * v / ||v||``, the norm over every dim of ``v`` but ``dim``.

    Computed by ``torch._weight_norm(v, g, dim)``, the kernel ``torch.nn.utils.weight_norm``
    and ``torch.nn.utils.parametrizations.weight_norm`` run (their default ``dim=0``);
    differentiable in ``g`` and ``v``.

    Args:
        g: the magnitudes, ``v.shape[dim]`` values: ``[out, 1, ...]`` as checkpoints store it
            (any shape of that many elements is taken).
        v: the direction, e.g. ``[out, in]`` (a linear) or ``[out, in, kernel]`` (a conv;
            ``[in, out, kernel]`` for a transposed conv, still ``dim=0`` as torch's default).
        dim: the dim that keeps its size in ``||v||`` (``0 <= dim < v.ndim``).
        name: ``v``'s checkpoint name, for the error.

    Returns:
        ``[*v.shape]`` in ``v``'s dtype.

    Raises:
        WeightNormError: an output channel with ``||v||`` 0 or not finite, or ``g`` with
            another number of elements than ``v.shape[dim]`` (naming ``name``).
    """
    axis = _dim(v, dim, name)
    if g.numel() != v.shape[axis]:
        raise WeightNormError(
            f"weight-norm tensor '{name}' {list(v.shape)} takes {v.shape[axis]} magnitudes "
            f"(g) along dim {axis}, got g {list(g.shape)}",
            name,
        )
    problem = weight_norm_problem(v.detach(), axis, name)
    if problem is not None:
        raise WeightNormError(problem, name)
    shape = [1] * v.ndim
    shape[axis] = v.shape[axis]
    return torch._weight_norm(v, g.reshape(shape), axis)


def checkpoint_dim(g: torch.Tensor, v: torch.Tensor, name: str = "weight_v") -> int:
    """The dim a checkpoint's weight norm keeps, read from ``g``'s shape: torch stores ``g``
    as ``||v||`` with that dim kept and every other dim 1 (``[out, 1, 1]`` for dim 0;
    ``[1, 1, K]`` for HuBERT's positional conv, ``weight_norm(conv, dim=2)``); 0 where both
    fit.

    Raises:
        WeightNormError: ``g``'s shape fits no dim of ``v`` (naming ``name``).
    """
    fits = [
        d
        for d in range(v.ndim)
        if g.ndim == v.ndim
        and all(g.shape[i] == (v.shape[d] if i == d else 1) for i in range(v.ndim))
    ]
    if not fits:
        raise WeightNormError(
            f"weight-norm tensor '{name}' {list(v.shape)}: its g {list(g.shape)} keeps no "
            "dim of it",
            name,
        )
    return fits[0]


def fold_parametrized(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A state dict with every ``X.parametrizations.weight.original0`` / ``original1`` pair
    (``torch.nn.utils.parametrizations.weight_norm``) replaced by ``X.weight``
    (``fold_weight_norm`` along the dim ``g``'s shape shows: ``checkpoint_dim``); other
    tensors as they are.

    Raises:
        KeyError: an ``original0`` without its ``original1`` (the missing name).
        WeightNormError: see ``fold_weight_norm`` and ``checkpoint_dim``.
    """
    out = {k: t for k, t in tensors.items() if not k.endswith((PARAMETRIZED_G, PARAMETRIZED_V))}
    for key, g in tensors.items():
        if key.endswith(PARAMETRIZED_G):
            base = key.removesuffix(PARAMETRIZED_G)
            v_name = base + PARAMETRIZED_V
            if v_name not in tensors:
                raise KeyError(v_name)
            v = tensors[v_name]
            out[f"{base}.weight"] = fold_weight_norm(g, v, checkpoint_dim(g, v, v_name), v_name)
    return out


def weight_norm_problems(
    tensors: Mapping[str, object], directions: Mapping[str, int]
) -> dict[str, str]:
    """``name -> problem`` for each tensor of a weight update that is a weight-norm ``v`` (its
    name in ``directions``, mapped to its ``dim``) and cannot be folded
    (``weight_norm_problem``); empty when all can."""
    problems = {}
    for name, value in tensors.items():
        if name in directions:
            problem = weight_norm_problem(value, directions[name], name)
            if problem is not None:
                problems[name] = problem
    return problems


def check_weight_norms(tensors: Mapping[str, object], directions: Mapping[str, int]) -> None:
    """Raises WeightNormError (naming the first bad tensor, listing all) when
    ``weight_norm_problems`` finds any."""
    problems = weight_norm_problems(tensors, directions)
    if problems:
        raise WeightNormError("; ".join(problems.values()), next(iter(problems)))
