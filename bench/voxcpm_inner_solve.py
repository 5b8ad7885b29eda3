"""Time of one VoxCPM2 AR step with the LocDiT solve inside the AR unit, and the solve's share.

What it measures
----------------
``VoxCPMAR`` (random weights, float32, this machine's CPU, ``--threads`` torch threads) on a
20-token zero-shot prompt, C requests batched (``--batches``, default 1 and 8): the median
over 8 decode steps of the wall time of one ``AR_TOKEN`` batch (both LMs, the stop decision
and every request's LocDiT solve: 10 Euler steps, each a conditional and an unconditional
forward of the batch) and of the LocDiT solve alone on a batch of the same size. Widths:
``--lm-width`` (base LM 4 layers, residual LM 2), ``--dit-width`` (LocDiT and LocEnc, 4 and 2
layers), ``feat_dim`` 64, patch 4.

The alternative, each Euler step a WorkUnit of its own, was built and measured against this
form in one run on branch ``voxunit`` (commit e8b2945: ``VoxCPMOptions(inner_solve="units")``,
``models/voxcpm/solve.py``, bit-equal to this form under ``batch_invariant``, and this script's
version there timing both); it lost (5 % less C=8 throughput, 13 % higher C=8 TTFA p99, 7x the
units), so it was removed. The figures and why: docs/models/voxcpm.md, "The inner solve".

Run: ``PYTHONPATH=. python bench/voxcpm_inner_solve.py [--threads 1] [--batches 1 8]``.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from omnistep.core import WorkUnitKind
from omnistep.kv import KVCacheConfig
from omnistep.loops.ar_decode import ARPrefillInput, ARStepInput
from omnistep.models.voxcpm.ar import VoxCPMAR, VoxCPMPrompt, stop_sampling
from omnistep.models.voxcpm.config import VoxCPMConfig
from omnistep.models.voxcpm.lm import VoxCPMBackbone, build_prompt
from omnistep.models.voxcpm.tiny import tiny_config

FEAT, PATCH, STEPS = 64, 4, 8


def _backbone(lm_width: int, dit_width: int) -> VoxCPMBackbone:
    cfg = tiny_config(head_dim=64)
    cfg["lm_config"].update(
        hidden_size=lm_width,
        intermediate_size=lm_width * 11 // 4,
        num_attention_heads=lm_width // 64,
        num_key_value_heads=2,
        num_hidden_layers=4,
    )
    cfg["residual_lm_num_layers"] = 2
    cfg["feat_dim"] = FEAT
    heads = dit_width // 64
    cfg["encoder_config"] = {
        "hidden_dim": dit_width,
        "ffn_dim": dit_width * 3,
        "num_heads": heads,
        "num_layers": 2,
    }
    cfg["dit_config"].update(
        hidden_dim=dit_width, ffn_dim=dit_width * 3, num_heads=heads, num_layers=4
    )
    cfg["audio_vae_config"]["latent_dim"] = FEAT
    folder = Path(tempfile.mkdtemp())
    (folder / "config.json").write_text(json.dumps(cfg))
    torch.manual_seed(0)
    return VoxCPMBackbone(VoxCPMConfig.from_file(folder / "config.json")).eval()


def measure(backbone: VoxCPMBackbone, batch: int) -> tuple[float, float]:
    """Median seconds of one AR step and of the LocDiT solve alone, for ``batch`` requests."""
    ar = VoxCPMAR(backbone, KVCacheConfig(num_blocks=256, block_size=16))
    prompt = VoxCPMPrompt(build_prompt(list(range(110, 130)), PATCH, FEAT))
    gens = [torch.Generator().manual_seed(i) for i in range(batch)]
    row = stop_sampling(2)
    units = [ARPrefillInput(f"s{i}", prompt, (), (), row, g) for i, g in enumerate(gens)]
    outs = ar.execute(WorkUnitKind.PREFILL, units)
    dit = backbone.estimator
    steps, solves = [], []
    for step in range(1, STEPS + 1):
        units = [
            ARStepInput(f"s{i}", o.tokens, step, (), row, gens[i], extra=o.hidden)
            for i, o in enumerate(outs)
        ]
        start = time.perf_counter()
        outs = ar.execute(WorkUnitKind.AR_TOKEN, units)
        steps.append(time.perf_counter() - start)
        mu = torch.randn(batch, 2 * dit.width)  # [lm_to_dit(lm), res_to_dit(res)]
        cond, noise = torch.randn(batch, FEAT, PATCH), torch.randn(batch, FEAT, PATCH)
        with torch.no_grad():
            start = time.perf_counter()
            dit.solve(mu, cond, noise, 10, torch.full((batch,), 2.0))
            solves.append(time.perf_counter() - start)
    return sorted(steps)[STEPS // 2], sorted(solves)[STEPS // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--lm-width", type=int, default=1024)
    parser.add_argument("--dit-width", type=int, default=512)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    backbone = _backbone(args.lm_width, args.dit_width)
    for batch in args.batches:
        step, solve = measure(backbone, batch)
        print(
            f"C={batch}: AR step {step * 1e3:.1f} ms, LocDiT solve alone {solve * 1e3:.1f} ms "
            f"({solve / step:.0%} of the step), {step / batch * 1e3:.1f} ms per patch"
        )


if __name__ == "__main__":
    main()
