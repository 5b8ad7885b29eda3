"""Hand an idle thread's OpenMP team back, so that idle teams do not slow down the busy one.

Torch's Linux CPU wheels run their intra-op parallelism (GEMMs, element-wise kernels) on
libgomp, GNU's OpenMP runtime, which keeps one team of worker threads per thread that ever
entered a parallel region, for as long as that thread lives. Between two parallel regions a
team's workers spin before they sleep, so that the next region starts without a futex wake:
300,000 spins by default, but only 100 once the process holds more libgomp threads than it has
CPUs (``gomp_managed_threads > gomp_available_cpus``, libgomp ``config/linux/wait.h``; the
spin counts are in ``env.c``). Idle teams count: the engine's two executor threads and the
thread that loaded the weights each keep a team, so on a 2-core machine every region of every
step pays a futex wake even when only one batch runs. A decode step of the full-size ChatTTS
GPT (thousands of small regions) took 85-110 ms in the engine against 55-60 ms in a process
holding one team; its 140 weight GEMMs alone, 45-50 ms against 30-37 ms (``bench/rollout.py``
figures, issue 12 notes).

``release_openmp_team`` frees the calling thread's team (OpenMP 5.0 ``omp_pause_resource_all``;
in libgomp, ``gomp_pause_host`` in ``team.c`` joins that thread's workers and lowers the managed
count; other threads' teams are untouched). The executor calls it on its worker threads after
each batch and on the event loop's thread before handing a batch over, so only the threads
computing at a given moment hold teams and a lone batch runs with libgomp's full spin. The next
region on a released thread starts a new team (one ``pthread_create`` per worker thread: tens
of microseconds against a batch's milliseconds).

Only libgomp is touched: LLVM's libomp implements the same call as a pause of the whole
runtime, so with any other OpenMP runtime (or none loaded) this is a no-op. Imports no torch.
"""

from __future__ import annotations

import ctypes
import functools
import sys
import threading
from collections.abc import Callable
from typing import ParamSpec, TypeVar

P = ParamSpec("P")
T = TypeVar("T")

_OMP_PAUSE_SOFT = 1  # omp_pause_resource_t, omp.h (libgomp frees the team either way)
_lock = threading.Lock()
_gomps: tuple[ctypes.CDLL, ...] = ()
_looked = False


def _loaded_libgomps() -> tuple[ctypes.CDLL, ...]:
    """Every libgomp this process has loaded, found in ``/proc/self/maps``: torch's copy, and
    any other a wheel vendors (ctranslate2's ``libgomp-<hash>.so``, loaded with faster-whisper,
    sorts before torch's); empty when there is none (torch not imported yet, another OpenMP
    runtime, not Linux)."""
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
            paths = {line.split()[-1] for line in maps if "libgomp" in line and "/" in line}
    except OSError:
        return ()
    libs = []
    for path in sorted(paths):
        try:
            lib = ctypes.CDLL(path)  # already mapped: dlopen returns the loaded copy
            lib.omp_pause_resource_all.argtypes = [ctypes.c_int]
            lib.omp_pause_resource_all.restype = ctypes.c_int
            libs.append(lib)
        except (OSError, AttributeError):  # not loadable, or a libgomp older than GCC 9
            continue
    return tuple(libs)


def _libgomps() -> tuple[ctypes.CDLL, ...]:
    """``_loaded_libgomps`` looked up once, after torch is imported (before that, no team can
    exist: the engine's own libraries do not use OpenMP)."""
    global _gomps, _looked
    if _looked:
        return _gomps
    if "torch" not in sys.modules:
        return ()
    with _lock:
        if not _looked:
            _gomps = _loaded_libgomps()
            _looked = True
    return _gomps


def release_openmp_team() -> bool:
    """Free the calling thread's idle libgomp team (see the module docstring).

    Call it on a thread that has finished its torch work for now. Every loaded libgomp frees
    the thread's team in it (each copy counts its own threads). Returns True when libgomp
    was found and freed the team (or the thread had none), False when there is no libgomp to
    call or the thread is inside a parallel region (libgomp refuses; nothing changes).
    Never raises.
    """
    libs = _libgomps()
    results = [lib.omp_pause_resource_all(_OMP_PAUSE_SOFT) == 0 for lib in libs]
    return bool(results) and all(results)


def releasing(fn: Callable[P, T]) -> Callable[P, T]:
    """``fn`` that frees its thread's OpenMP team when it returns or raises: for work handed
    to a pool thread (``run_in_executor``, ``asyncio.to_thread``) that then sits idle."""

    @functools.wraps(fn)
    def call(*args: P.args, **kwargs: P.kwargs) -> T:
        try:
            return fn(*args, **kwargs)
        finally:
            release_openmp_team()

    return call
