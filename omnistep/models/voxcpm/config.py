"""VoxCPM2's ``config.json`` parsed (upstream ``voxcpm/model/voxcpm2.py: VoxCPMConfig``), and
the MiniCPM-4 decoder stacks it describes as ``LlamaConfigLite``s.

Four MiniCPM-4 stacks share ``lm_config``'s norm epsilon, rope (LongRoPE) and muP depth
scaling; upstream copies ``lm_config`` and overrides widths and depths
(``VoxCPM2Model.__init__``): the base LM (text + latent patches), the residual LM
(``residual_lm_num_layers``, rope dropped with ``residual_lm_no_rope``), the local encoder
(``encoder_config``) and the LocDiT (``dit_config``). Imports: the standard library,
``omnistep.layers``.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omnistep.layers.llama import LlamaConfigLite
from omnistep.layers.rope import LongRopeScaling


class VoxCPMConfigError(ValueError):
    """``config.json`` is missing a key or has a value this implementation cannot run."""


def _need(section: dict[str, Any], key: str, where: str) -> Any:
    if key not in section:
        raise VoxCPMConfigError(f"config.json: {where} has no {key!r}")
    return section[key]


@dataclass(frozen=True)
class StackSize:
    """Width and depth of one MiniCPM stack (``encoder_config`` / ``dit_config`` keys)."""

    hidden_dim: int
    ffn_dim: int
    num_heads: int
    num_layers: int
    kv_channels: int | None = None


@dataclass(frozen=True)
class VoxCPMConfig:
    """The keys of VoxCPM2's ``config.json`` this implementation reads.

    ``lm`` is the raw ``lm_config`` dict (MiniCPM4Config keys); ``audio_vae`` the raw
    ``audio_vae_config`` dict (upstream ``AudioVAEConfig`` keys, defaults filled).
    """

    lm: dict[str, Any]
    patch_size: int
    feat_dim: int
    residual_lm_num_layers: int
    residual_lm_no_rope: bool
    fsq_latent_dim: int
    fsq_scale: int
    encoder: StackSize
    dit: StackSize
    dit_mean_mode: bool
    audio_vae: dict[str, Any]
    dtype: str

    @classmethod
    def from_file(cls, path: str | Path) -> VoxCPMConfig:
        """Parse ``config.json``.

        Raises:
            FileNotFoundError: no such file. VoxCPMConfigError: a missing key, an
            ``architecture`` other than voxcpm2, a mean-mode DiT, or a feature width that
            differs from the AudioVAE's latent width.
        """
        raw = json.loads(Path(path).read_text())
        arch = str(raw.get("architecture", "voxcpm")).lower()
        if arch != "voxcpm2":
            raise VoxCPMConfigError(f"config.json: architecture {arch!r} is not 'voxcpm2'")
        lm = _need(raw, "lm_config", "config.json")
        for key in ("hidden_size", "intermediate_size", "num_attention_heads",
                    "num_hidden_layers", "num_key_value_heads", "rms_norm_eps", "rope_theta",
                    "rope_scaling", "vocab_size", "scale_emb", "scale_depth",
                    "max_position_embeddings"):  # fmt: skip
            _need(lm, key, "lm_config")
        dit = _need(raw, "dit_config", "config.json")
        if dit.get("dit_mean_mode", False):
            raise VoxCPMConfigError("config.json: dit_config.dit_mean_mode=true is not supported")
        vae = dict(AUDIO_VAE_DEFAULTS)
        vae.update(raw.get("audio_vae_config") or {})
        feat_dim = int(raw.get("feat_dim", 64))
        if vae["latent_dim"] != feat_dim:
            raise VoxCPMConfigError(
                f"config.json: feat_dim {feat_dim} != audio_vae_config.latent_dim "
                f"{vae['latent_dim']}"
            )

        def size(section: dict[str, Any]) -> StackSize:
            return StackSize(
                int(section.get("hidden_dim", 1024)),
                int(section.get("ffn_dim", 4096)),
                int(section.get("num_heads", 16)),
                int(section.get("num_layers", 4)),
                section.get("kv_channels"),
            )

        return cls(
            lm=lm,
            patch_size=int(raw.get("patch_size", 4)),
            feat_dim=feat_dim,
            residual_lm_num_layers=int(raw.get("residual_lm_num_layers", 8)),
            residual_lm_no_rope=bool(raw.get("residual_lm_no_rope", False)),
            fsq_latent_dim=int(raw.get("scalar_quantization_latent_dim", 512)),
            fsq_scale=int(raw.get("scalar_quantization_scale", 9)),
            encoder=size(_need(raw, "encoder_config", "config.json")),
            dit=size(dit),
            dit_mean_mode=False,
            audio_vae=vae,
            dtype=str(raw.get("dtype", "bfloat16")),
        )

    @property
    def hidden_size(self) -> int:
        return int(self.lm["hidden_size"])

    @property
    def use_mup(self) -> bool:
        return bool(self.lm.get("use_mup", True))

    @property
    def scale_emb(self) -> float:
        """Text embedding multiplier (``scale_emb`` under ``use_mup``, else 1)."""
        return float(self.lm["scale_emb"]) if self.use_mup else 1.0

    def stack(
        self,
        hidden: int | None = None,
        ffn: int | None = None,
        heads: int | None = None,
        layers: int | None = None,
        kv_channels: int | None = None,
        rope: bool = True,
    ) -> LlamaConfigLite:
        """A MiniCPM stack: ``lm_config`` with the given overrides (None keeps lm_config's
        width, depth and heads; ``kv_channels`` None: head_dim = hidden // heads), as
        upstream's ``model_copy`` + overrides."""
        lm = self.lm
        hidden = hidden or int(lm["hidden_size"])
        heads = heads or int(lm["num_attention_heads"])
        layers = layers or int(lm["num_hidden_layers"])
        head_dim = int(kv_channels) if kv_channels else hidden // heads
        scaling = lm["rope_scaling"]
        rope_scaling = LongRopeScaling(
            tuple(float(f) for f in scaling["long_factor"]),
            tuple(float(f) for f in scaling["short_factor"]),
            int(scaling["original_max_position_embeddings"]),
            int(lm["max_position_embeddings"]),
        )
        scale = float(lm["scale_depth"]) / math.sqrt(layers) if self.use_mup else 1.0
        return LlamaConfigLite(
            hidden_size=hidden,
            num_attention_heads=heads,
            num_hidden_layers=layers,
            intermediate_size=ffn or int(lm["intermediate_size"]),
            num_key_value_heads=int(lm["num_key_value_heads"]),
            head_dim=head_dim,
            rms_norm_eps=float(lm["rms_norm_eps"]),
            rope_theta=float(lm["rope_theta"]),
            max_position_embeddings=int(lm["max_position_embeddings"]),
            rope_scaling=rope_scaling,
            rope=rope,
            residual_scale=scale,
        )

    def base_lm(self) -> LlamaConfigLite:
        return self.stack(kv_channels=self.lm.get("kv_channels"))

    def residual_lm(self) -> LlamaConfigLite:
        return self.stack(
            layers=self.residual_lm_num_layers,
            kv_channels=self.lm.get("kv_channels"),
            rope=not self.residual_lm_no_rope,
        )

    def local_stack(self, size: StackSize) -> LlamaConfigLite:
        """The local encoder's or LocDiT's stack (upstream takes ``kv_channels`` from the
        section, and None there means hidden // heads)."""
        return self.stack(
            size.hidden_dim, size.ffn_dim, size.num_heads, size.num_layers, size.kv_channels
        )


AUDIO_VAE_DEFAULTS: dict[str, Any] = {
    "encoder_dim": 128,
    "encoder_rates": [2, 5, 8, 8],
    "latent_dim": 64,
    "decoder_dim": 2048,
    "decoder_rates": [8, 6, 5, 2, 2, 2],
    "depthwise": True,
    "sample_rate": 16000,
    "out_sample_rate": 48000,
    "use_noise_block": False,
    "sr_bin_boundaries": [20000, 30000, 40000],
    "cond_type": "scale_bias",
    "cond_dim": 128,
    "cond_out_layer": False,
}
"""Upstream ``audio_vae_v2.AudioVAEConfig``'s defaults (VoxCPM2's AudioVAE)."""
