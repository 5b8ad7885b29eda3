"""A Llama decoder stack over a paged KV cache, for continuous-batching AR decode.

Imports torch and ``omnistep.layers`` only. Architecture and parameter names follow transformers'
``LlamaModel`` (models/llama/modeling_llama.py): pre-norm decoder layers (RMSNorm -> attention with
rope -> residual; RMSNorm -> SwiGLU MLP -> residual) and a final RMSNorm, so a transformers state
dict loads key for key (``load_hf_state_dict``); with ``LlamaConfigLite.moe`` the MLPs are
``layers.moe.MoEFeedForward`` (Qwen3-MoE, Qwen3-Omni) and ``forward`` can return each MoE
layer's routing. There is no token embedding: callers feed
``inputs_embeds`` (ChatTTS sums its own text/code embeddings). Inputs are varlen: the new tokens of
B sequences flattened into N rows, described by an ``AttentionMetadata``. ``forward_dense`` runs
one whole sequence without a cache, with autograd (a trainer's teacher-forced score).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from omnistep.layers.batch_invariant import RowChunking, RowFn, RowGroup, map_row_groups
from omnistep.layers.linear import PackedLinear, linears_batch_invariant
from omnistep.layers.norm import RMSNorm
from omnistep.layers.paged_attention import (
    AttentionMetadata,
    PagedKVCache,
    causal_attention,
    causal_attention_tail,
    paged_attention,
    write_kv,
)
from omnistep.layers.rope import Llama3RopeScaling, LongRopeScaling, RotaryEmbedding, apply_rope

_IGNORED_HF_PREFIXES = ("embed_tokens.", "rotary_emb.")


@dataclass(frozen=True)
class LlamaConfigLite:
    """The fields of a transformers ``LlamaConfig`` this stack needs.

    Attributes:
        hidden_size: model width.
        num_attention_heads: query heads.
        num_hidden_layers: decoder layers.
        intermediate_size: MLP width.
        num_key_value_heads: KV heads (grouped-query attention); None means one per query head.
        head_dim: per-head width; None means ``hidden_size // num_attention_heads``.
        rms_norm_eps: RMSNorm epsilon.
        rope_theta: rope base.
        max_position_embeddings: positions the rope table covers.
        hidden_act: MLP activation; only "silu".
        attention_bias: biases on the q/k/v/o projections.
        mlp_bias: biases on the gate/up/down projections.
        qkv_bias: biases on the q/k/v projections only, none on o (Qwen2's attention); implied
            for q/k/v when ``attention_bias`` is set.
        qk_norm: an RMSNorm over each head's ``head_dim`` on the projected queries and keys,
            before rope (Qwen3's ``q_norm``/``k_norm``, weights ``self_attn.{q,k}_norm.weight``).
        moe: a ``layers.moe.MoEConfig``: layer i's MLP is a ``MoEFeedForward`` (weights
            ``mlp.gate.weight``, ``mlp.experts.*``) unless i is in ``mlp_only_layers`` or
            ``(i + 1) % decoder_sparse_step`` (Qwen3-MoE's rule, transformers
            ``Qwen3OmniMoeThinkerTextDecoderLayer``); None: every layer is dense.
        mlp_only_layers: layers kept dense in a MoE stack (config key ``mlp_only_layers``).
        decoder_sparse_step: every this many layers is sparse (config key).
        rope_scaling: Llama 3.1's rope frequency rescaling (``rope_type: "llama3"``),
            MiniCPM's LongRoPE (``LongRopeScaling``), or None.
        rope: rotate queries and keys; False: no position encoding at all (VoxCPM's residual
            LM with ``residual_lm_no_rope``).
        residual_scale: each block's attention and MLP outputs are multiplied by this before
            the residual add (MiniCPM's muP depth scaling, ``scale_depth /
            sqrt(num_hidden_layers)`` when ``use_mup``); 1.0 adds them unscaled.
    """

    hidden_size: int
    num_attention_heads: int
    num_hidden_layers: int
    intermediate_size: int
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 4096
    hidden_act: str = "silu"
    attention_bias: bool = False
    mlp_bias: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    moe: Any = None
    mlp_only_layers: tuple[int, ...] = ()
    decoder_sparse_step: int = 1
    rope_scaling: Llama3RopeScaling | LongRopeScaling | None = None
    rope: bool = True
    residual_scale: float = 1.0

    SIZE_FIELDS = (
        "hidden_size",
        "num_attention_heads",
        "num_hidden_layers",
        "intermediate_size",
        "num_key_value_heads",
        "head_dim",
        "rms_norm_eps",
        "rope_theta",
        "max_position_embeddings",
    )
    """The fields ``of`` reads from a family's config (the transformers config key names)."""

    @classmethod
    def of(cls, cfg: Any, **flags: Any) -> LlamaConfigLite:
        """The stack whose sizes are ``cfg``'s ``SIZE_FIELDS`` (any object with those
        attributes, e.g. a family's parsed config), with ``flags`` (``qkv_bias``,
        ``qk_norm``, ...) on top."""
        return cls(**{name: getattr(cfg, name) for name in cls.SIZE_FIELDS}, **flags)

    @classmethod
    def qwen3(cls, cfg: Any) -> LlamaConfigLite:
        """A Qwen3 decoder stack (no biases, per-head q/k RMSNorm) of ``cfg``'s sizes (``of``),
        which must also carry ``hidden_act`` and ``attention_bias`` (Qwen3-TTS's talker and
        code predictor, Qwen3-Omni's code predictor).

        Raises:
            ValueError: an activation other than silu, attention biases.
        """
        what = type(cfg).__name__
        if cfg.hidden_act != "silu":
            raise ValueError(f"{what}: hidden_act must be 'silu', got {cfg.hidden_act!r}")
        if cfg.attention_bias:
            raise ValueError(f"{what}: attention_bias=True is not supported")
        return cls.of(cfg, qk_norm=True)

    def __post_init__(self) -> None:
        if self.num_key_value_heads is None:
            object.__setattr__(self, "num_key_value_heads", self.num_attention_heads)
        if self.head_dim is None and self.num_attention_heads > 0:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        self._validate()

    def _validate(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if isinstance(value, int | float) and not isinstance(value, bool) and value <= 0:
                raise ValueError(f"{field.name} must be > 0, got {value}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rope, got {self.head_dim}")
        if self.hidden_act != "silu":
            raise ValueError(f"hidden_act must be 'silu', got {self.hidden_act!r}")
        if self.moe is not None and self.moe.hidden_size != self.hidden_size:
            raise ValueError(
                f"moe.hidden_size={self.moe.hidden_size} differs from hidden_size="
                f"{self.hidden_size}"
            )

    def is_sparse(self, layer_idx: int) -> bool:
        """Whether layer ``layer_idx``'s MLP is the MoE block (see ``moe``)."""
        return (
            self.moe is not None
            and layer_idx not in self.mlp_only_layers
            and (layer_idx + 1) % self.decoder_sparse_step == 0
        )

    @classmethod
    def from_hf(cls, config: Any) -> LlamaConfigLite:
        """From a transformers ``LlamaConfig`` (``rope_parameters`` in v5, ``rope_theta`` before).

        Raises:
            ValueError: a rope scaling type other than the default and Llama 3.1's.
        """
        # v5 keeps theta and type in rope_parameters; v4 has rope_theta and rope_scaling.
        rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
        rope = rope or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", "llama3"):
            raise ValueError(f"rope_type must be 'default' or 'llama3', got {rope_type!r}")
        scaling = None
        if rope_type == "llama3":
            scaling = Llama3RopeScaling(
                float(rope["factor"]),
                float(rope["low_freq_factor"]),
                float(rope["high_freq_factor"]),
                int(rope["original_max_position_embeddings"]),
            )
        return cls(
            hidden_size=config.hidden_size,
            num_attention_heads=config.num_attention_heads,
            num_hidden_layers=config.num_hidden_layers,
            intermediate_size=config.intermediate_size,
            num_key_value_heads=config.num_key_value_heads,
            head_dim=getattr(config, "head_dim", None),
            rms_norm_eps=config.rms_norm_eps,
            rope_theta=rope.get("rope_theta", getattr(config, "rope_theta", 10000.0)),
            max_position_embeddings=config.max_position_embeddings,
            hidden_act=config.hidden_act,
            attention_bias=config.attention_bias,
            mlp_bias=config.mlp_bias,
            rope_scaling=scaling,
        )


RowPlan = list[RowGroup] | None


def _rows(fn: RowFn, x: torch.Tensor, row_plan: RowPlan) -> torch.Tensor:
    """``fn(x)``; on fixed-size row chunks when ``row_plan`` is set (batch-invariant mode)."""
    return fn(x) if row_plan is None else map_row_groups(fn, x, row_plan)


@dataclass(frozen=True)
class RowPlans:
    """Row chunking of batch-invariant mode, for the norms and for the GEMMs.

    ``gemm`` is None when every linear layer's kernel is batch-invariant by itself (see
    ``PackedLinear.batch_invariant``): then GEMMs run on all rows at once.
    """

    norm: RowPlan = None
    gemm: RowPlan = None


NO_ROW_PLANS = RowPlans()


class LlamaAttention(nn.Module):
    """Self-attention with rope and grouped-query heads over the paged cache of one layer."""

    def __init__(self, config: LlamaConfigLite, layer_idx: int, **factory: Any):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.scaling = config.head_dim**-0.5
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        bias = config.attention_bias or config.qkv_bias
        self.q_proj = PackedLinear(config.hidden_size, q_size, bias=bias, **factory)
        self.k_proj = PackedLinear(config.hidden_size, kv_size, bias=bias, **factory)
        self.v_proj = PackedLinear(config.hidden_size, kv_size, bias=bias, **factory)
        self.o_proj = PackedLinear(
            q_size, config.hidden_size, bias=config.attention_bias, **factory
        )
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if config.qk_norm:
            self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps, **factory)
            self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps, **factory)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: PagedKVCache,
        meta: AttentionMetadata,
        plans: RowPlans = NO_ROW_PLANS,
    ) -> torch.Tensor:
        """``x`` ``[N, hidden]``, ``cos``/``sin`` ``[N, head_dim]`` -> ``[N, hidden]``.

        Writes the new tokens' rotated keys and values into ``cache`` layer ``layer_idx``.
        """

        def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            write_kv(cache, self.layer_idx, k, v, meta)
            return paged_attention(q, cache, self.layer_idx, meta, self.scaling)

        return self._attention(x, cos, sin, attend, plans)

    def forward_dense(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        prefill_len: int | Sequence[int] | None = None,
        plans: RowPlans = NO_ROW_PLANS,
    ) -> torch.Tensor:
        """One whole sequence ``x`` ``[N, hidden]`` -> ``[N, hidden]``, no cache (autograd
        works); ``prefill_len`` as in ``causal_attention``."""

        def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return causal_attention(q, k, v, self.scaling, prefill_len)

        return self._attention(x, cos, sin, attend, plans)

    def _attention(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attend: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
        plans: RowPlans,
    ) -> torch.Tensor:
        """Projections and rope, ``attend(q [N, H, D], k, v [N, Hkv, D]) -> [N, H, D]``, then
        ``o_proj``."""
        num_tokens = x.shape[0]
        row_plan = plans.gemm
        q = _rows(self.q_proj, x, row_plan).view(num_tokens, self.num_heads, self.head_dim)
        k = _rows(self.k_proj, x, row_plan).view(num_tokens, self.num_kv_heads, self.head_dim)
        v = _rows(self.v_proj, x, row_plan).view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:  # Qwen3: per-head RMSNorm of queries and keys before rope
            q = _rows(self.q_norm, q, plans.norm)
            k = _rows(self.k_norm, k, plans.norm)
        if cos is not None:  # None: a stack without position encoding (config.rope False)
            q, k = apply_rope(q, k, cos, sin)
        out = attend(q, k, v)  # [N, H, D]
        return _rows(self.o_proj, out.reshape(num_tokens, -1), row_plan)


