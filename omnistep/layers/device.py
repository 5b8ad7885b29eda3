"""Check a ``--device`` string against what this torch build can run on."""

from __future__ import annotations

import torch

from omnistep.core import DeviceUnavailableError


def check_device(device: str | torch.device) -> torch.device:
    """``device`` as a torch.device, once torch can use it.

    Called by the component builders of torch families before they allocate or read anything,
    so that ``--device cuda`` on a machine without CUDA is one clear error, not a traceback
    from deep inside torch.

    Raises:
        DeviceUnavailableError: not a torch device string; CUDA asked but this torch build has
            none or sees no GPU; a CUDA index beyond the visible GPUs.
    """
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise DeviceUnavailableError(f"bad device {device!r}: {exc}") from None
    if dev.type != "cuda":
        return dev
    if not torch.cuda.is_available():
        why = (
            "this torch build has no CUDA (a CPU build)"
            if torch.version.cuda is None
            else "torch sees no CUDA GPU"
        )
        raise DeviceUnavailableError(f"--device {device}: {why}; use --device cpu")
    count = torch.cuda.device_count()
    if dev.index is not None and dev.index >= count:
        raise DeviceUnavailableError(
            f"--device {device}: only {count} CUDA device(s) visible (cuda:0 to cuda:{count - 1})"
        )
    return dev
