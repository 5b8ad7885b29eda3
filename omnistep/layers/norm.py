"""RMSNorm as in Llama. Imports torch only.

Formula and parameter layout follow transformers' ``LlamaRMSNorm`` (models/llama/modeling_llama.py)
exactly: normalise in float32, cast back to the input dtype, then scale by ``weight``.
"""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """``weight * (x / sqrt(mean(x**2, -1) + eps))``, the mean taken in float32.

    Args:
        hidden_size: size of the last dimension.
        eps: added to the mean square before the reciprocal square root.

    Shapes: ``x`` ``[..., hidden_size]`` of any float dtype -> same shape; the result dtype is
    ``weight.dtype`` promoted with ``x.dtype`` (as in transformers).
    """

    def __init__(
        self,
        hidden_size: int,
        eps: float = 1e-6,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        input_dtype = x.dtype
        x = x.to(torch.float32)
        variance = x.pow(2).mean(-1, keepdim=True)
        x = x * torch.rsqrt(variance + self.eps)
        return self.weight * x.to(input_dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"
