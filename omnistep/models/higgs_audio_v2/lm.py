"""Higgs Audio v2's backbone: a Llama stack with a DualFFN audio adapter, on the shared paged-KV
AR component.

Our torch implementation of transformers' ``HiggsAudioV2ForConditionalGeneration``
(models/higgs_audio_v2/modeling_higgs_audio_v2.py):

- inputs: text rows embed ``model.embed_tokens``; audio rows (a reference clip's delayed
  frames at the prompt's ``<|AUDIO_OUT|>`` / delay-token placeholders, and every generated
  frame) embed the sum over codebooks ``k`` of ``model.embed_audio_tokens.embed_audio_tokens``
  at ``code_k + k * codebook_size``;
- each decoder layer (DualFFN): text rows use ``input_layernorm``, ``post_attention_layernorm``
  and ``mlp``; audio rows ``audio_input_layernorm``, ``audio_post_attention_layernorm`` and
  ``audio_mlp``; attention (one set of q/k/v/o) is shared by both;
- rope: llama3 frequency scaling (``rope_parameters``: factor, low/high_freq_factor,
  original_max_position_embeddings), as transformers' ``_compute_llama3_parameters``;
- head: ``audio_lm_head`` -> logits ``[B, num_codebooks, codebook_size]``.

Input rows are ``[N, hidden + 1]``: the embedding and a last column 1.0 on audio rows, which
the stack strips off and routes by (per call and thread, so a trainer scoring in another
thread does not disturb serving). The delay pattern is the sampler's
(``omnistep.sampling.delay``), configured by the card.

Imports: torch, ``omnistep.layers``, ``omnistep.runners``, ``omnistep.loops``, ``omnistep.kv``
and this family's loader.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from omnistep.kv import KVCacheConfig
from omnistep.layers.batch_invariant import RowChunking, map_row_groups
from omnistep.layers.llama import (
    NO_ROW_PLANS,
    LlamaConfigLite,
    LlamaDecoderLayer,
    LlamaMLP,
    LlamaModel,
    RowPlans,
)
from omnistep.layers.norm import RMSNorm
from omnistep.layers.rope import RotaryEmbedding
from omnistep.loops.ar_decode import ARPrefillInput
from omnistep.models.higgs_audio_v2.loader import (
    HiggsCheckpoint,
    HiggsCheckpointError,
    HiggsLMConfig,
    read_safetensors,
    take,
)
from omnistep.runners.paged_ar import PagedARModel


@dataclass(frozen=True)
class HiggsPrompt:
    """A prompt as transformers takes it: ``input_ids`` with placeholders (``audio_token_id``
    or ``audio_delay_token_id``) where audio rows go, and those rows' delayed frames in order.

    Attributes:
        ids: text ids, placeholders included; ends with ``<|audio_out_bos|>``.
        audio: one frame of ``num_codebooks`` ids per placeholder.
    """

    ids: tuple[int, ...]
    audio: tuple[tuple[int, ...], ...] = ()


def llama3_inv_freq(head_dim: int, rope: dict[str, Any]) -> torch.Tensor:
    """Inverse rope frequencies ``[head_dim // 2]`` float32 with Llama 3's scaling (Meta's
    ``apply_scaling``; transformers ``_compute_llama3_parameters``): wavelengths longer than
    ``original_max / low_freq_factor`` are divided by ``factor``, shorter than
    ``original_max / high_freq_factor`` kept, and those between interpolated smoothly."""
    theta = float(rope.get("rope_theta", 500000.0))
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
    if rope.get("rope_type", "default") != "llama3":
        return inv
    factor = float(rope["factor"])
    low, high = float(rope["low_freq_factor"]), float(rope["high_freq_factor"])
    old = float(rope["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old / low, inv / factor, inv)
    smooth = (old / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old / high) & ~(wavelen > old / low)
    return torch.where(medium, smoothed, scaled)


def _rows(fn, x: torch.Tensor, plan) -> torch.Tensor:
    """``fn(x)``, on the row chunks of batch-invariant mode when ``plan`` is set."""
    return fn(x) if plan is None else map_row_groups(fn, x, plan)


class DualFFNDecoderLayer(LlamaDecoderLayer):
    """A Llama layer with a second set of norms and MLP for audio rows (DualFFN)."""

    def __init__(self, config: LlamaConfigLite, layer_idx: int, route: threading.local, **f):
        super().__init__(config, layer_idx, **f)
        self.audio_mlp = LlamaMLP(
            config.hidden_size, config.intermediate_size, config.mlp_bias, **f
        )
        self.audio_input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, **f)
        self.audio_post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, **f)
        self._route = route

    def _block(self, hidden: torch.Tensor, attention, plans: RowPlans = NO_ROW_PLANS, routing=None):
        audio = getattr(self._route, "audio", None)  # [N] bool
        if audio is None or not bool(audio.any()):
            return super()._block(hidden, attention, plans, routing)  # dense: routing unused
        if bool(audio.all()):
            attn_in = _rows(self.audio_input_layernorm, hidden, plans.norm)
            hidden = hidden + attention(attn_in)
            mlp_in = _rows(self.audio_post_attention_layernorm, hidden, plans.norm)
            return hidden + self.audio_mlp(mlp_in, plans)
        pick = audio[:, None]  # mixed rows: both paths on every row, each row keeps its own
        attn_in = torch.where(
            pick,
            _rows(self.audio_input_layernorm, hidden, plans.norm),
            _rows(self.input_layernorm, hidden, plans.norm),
        )
        hidden = hidden + attention(attn_in)
        audio_in = _rows(self.audio_post_attention_layernorm, hidden, plans.norm)
        audio_out = self.audio_mlp(audio_in, plans)
        text_out = self.mlp(_rows(self.post_attention_layernorm, hidden, plans.norm), plans)
        return hidden + torch.where(pick, audio_out, text_out)


class DualFFNStack(LlamaModel):
    """``LlamaModel`` with DualFFN layers and llama3 rope; inputs ``[N, hidden + 1]`` (the
    last column flags audio rows). ``state_dict`` keys: transformers' ``model.*`` ones less
    the embeddings."""

    def __init__(self, config: LlamaConfigLite, rope: dict[str, Any], device=None, dtype=None):
        # LlamaModel's attributes, set here so its plain layers are never allocated (a 3B
        # stack twice over): config, row_chunking, layers, norm, rotary_emb.
        nn.Module.__init__(self)
        self.config = config
        self.row_chunking = RowChunking()
        self._route = threading.local()
        self.layers = nn.ModuleList(
            DualFFNDecoderLayer(config, i, self._route, device=device, dtype=dtype)
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, device=device, dtype=dtype)
        self.rotary_emb = RotaryEmbedding(
            config.head_dim, config.rope_theta, config.max_position_embeddings, device=device
        )
        inv = llama3_inv_freq(config.head_dim, rope)
        freqs = torch.arange(config.max_position_embeddings).float()[:, None] * inv
        emb = torch.cat((freqs, freqs), dim=-1)
        self.rotary_emb.cos_cached = emb.cos().to(self.rotary_emb.cos_cached.device)
        self.rotary_emb.sin_cached = emb.sin().to(self.rotary_emb.sin_cached.device)

    def _routed(self, method, inputs_embeds: torch.Tensor, *args, **kwargs):
        if getattr(self._route, "audio", None) is not None:  # nested (forward_packed)
            return method(inputs_embeds, *args, **kwargs)
        self._route.audio = inputs_embeds[:, -1] > 0.5
        try:
            return method(inputs_embeds[:, :-1], *args, **kwargs)
        finally:
            self._route.audio = None

    def forward(self, inputs_embeds, positions, cache, meta, routing=None):  # noqa: D102 - see LlamaModel
        return self._routed(super().forward, inputs_embeds, positions, cache, meta, routing)

    def forward_dense(self, inputs_embeds, *args, **kwargs):  # noqa: D102
        return self._routed(super().forward_dense, inputs_embeds, *args, **kwargs)

    def forward_attend(self, inputs_embeds, *args, **kwargs):  # noqa: D102
        return self._routed(super().forward_attend, inputs_embeds, *args, **kwargs)


class HiggsAudioV2LM(PagedARModel):
    """The ``lm`` component: prefill/decode of Higgs prompts, 8-codebook frames sampled with
    the delay pattern the loop's ``SamplingRow`` carries.

    Args:
        config: the parsed ``config.json``.
        kv, device, dtype, batch_invariant: as ``PagedARModel``.
    """

    def __init__(
        self,
        config: HiggsLMConfig,
        kv: KVCacheConfig,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        batch_invariant: bool = False,
    ):
        llama = LlamaConfigLite(
            hidden_size=config.hidden_size,
            num_attention_heads=config.num_attention_heads,
            num_hidden_layers=config.num_hidden_layers,
            intermediate_size=config.intermediate_size,
            num_key_value_heads=config.num_key_value_heads,
            head_dim=config.head_dim,
            rms_norm_eps=config.rms_norm_eps,
            rope_theta=config.rope_theta,
            max_position_embeddings=config.max_position_embeddings,
        )
        self.config = config
        super().__init__(llama, kv, device, dtype, batch_invariant, config.num_codebooks)
        factory = {"device": self.device, "dtype": dtype}
        c, size = config.num_codebooks, config.codebook_size
        self.embed_tokens = torch.zeros(config.vocab_size, config.hidden_size, **factory)
        self.embed_audio = torch.zeros(c * size, config.hidden_size, **factory)
        self.audio_head = torch.zeros(c * size, config.hidden_size, **factory)
        self.offsets = torch.arange(c, device=self.device) * size

    @classmethod
    def from_checkpoint(
        cls,
        checkpoint: HiggsCheckpoint,
        kv: KVCacheConfig,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        batch_invariant: bool = False,
    ) -> HiggsAudioV2LM:
        """Build and load the folder's weights.

        Raises:
            HiggsCheckpointError: a missing tensor or one of another shape (named).
        """
        lm = cls(checkpoint.lm, kv, device, dtype, batch_invariant)
        tensors = read_safetensors(checkpoint.root, "Higgs Audio v2 folder")
        lm.load(tensors, checkpoint.root)
        return lm

    def load(self, tensors: dict[str, torch.Tensor], where: Any = "weights") -> None:
        """Copy transformers-named tensors in (``model.*``, ``audio_lm_head.weight``;
        ``text_lm_head.weight`` is ignored, as transformers does).

        Raises:
            HiggsCheckpointError: a missing tensor or one of another shape.
        """
        for name, target in self._weight_tensors().items():
            value = take(tensors, name, tuple(target.shape), where)
            with torch.no_grad():
                target.copy_(value.to(target.dtype))
        known = set(self._weight_tensors()) | {"text_lm_head.weight"}
        extra = sorted(set(tensors) - known)
        if extra:
            raise HiggsCheckpointError(f"{where}: unexpected tensors {extra[:4]}")

    def _weight_tensors(self) -> dict[str, torch.Tensor]:
        names = {f"model.{k}": v for k, v in self.llama.state_dict(keep_vars=True).items()}
        names["model.embed_tokens.weight"] = self.embed_tokens
        names["model.embed_audio_tokens.embed_audio_tokens.weight"] = self.embed_audio
        names["audio_lm_head.weight"] = self.audio_head
        return names

    # ------------------------------------------------------------ PagedARModel hooks
    def _make_stack(self, llama: LlamaConfigLite, dtype: torch.dtype) -> DualFFNStack:
        return DualFFNStack(llama, self.config.rope, device=self.device, dtype=dtype)

    def _audio_rows(self, frames: torch.Tensor) -> torch.Tensor:
        """``[n, hidden + 1]`` rows of frames ``[n, num_codebooks]`` (flag 1)."""
        emb = self.embed_audio[frames.to(self.device) + self.offsets].sum(dim=1)
        return torch.cat([emb, torch.ones_like(emb[:, :1])], dim=1)

    def _prefill_inputs(self, unit: ARPrefillInput) -> torch.Tensor:
        prompt: HiggsPrompt = unit.prompt
        cfg = self.config
        ids = torch.tensor(prompt.ids, dtype=torch.long, device=self.device)
        audio = (ids == cfg.audio_token_id) | (ids == cfg.audio_delay_token_id)
        if int(audio.sum()) != len(prompt.audio):
            raise ValueError(
                f"prompt has {int(audio.sum())} audio placeholders for {len(prompt.audio)} frames"
            )
        if not len(ids) or int(ids.max()) >= cfg.vocab_size or int(ids.min()) < 0:
            raise ValueError("prompt ids empty or outside the vocabulary")
        text = self.embed_tokens[ids]
        rows = torch.cat([text, torch.zeros_like(text[:, :1])], dim=1)
        if prompt.audio:
            rows[audio] = self._audio_rows(self._frames(prompt.audio))
        if unit.generated:
            rows = torch.cat([rows, self._audio_rows(self._frames(unit.generated))])
        return rows

    def _frames(self, frames: Sequence[Sequence[int]]) -> torch.Tensor:
        t = torch.tensor([tuple(f) for f in frames], dtype=torch.long, device=self.device)
        c, size = self.config.num_codebooks, self.config.codebook_size
        if t.dim() != 2 or t.shape[1] != c or int(t.min()) < 0 or int(t.max()) >= size:
            raise ValueError(f"audio frames must be {c} ids in [0, {size}) each")
        return t

    def _step_inputs(self, units: Sequence[Any]) -> torch.Tensor:
        return self._audio_rows(self._frames([u.last for u in units]))

    def _head(self, hidden: torch.Tensor, seq_id: str) -> torch.Tensor:
        logits = self._linear_rows(hidden, self.audio_head)  # [B, C * size]
        return logits.view(hidden.shape[0], self.config.num_codebooks, self.config.codebook_size)

    def _score_head(self, hidden: torch.Tensor, prompt: Any) -> torch.Tensor:
        logits = torch.nn.functional.linear(hidden, self.audio_head)
        return logits.view(hidden.shape[0], self.config.num_codebooks, self.config.codebook_size)
