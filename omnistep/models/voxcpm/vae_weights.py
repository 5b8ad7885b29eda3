"""AudioVAE weight updates under the published ``audiovae`` file's tensor names.

The loader folds upstream's weight norm (``weight_g`` ``[out, 1, 1]``, ``weight_v``: a conv's
weight ``g * v / ||v||``, the norm over every dim but 0; ``layers.weight_norm``), so
the modules hold plain ``weight`` tensors. ``VAEWeights`` names one part's (``decoder`` or
``encoder``) parameters as the file it was loaded from does: ``{part}.{name}`` for a tensor the
file holds as it is (biases, Snake ``alpha``, and every conv of a folder written with folded
weights), ``{part}.{base}.weight_g`` and ``.weight_v`` for a conv the file holds weight-normed.
An update of such a conv refolds its weight from the pair; a half sent alone is combined with
the other half of the current weight (``g = ||w||`` per output row, ``v = w``: the direction
kept), so ``v`` alone changes the direction and ``g`` alone the norms. A ``weight_v`` with an
output channel of norm 0 would fold to NaN: ``problems`` names it (``ModelInstance.
check_weights`` refuses the update before anything changes) and ``update`` refuses it.

Imports torch and ``omnistep.layers``.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from omnistep.layers.weight_norm import fold_weight_norm, weight_norm_problems

NORM_SUFFIXES = ("_g", "_v")
"""Upstream's weight-norm halves of a ``weight``: ``weight_g`` and ``weight_v``."""


def _row_norms(w: torch.Tensor) -> torch.Tensor:
    """``||w||`` over every dim but 0, shaped ``[out, 1, ...]`` as upstream's ``weight_g``."""
    return w.reshape(w.shape[0], -1).norm(dim=1).view(-1, *([1] * (w.ndim - 1)))


class VAEWeights:
    """One AudioVAE part's parameters by their names in the published file.

    Args:
        module: the loaded ``AudioVAEDecoder`` or ``AudioVAEEncoder`` (updated in place).
        part: ``"decoder"`` or ``"encoder"``, the file's name prefix.
        normed: the ``*.weight`` parameters the file holds as ``weight_g`` / ``weight_v``
            (``weight_normed``); names the module lacks are ignored.
    """

    def __init__(self, module: nn.Module, part: str, normed: frozenset[str] = frozenset()):
        self.module, self.part = module, part
        self._params = dict(module.named_parameters())
        # the file may hold tensors the module does not use (upstream's encoder
        # ``fc_logvar``): the loader skips them, and so do updates
        self._normed = frozenset(normed) & frozenset(self._params)

    def specs(self) -> dict[str, tuple[tuple[int, ...], str]]:
        """``published name -> (shape, dtype)`` of every tensor an update may send."""
        out: dict[str, tuple[tuple[int, ...], str]] = {}
        for name, p in self._params.items():
            dtype = str(p.dtype)
            if name in self._normed:
                g_shape = (p.shape[0], *([1] * (p.ndim - 1)))
                out[f"{self.part}.{name}_g"] = (g_shape, dtype)
                out[f"{self.part}.{name}_v"] = (tuple(p.shape), dtype)
            else:
                out[f"{self.part}.{name}"] = (tuple(p.shape), dtype)
        return out

    def problems(self, tensors: Mapping[str, object]) -> list[str]:
        """One line per ``weight_v`` of ``tensors`` with an output channel of norm 0 (or not
        finite): its fold would be NaN (``layers.weight_norm.weight_norm_problem``); for a
        ``weight_g`` sent alone, the current weight stands for ``v`` and is checked so."""
        prefix = f"{self.part}."
        directions = {f"{prefix}{name}_v": 0 for name in self._normed}
        kept_v = {}  # a g sent alone: v is the current weight
        for key in tensors:
            v_name = key.removesuffix("_g") + "_v"
            if key.endswith("_g") and v_name in directions and v_name not in tensors:
                kept_v[v_name] = self._params[v_name[len(prefix) : -2]]
        return list(weight_norm_problems({**tensors, **kept_v}, directions).values())

    @torch.no_grad()
    def update(self, tensors: Mapping[str, object]) -> None:
        """Copy ``tensors`` (published names, checked against ``specs`` by
        ``ModelInstance.check_weights``; torch tensors or numpy arrays) into the module in
        place, weight-normed convs refolded (see the module docstring). Every fold is made
        before anything is copied, so a refused update changes nothing.

        Raises:
            KeyError: a name ``specs`` does not list (callers check first).
            WeightNormError: a ``weight_v`` with an output channel of norm 0 (named).
        """
        prefix = f"{self.part}."
        pairs: dict[str, dict[str, torch.Tensor]] = {}
        plain: dict[str, torch.Tensor] = {}
        for key, value in tensors.items():
            if not key.startswith(prefix):
                raise KeyError(key)
            name, tensor = key[len(prefix) :], torch.as_tensor(value)
            base, half = name[:-2], name[-2:]
            if half in NORM_SUFFIXES and base in self._normed:
                pairs.setdefault(base, {})[half] = tensor
            elif name in self._params and name not in self._normed:
                plain[name] = tensor
            else:
                raise KeyError(key)
        for base, halves in pairs.items():
            w = self._params[base]
            g = halves.get("_g", _row_norms(w)).to(w.device, w.dtype)
            v = halves.get("_v", w).to(w.device, w.dtype)
            plain[base] = fold_weight_norm(g, v, 0, f"{prefix}{base}_v")
        for name, tensor in plain.items():
            self._params[name].copy_(tensor)


def weight_normed(raw: Mapping[str, object], part: str) -> frozenset[str]:
    """The ``{part}.*`` weights a raw AudioVAE state dict holds weight-normed (those with a
    ``weight_v``), under the module's names (``model.0.weight``)."""
    prefix = f"{part}."
    return frozenset(
        name[len(prefix) : -len("_v")]
        for name in raw
        if name.startswith(prefix) and name.endswith(".weight_v")
    )