class LlamaMLP(nn.Module):
    """SwiGLU: ``down_proj(silu(gate_proj(x)) * up_proj(x))``, ``hidden_size`` ->
    ``intermediate_size`` -> ``hidden_size`` (also the MoE layer's shared expert)."""

    def __init__(self, hidden: int, inner: int, bias: bool = False, **factory: Any):
        super().__init__()
        self.gate_proj = PackedLinear(hidden, inner, bias=bias, **factory)
        self.up_proj = PackedLinear(hidden, inner, bias=bias, **factory)
        self.down_proj = PackedLinear(inner, hidden, bias=bias, **factory)

    def forward(self, x: torch.Tensor, plans: RowPlans = NO_ROW_PLANS) -> torch.Tensor:
        """``x`` ``[N, hidden]`` -> ``[N, hidden]``; ``plans`` set = batch-invariant.

        SiLU runs on the norm plan's chunks: its vectorized and scalar-tail paths may round
        differently, and where a tail falls depends on the call's size (products are exact).
        """
        gate = _rows(self.gate_proj, x, plans.gemm)
        up = _rows(self.up_proj, x, plans.gemm)
        return _rows(self.down_proj, _rows(F.silu, gate, plans.norm) * up, plans.gemm)


class LlamaDecoderLayer(nn.Module):
    """Pre-norm block: ``h = x + attn(norm(x))``; ``out = h + mlp(norm(h))``."""

    def __init__(self, config: LlamaConfigLite, layer_idx: int, **factory: Any):
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_idx, **factory)
        self.sparse = config.is_sparse(layer_idx)
        """The MLP is a ``MoEFeedForward`` (its routing goes to the forward's ``routing``)."""
        if self.sparse:
            from omnistep.layers.moe import MoEFeedForward  # moe imports this module

            self.mlp: nn.Module = MoEFeedForward(config.moe, **factory)
        else:
            self.mlp = LlamaMLP(
                config.hidden_size, config.intermediate_size, config.mlp_bias, **factory
            )
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, **factory)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, **factory)
        self.residual_scale = config.residual_scale

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: PagedKVCache,
        meta: AttentionMetadata,
        plans: RowPlans = NO_ROW_PLANS,
        routing: list[torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """``hidden`` ``[N, hidden]`` -> ``[N, hidden]``; ``plans`` set = batch-invariant; a
        sparse layer appends its routing ``[N, k]`` to ``routing`` when given."""
        return self._block(
            hidden, lambda x: self.self_attn(x, cos, sin, cache, meta, plans), plans, routing
        )

    def forward_dense(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        prefill_len: int | Sequence[int] | None = None,
        plans: RowPlans = NO_ROW_PLANS,
    ) -> torch.Tensor:
        """One whole sequence, no cache (see ``LlamaModel.forward_dense``)."""
        return self._block(
            hidden,
            lambda x: self.self_attn.forward_dense(x, cos, sin, prefill_len, plans),
            plans,
        )

    def _block(
        self,
        hidden: torch.Tensor,
        attention: Callable[[torch.Tensor], torch.Tensor],
        plans: RowPlans,
        routing: list[torch.Tensor] | None = None,
        expert_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The block on rows ``[N, hidden]``; a sparse layer replays ``expert_ids`` ``[N, k]``
        when given (``MoEFeedForward.forward``) and appends its routing to ``routing``."""
        attn_in = _rows(self.input_layernorm, hidden, plans.norm)
        hidden = hidden + self._scaled(attention(attn_in))
        mlp_in = _rows(self.post_attention_layernorm, hidden, plans.norm)
        if not self.sparse:
            return hidden + self._scaled(self.mlp(mlp_in, plans))
        out = self.mlp(mlp_in, expert_ids, batch_invariant=plans.norm is not None)  # MoEOutput
        if routing is not None:
            routing.append(out.expert_ids)
        return hidden + out.hidden

    def _scaled(self, branch: torch.Tensor) -> torch.Tensor:
        """A block branch's output times ``residual_scale`` (untouched at 1.0)."""
        return branch if self.residual_scale == 1.0 else branch * self.residual_scale

    def forward_bidirectional(
        self, hidden: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None
    ) -> torch.Tensor:
        """``B`` sequences of equal length, ``hidden`` ``[B, S, hidden]``, each row attending
        to every row of its sequence (no mask, no cache; see
        ``LlamaModel.forward_bidirectional``); ``cos``/``sin`` ``[B * S, head_dim]`` or None."""
        batch, length, width = hidden.shape
        attn = self.self_attn

        def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            q = q.view(batch, length, attn.num_heads, -1).transpose(1, 2)
            k = k.view(batch, length, attn.num_kv_heads, -1).transpose(1, 2)
            v = v.view(batch, length, attn.num_kv_heads, -1).transpose(1, 2)
            out = F.scaled_dot_product_attention(
                q, k, v, scale=attn.scaling, enable_gqa=attn.num_heads != attn.num_kv_heads
            )
            return out.transpose(1, 2).reshape(batch * length, attn.num_heads, -1)

        flat = hidden.reshape(batch * length, width)
        out = self._block(
            flat, lambda x: attn._attention(x, cos, sin, attend, NO_ROW_PLANS), NO_ROW_PLANS
        )
        return out.view(batch, length, width)


class LlamaModel(nn.Module):
    """Decoder layers and final norm of a Llama, over a paged KV cache.

    ``state_dict()`` keys equal transformers ``LlamaModel``'s minus ``embed_tokens.weight``:
    ``layers.{i}.self_attn.{q,k,v,o}_proj.weight``, ``layers.{i}.mlp.{gate,up,down}_proj.weight``,
    ``layers.{i}.{input,post_attention}_layernorm.weight``, ``norm.weight`` (and, with
    ``qk_norm``, Qwen3's ``layers.{i}.self_attn.{q,k}_norm.weight``).

    Args:
        config: a ``LlamaConfigLite`` (see ``LlamaConfigLite.from_hf`` for a ``LlamaConfig``).
        device, dtype: where and in what dtype to create the parameters.
        row_chunking: rows per dense-kernel call in batch-invariant mode.
    """

    def __init__(
        self,
        config: LlamaConfigLite,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        row_chunking: RowChunking | None = None,
    ):
        super().__init__()
        self.config = config
        self.row_chunking = row_chunking or RowChunking()
        factory = {"device": device, "dtype": dtype}
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, **factory) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, **factory)
        self.rotary_emb = RotaryEmbedding(
            config.head_dim,
            config.rope_theta,
            config.max_position_embeddings,
            device=device,
            scaling=config.rope_scaling,
        )

    def _cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The rope table's rows for ``positions``, or ``(None, None)`` without rope."""
        if not self.config.rope:
            return None, None
        return self.rotary_emb(positions, dtype)

    def forward_bidirectional(self, inputs_embeds: torch.Tensor) -> torch.Tensor:
        """``B`` independent sequences of equal length ``S``, ``inputs_embeds`` ``[B, S,
        hidden]``, with full (unmasked) self-attention inside each and positions ``0..S-1``; no
        cache, autograd works. VoxCPM's LocEnc and LocDiT (upstream ``MiniCPMModel.forward``
        with ``is_causal=False``) run their stacks this way.

        Returns:
            Hidden states after the final norm, ``[B, S, hidden]``.

        Raises:
            ValueError: ``S`` past ``max_position_embeddings``.
        """
        batch, length, _ = inputs_embeds.shape
        if length > self.rotary_emb.max_positions:
            raise ValueError(
                f"{length} rows exceed max_position_embeddings={self.rotary_emb.max_positions}"
            )
        positions = torch.arange(length, device=inputs_embeds.device).repeat(batch)
        cos, sin = self._cos_sin(positions, inputs_embeds.dtype)
        hidden = inputs_embeds
        for layer in self.layers:
            hidden = layer.forward_bidirectional(hidden, cos, sin)
        return self.norm(hidden)

    def make_cache(
        self,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> PagedKVCache:
        """An empty paged cache shaped for this model (default: the parameters' dtype/device)."""
        weight = self.norm.weight
        return PagedKVCache(
            num_layers=self.config.num_hidden_layers,
            num_blocks=num_blocks,
            block_size=block_size,
            num_kv_heads=self.config.num_key_value_heads,
            head_dim=self.config.head_dim,
            dtype=dtype or weight.dtype,
            device=device or weight.device,
        )

    def forward(
        self,
        inputs_embeds: torch.Tensor,
        positions: torch.Tensor,
        cache: PagedKVCache,
        meta: AttentionMetadata,
        routing: list[torch.Tensor] | None = None,
        after_layer: Callable[[int, torch.Tensor], torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Run the new tokens of a varlen batch; write their K/V into ``cache``.

        Args:
            inputs_embeds: ``[N, hidden]``, rows grouped by sequence as ``meta`` says.
            positions: LongTensor ``[N]`` on the model's device; sequence ``i``'s rows are
                positions ``context_lens[i] - query_lens[i] ...``, as ``meta`` was built (an
                M-RoPE stack, ``MRotaryEmbedding``, takes ``[3, N]``: a sequence's rows then
                hold its own positions, e.g. TMRoPE's for media, in the same cache slots).
            meta: with ``batch_invariant`` set, every sequence's rows are bit-identical whatever
                else is in the batch.
            routing: when given, each MoE layer appends the experts each row was routed to,
                LongTensor ``[N, k]``, in layer order (``config.moe``).
            after_layer: ``after_layer(i, hidden) -> hidden`` runs on the ``[N, hidden]``
                output of layer ``i`` before layer ``i + 1`` reads it (Qwen3-Omni's deepstack
                visual features are added there).

        Returns:
            Hidden states after the final norm, ``[N, hidden]``.
        """
        self._check_inputs(inputs_embeds, meta)
        plans = self.row_plans(inputs_embeds, meta.query_lens_host, meta.batch_invariant)
        cos, sin = self._cos_sin(positions, inputs_embeds.dtype)
        hidden = inputs_embeds
        for i, layer in enumerate(self.layers):
            hidden = layer(hidden, cos, sin, cache, meta, plans, routing)
            if after_layer is not None:
                hidden = after_layer(i, hidden)
        return _rows(self.norm, hidden, plans.norm)

    def forward_dense(
        self,
        inputs_embeds: torch.Tensor,
        positions: torch.Tensor | None = None,
        prefill_len: int | Sequence[int] | None = None,
        batch_invariant: bool = False,
    ) -> torch.Tensor:
        """Teacher-forced forward of one whole sequence with no KV cache: the same layers,
        rope, norms and linear kernels as ``forward``, and autograd works (a loss on the
        result backpropagates into the stack's parameters). Touches no cache and no state, so
        it may run while other threads serve.

        Args:
            inputs_embeds: ``[N, hidden]`` rows of one sequence, in order.
            positions: LongTensor ``[N]``, or ``[R, N]`` for a multi-row rope (M-RoPE's
                ``MRotaryEmbedding``); default ``0 .. N-1``.
            prefill_len: None: plain causal attention, one SDPA call over all rows (the
                training shape). An int in ``[1, N]``: rows ``[0, prefill_len)`` attend as one
                prefill and every later row as one decode step over the rows before it,
                exactly the attention calls serving made for a sequence prefilled with
                ``prefill_len`` rows and then decoded one row at a time
                (``causal_attention``): each row's result equals serving's to the bit when
                the rest matches too (``batch_invariant`` below, or kernels that are
                batch-invariant by themselves).
                A sequence of ints: the prompt was prefilled in those consecutive pieces
                (a cached prefix, then the rest; ``PagedARModel``'s split prefill).
            batch_invariant: chunk the row-wise work as batch-invariant serving did for such
                a sequence (prefill rows in ``prefill_rows`` chunks, decode rows in
                ``decode_rows`` chunks; see ``RowChunking``).

        Returns:
            Hidden states after the final norm, ``[N, hidden]`` (the input dtype).

        Raises:
            ValueError: ``prefill_len`` outside ``[1, N]``, ``positions`` of another length,
                or a position past ``max_position_embeddings``.
        """
        num_tokens = inputs_embeds.shape[0]
        device = inputs_embeds.device
        if positions is None:
            positions = torch.arange(num_tokens, device=device)
        if positions.ndim not in (1, 2) or positions.shape[-1] != num_tokens:
            raise ValueError(f"positions {tuple(positions.shape)} for {num_tokens} rows")
        pieces = (prefill_len,) if isinstance(prefill_len, int) else prefill_len
        if pieces is not None and (not pieces or min(pieces) < 1 or sum(pieces) > num_tokens):
            raise ValueError(f"prefill_len={prefill_len} outside [1, {num_tokens}]")
        if num_tokens > self.rotary_emb.max_positions:
            raise ValueError(
                f"{num_tokens} tokens exceed max_position_embeddings="
                f"{self.rotary_emb.max_positions}"
            )
        if prefill_len is None:
            query_lens = [num_tokens]
        else:
            query_lens = [*pieces] + [1] * (num_tokens - sum(pieces))
        plans = self.row_plans(inputs_embeds, query_lens, batch_invariant)
        cos, sin = self._cos_sin(positions, inputs_embeds.dtype)
        hidden = inputs_embeds
        for layer in self.layers:
            hidden = layer.forward_dense(hidden, cos, sin, prefill_len, plans)
        return _rows(self.norm, hidden, plans.norm)

    def forward_packed(
        self,
        inputs_embeds: torch.Tensor,
        seq_lens: Sequence[int],
        prefill_lens: Sequence[int | Sequence[int] | None] | None = None,
        batch_invariant: bool = False,
        shared: Sequence[tuple[int, int] | None] | None = None,
        positions: torch.Tensor | None = None,
        expert_ids: torch.Tensor | None = None,
        after_layer: Callable[[int, torch.Tensor], torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """``forward_dense`` of several whole sequences packed into one call: the row-wise
        work (projections, MLP, norms) runs once over every sequence's rows, attention per
        sequence (positions ``0..N_i-1`` each, its own causal calls). Autograd works.

        Each sequence's rows equal its own ``forward_dense`` to the bit under
        ``batch_invariant`` (its rows get the row chunks of its own query lengths, and the
        chunked kernels give a row the same result whatever rows share a chunk, and each
        sequence gets its ``prefill_lens`` attention calls); otherwise within float rounding:
        the GEMMs see a larger M, and several sequences' attention runs as one causal call
        each whatever their ``prefill_lens`` (serving's default-mode decode attention saw the
        batch anyway; per-row calls would cost a kernel launch per row and layer).

        Args:
            inputs_embeds: ``[sum(seq_lens), hidden]``: sequence 0's rows, then sequence 1's...
            seq_lens: rows per sequence in ``inputs_embeds`` (each >= 1).
            prefill_lens: per sequence, ``forward_dense``'s ``prefill_len`` (None: plain causal
                attention); None: None for all.
            batch_invariant: as in ``forward_dense``.
            shared: per sequence None, or ``(j, P)``: its first ``P`` rows are those of an
                earlier sequence ``j`` (a group's common prompt), computed once there; its
                own ``seq_lens[i]`` rows are its rows ``P..``, each a decode row (one
                attention call per row under ``batch_invariant``, as serving decoded them).
            positions: LongTensor ``[sum(seq_lens)]`` or ``[R, sum(seq_lens)]`` (M-RoPE);
                None: ``offset .. offset + N_i - 1`` per sequence (its shared prompt's length).
            expert_ids: integer ``[sum(seq_lens), sparse layers, k]``: a MoE stack replays
                these experts (Rollout Routing Replay; see ``forward_attend``); None: the
                router chooses.
            after_layer: as in ``forward``, on the packed ``[sum(seq_lens), hidden]`` rows
                (Qwen3-Omni's deepstack features, so scoring a media prompt adds them as
                serving did).

        Returns:
            ``[sum(seq_lens), hidden]`` after the final norm.

        Raises:
            ValueError: lengths that do not add up to the rows, a ``prefill_len`` outside
                ``[1, N_i]``, a sequence past ``max_position_embeddings``, a bad ``shared``.
        """
        lens = [int(n) for n in seq_lens]
        pieces_of = [None] * len(lens) if prefill_lens is None else list(prefill_lens)
        shared = [None] * len(lens) if shared is None else list(shared)
        if len(pieces_of) != len(lens) or len(shared) != len(lens) or min(lens, default=0) < 1:
            raise ValueError(f"seq_lens {lens} and prefill_lens {prefill_lens} do not match")
        if sum(lens) != inputs_embeds.shape[0]:
            raise ValueError(f"seq_lens sum to {sum(lens)}, inputs have {inputs_embeds.shape[0]}")
        offsets = [0 if s is None else s[1] for s in shared]
        for i, s in enumerate(shared):
            if s is not None and not (0 <= s[0] < i and shared[s[0]] is None and s[1] >= 1):
                raise ValueError(f"shared[{i}]={s} must name an earlier unshared sequence")
            if s is not None and s[1] > lens[s[0]]:
                raise ValueError(f"shared[{i}]={s}: sequence {s[0]} has {lens[s[0]]} rows")
        if max(n + o for n, o in zip(lens, offsets, strict=True)) > self.rotary_emb.max_positions:
            raise ValueError(
                f"{max(lens)} tokens exceed max_position_embeddings={self.rotary_emb.max_positions}"
            )
        query_lens: list[int] = []
        for n, prefill, share in zip(lens, pieces_of, shared, strict=True):
            pieces = (prefill,) if isinstance(prefill, int) else prefill
            if share is not None:
                query_lens += [1] * n  # decode rows after the shared prompt
            elif pieces is None:
                query_lens.append(n)
            elif not pieces or min(pieces) < 1 or sum(pieces) > n:
                raise ValueError(f"prefill_len={prefill} outside [1, {n}]")
            else:
                query_lens += [*pieces] + [1] * (n - sum(pieces))
        device = inputs_embeds.device
        if positions is None:
            positions = torch.cat(
                [torch.arange(o, o + n, device=device) for n, o in zip(lens, offsets, strict=True)]
            )
        elif positions.shape[-1] != sum(lens):
            raise ValueError(f"positions {tuple(positions.shape)} for {sum(lens)} rows")
        starts = [0, *itertools.accumulate(lens)]
        per_row = [batch_invariant and p is not None for p in pieces_of]
        if len(lens) > 1 and not batch_invariant:  # one causal call per sequence
            pieces_of = [None] * len(lens)
        scale = self.layers[0].self_attn.scaling

        def attend(_layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            outs = []
            for i, (a, b) in enumerate(zip(starts[:-1], starts[1:], strict=True)):
                if shared[i] is None:
                    outs.append(causal_attention(q[a:b], k[a:b], v[a:b], scale, pieces_of[i]))
                    continue
                j, n = shared[i]
                keys = torch.cat([k[starts[j] : starts[j] + n], k[a:b]])
                values = torch.cat([v[starts[j] : starts[j] + n], v[a:b]])
                outs.append(causal_attention_tail(q[a:b], keys, values, scale, per_row[i]))
            return outs[0] if len(outs) == 1 else torch.cat(outs)

        return self.forward_attend(
            inputs_embeds, positions, attend, query_lens, batch_invariant, expert_ids, after_layer
        )

    def forward_attend(
        self,
        inputs_embeds: torch.Tensor,
        positions: torch.Tensor,
        attend: Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
        query_lens: Sequence[int],
        batch_invariant: bool = False,
        expert_ids: torch.Tensor | None = None,
        after_layer: Callable[[int, torch.Tensor], torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """The stack with a caller's attention: the same layers, rope, norms and linear kernels
        as ``forward``, but each layer's attention is ``attend(layer_idx, q, k, v)`` on the
        rotated queries ``[N, H, D]`` and keys/values ``[N, Hkv, D]``, returning ``[N, H, D]``
        (e.g. a small dense per-step cache, as the Qwen3-TTS code predictor keeps). Autograd
        works when ``attend`` is differentiable.

        Args:
            inputs_embeds: ``[N, hidden]``; positions: LongTensor ``[N]``.
            query_lens: rows per sequence (they sum to N): the row chunks of batch-invariant
                mode, as ``forward`` picks them from ``AttentionMetadata.query_lens_host``.
            batch_invariant: chunk the row-wise work to fixed shapes (``RowChunking``).
            expert_ids: integer ``[N, sparse layers, k]``: MoE layer ``j`` (the ``j``-th
                sparse layer) routes row ``n`` to ``expert_ids[n, j]`` instead of its router's
                choice (Rollout Routing Replay: the weights are still the router's
                probabilities at those experts, so replaying the routing the router chose
                gives the same rows to the bit).
            after_layer: as in ``forward``: ``after_layer(i, hidden) -> hidden`` on layer
                ``i``'s output before layer ``i + 1`` reads it.

        Returns:
            Hidden states after the final norm, ``[N, hidden]``.

        Raises:
            ValueError: ``expert_ids`` given to a dense stack, or not ``[N, sparse layers,
                k]`` with ids in ``[0, num_experts)``.
        """
        sparse = [i for i, layer in enumerate(self.layers) if layer.sparse]
        if expert_ids is not None:
            k = self.config.moe.num_experts_per_tok if self.config.moe is not None else 0
            want = (inputs_embeds.shape[0], len(sparse), k)
            if not sparse or tuple(expert_ids.shape) != want:
                raise ValueError(
                    f"expert_ids must be {list(want)} (rows, MoE layers, k), got "
                    f"{list(expert_ids.shape)}"
                )
        plans = self.row_plans(inputs_embeds, query_lens, batch_invariant)
        cos, sin = self._cos_sin(positions, inputs_embeds.dtype)
        hidden = inputs_embeds
        for i, layer in enumerate(self.layers):

            def attention(x: torch.Tensor, layer: LlamaDecoderLayer = layer, i: int = i):
                return layer.self_attn._attention(
                    x, cos, sin, lambda q, k, v: attend(i, q, k, v), plans
                )

            if expert_ids is not None and layer.sparse:
                replay = expert_ids[:, sparse.index(i)]
                hidden = layer._block(hidden, attention, plans, expert_ids=replay)
            else:  # a dense layer: its own _block may take no expert_ids (Higgs' DualFFN)
                hidden = layer._block(hidden, attention, plans)
            if after_layer is not None:
                hidden = after_layer(i, hidden)
        return _rows(self.norm, hidden, plans.norm)

    def row_plans(
        self, x: torch.Tensor, query_lens: Sequence[int], batch_invariant: bool
    ) -> RowPlans:
        """The row chunking of a forward over rows ``x`` of sequences with ``query_lens`` new
        rows each: none unless ``batch_invariant``; then norm-wise work in ``RowChunking``
        chunks, and GEMMs too unless their kernels are batch-invariant by themselves."""
        if not batch_invariant:
            return NO_ROW_PLANS
        row_plan = self.row_chunking.plan(query_lens, x.device)
        gemm_plan = None if self.gemms_batch_invariant(x) else row_plan
        return RowPlans(norm=row_plan, gemm=gemm_plan)

    def gemms_batch_invariant(self, x: torch.Tensor) -> bool:
        """Whether every linear layer gives a row the same result whatever rows share its call,
        for inputs like ``x`` (CPU float32 with oneDNN: probed once per weight version)."""
        if x.device.type != "cpu" or x.dtype != torch.float32:
            return False
        return linears_batch_invariant(self.layers)

    def _check_inputs(self, inputs_embeds: torch.Tensor, meta: AttentionMetadata) -> None:
        if inputs_embeds.shape[0] != meta.num_tokens:
            raise ValueError(
                f"inputs_embeds has {inputs_embeds.shape[0]} rows, meta has {meta.num_tokens}"
            )
        if meta.max_context_len > self.rotary_emb.max_positions:
            raise ValueError(
                f"context of {meta.max_context_len} tokens exceeds max_position_embeddings="
                f"{self.rotary_emb.max_positions}"
            )

    def load_hf_state_dict(self, state_dict: Mapping[str, torch.Tensor], prefix: str = "") -> None:
        """Load a transformers ``LlamaModel`` state dict, strictly, ignoring its embedding; a
        MoE layer's experts by their published per-expert names or fused (``layers.moe``).

        Keys are taken from those starting with ``prefix`` (e.g. ``"model."`` for a
        ``LlamaForCausalLM``), with the prefix stripped; ``embed_tokens.*`` (and any
        ``rotary_emb.*`` buffer) is dropped; every other key must match.

        Raises:
            RuntimeError: missing or unexpected keys, or shape mismatches (from ``nn.Module``).
        """
        selected = {
            key[len(prefix) :]: value for key, value in state_dict.items() if key.startswith(prefix)
        }
        kept = {k: v for k, v in selected.items() if not k.startswith(_IGNORED_HF_PREFIXES)}
        if self.config.moe is not None:  # the published per-expert names -> fused tensors
            from omnistep.layers.moe import fuse_expert_tensors

            for i, layer in enumerate(self.layers):
                if layer.sparse:
                    p = f"layers.{i}.mlp."
                    mlp = {k[len(p) :]: kept.pop(k) for k in list(kept) if k.startswith(p)}
                    fused = fuse_expert_tensors(mlp, self.config.moe.num_experts)
                    kept.update({p + k: v for k, v in fused.items()})
        self.load_state_dict(kept, strict=True)
