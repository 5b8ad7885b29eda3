"""Tiny VoxCPM2 weights written by the reference's own classes, and reference outputs.

Runs inside the reference subprocess (``tests.voxcpm_ref.env``). ``write_weights`` builds
upstream's ``VoxCPM2Model`` from a folder's ``config.json`` / tokenizer (written by
``omnistep.models.voxcpm.tiny``), moves norms, Snake alphas and the AudioVAE's sample-rate
scale/bias away from their neutral init (so a wrong formula shows), and writes the published
weight files: ``model.safetensors`` (every tensor but ``audio_vae.*``) and ``audiovae.pth``
(the AudioVAE state dict, weight-norm ``weight_g`` / ``weight_v`` names).

``generate`` runs upstream ``VoxCPM2Model._generate`` with ``torch.randn`` replaced by a queue of
given noises (the LocDiT's initial noise per patch, in call order) and records, by forward
hooks, what omnistep's parity tests compare: the prefill's LM hidden states, each step's LocDiT
conditioning and output, the stop logits and the waveform.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch


def _load(root: str):
    from voxcpm.model.voxcpm2 import VoxCPM2Model

    return VoxCPM2Model.from_local(str(root), optimize=False, device="cpu")


def write_weights(root: str, seed: int = 0) -> dict[str, list[int]]:
    """Write ``model.safetensors`` and ``audiovae.pth`` under ``root``; returns every tensor's
    shape by its published name (``audio_vae.`` prefixed for the VAE's)."""
    from safetensors.torch import save_file
    from transformers import LlamaTokenizerFast
    from voxcpm.model.voxcpm2 import AudioVAEConfigV2, AudioVAEV2, VoxCPM2Model, VoxCPMConfig

    torch.manual_seed(seed)
    config = VoxCPMConfig.model_validate_json((Path(root) / "config.json").read_text())
    tokenizer = LlamaTokenizerFast.from_pretrained(root)
    vae = AudioVAEV2(config=AudioVAEConfigV2(**config.audio_vae_config.model_dump()))
    model = VoxCPM2Model(config, tokenizer, vae, device="cpu")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("alpha") or "scale_embed" in name:
                p.add_(0.1 * torch.randn_like(p))
            elif "bias_embed" in name:
                p.add_(0.05 * torch.randn_like(p))
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    main = {k: v for k, v in state.items() if not k.startswith("audio_vae.")}
    save_file(main, str(Path(root) / "model.safetensors"))
    torch.save(model.audio_vae.state_dict(), Path(root) / "audiovae.pth")
    return {k: list(v.shape) for k, v in state.items()}


class _NoiseQueue:
    """``torch.randn`` stand-in: pops the given arrays in order (shape-checked)."""

    def __init__(self, noises: list[np.ndarray]):
        self.noises = list(noises)
        self.real = torch.randn

    def __call__(self, *size, device=None, dtype=None, **kwargs):
        shape = tuple(size[0]) if len(size) == 1 and not isinstance(size[0], int) else size
        if not self.noises:
            raise RuntimeError(f"noise queue empty (asked for {shape})")
        z = torch.from_numpy(self.noises.pop(0))[None]
        if tuple(z.shape) != tuple(shape):
            raise RuntimeError(f"noise shape {tuple(z.shape)} != requested {shape}")
        return z.to(device=device, dtype=dtype or torch.float32)


def generate(
    root: str,
    text: str,
    noises: list[np.ndarray],
    max_len: int = 8,
    min_len: int = 2,
    inference_timesteps: int = 10,
    cfg_value: float = 2.0,
    reference_wav: str = "",
    streaming: bool = False,
) -> dict[str, Any]:
    """Upstream ``_generate`` on ``text`` (zero-shot, or with ``reference_wav``, a 16 kHz clip).

    ``noises``: ``[feat_dim, patch_size]`` float32 arrays, one per generated patch, used as the
    LocDiT's initial noise in order. Returns float32 numpy arrays: ``text_ids`` (the
    tokenizer wrapper's ids of ``text``), ``prefill_lm`` ``[L, H]`` (the base LM's final-norm
    output over the prompt), ``prefill_residual`` ``[L, H]``, ``mu`` ``[T, 2 * h_dit]`` (each
    step's LocDiT conditioning), ``cond`` ``[T, feat_dim, patch]`` (its prefix patch),
    ``patches`` ``[T, feat_dim, patch]`` (each step's solved patch), ``stop_logits`` ``[T, 2]``,
    ``lm_steps`` ``[T-1, H]`` (the base LM's decode-step outputs), ``ref_feat`` (the encoded
    reference patches, or None), ``waveform`` ``[samples]`` (48 kHz; with ``streaming`` the
    concatenation of upstream's streamed chunks) and ``chunks`` (the streamed chunks' lengths).
    """
    model = _load(root)
    rec: dict[str, list] = {k: [] for k in ("mu", "cond", "patches", "stop", "lm", "res", "ref")}

    def dit_hook(_mod, _args, kwargs, out):
        rec["mu"].append(kwargs["mu"][0].float().numpy().copy())
        rec["cond"].append(kwargs["cond"][0].float().numpy().copy())
        rec["patches"].append(out[0].float().numpy().copy())

    def stop_hook(_mod, _args, out):
        rec["stop"].append(out[0].float().numpy().copy())

    def lm_hook(key):
        def hook(_mod, _args, out):
            rec[key].append(out[0][0].float().numpy().copy())

        return hook

    model.feat_decoder.register_forward_hook(dit_hook, with_kwargs=True)
    model.stop_head.register_forward_hook(stop_hook)
    model.base_lm.register_forward_hook(lm_hook("lm"))
    model.residual_lm.register_forward_hook(lm_hook("res"))
    steps: list[np.ndarray] = []
    step_fn = model.base_lm.forward_step

    def record_step(*args, **kwargs):
        out = step_fn(*args, **kwargs)
        steps.append(out[0].float().numpy().copy())
        return out

    model.base_lm.forward_step = record_step
    encode = model._encode_wav

    def record_encode(*args, **kwargs):
        feat = encode(*args, **kwargs)
        rec["ref"].append(feat.float().numpy().copy())
        return feat

    model._encode_wav = record_encode
    queue = _NoiseQueue(noises)
    torch.randn = queue
    kwargs = dict(
        target_text=text,
        reference_wav_path=reference_wav,
        max_len=max_len,
        min_len=min_len,
        inference_timesteps=inference_timesteps,
        cfg_value=cfg_value,
    )
    try:
        if streaming:
            chunks = [c[0].float().numpy() for c in model.generate_streaming(**kwargs)]
        else:
            chunks = [model.generate(**kwargs)[0].float().numpy()]
    finally:
        torch.randn = queue.real
    return {
        "text_ids": list(model.text_tokenizer(text)),
        "prefill_lm": rec["lm"][0],
        "prefill_residual": rec["res"][0],
        "mu": np.stack(rec["mu"]),
        "cond": np.stack(rec["cond"]),
        "patches": np.stack(rec["patches"]),
        "stop_logits": np.stack(rec["stop"]),
        "lm_steps": np.stack(steps) if steps else np.zeros((0,)),
        "ref_feat": rec["ref"][0] if rec["ref"] else None,
        "waveform": np.concatenate(chunks),
        "chunks": [len(c) for c in chunks],
    }


def write_and_generate(
    root: str,
    seed: int = 0,
    schedules: list[list[int]] = (),
    clone: dict[str, Any] | None = None,
    **kwargs: Any,
) -> dict[str, Any]:
    """``write_weights``, then ``generate(root, **kwargs)``, then ``vae_decode`` of the
    generated patches with ``schedules``, in one subprocess (the tests' one reference call):
    ``generate``'s dict plus ``"vae"`` (``vae_decode``'s) and, with ``clone``, ``"clone"``:
    ``generate(root, **clone)`` (e.g. with ``reference_wav``)."""
    write_weights(root, seed)
    out = generate(root, **kwargs)
    if clone is not None:
        out["clone"] = generate(root, **clone)
    patches = out["patches"]  # [T, C, P] -> [C, T * P]
    latents = np.ascontiguousarray(patches.transpose(1, 0, 2).reshape(patches.shape[1], -1))
    out["vae"] = vae_decode(root, latents, schedules)
    return out


def vae_decode(root: str, latents: np.ndarray, schedules: list[list[int]] = ()) -> dict:
    """Upstream ``AudioVAE.decode`` of ``latents`` ``[feat_dim, frames]`` (whole), and, per
    schedule of ``schedules``, its ``streaming_decode`` fed that many frames per call.

    Returns ``{"whole": [samples], "streams": [[[samples_i], ...] per schedule]}`` float32."""
    model = _load(root)
    z = torch.from_numpy(latents)[None].float()
    streams = []
    with torch.inference_mode():
        whole = model.audio_vae.decode(z)[0, 0].numpy()
        for schedule in schedules:
            chunks, start = [], 0
            with model.audio_vae.streaming_decode() as dec:
                for n in schedule:
                    chunks.append(dec.decode_chunk(z[..., start : start + n])[0, 0].numpy())
                    start += n
            streams.append(chunks)
    return {"whole": whole, "streams": streams}
