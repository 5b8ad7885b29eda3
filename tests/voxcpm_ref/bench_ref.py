"""The VoxCPM2 reference (``voxcpm`` 2.0.3) for ``bench/families.py``: the published sizes from
its config classes, a folder written by its own classes, and one long-lived subprocess that
loads the model once and times text -> waveform calls.

Functions (run inside the overlay subprocess, ``Session.call`` or ``env.call_reference``):

- ``published_config(layers)``: ``config.json`` at VoxCPM2's published widths with ``layers``
  layers in each of the four MiniCPM stacks (base LM, residual LM, LocEnc, LocDiT; capped at
  the published depth). What ``voxcpm``'s config classes default (``VoxCPMConfig``:
  ``patch_size``, ``feat_dim``, ``residual_lm_num_layers``, the scalar quantizer;
  ``VoxCPMEncoderConfig`` / ``VoxCPMDitConfig``: width 1024, FFN 4096, 16 heads; ``CfmConfig``;
  ``AudioVAEConfigV2``: encoder 128, decoder 2048 channels, 16 kHz in, 48 kHz out) is read from
  them; ``MiniCPM4Config`` has no defaults, so the base LM's block is the published
  ``openbmb/VoxCPM2`` ``config.json``'s (``PUBLISHED_LM``: hidden 2048, MLP 6144, 16 heads, 2 KV
  heads of 128, 28 layers, no muP, LongRoPE), as are the published depths (LocEnc and LocDiT
  12 layers, ``residual_lm_no_rope``) and the LocEnc's and LocDiT's ``kv_channels`` 128 (their
  MiniCPM stacks share the LM's LongRoPE factors, one per pair of head dims).
- ``write_bench_weights(root, seed)``: ``upstream.write_weights`` (the published files
  ``model.safetensors`` and ``audiovae.pth``, written by ``VoxCPM2Model`` itself), then the
  stop head zeroed (``stop_head.weight``): both stop logits are 0, argmax picks "continue", so
  neither side stops before its cap (random weights would stop at an arbitrary step).
- ``bench_load(root, threads)``: ``VoxCPM2Model.from_local(optimize=False)`` on the CPU,
  float32 (the folder's ``dtype``), ``threads`` intra-op threads.
- ``bench_generate(text, max_len)``: upstream ``generate`` (the whole utterance, then one
  AudioVAE decode), timed; split into ``_inference`` (LMs + LocDiT) and the decode.
- ``bench_first_audio(text, max_len)``: upstream ``generate_streaming`` (a chunk per patch),
  the time to its first chunk and to its end.
- ``bench_noise(text, max_len, noises)``: ``generate`` with ``torch.randn`` replaced by the
  given LocDiT noises (``upstream._NoiseQueue``): the waveform, for the work check.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from tests.ref_overlay import ReferenceSession
from tests.voxcpm_ref.env import OVERLAY

PUBLISHED_LM: dict[str, Any] = {
    "bos_token_id": 1,
    "eos_token_id": 2,
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "max_position_embeddings": 32768,
    "num_attention_heads": 16,
    "num_hidden_layers": 28,
    "num_key_value_heads": 2,
    "kv_channels": 128,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000,
    "rope_scaling": {
        "type": "longrope",
        "long_factor": [1.0] * 64,
        "short_factor": [1.0] * 64,
        "original_max_position_embeddings": 32768,
    },
    "vocab_size": 73448,
    "use_mup": False,
    "scale_emb": 12,
    "dim_model_base": 256,
    "scale_depth": 1.4,
}
"""The base LM block of ``openbmb/VoxCPM2``'s ``config.json`` (``MiniCPM4Config`` has no
defaults). The LongRoPE factors are ones here (their values change no cost)."""
PUBLISHED_DEPTH = {"lm": 28, "residual": 8, "encoder": 12, "dit": 12}
"""Layers of the four stacks in the published folder."""

_LOADED: dict[str, Any] = {}


def published_config(layers: int, vocab_size: int) -> dict[str, Any]:
    """``config.json`` (a dict) at the published widths, ``layers`` layers per stack (see the
    module docstring); ``vocab_size``: the folder tokenizer's (text ids are only looked up)."""
    from voxcpm.model.voxcpm2 import (
        AudioVAEConfigV2,
        VoxCPMConfig,
        VoxCPMDitConfig,
        VoxCPMEncoderConfig,
    )
    from voxcpm.modules.locdit.unified_cfm import CfmConfig

    fields = VoxCPMConfig.model_fields

    def default(name: str) -> Any:
        return fields[name].default

    depth = {k: min(layers, v) for k, v in PUBLISHED_DEPTH.items()}
    lm = dict(PUBLISHED_LM, num_hidden_layers=depth["lm"], vocab_size=vocab_size)
    kv = PUBLISHED_LM["kv_channels"]  # published LocEnc / LocDiT heads of 128 (16 x 128 > 1024)
    encoder = VoxCPMEncoderConfig(num_layers=depth["encoder"], kv_channels=kv).model_dump()
    cfm = CfmConfig(inference_cfg_rate=2.0).model_dump()
    dit = VoxCPMDitConfig(num_layers=depth["dit"], kv_channels=kv, cfm_config=cfm).model_dump()
    vae = AudioVAEConfigV2().model_dump()
    return {
        "architecture": "voxcpm2",
        "lm_config": lm,
        "patch_size": default("patch_size"),
        "feat_dim": default("feat_dim"),
        "residual_lm_num_layers": depth["residual"],
        "residual_lm_no_rope": True,
        "scalar_quantization_latent_dim": default("scalar_quantization_latent_dim"),
        "scalar_quantization_scale": default("scalar_quantization_scale"),
        "encoder_config": {k: v for k, v in encoder.items() if v is not None},
        "dit_config": {k: v for k, v in dit.items() if v is not None},
        "audio_vae_config": vae,
        "max_length": default("max_length"),
        "device": "cpu",
        "dtype": "float32",
    }


