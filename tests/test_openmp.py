"""Idle OpenMP teams are handed back (``omnistep.engine.openmp``).

libgomp shortens every team's spin-wait once the process holds more OpenMP threads than CPUs,
so a team kept by an idle thread slows the busy one (measured in the module docstring). These
tests count the process's threads in a fresh interpreter (nothing else there starts or ends
threads while it counts): a thread that entered a parallel region with 2 intra-op threads owns
one libgomp worker thread until its team is freed.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

SCRIPT = r"""
import asyncio, json, os, threading, time
import torch
from omnistep.core import WorkUnitKind
from omnistep.engine.executor import InProcessExecutor
from omnistep.engine.openmp import release_openmp_team, releasing

torch.set_num_threads(2)

def threads():
    return len(os.listdir("/proc/self/task"))

def parallel_work():
    x = torch.ones(1 << 22)  # 4M elements: many grains, so a 2-thread parallel region
    x.mul_(3.0)
    return float(x.sum())

class Parallel:
    def execute(self, kind, payloads):
        return [parallel_work() + p for p in payloads]

out = {"base": threads()}
out["work"] = parallel_work()
out["main_team"] = threads()  # the main thread now keeps a team
out["main_released"] = release_openmp_team()
out["main_after_release"] = threads()

# a plain thread: its team lives as long as it does, unless released
hold, go = threading.Event(), threading.Event()
def worker(release):
    parallel_work()
    if release:
        out["worker_released"] = release_openmp_team()
    hold.set()
    go.wait()
for release in (False, True):
    hold.clear(); go.clear()
    t = threading.Thread(target=worker, args=(release,))
    t.start(); hold.wait()
    out[f"worker_alive_release_{release}"] = threads()
    go.set(); t.join()
    # a joined thread's libgomp worker exits on its own time (seconds on a loaded machine):
    # count the next case only once it is gone
    deadline = time.monotonic() + 20
    while threads() > out["base"] and time.monotonic() < deadline:
        time.sleep(0.01)

# releasing(): the wrapped call frees its team when it returns
def in_thread():
    releasing(parallel_work)()
    out["after_releasing"] = threads() - 1  # this thread itself does not count
t = threading.Thread(target=in_thread); t.start(); t.join()

async def engine_side():
    parallel_work()  # the loop's thread gets a team, as a model load would give it
    out["loop_team"] = threads()
    ex = InProcessExecutor(2)
    results = await asyncio.gather(*(ex.run(Parallel(), WorkUnitKind.AR_TOKEN, [k, 10 + k])
                                     for k in range(2)))
    out["results"] = [[r.output for r in batch] for batch in results]
    out["executor_idle"] = threads()  # 2 executor threads, no team anywhere
    ex.close()
asyncio.run(engine_side())
print(json.dumps(out))
"""


def run_script() -> dict:
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, cwd=REPO, timeout=120
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_idle_threads_keep_no_openmp_team():
    out = run_script()
    base, value = out["base"], 3.0 * (1 << 22)
    assert out["work"] == value
    # entering a 2-thread region gives the thread a team of one more thread...
    assert out["main_team"] == base + 1
    # ...which release_openmp_team (libgomp's omp_pause_resource_all) frees
    assert out["main_released"] is True
    assert out["main_after_release"] == base
    # a live thread keeps its team (itself + its worker) unless it releases it
    assert out["worker_alive_release_False"] == base + 2
    assert out["worker_released"] is True
    assert out["worker_alive_release_True"] == base + 1
    assert out["after_releasing"] == base
    # the executor: the loop's thread hands its team back before a batch, and each worker
    # after its batch; the results are the batches' own
    assert out["loop_team"] == base + 1
    assert out["results"] == [[value, value + 10], [value + 1, value + 11]]
    assert out["executor_idle"] == base + 2


SECOND_COPY = r"""
import ctypes, json, os, sys
import torch
from omnistep.engine.openmp import release_openmp_team

torch.set_num_threads(2)
ctypes.CDLL(sys.argv[1])  # a second libgomp, as a wheel vendors one (ctranslate2)
base = len(os.listdir("/proc/self/task"))
x = torch.ones(1 << 22)
x.mul_(3.0)  # 2-thread regions: the main thread gets a team in torch's libgomp
team = len(os.listdir("/proc/self/task"))
released = release_openmp_team()
print(json.dumps([base, team, released, len(os.listdir("/proc/self/task"))]))
"""


def test_torchs_team_is_freed_beside_another_libgomp(tmp_path):
    """A second libgomp in the process (faster-whisper's ctranslate2 vendors
    ``libgomp-<hash>.so``, whose path sorts before torch's) must not take the place of
    torch's: the team torch's libgomp made is the one freed."""
    import torch

    torch_gomp = Path(torch.__file__).parent / "lib" / "libgomp.so.1"
    if not torch_gomp.exists():
        pytest.skip("this torch does not ship libgomp")
    copy = tmp_path / "a" / "libgomp-copy.so.1"
    copy.parent.mkdir()
    copy.write_bytes(torch_gomp.read_bytes())
    result = subprocess.run(
        [sys.executable, "-c", SECOND_COPY, str(copy)],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    base, team, released, after = json.loads(result.stdout.strip().splitlines()[-1])
    assert team == base + 1 and released is True
    assert after == base
