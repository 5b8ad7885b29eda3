"""Timing on the bench's ``--device``: one place for what CPU and CUDA timing need.

CUDA kernels run asynchronously: a wall-clock interval around a GPU region measures only the
launches unless the device is synchronised at both ends. ``now(device)`` waits for every kernel
queued on ``device`` (``torch.cuda.synchronize``), then reads ``time.perf_counter()``; on the
CPU it is ``time.perf_counter()`` alone. ``device_info`` records what ran the numbers.

Imported by ``bench/ar_decode.py`` and ``bench/rollout.py`` (``bench/`` is not a package: they
put this folder on ``sys.path``).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from omnistep.layers.device import check_device

DEVICES = ("cpu", "cuda")
"""``--device`` choices of the benches (``cuda`` is the current CUDA device, ``cuda:0``)."""


def resolve_device(name: str) -> torch.device:
    """``name`` (``cpu``, ``cuda``, ``cuda:N``) as a torch.device this torch can run on.

    Raises:
        omnistep.core.DeviceUnavailableError: CUDA asked where torch has none (the same
            message ``omnistep serve --device cuda`` gives).
    """
    return check_device(name)


def synchronize(device: torch.device | str) -> None:
    """Wait for the kernels queued on ``device`` (CUDA); nothing to wait for on the CPU."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def now(device: torch.device | str) -> float:
    """``time.perf_counter()`` seconds after the work queued on ``device`` has finished."""
    synchronize(device)
    return time.perf_counter()


def device_info(device: torch.device | str) -> dict[str, Any]:
    """What ran the numbers: the device, and for CUDA the GPU's name, memory (GiB), the CUDA
    version torch was built with and whether float32 matmuls may use TF32 (they may not by
    default: both sides of every comparison then run plain float32 GEMMs)."""
    device = torch.device(device)
    info: dict[str, Any] = {"device": str(device), "torch": torch.__version__}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(
            gpu=props.name,
            gpu_memory_gib=round(props.total_memory / 2**30, 1),
            multiprocessors=props.multi_processor_count,
            cuda=torch.version.cuda,
            allow_tf32_matmul=torch.backends.cuda.matmul.allow_tf32,
            float32_matmul_precision=torch.get_float32_matmul_precision(),
        )
    return info
