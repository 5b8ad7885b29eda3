"""VoxCPM2 packed scoring: ``score`` of 8 SDE rollout samples (stop and SDE log-probs) in one
packed teacher-forced forward (``batch_size=8``) against one forward per sample
(``batch_size=1``, the path before packing), forward alone and forward + backward on a
trainer's copy.

The folder is the tiny one (``omnistep.models.voxcpm.tiny``) with its LM widened to
``--hidden`` (head dim 64) and ``--layers`` per stack, the LocEnc / LocDiT to ``--hidden // 2``
and the published ``feat_dim`` 64, random weights written by omnistep's modules (the AudioVAE
stays tiny: scoring does not run it). Samples: ``flow_noise_level`` 0.7, at most
``--patches`` patches, ``--timesteps`` Euler steps; the times are the median of ``--reps``
calls on ``--threads`` threads.

    PYTHONPATH=. .venv/bin/python bench/voxcpm_score.py [--hidden 1024 --layers 2]

Prints one JSON line per (mode, batch_size) and the packed / one-at-a-time ratios.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from omnistep.core import SamplingParams
from omnistep.offline import OmniEngine


def _time(reps: int, fn, *args) -> float:  # noqa: ANN001
    """Median wall seconds of ``reps`` calls after a warm-up."""
    fn(*args)
    walls = []
    for _ in range(reps):
        start = time.perf_counter()
        fn(*args)
        walls.append(time.perf_counter() - start)
    return statistics.median(walls)


def write_wide_folder(root: Path, hidden: int, layers: int, seed: int = 0) -> Path:
    """The tiny folder with a wider, deeper LM and a wider LocEnc / LocDiT (see the module
    docstring); returns ``root``."""
    from safetensors.torch import save_file

    from omnistep.models.voxcpm.config import VoxCPMConfig
    from omnistep.models.voxcpm.lm import VoxCPMBackbone
    from omnistep.models.voxcpm.tiny import tiny_config, write_folder

    write_folder(root, seed=seed)  # tokenizer, AudioVAE
    config = tiny_config(head_dim=64)
    lm = config["lm_config"]
    lm.update(hidden_size=hidden, intermediate_size=hidden * 11 // 4, num_hidden_layers=layers)
    lm.update(num_attention_heads=hidden // 64, num_key_value_heads=2)
    config.update(feat_dim=64, residual_lm_num_layers=layers)
    config["audio_vae_config"]["latent_dim"] = 64
    for key in ("encoder_config", "dit_config"):
        config[key].update(hidden_dim=hidden // 2, ffn_dim=hidden * 11 // 8, num_layers=layers)
        config[key]["num_heads"] = hidden // 128
    (root / "config.json").write_text(json.dumps(config, indent=2))
    # the AudioVAE's latent width follows feat_dim: rewrite it too
    from omnistep.models.voxcpm.audio_vae import AudioVAEDecoder, AudioVAEEncoder

    parsed = VoxCPMConfig.from_file(root / "config.json")
    torch.manual_seed(seed)
    state = {}
    for name, value in VoxCPMBackbone(parsed).state_dict().items():
        if name == "embed_tokens.weight":
            name = "base_lm.embed_tokens.weight"
        elif name.startswith("estimator."):
            name = "feat_decoder." + name
        state[name] = value.contiguous()
    save_file(state, str(root / "model.safetensors"))
    vae = {}
    for part, module in (
        ("decoder", AudioVAEDecoder(parsed.audio_vae)),
        ("encoder", AudioVAEEncoder(parsed.audio_vae)),
    ):
        vae.update({f"{part}.{k}": v.contiguous() for k, v in module.state_dict().items()})
    save_file(vae, str(root / "audiovae.safetensors"))
    return root


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--patches", type=int, default=16)
    parser.add_argument("--timesteps", type=int, default=10)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch-invariant", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    root = write_wide_folder(Path(tempfile.mkdtemp()) / "voxcpm", args.hidden, args.layers)
    sampling = SamplingParams(flow_noise_level=0.7, max_new_tokens=args.patches)
    with OmniEngine(
        f"voxcpm={root}",
        batch_invariant=args.batch_invariant,
        kv_cache_gb=0.25,
        inference_timesteps=args.timesteps,
    ) as omni:
        groups = omni.rollout(["the cat sat on the mat"], n=8, seed=1, sampling=sampling,
                              progress=False)  # fmt: skip
        samples = list(groups[0].samples)
        lengths = [s.loops["decode"].tokens.shape[0] for s in samples]
        trainer = omni.trainer()
        trainer.weights()

        def forward(batch: int) -> None:
            with torch.no_grad():
                omni.score(samples, batch_size=batch)

        def backward(batch: int) -> None:
            scores = omni.score(samples, trainer=trainer, batch_size=batch)
            loss = sum(s["decode"].flow.sum() + s["decode"].logprobs.sum() for s in scores)
            loss.backward()

        alone, packed = omni.score(samples, batch_size=1), omni.score(samples, batch_size=8)
        diff = max(
            float(np.abs(a["decode"].flow.numpy() - b["decode"].flow.numpy()).max())
            for a, b in zip(alone, packed, strict=True)
        )
        times = {}
        for mode, fn in (("forward", forward), ("forward+backward", backward)):
            for batch in (1, 8):
                times[mode, batch] = _time(args.reps, fn, batch)
                print(json.dumps({"mode": mode, "batch_size": batch, "s": times[mode, batch]}))
    print(
        json.dumps(
            {
                "hidden": args.hidden,
                "layers": args.layers,
                "patches": lengths,
                "max_abs_diff_sde": diff,
                "ratio_forward": times["forward", 8] / times["forward", 1],
                "ratio_backward": times["forward+backward", 8] / times["forward+backward", 1],
            }
        )
    )


if __name__ == "__main__":
    main()
