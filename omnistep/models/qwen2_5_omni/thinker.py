"""The Qwen2.5-Omni thinker as a component: the Qwen2.5 text LM on a paged KV cache, batched across
requests, for text and media prompts; configures the shared
``omnistep.runners.paged_ar.PagedARModel`` (as the talker and ChatTTS's GPT do) with its
embedding, ``lm_head``, rope positions and the rows it streams.

Mirrors transformers' ``Qwen2_5OmniThinkerForConditionalGeneration`` (models/qwen2_5_omni/
modeling_qwen2_5_omni.py): ``model.language_model`` is a Qwen2 decoder (``Qwen2_5OmniDecoderLayer``:
q/k/v projections with bias, o_proj without, SwiGLU MLP, RMSNorm), ``lm_head`` maps the final
normed hidden state to the text vocab. The audio tower and vision encoder run in their own
component (ENCODE units, ``encoders.py``); their rows reach the thinker in a ``ThinkerPrompt``.

Prompts: token ids (text only), or a ``ThinkerPrompt``: the ids with one placeholder token per
encoder row, the rows (which replace the placeholders' embeddings, as the thinker's
``masked_scatter`` does) and their TMRoPE positions (``mrope.rope_index``).

Rope: the thinker uses M-RoPE (``Qwen2_5OmniRotaryEmbedding``): three position ids per token
(temporal, height, width); the rotary frequencies are split by ``mrope_section`` and each split
takes its angles from one of the three. For text-only input ``get_rope_index`` gives all three the
same ids ``0..L-1`` (and a zero ``rope_deltas``, so decode positions continue ``L, L+1, ...``), so
every split reads the same angles and M-RoPE is exactly Llama's 1-D rope over ``head_dim``
(checked against transformers in tests/test_qwen_lm.py). Media prompts need the three rows: the
stack's rope is an ``MRotaryEmbedding`` (``position_rows = 3``), which gives bit-identical
values for equal rows; decode positions continue at ``length + rope_delta``.

What the talker needs (``Qwen2_5OmniForConditionalGeneration.generate``): for every thinker token,
its input embedding plus the thinker's last hidden state (after the final norm) at that position,
``embed_tokens(id) + hidden_states[-1]``, in the model dtype. ``ARStepOutput.hidden`` carries
exactly those rows, float32 on the CPU, ``[n, hidden_size]``, for the tokens a unit fed that no
earlier output covered:

- PREFILL of a fresh sequence: ``n = L``, one row per prompt token (the talker's prompt part).
- AR_TOKEN feeding generated token ``g_j``: ``n = 1``, the row of ``g_j`` (``thinker_reply_part``
  row ``j``); so the step that samples ``g_{j+1}`` streams ``g_j``'s row.
- PREFILL replaying frames after a preemption: ``n = 1``, the row of the last replayed frame (the
  rows before it were streamed before the preemption).

The token the thinker samples last (its EOS, or the one cut by ``max_new_tokens``) is never fed,
so it has no row: the talker reads the text-EOS embedding there instead (see the talker module).
At media placeholders transformers zeroes the embedding part before the sum (the row is the
hidden state alone): the thinker's input rows carry one more column, 1 where the token's
embedding conditions the talker and 0 at placeholders, which ``_lm_inputs`` drops and
``_stream`` multiplies the embedding by.

KV admission, preemption, batching and sampling: ``PagedARModel``'s, with its prefix caching
on (``prefix_caching``): a salted request (a realtime session's turn) starts on the cached
blocks of the longest equal prefix of its rows and streams their kept rows to the talker.

Imports torch, ``omnistep.kv``, ``layers`` and ``loops``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from omnistep.kv import KVCacheConfig
from omnistep.layers.llama import LlamaConfigLite
from omnistep.layers.rope import MRotaryEmbedding
from omnistep.loops.ar_decode import ARPrefillInput, ARStepInput
from omnistep.runners.media_prompt import ThinkerPrompt
from omnistep.runners.paged_ar import PagedARModel

ENCODER_PREFIXES = ("audio_tower.", "visual.")
"""Thinker weights of the audio tower and the vision encoder, by official key prefix."""

__all__ = ["ENCODER_PREFIXES", "QwenThinker", "ThinkerConfig", "ThinkerPrompt", "load_thinker"]


# ---------------------------------------------------------------- config helpers
def sub_config(raw: Mapping[str, Any], *path: str) -> Mapping[str, Any]:
    """Descend into ``raw`` along ``path`` as far as the keys exist (so a full ``config.json``,
    its ``thinker_config`` or its ``text_config`` all reach the same dict)."""
    for key in path:
        if key in raw:
            raw = raw[key]
    return raw


def rope_fields(raw: Mapping[str, Any], default_theta: float) -> tuple[float, tuple[int, ...]]:
    """``(rope_theta, mrope_section)`` of a Qwen2.5-Omni text/talker config dict.

    Reads transformers v5's ``rope_parameters`` or the official files' ``rope_theta`` +
    ``rope_scaling`` (``{"mrope_section": [16, 24, 24], "rope_type": "default", ...}``).

    Raises:
        ValueError: a rope type other than the default (or "mrope"), or sliding-window
            attention (``use_sliding_window``), which this stack does not implement.
    """
    if raw.get("use_sliding_window", False):
        raise ValueError("use_sliding_window=True is not supported")
    rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "mrope"):
        raise ValueError(f"rope_type must be 'default', got {rope_type!r}")
    theta = rope.get("rope_theta", raw.get("rope_theta", default_theta))
    section = tuple(rope.get("mrope_section", (16, 24, 24)))
    return float(theta), section


def check_mrope(section: tuple[int, ...], head_dim: int) -> None:
    """M-RoPE splits the ``head_dim // 2`` frequencies into ``mrope_section``.

    Raises:
        ValueError: the sections do not add up to ``head_dim // 2``.
    """
    if len(section) != 3 or sum(section) * 2 != head_dim:
        raise ValueError(f"mrope_section={section} must be 3 parts summing to head_dim/2")


def qwen2_stack(cfg: Any) -> LlamaConfigLite:
    """A Qwen2 decoder stack (q/k/v bias, no o or MLP bias) from a config with the Llama size
    fields (hidden_size, heads, layers, intermediate_size, kv heads, head_dim, eps, rope_theta,
    max_position_embeddings): shared by the thinker and the talker."""
    return LlamaConfigLite.of(cfg, qkv_bias=True)


@dataclass(frozen=True)
class ThinkerConfig:
    """The thinker's text model, from ``config.json``'s ``thinker_config.text_config``.

    Defaults are transformers' ``Qwen2_5OmniTextConfig`` (= Qwen2.5-Omni-7B).

    Attributes:
        vocab_size: text vocab (rows of ``embed_tokens`` and ``lm_head``).
        hidden_size, intermediate_size, num_hidden_layers, num_attention_heads,
            num_key_value_heads, rms_norm_eps, max_position_embeddings: as in the config.
        head_dim: per-head width; None = ``hidden_size // num_attention_heads``.
        rope_theta: rope base.
        mrope_section: M-RoPE split of the ``head_dim // 2`` frequencies (t, h, w).
        tie_word_embeddings: ``lm_head`` shares ``embed_tokens``' weight when the checkpoint has
            no ``lm_head.weight``.
    """

    vocab_size: int = 152064
    hidden_size: int = 3584
    intermediate_size: int = 18944
    num_hidden_layers: int = 28
    num_attention_heads: int = 28
    num_key_value_heads: int = 4
    head_dim: int | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    mrope_section: tuple[int, ...] = (16, 24, 24)
    max_position_embeddings: int = 32768
    tie_word_embeddings: bool = False

    def __post_init__(self) -> None:
        if self.head_dim is None:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        check_mrope(self.mrope_section, self.head_dim)

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> ThinkerConfig:
        """From a full ``config.json`` dict, its ``thinker_config``, or a ``text_config``.

        Raises:
            ValueError: unsupported rope or sliding-window settings (``rope_fields``).
        """
        text = sub_config(raw, "thinker_config", "text_config")
        theta, section = rope_fields(text, 1_000_000.0)
        names = (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "rms_norm_eps",
            "max_position_embeddings",
            "tie_word_embeddings",
        )
        fields = {name: text[name] for name in names if text.get(name) is not None}
        return cls(**fields, rope_theta=theta, mrope_section=section)

    def llama(self) -> LlamaConfigLite:
        """The decoder stack: Qwen2 attention (q/k/v bias, no o bias), no MLP bias."""
        return qwen2_stack(self)


# ---------------------------------------------------------------- the thinker
def official_thinker_keys(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Thinker tensors under the official checkpoint's names (``thinker.`` prefix removed):
    ``model.*`` (text model), ``lm_head.weight``, ``audio_tower.*``, ``visual.*``.

    Also accepts transformers v5's in-memory names (``model.language_model.*``,
    ``model.audio_tower.*``, ``model.visual.*``; the reverse of its checkpoint conversion
    mapping for ``Qwen2_5OmniThinkerForConditionalGeneration``) and a leading ``thinker.``.
    """
    out = {}
    for key, value in state.items():
        key = key.removeprefix("thinker.")
        if key.startswith("model.language_model."):
            key = "model." + key.removeprefix("model.language_model.")
        elif key.startswith(tuple(f"model.{p}" for p in ENCODER_PREFIXES)):
            key = key.removeprefix("model.")
        out[key] = value
    return out


