"""Parity gates: helpers that run requests alone and interleaved, and compare their outputs.

Imports ``omnistep.core`` and ``omnistep.engine`` only; used by tests and benchmarks.
"""

from omnistep.parity.gates import Collected, collect, run_alone, run_interleaved

__all__ = ["Collected", "collect", "run_alone", "run_interleaved"]
