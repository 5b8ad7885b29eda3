"""Load a VoxCPM2 folder (the layout of ``VoxCPM2Model.from_local``) into omnistep's modules.

Files: ``config.json``; the tokenizer (``tokenizer.json`` / ``tokenizer_config.json``, read by
``LlamaTokenizerFast``); ``model.safetensors`` (or ``pytorch_model.bin``): everything but the
AudioVAE; ``audiovae.safetensors`` (or ``audiovae.pth``): the AudioVAE state dict, with weight
norm as ``weight_g`` / ``weight_v``. Tensor names are upstream's; two are renamed here:
``base_lm.embed_tokens.weight`` -> ``embed_tokens.weight`` and ``feat_decoder.estimator.*`` ->
``estimator.*``."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from omnistep.layers.weight_norm import fold_weight_norm
from omnistep.models.voxcpm.audio_vae import AudioVAEDecoder, AudioVAEEncoder
from omnistep.models.voxcpm.config import VoxCPMConfig
from omnistep.models.voxcpm.lm import VoxCPMBackbone
from omnistep.models.voxcpm.vae_weights import weight_normed


class VoxCPMCheckpointError(ValueError):
    """A VoxCPM2 folder lacks a file, or a weight file lacks or misshapes a tensor."""


def _first(root: Path, names: tuple[str, ...]) -> Path:
    for name in names:
        if (root / name).is_file():
            return root / name
    raise VoxCPMCheckpointError(f"{root} has none of {', '.join(names)}")


def _read(path: Path) -> dict[str, torch.Tensor]:
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(path))
    state = torch.load(path, map_location="cpu", weights_only=True)
    return state.get("state_dict", state)


def _fill(module: torch.nn.Module, state: dict[str, torch.Tensor], what: str) -> None:
    own = module.state_dict()
    missing = sorted(set(own) - set(state))
    if missing:
        raise VoxCPMCheckpointError(f"{what} lacks {len(missing)} tensors, e.g. {missing[:3]}")
    for name, value in own.items():
        got, want = tuple(state[name].shape), tuple(value.shape)
        if got != want:
            raise VoxCPMCheckpointError(f"{what}: {name} has shape {got}, expected {want}")
    module.load_state_dict({k: state[k] for k in own})


def backbone_state(raw: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``model.safetensors`` names -> ``VoxCPMBackbone`` names."""
    out = {}
    for name, value in raw.items():
        if name == "base_lm.embed_tokens.weight":
            name = "embed_tokens.weight"
        elif name.startswith("feat_decoder.estimator."):
            name = name[len("feat_decoder.") :]
        out[name] = value
    return out


def published_name(name: str) -> str:
    """A ``VoxCPMBackbone`` parameter's name in the published ``model.safetensors`` (the
    inverse of ``backbone_state``): what weight updates and trainers name tensors by."""
    if name == "embed_tokens.weight":
        return "base_lm.embed_tokens.weight"
    if name.startswith("estimator."):
        return "feat_decoder." + name
    return name


def vae_state(raw: dict[str, torch.Tensor], part: str) -> dict[str, torch.Tensor]:
    """The AudioVAE state dict's ``{part}.*`` tensors (``part``: ``decoder`` or ``encoder``)
    with weight norm folded (``layers.weight_norm.fold_weight_norm``, dim 0), under
    ``AudioVAEDecoder`` / ``AudioVAEEncoder`` names.

    Raises:
        VoxCPMCheckpointError: a ``weight_v`` without its ``weight_g``.
        WeightNormError: a ``weight_v`` with an output channel of norm 0 (named).
    """
    out, prefix = {}, f"{part}."
    for name, value in raw.items():
        if not name.startswith(prefix) or name.endswith("sr_bin_boundaries"):
            continue
        name = name[len(prefix) :]
        if name.endswith(".weight_v"):
            base = name[: -len("_v")]
            g = raw.get(f"{prefix}{base}_g")
            if g is None:
                raise VoxCPMCheckpointError(f"AudioVAE: {prefix}{base}_v without its _g")
            out[base] = fold_weight_norm(g, value, 0, f"{prefix}{name}")
        elif not name.endswith(".weight_g"):
            out[name] = value
    return out


@dataclass
class VoxCPMWeights:
    """A loaded folder: its config, the backbone (LMs, LocEnc, LocDiT, heads), the AudioVAE's
    decoder and encoder, and which of their weights the file holds weight-normed
    (``vae_weights.weight_normed``: weight updates name those by ``weight_g`` / ``weight_v``)."""

    config: VoxCPMConfig
    backbone: VoxCPMBackbone
    vae: AudioVAEDecoder
    encoder: AudioVAEEncoder
    vae_normed: frozenset[str] = frozenset()
    encoder_normed: frozenset[str] = frozenset()

    def __iter__(self):  # (config, backbone, vae) unpacking
        return iter((self.config, self.backbone, self.vae))


def load_voxcpm(
    root: str | Path, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
) -> VoxCPMWeights:
    """A folder's modules, the backbone in ``dtype`` (the AudioVAE in float32, as upstream
    keeps it) on ``device``, in eval mode.

    Raises:
        VoxCPMCheckpointError: a missing file (named) or tensor, or a wrong shape.
        VoxCPMConfigError: see ``VoxCPMConfig.from_file``.
        WeightNormError: an AudioVAE ``weight_v`` with an output channel of norm 0 (named).
    """
    root = Path(root)
    config = VoxCPMConfig.from_file(_first(root, ("config.json",)))
    backbone = VoxCPMBackbone(config)
    model_file = _first(root, ("model.safetensors", "pytorch_model.bin"))
    _fill(backbone, backbone_state(_read(model_file)), model_file.name)
    vae, encoder = AudioVAEDecoder(config.audio_vae), AudioVAEEncoder(config.audio_vae)
    vae_file = _first(root, ("audiovae.safetensors", "audiovae.pth"))
    vae_raw = _read(vae_file)
    _fill(vae, vae_state(vae_raw, "decoder"), vae_file.name)
    _fill(encoder, vae_state(vae_raw, "encoder"), vae_file.name)
    return VoxCPMWeights(
        config,
        backbone.to(device, dtype).eval(),
        vae.to(device).eval(),
        encoder.to(device).eval(),
        weight_normed(vae_raw, "decoder"),
        weight_normed(vae_raw, "encoder"),
    )