class QwenThinker(PagedARModel):
    """The thinker component (see module docstring).

    PREFILL payloads are ``ARPrefillInput`` whose ``prompt`` is the prompt's token ids
    (``Sequence[int]``, e.g. the chat template's ids); AR_TOKEN payloads are ``ARStepInput``.
    Frames are 1-tuples of text ids; ``hidden`` is the talker conditioning described above.

    Attributes:
        embed_weight: ``[vocab, hidden]`` token embedding (``model.embed_tokens.weight``).
        lm_head: ``[vocab, hidden]`` output projection (``lm_head.weight``).
        encoder_weights: audio tower / vision encoder tensors by official name when the
            loaded state held them (the card's thinker leaves them to its ``encoder``).
    """

    stream_prompt_rows = True
    position_rows = 3
    prefix_caching = True  # a realtime session's turns (``Request.cache_salt``)

    def __init__(
        self,
        config: ThinkerConfig,
        kv: KVCacheConfig,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        batch_invariant: bool = False,
    ):
        super().__init__(config.llama(), kv, device, dtype, batch_invariant)
        self.config = config
        stack = self.llama.config
        self.llama.rotary_emb = MRotaryEmbedding(
            config.head_dim,
            stack.rope_theta,
            stack.max_position_embeddings,
            config.mrope_section,
            self.device,
        )
        shape = (config.vocab_size, config.hidden_size)
        self.embed_weight = torch.zeros(shape, device=self.device, dtype=dtype)
        self.lm_head = torch.zeros(shape, device=self.device, dtype=dtype)
        self.encoder_weights: dict[str, torch.Tensor] = {}
        self.tied_head = False  # the checkpoint had no lm_head.weight: lm_head copies embeddings

    def load_weights(self, state: Mapping[str, torch.Tensor]) -> None:
        """Load thinker tensors (official names, see ``official_thinker_keys``).

        Raises:
            ValueError: tensors that belong to no part of the thinker, or no ``lm_head.weight``
                while the embeddings are not tied.
            KeyError / RuntimeError: a missing or mis-shaped text-model tensor.
        """
        state = official_thinker_keys(state)
        model = {k.removeprefix("model."): v for k, v in state.items() if k.startswith("model.")}
        encoders = {k: v for k, v in state.items() if k.startswith(ENCODER_PREFIXES)}
        unknown = set(state) - {f"model.{k}" for k in model} - set(encoders) - {"lm_head.weight"}
        if unknown:
            raise ValueError(f"unexpected thinker tensors: {sorted(unknown)[:5]}")
        self.embed_weight.copy_(model["embed_tokens.weight"])
        head = state.get("lm_head.weight")
        if head is None and not self.config.tie_word_embeddings:
            raise ValueError("no lm_head.weight and tie_word_embeddings is False")
        self.lm_head.copy_(model["embed_tokens.weight"] if head is None else head)
        self.tied_head = head is None
        self.llama.load_hf_state_dict(model)
        self.encoder_weights = {
            k: v.to(self.device, self.dtype) if v.is_floating_point() else v.to(self.device)
            for k, v in encoders.items()
        }

    def _weight_tensors(self) -> dict[str, torch.Tensor]:
        """The official checkpoint's text-model names (``thinker.model.*``,
        ``thinker.lm_head.weight`` unless tied); the audio and vision encoders take no
        updates (they run in the ``encoder`` component)."""
        tensors = {
            f"thinker.model.{k}": v for k, v in self.llama.state_dict(keep_vars=True).items()
        }
        tensors["thinker.model.embed_tokens.weight"] = self.embed_weight
        if not self.tied_head:
            tensors["thinker.lm_head.weight"] = self.lm_head
        return tensors

    def _weights_updated(self, names: set[str]) -> None:
        if self.tied_head and "thinker.model.embed_tokens.weight" in names:
            self.lm_head.copy_(self.embed_weight)

    @torch.inference_mode()
    def embed(self, token_ids: Sequence[int]) -> torch.Tensor:
        """Input embeddings ``[n, hidden]`` float32 (CPU) of text ids (e.g. the talker's
        text-EOS/pad/speaker ids, which the talker adds in the thinker's space)."""
        ids = self._frame_ids([(int(t),) for t in token_ids], self.config.vocab_size)
        return self.embed_weight[ids].float().cpu()

    @torch.inference_mode()
    def teacher_forced_logits(
        self,
        prompt_ids: Sequence[int] | ThinkerPrompt,
        generated: Sequence[int | tuple[int]] = (),
        incremental: bool = False,
    ) -> torch.Tensor:
        """Text logits ``[len(generated) + 1, 1, vocab]`` (float32) of the prompt followed by
        ``generated``: row ``i`` is the distribution token ``i`` was drawn from (row 0: after
        the prompt). Used by parity tests and the rollout gate C2.

        Args:
            generated: generated ids (ints or 1-tuples).
            incremental: feed them one decode step at a time, the path generation takes (bit-
                identical logits when the request ran alone or in ``batch_invariant`` mode);
                False runs one forward over prompt and tokens (other GEMM shapes: ~1e-6).

        Raises:
            KVCacheFullError: the sequence does not fit the KV pool.
            ValueError: an id outside the vocab.
        """
        frames = tuple((f,) if isinstance(f, int) else tuple(f) for f in generated)
        seq_id = self.scorer.teacher_seq_id()
        head = () if incremental else frames
        prompt = prompt_ids if isinstance(prompt_ids, ThinkerPrompt) else tuple(prompt_ids)
        first = ARPrefillInput(seq_id, prompt, head, (), None, None)
        steps = [ARStepInput(seq_id, f, i + 1, (), None, None) for i, f in enumerate(frames)]
        return self.scorer.teacher_forced(first, steps if incremental else [])

    # ------------------------------------------------------------ hooks
    def _prefill_inputs(self, unit: ARPrefillInput) -> torch.Tensor:
        """``[L + len(generated), hidden + 1]``: embeddings (encoder rows at a
        ``ThinkerPrompt``'s placeholders) and the talker flag column (see module docstring)."""
        prompt = unit.prompt
        ids = prompt.ids if isinstance(prompt, ThinkerPrompt) else prompt
        if len(ids) == 0:
            raise ValueError(f"empty thinker prompt for sequence {unit.seq_id!r}")
        frames = [(int(t),) for t in ids] + [tuple(f) for f in unit.generated]
        ids_tensor = self._frame_ids(frames, self.config.vocab_size)
        rows = self.embed_weight[ids_tensor]
        flag = torch.ones(rows.shape[0], 1, device=self.device, dtype=rows.dtype)
        if isinstance(prompt, ThinkerPrompt) and prompt.media_rows:
            is_media = torch.zeros(rows.shape[0], dtype=torch.bool, device=self.device)
            is_media[: len(ids)] = torch.isin(
                ids_tensor[: len(ids)], torch.tensor(prompt.placeholder_ids, device=self.device)
            )
            media = torch.cat(prompt.media_rows).to(self.device, rows.dtype)
            rows[is_media] = media
            flag[is_media] = 0
        return torch.cat([rows, flag], dim=1)

    def _step_inputs(self, units: Sequence[ARStepInput]) -> torch.Tensor:
        ids = self._frame_ids([tuple(u.last) for u in units], self.config.vocab_size)
        rows = self.embed_weight[ids]
        return torch.cat([rows, torch.ones_like(rows[:, :1])], dim=1)

    def _lm_inputs(self, rows: torch.Tensor, query_lens: list[int]) -> torch.Tensor:
        return rows[:, :-1]

    def _prompt_positions(self, prompt: Any) -> tuple[torch.Tensor, int] | None:
        if not isinstance(prompt, ThinkerPrompt):
            return None
        return torch.from_numpy(prompt.positions), prompt.rope_delta

    def _head(self, hidden: torch.Tensor, seq_id: str) -> torch.Tensor:
        return self._linear_rows(hidden.to(self.dtype), self.lm_head).unsqueeze(1)

    def _score_head(self, hidden: torch.Tensor, prompt: Sequence[int]) -> torch.Tensor:
        """``_head`` on ``embed_tokens`` itself when the head is tied (equal values; the
        gradient then reaches the one checkpoint tensor)."""
        weight = self.embed_weight if self.tied_head else self.lm_head
        return self._linear_rows(hidden.to(self.dtype), weight).unsqueeze(1)

    def _stream(self, rows: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """``embed + last hidden`` per fed token, ``[n, hidden]`` float32 on the CPU (summed in
        the compute dtype, as transformers' ``generate`` does)."""
        embeds = rows[:, :-1] * rows[:, -1:]  # 0 at media placeholders
        return (hidden + embeds).float().cpu()


def load_thinker(
    state: Mapping[str, torch.Tensor],
    config: Mapping[str, Any],
    kv: KVCacheConfig,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    batch_invariant: bool = False,
) -> QwenThinker:
    """Build a ``QwenThinker`` and load it.

    Args:
        state: thinker tensors, keys with the ``thinker.`` prefix removed (official layout:
            ``model.*``, ``lm_head.weight``, ``audio_tower.*``, ``visual.*``; transformers v5
            names are accepted too).
        config: the official ``config.json`` dict (or its ``thinker_config`` / ``text_config``).
        kv: KV pool size.
    """
    thinker = QwenThinker(ThinkerConfig.from_dict(config), kv, device, dtype, batch_invariant)
    thinker.load_weights(state)
    return thinker
