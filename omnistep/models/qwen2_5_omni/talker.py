"""The Qwen2.5-Omni talker as a component: a Qwen2 LM over the codec vocab, conditioned token by
token on the thinker, on a paged KV cache, batched across requests.

Mirrors transformers' ``Qwen2_5OmniTalkerForConditionalGeneration`` and the hand-off in
``Qwen2_5OmniForConditionalGeneration.generate`` (models/qwen2_5_omni/modeling_qwen2_5_omni.py).
Every talker input row lives in the thinker's hidden space (``embedding_size`` = thinker hidden):
``x = codec_embed(code) + c`` where ``c`` is thinker conditioning, and the stack's input is
``thinker_to_talker_proj(x)`` (a Linear with bias, ``embedding_size -> hidden_size``). The codec
embedding (``model.embed_tokens``) is ``[vocab, embedding_size]``; ``codec_head`` maps the final
normed hidden state to codec logits (float32).

Conditioning, with ``r_j = thinker_embed(g_j) + thinker_last_hidden(g_j)`` for the thinker's
generated token ``g_j`` and ``p_i`` the same for prompt token ``i`` (the thinker's
``ARStepOutput.hidden`` rows):

- PREFILL, ``L + 2`` rows: ``p_0 .. p_{L-1}`` (no codec part: the codec ids there are
  ``tts_codec_mask_token_id`` and are only in the id sequence), then
  ``thinker_embed(speaker_bos) + codec_embed(tts_codec_pad_token_id)``, then
  ``r_0 + codec_embed(tts_codec_start_token_id)``. ``speaker_bos`` is the speaker's
  ``bos_token`` from ``spk_dict.pt``. The prefill samples code ``c_0``.
- AR_TOKEN step ``t >= 1`` (feeds ``c_{t-1}``, samples ``c_t``): ``codec_embed(c_{t-1}) + cond_t``
  with ``cond_t = r_t`` while the thinker has that token; after the thinker's last fed token
  ``g_{E-1}`` (``E`` reply rows ``r_0 .. r_{E-1}`` exist; the thinker's final sampled token, its
  EOS or the one cut by ``max_new_tokens``, is never fed and has no row): ``cond_E =
  thinker_embed(tts_text_end_token_id)`` once, then ``thinker_embed(tts_text_pad_token_id)`` for
  every later step. ``condition_for_step`` encodes this rule; ``TalkerCondition`` is the
  per-step payload.
- Positions are ``0, 1, 2, ...`` for a text-only prompt (M-RoPE reduces to 1-D rope, as for
  the thinker). A media prompt's ``L`` rows take the thinker prompt's TMRoPE positions and every
  later row ``index + rope_delta`` (transformers computes the talker's rope index over the
  thinker's ids plus two text ids, so the delta is the thinker's); ``TalkerPrompt.positions``.

So talker step ``t`` needs thinker row ``r_t``, which exists once the thinker has fed ``g_t``
(thinker step ``t + 1``): the talker runs at least one token behind the thinker, and its prefill
waits for the thinker's first decode step (``r_0``).

transformers 5.24 quirk: ``GenerationMixin.generate`` drops an all-ones attention mask, and the
talker's forward adds the codec pad/bos embeddings only when a mask is present, so a single
unpadded request there runs the prefill without them, while padded batches (and earlier
transformers, whose generate kept the mask) add them. This component always adds them (the
forward's evident intent); parity tests call the talker forward with a mask.

Sampling (``generate``'s talker defaults, ``TALKER_GENERATE_DEFAULTS``): do_sample, temperature
0.9, top_k 40, top_p 0.8, repetition_penalty 1.05, max_new_tokens 4096, EOS ids
``[8292, 8294]`` (= ``tts_codec_pad_token_id``, ``tts_codec_end_token_id``), and
``suppress_tokens=[tts_codec_start_token_id]``, which this component always applies (the start id
gets -inf before sampling; ``teacher_forced_logits`` stays raw).

Prefill/decode, KV admission, preemption and sampling are the shared
``omnistep.runners.paged_ar.PagedARModel``'s; this module configures its inputs and head.

Imports torch, ``omnistep.kv``, ``layers``, ``loops`` and the thinker module (config helpers).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import torch

from omnistep.kv import KVCacheConfig
from omnistep.layers.batch_invariant import map_row_groups
from omnistep.layers.llama import LlamaConfigLite
from omnistep.layers.rope import MRotaryEmbedding
from omnistep.loops.ar_decode import ARPrefillInput, ARStepInput
from omnistep.models.qwen2_5_omni.thinker import (
    check_mrope,
    qwen2_stack,
    rope_fields,
    sub_config,
)
from omnistep.runners.paged_ar import PagedARModel

NEG_INF = float("-inf")


@dataclass(frozen=True)
class TalkerGenerateDefaults:
    """The talker's sampling in transformers' ``Qwen2_5OmniForConditionalGeneration.generate``
    (its ``talker_*`` keyword defaults).

    transformers applies repetition penalty (once per distinct id anywhere in the sequence,
    prompt codec ids included) and ``suppress_tokens`` first, then temperature, top-k, top-p
    (``min_tokens_to_keep = 1``). ``omnistep.sampling`` applies temperature, a compounding
    windowed penalty, top-p then top-k: equal for greedy and for penalty 1 with top-k or top-p
    alone, not in general.
    """

    do_sample: bool = True
    temperature: float = 0.9
    top_k: int = 40
    top_p: float = 0.8
    repetition_penalty: float = 1.05
    max_new_tokens: int = 4096


TALKER_GENERATE_DEFAULTS = TalkerGenerateDefaults()


@dataclass(frozen=True)
class TalkerConfig:
    """The talker, from ``config.json``'s ``talker_config``; defaults are transformers'
    ``Qwen2_5OmniTalkerConfig`` (note ``head_dim`` defaults to 128 there, not hidden/heads).

    Attributes:
        vocab_size: codec vocab.
        embedding_size: width of the codec embedding and of the thinker conditioning (the
            thinker's hidden size); ``thinker_to_talker_proj`` maps it to ``hidden_size``.
        hidden_size, intermediate_size, num_hidden_layers, num_attention_heads,
            num_key_value_heads, head_dim, rms_norm_eps, max_position_embeddings: the stack.
        rope_theta, mrope_section: rope (text-only: 1-D).
        tts_text_start_token_id, tts_text_end_token_id, tts_text_pad_token_id: thinker-vocab
            ids whose thinker embeddings the talker reads (start: when no speaker bos is
            given; end: the step after the thinker's last token; pad: every step after).
        tts_codec_start_token_id: codec BOS (last prefill row; never sampled).
        tts_codec_end_token_id, tts_codec_pad_token_id: codec EOS ids (``eos_token_ids``); pad
            is also added to the speaker-bos prefill row.
        tts_codec_mask_token_id: codec id of the prompt rows (ids only, no embedding added).
    """

    vocab_size: int = 8448
    embedding_size: int = 3584
    hidden_size: int = 3584
    intermediate_size: int = 18944
    num_hidden_layers: int = 28
    num_attention_heads: int = 28
    num_key_value_heads: int = 4
    head_dim: int = 128
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    mrope_section: tuple[int, ...] = (16, 24, 24)
    max_position_embeddings: int = 32768
    tts_text_start_token_id: int = 151860
    tts_text_end_token_id: int = 151861
    tts_text_pad_token_id: int = 151859
    tts_codec_start_token_id: int = 8293
    tts_codec_end_token_id: int = 8294
    tts_codec_pad_token_id: int = 8292
    tts_codec_mask_token_id: int = 8296

    def __post_init__(self) -> None:
        check_mrope(self.mrope_section, self.head_dim)
        for name in ("start", "end", "pad", "mask"):
            value = getattr(self, f"tts_codec_{name}_token_id")
            if not 0 <= value < self.vocab_size:
                raise ValueError(f"tts_codec_{name}_token_id={value} outside [0, vocab_size)")

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> TalkerConfig:
        """From a full ``config.json`` dict or its ``talker_config``.

        Raises:
            ValueError: unsupported rope or sliding-window settings, bad codec ids.
        """
        talker = sub_config(raw, "talker_config")
        theta, section = rope_fields(talker, 1_000_000.0)
        names = {f for f in cls.__dataclass_fields__ if f not in ("rope_theta", "mrope_section")}
        fields = {name: talker[name] for name in names if talker.get(name) is not None}
        return cls(**fields, rope_theta=theta, mrope_section=section)

    @property
    def eos_token_ids(self) -> tuple[int, int]:
        """Codec ids that end generation: ``generate``'s ``talker_eos_token_id`` default
        ``[8292, 8294]`` is ``(tts_codec_pad_token_id, tts_codec_end_token_id)``."""
        return (self.tts_codec_pad_token_id, self.tts_codec_end_token_id)

    def text_token_ids(self) -> tuple[int, int, int]:
        """Thinker ids whose embeddings the talker always keeps: start, end, pad."""
        return (
            self.tts_text_start_token_id,
            self.tts_text_end_token_id,
            self.tts_text_pad_token_id,
        )

    def llama(self) -> LlamaConfigLite:
        """The decoder stack: Qwen2 attention, as the thinker's."""
        return qwen2_stack(self)


# ---------------------------------------------------------------- payloads
class ConditionKind(StrEnum):
    """What the thinker contributes to one talker step."""

    REPLY = "reply"
    """A thinker token's row ``embed + last hidden`` (the thinker's ``ARStepOutput.hidden``)."""
    TEXT_EOS = "text_eos"
    """The thinker is done: its embedding of ``tts_text_end_token_id`` (one step)."""
    TEXT_PAD = "text_pad"
    """Every step after TEXT_EOS: its embedding of ``tts_text_pad_token_id``."""


@dataclass(frozen=True, slots=True, eq=False)  # holds a tensor: compare by identity
class TalkerCondition:
    """The thinker conditioning of one talker step (see the module docstring).

    Attributes:
        kind: REPLY, TEXT_EOS or TEXT_PAD.
        vector: REPLY only: ``[embedding_size]`` float (any device; ``[1, embedding_size]`` is
            accepted and flattened), the thinker's streamed row for the token.
    """

    kind: ConditionKind
    vector: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if (self.kind is ConditionKind.REPLY) != (self.vector is not None):
            raise ValueError("a REPLY condition needs a vector; TEXT_EOS/TEXT_PAD take none")
        if self.vector is not None:
            object.__setattr__(self, "vector", self.vector.reshape(-1))

    @classmethod
    def reply(cls, vector: torch.Tensor) -> TalkerCondition:
        return cls(ConditionKind.REPLY, vector)


TEXT_EOS = TalkerCondition(ConditionKind.TEXT_EOS)
TEXT_PAD = TalkerCondition(ConditionKind.TEXT_PAD)


def condition_for_step(
    step: int, replies: Sequence[torch.Tensor], thinker_done: bool
) -> TalkerCondition | None:
    """The condition of talker decode step ``step`` (>= 1; the prefill consumed ``replies[0]``).

    Args:
        replies: the thinker's reply rows so far, ``r_0, r_1, ...`` (one per AR_TOKEN output
            of the thinker, ``[1, E]`` or ``[E]`` each), including the row of the step that
            sampled the thinker's EOS.
        thinker_done: the thinker will stream no more rows.

    Returns:
        ``REPLY(r_step)``; once the thinker is done, TEXT_EOS at ``step == len(replies)`` and
        TEXT_PAD after; None while ``r_step`` is not streamed yet (the talker must wait).
    """
    if step < 1:
        raise ValueError(f"step must be >= 1, got {step}")
    if step < len(replies):
        return TalkerCondition.reply(replies[step])
    if not thinker_done:
        return None
    return TEXT_EOS if step == len(replies) else TEXT_PAD


@dataclass(frozen=True, slots=True, eq=False)  # holds tensors: compare by identity
class TalkerPrompt:
    """The PREFILL prompt of one request's talker sequence.

    Attributes:
        prompt_conditions: ``[L, embedding_size]``: the thinker's PREFILL ``hidden`` (one row per
            prompt token).
        first_reply: ``[embedding_size]`` (or ``[1, embedding_size]``): ``r_0``, the thinker's
            first AR_TOKEN ``hidden`` (the row of its first generated token).
        speaker_bos_id: the speaker's ``bos_token`` (a thinker id, from ``spk_dict.pt``); its
            thinker embedding must have been loaded (``load_talker(speaker_bos_ids=...)``).
            None uses ``tts_text_start_token_id``.
        replay: conditions of decode steps ``1..n`` already run; a re-prefill after a preemption
            replays ``generated`` frames ``c_0..c_{n-1}`` with them, so it needs at least
            ``len(generated)`` (the condition of the preempted step included).
        positions: int64 ``[3, L]`` TMRoPE positions of the thinker prompt (a media prompt),
            or None (text only: ``0 .. L-1``); ``rope_delta``: later rows' offset.
    """

    prompt_conditions: torch.Tensor
    first_reply: torch.Tensor
    speaker_bos_id: int | None = None
    replay: tuple[TalkerCondition, ...] = ()
    positions: torch.Tensor | None = None
    rope_delta: int = 0


# ---------------------------------------------------------------- the component
class QwenTalker(PagedARModel):
    """The talker component (see module docstring).

    PREFILL payloads are ``ARPrefillInput`` with a ``TalkerPrompt``; AR_TOKEN payloads are
    ``ARStepInput`` whose ``extra`` is the step's ``TalkerCondition``. Frames are 1-tuples of
    codec ids; outputs carry no ``hidden``.

    Attributes:
        codec_embed: ``[vocab, embedding_size]`` (``model.embed_tokens.weight``).
        proj_weight, proj_bias: ``thinker_to_talker_proj`` ``[hidden, embedding_size]``,
            ``[hidden]``.
        codec_head: ``[vocab, hidden]`` (``codec_head.weight``).
        text_embeds: thinker embeddings ``[embedding_size]`` of the text ids the talker reads
            (start, end, pad, speaker bos ids), by id.
    """

    position_rows = 3

    def __init__(
        self,
        config: TalkerConfig,
        kv: KVCacheConfig,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        batch_invariant: bool = False,
    ):
        super().__init__(config.llama(), kv, device, dtype, batch_invariant)
        self.config = config
        stack = self.llama.config
        self.llama.rotary_emb = MRotaryEmbedding(
            stack.head_dim,
            stack.rope_theta,
            stack.max_position_embeddings,
            config.mrope_section,
            self.device,
        )
        factory = {"device": self.device, "dtype": dtype}
        self.codec_embed = torch.zeros(config.vocab_size, config.embedding_size, **factory)
        self.proj_weight = torch.zeros(config.hidden_size, config.embedding_size, **factory)
        self.proj_bias = torch.zeros(config.hidden_size, **factory)
        self.codec_head = torch.zeros(config.vocab_size, config.hidden_size, **factory)
        self.text_embeds: dict[int, torch.Tensor] = {}

    def load_weights(
        self,
        state: Mapping[str, torch.Tensor],
        thinker_embed_tokens: torch.Tensor,
        speaker_bos_ids: Sequence[int] = (),
    ) -> None:
        """Load talker tensors and the thinker embedding rows the talker reads.

        Args:
            state: talker tensors, ``talker.`` prefix optional: ``model.*``,
                ``thinker_to_talker_proj.{weight,bias}``, ``codec_head.weight``.
            thinker_embed_tokens: the thinker's ``[text_vocab, embedding_size]`` embedding
                (``thinker.model.embed_tokens.weight``); only a few rows are copied.
            speaker_bos_ids: the speakers' ``bos_token`` ids (``spk_dict.pt``).

        Raises:
            ValueError: unexpected tensors, or a text id outside the thinker vocab.
            KeyError / RuntimeError: a missing or mis-shaped tensor.
        """
        state = {k.removeprefix("talker."): v for k, v in state.items()}
        model = {k.removeprefix("model."): v for k, v in state.items() if k.startswith("model.")}
        own = {"thinker_to_talker_proj.weight", "thinker_to_talker_proj.bias", "codec_head.weight"}
        unknown = set(state) - {f"model.{k}" for k in model} - own
        if unknown:
            raise ValueError(f"unexpected talker tensors: {sorted(unknown)[:5]}")
        self.codec_embed.copy_(model["embed_tokens.weight"])
        self.proj_weight.copy_(state["thinker_to_talker_proj.weight"])
        self.proj_bias.copy_(state["thinker_to_talker_proj.bias"])
        self.codec_head.copy_(state["codec_head.weight"])
        self.llama.load_hf_state_dict(model)
        ids = dict.fromkeys([*self.config.text_token_ids(), *speaker_bos_ids])
        for token_id in ids:
            if not 0 <= token_id < thinker_embed_tokens.shape[0]:
                raise ValueError(f"text id {token_id} outside the thinker vocab")
            row = thinker_embed_tokens[token_id]
            self.text_embeds[token_id] = row.to(self.device, self.dtype)

    def _weight_tensors(self) -> dict[str, torch.Tensor]:
        """The official checkpoint's talker names (``talker.model.*``,
        ``talker.thinker_to_talker_proj.*``, ``talker.codec_head.weight``)."""
        tensors = {f"talker.model.{k}": v for k, v in self.llama.state_dict(keep_vars=True).items()}
        tensors["talker.model.embed_tokens.weight"] = self.codec_embed
        tensors["talker.thinker_to_talker_proj.weight"] = self.proj_weight
        tensors["talker.thinker_to_talker_proj.bias"] = self.proj_bias
        tensors["talker.codec_head.weight"] = self.codec_head
        return tensors

    def refresh_text_embeds(self, thinker_embed_tokens: torch.Tensor) -> None:
        """Copy again the thinker embedding rows the talker reads (after the thinker's
        ``embed_tokens`` changed; a torch tensor or a numpy array, detached here)."""
        rows = torch.as_tensor(thinker_embed_tokens).detach()
        for token_id in self.text_embeds:
            self.text_embeds[token_id] = rows[token_id].to(self.device, self.dtype)

    @torch.inference_mode()
    def teacher_forced_logits(
        self,
        prompt: TalkerPrompt,
        generated: Sequence[int | tuple[int]] = (),
        incremental: bool = False,
    ) -> torch.Tensor:
        """Raw codec logits ``[len(generated) + 1, 1, vocab]`` (float32, no suppression) of the
        prefill followed by ``generated`` codes, conditioned by ``prompt.replay`` (which needs
        one condition per generated code): row ``i`` is the distribution code ``i`` was drawn
        from.

        Args:
            incremental: one decode step per code, the path generation takes (bit-identical
                logits when the request ran alone or in ``batch_invariant`` mode); False runs
                one forward (other GEMM shapes: ~1e-6).

        Raises:
            KVCacheFullError: the sequence does not fit the KV pool.
            ValueError: too few replay conditions, or malformed inputs.
        """
        frames = tuple((f,) if isinstance(f, int) else tuple(f) for f in generated)
        if len(prompt.replay) < len(frames):
            raise ValueError(f"{len(frames)} codes need as many replay conditions")
        seq_id = self.scorer.teacher_seq_id()
        head = () if incremental else frames
        first = ARPrefillInput(seq_id, prompt, head, (), None, None)
        steps = [
            ARStepInput(seq_id, f, i + 1, (), None, None, extra=prompt.replay[i])
            for i, f in enumerate(frames)
        ]
        return self.scorer.teacher_forced(first, steps if incremental else [])

    # ------------------------------------------------------------ hooks
    def _check_prompt(self, unit: ARPrefillInput) -> None:
        prompt = unit.prompt
        if not isinstance(prompt, TalkerPrompt):
            raise ValueError(f"talker PREFILL needs a TalkerPrompt, got {type(prompt).__name__}")
        rows = prompt.prompt_conditions
        if rows.ndim != 2 or rows.shape[1] != self.config.embedding_size:
            raise ValueError(
                f"prompt_conditions must be [L, {self.config.embedding_size}], got {rows.shape}"
            )
        if len(prompt.replay) < len(unit.generated):
            raise ValueError(
                f"replaying {len(unit.generated)} codes needs as many conditions, "
                f"got {len(prompt.replay)}"
            )

    def _prefill_inputs(self, unit: ARPrefillInput) -> torch.Tensor:
        """``L + 2 + len(generated)`` rows: prompt conditions, speaker bos + codec pad, ``r_0`` +
        codec bos, then ``codec_embed(c_{t-1}) + cond_t`` per replayed code."""
        self._check_prompt(unit)
        prompt: TalkerPrompt = unit.prompt
        cfg = self.config
        bos_id = (
            cfg.tts_text_start_token_id if prompt.speaker_bos_id is None else prompt.speaker_bos_id
        )
        speaker_row = self._text_row(bos_id) + self.codec_embed[cfg.tts_codec_pad_token_id]
        reply_row = (
            self._vector(prompt.first_reply) + self.codec_embed[cfg.tts_codec_start_token_id]
        )
        rows = [
            prompt.prompt_conditions.to(self.device, self.dtype),
            speaker_row[None],
            reply_row[None],
        ]
        if unit.generated:
            codes = self._frame_ids(unit.generated, cfg.vocab_size)
            conditions = self._conditions(prompt.replay[: len(unit.generated)])
            rows.append(self.codec_embed[codes] + conditions)
        return torch.cat(rows)

    def _prompt_positions(self, prompt: Any) -> tuple[torch.Tensor, int] | None:
        if not isinstance(prompt, TalkerPrompt) or prompt.positions is None:
            return None
        return prompt.positions, prompt.rope_delta

    def _step_inputs(self, units: Sequence[ARStepInput]) -> torch.Tensor:
        codes = self._frame_ids([tuple(u.last) for u in units], self.config.vocab_size)
        return self.codec_embed[codes] + self._conditions([u.extra for u in units])

    def _lm_inputs(self, rows: torch.Tensor, query_lens: list[int]) -> torch.Tensor:
        """``thinker_to_talker_proj`` ``[N, embedding_size] -> [N, hidden]``."""

        def proj(x: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.linear(x, self.proj_weight, self.proj_bias)

        if not self.batch_invariant:
            return proj(rows)
        plan = self.llama.row_chunking.plan(query_lens, rows.device)
        return map_row_groups(proj, rows, plan)

    def _head(self, hidden: torch.Tensor, seq_id: str) -> torch.Tensor:
        return self._linear_rows(hidden.to(self.dtype), self.codec_head).unsqueeze(1)

    def _sampling_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """``suppress_tokens=[tts_codec_start_token_id]``, as ``generate`` passes it."""
        return logits.index_fill(-1, self._suppressed_ids(logits.device), NEG_INF)

    # ------------------------------------------------------------ helpers
    def _suppressed_ids(self, device: torch.device) -> torch.Tensor:
        return torch.tensor([self.config.tts_codec_start_token_id], device=device)

    def _text_row(self, token_id: int) -> torch.Tensor:
        try:
            return self.text_embeds[token_id]
        except KeyError:
            raise ValueError(
                f"thinker embedding of text id {token_id} not loaded (load_weights' "
                "speaker_bos_ids)"
            ) from None

    def _vector(self, vector: torch.Tensor) -> torch.Tensor:
        """A thinker-space vector as ``[embedding_size]`` in the compute dtype and device."""
        vector = vector.reshape(-1)
        if vector.shape[0] != self.config.embedding_size:
            raise ValueError(
                f"conditioning vector has {vector.shape[0]} values, "
                f"embedding_size is {self.config.embedding_size}"
            )
        return vector.to(self.device, self.dtype)

    def _conditions(self, conditions: Sequence[TalkerCondition]) -> torch.Tensor:
        """``[n, embedding_size]`` rows of the conditions."""
        rows = []
        for condition in conditions:
            if condition.kind is ConditionKind.REPLY:
                rows.append(self._vector(condition.vector))
            elif condition.kind is ConditionKind.TEXT_EOS:
                rows.append(self._text_row(self.config.tts_text_end_token_id))
            else:
                rows.append(self._text_row(self.config.tts_text_pad_token_id))
        return torch.stack(rows)


def load_talker(
    state: Mapping[str, torch.Tensor],
    config: Mapping[str, Any],
    kv: KVCacheConfig,
    thinker_embed_tokens: torch.Tensor,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    speaker_bos_ids: Sequence[int] = (),
    batch_invariant: bool = False,
) -> QwenTalker:
    """Build a ``QwenTalker`` and load it.

    Args:
        state: talker tensors, keys with the ``talker.`` prefix removed.
        config: the official ``config.json`` dict (or its ``talker_config``).
        kv: KV pool size.
        thinker_embed_tokens: ``thinker.model.embed_tokens.weight`` ``[text_vocab, E]``.
        speaker_bos_ids: the ``bos_token`` of each speaker in ``spk_dict.pt``.
    """
    talker = QwenTalker(TalkerConfig.from_dict(config), kv, device, dtype, batch_invariant)
    talker.load_weights(state, thinker_embed_tokens, speaker_bos_ids)
    return talker