def write_bench_weights(root: str, seed: int = 0) -> dict[str, int]:
    """Upstream's ``VoxCPM2Model`` writes the folder's weights; the stop head zeroed (module
    docstring). Returns parameters per part (``lm``: everything but the AudioVAE and the
    LocDiT; ``locdit``; ``audio_vae_decoder``; ``audio_vae_encoder``)."""
    import torch
    from safetensors.torch import load_file, save_file

    from tests.voxcpm_ref.upstream import write_weights

    shapes = write_weights(root, seed)
    path = Path(root) / "model.safetensors"
    state = load_file(str(path))
    state["stop_head.weight"] = torch.zeros_like(state["stop_head.weight"])
    save_file(state, str(path))
    counts = {"lm": 0, "locdit": 0, "audio_vae_decoder": 0, "audio_vae_encoder": 0}
    for name, shape in shapes.items():
        n = 1
        for s in shape:
            n *= s
        if name.startswith("audio_vae.decoder."):
            counts["audio_vae_decoder"] += n
        elif name.startswith("audio_vae."):
            counts["audio_vae_encoder"] += n
        elif name.startswith("feat_decoder."):
            counts["locdit"] += n
        else:
            counts["lm"] += n
    return counts


def bench_load(root: str, threads: int) -> dict[str, Any]:
    """Load the folder once (float32, CPU, ``threads`` intra-op threads)."""
    import torch
    import transformers
    from voxcpm.model.voxcpm2 import VoxCPM2Model

    torch.set_num_threads(threads)
    start = time.perf_counter()
    model = VoxCPM2Model.from_local(str(root), optimize=False, device="cpu")
    model.eval()
    _LOADED["model"] = model
    decode = model.audio_vae.decode
    times: list[float] = []

    def timed_decode(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        out = decode(*args, **kwargs)
        times.append(time.perf_counter() - t0)
        return out

    model.audio_vae.decode = timed_decode
    _LOADED["decode_times"] = times
    return {
        "load_s": round(time.perf_counter() - start, 2),
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "dtype": str(next(model.base_lm.parameters()).dtype),
    }


def bench_generate(text: str, max_len: int) -> dict[str, Any]:
    """Upstream ``generate`` (whole utterance): ``seconds``, ``lm_s`` (``_inference``: both
    LMs and the LocDiT), ``vae_s`` (the decode), ``samples`` (48 kHz)."""
    model, times = _LOADED["model"], _LOADED["decode_times"]
    times.clear()
    start = time.perf_counter()
    wav = model.generate(target_text=text, max_len=max_len)
    seconds = time.perf_counter() - start
    vae = sum(times)
    return {"seconds": seconds, "lm_s": seconds - vae, "vae_s": vae, "samples": int(wav.numel())}


def bench_first_audio(text: str, max_len: int) -> dict[str, Any]:
    """Upstream ``generate_streaming``: ``first_s`` (its first chunk), ``seconds`` (its end),
    ``chunks``, ``samples``."""
    model = _LOADED["model"]
    start = time.perf_counter()
    first, chunks, samples = None, 0, 0
    for chunk in model.generate_streaming(target_text=text, max_len=max_len):
        if first is None:
            first = time.perf_counter() - start
        chunks += 1
        samples += int(chunk.numel())
    return {
        "first_s": first,
        "seconds": time.perf_counter() - start,
        "chunks": chunks,
        "samples": samples,
    }


def bench_noise(text: str, max_len: int, noises: list) -> dict[str, Any]:
    """Upstream ``generate`` with the LocDiT noises given (``[C, P]`` float32 each, in
    order): ``waveform`` (float32 numpy, 48 kHz), ``noises_left``."""
    import torch

    from tests.voxcpm_ref.upstream import _NoiseQueue

    queue = _NoiseQueue(noises)
    torch.randn = queue
    try:
        wav = _LOADED["model"].generate(target_text=text, max_len=max_len)
    finally:
        torch.randn = queue.real
    return {"waveform": wav[0].float().numpy(), "noises_left": len(queue.noises)}


class Session(ReferenceSession):
    """One long-lived reference subprocess running this module's functions (``call``), with
    the ``.ref/voxcpm`` overlay first on its path and ``voxcpm`` / ``voxcpm.model`` registered
    as bare packages (``tests.ref_overlay.ReferenceSession`` of ``env.OVERLAY``; tqdm's
    progress bars off).

    Raises (constructor):
        FileNotFoundError: the overlay is not installed (``make install-test``).
    """

    def __init__(self) -> None:
        super().__init__(OVERLAY, module="tests.voxcpm_ref.bench_ref")
