"""Qwen3-Omni's thinker text model (text prompts) on the shared paged-KV AR component.

The text model is transformers' ``Qwen3OmniMoeThinkerTextModel`` (models/qwen3_omni_moe): a
Qwen3-MoE stack (q/k RMSNorm, no biases, MoE MLPs ``layers.moe.MoEFeedForward`` with
``norm_topk_prob``; dense layers where ``mlp_only_layers`` / ``decoder_sparse_step`` say so),
then the untied ``lm_head``. Its rope is interleaved MRoPE (``rope_parameters.mrope_section``,
published (24, 20, 20) of 64 frequencies): each frequency takes the temporal, height or width
position of its section. For text-only prompts the three positions are equal (the token index),
so every frequency sees the same position and MRoPE is plain RoPE with ``rope_theta``
(bit-identical through the 3-row table). Media prompts are ``ThinkerPrompt``s
(``runners.media_prompt``, built from the ENCODE units' rows, shared with Qwen2.5-Omni): their
placeholder tokens' embeddings are replaced by the encoder rows and their 3-row positions
(``runners.mrope.rope_index``) run through the interleaved ``MRotaryEmbedding``. Deepstack
(Qwen3-VL): an image's or video's features ``k`` are added to its tokens' hidden states after
decoder layer ``k`` (transformers' ``_deepstack_process``). They ride in the input rows: with
``deepstack_layers`` K > 0 every row carries ``K * hidden`` more columns (zeros but at a media
prompt's image and video tokens), which ``_lm_inputs`` drops and ``_after_layer`` adds after
layers ``0 .. K-1`` (adding zeros elsewhere changes no value, and needs no mask or host sync);
the rows' prefix-cache digests cover them. Scoring (``score_*``) adds them the same way: its
teacher-forced forward runs ``_after_layer`` on the same rows.

Routing: every forward's experts per token and MoE layer (``PagedARModel.last_routing``) are
kept per sequence, ``routing(seq_id)`` ``[T, L, k]`` in the order its tokens were computed;
reset when the sequence is (re)admitted, freed with it. A group member forked from a computed
prompt has no rows for that prompt (the computing member has them). Rollouts get theirs from
``PagedARModel`` (``ARStepOutput.routing``, a group's prompt rows shared), and scoring replays
them (``score_batch(..., routing=)``: Rollout Routing Replay).

Weight updates take the official names (``_weight_tensors``), a MoE layer's experts also by
their published per-expert names (``_weight_aliases``).

What the talker reads (``talker_layer``: ``talker_config.accept_hidden_layer``, set when the
checkpoint has a talker): transformers' ``generate`` feeds the talker, at the prompt's audio,
image and video tokens, ``hidden_states[accept_hidden_layer]`` of the thinker: the input
embeddings for 0, the output of decoder layer ``k - 1`` for ``k`` (taken by its output hook,
so before that layer's deepstack features are added), the final normed state for the last.
``ARStepOutput.hidden`` then streams that state of each fed token, ``[n, hidden]`` float32 on
the CPU (else the final hidden state). The paged forward keeps it beside the final state:
``_forward`` returns ``[N, 2 * hidden]`` (final | kept) and ``_head`` reads the first half.
``_after_layer`` takes the layer's output only inside ``_forward`` (looked up by the forward's
input rows), so a score forward run beside serving keeps nothing.

Imports torch, ``omnistep.core``, ``omnistep.kv``, ``omnistep.layers``, ``omnistep.loops``,
``omnistep.runners``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from omnistep.kv import KVCacheConfig
from omnistep.layers.llama import LlamaConfigLite
from omnistep.layers.moe import MoEConfig
from omnistep.layers.rope import MRotaryEmbedding
from omnistep.loops.ar_decode import ARPrefillInput, ARStepInput
from omnistep.runners.media_prompt import ThinkerPrompt
from omnistep.runners.paged_ar import PagedARModel

ENCODER_PREFIXES = ("audio_tower.", "visual.")
"""Thinker tensors of the encoders (not run by this component yet)."""


@dataclass(frozen=True)
class ThinkerTextConfig:
    """``thinker_config.text_config`` (``Qwen3OmniMoeTextConfig``), the fields the text model
    uses, defaults transformers'; ``from_dict(raw, "talker_config")`` reads the talker's
    (``Qwen3OmniMoeTalkerTextConfig``: the same keys plus ``shared_expert_intermediate_size``,
    ``norm_topk_prob`` false)."""

    vocab_size: int = 152064
    hidden_size: int = 2048
    intermediate_size: int = 768
    """Width of the dense layers' MLP (only ``mlp_only_layers`` use it)."""
    num_hidden_layers: int = 48
    num_attention_heads: int = 32
    num_key_value_heads: int = 4
    head_dim: int = 128
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1000000.0
    mrope_section: tuple[int, ...] = (24, 20, 20)
    max_position_embeddings: int = 65536
    hidden_act: str = "silu"
    attention_bias: bool = False
    moe_intermediate_size: int = 768
    num_experts: int = 128
    num_experts_per_tok: int = 8
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    tie_word_embeddings: bool = False
    shared_expert_intermediate_size: int = 0
    """The talker's gated shared expert width; 0 (the thinker): none."""

    def __post_init__(self) -> None:
        if sum(self.mrope_section) != self.head_dim // 2:
            raise ValueError(
                f"thinker text_config: mrope_section {list(self.mrope_section)} must sum to "
                f"head_dim // 2 = {self.head_dim // 2}"
            )
        if self.attention_bias:
            raise ValueError("thinker text_config: attention_bias=True is not supported")

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any], part: str = "thinker_config") -> ThinkerTextConfig:
        """From ``config.json`` (the whole dict, its ``part`` -- ``thinker_config`` or
        ``talker_config`` -- or that part's ``text_config``); rope from ``rope_parameters``
        (transformers 5) or ``rope_theta`` + ``rope_scaling``.

        Raises:
            ValueError: a rope type other than default, or values the stack rejects.
        """
        raw = raw.get(part, raw)
        tie = bool(raw.get("tie_word_embeddings", False))
        text = raw.get("text_config", raw)
        rope = dict(text.get("rope_scaling") or {}) | dict(text.get("rope_parameters") or {})
        if rope.get("rope_type", rope.get("type", "default")) != "default":
            raise ValueError(f"thinker text_config: unsupported rope {rope!r}")
        names = {f for f in cls.__dataclass_fields__ if text.get(f) is not None}
        fields: dict[str, Any] = {n: text[n] for n in names}
        if "num_experts" not in fields and text.get("num_local_experts") is not None:
            # transformers 5 writes the talker's expert count under its attribute_map name
            fields["num_experts"] = text["num_local_experts"]
        fields["mlp_only_layers"] = tuple(text.get("mlp_only_layers") or ())
        fields["rope_theta"] = rope.get("rope_theta", text.get("rope_theta", cls.rope_theta))
        if "mrope_section" in rope:
            fields["mrope_section"] = tuple(rope["mrope_section"])
        fields["tie_word_embeddings"] = tie
        return cls(**fields)

    def llama(self) -> LlamaConfigLite:
        """The decoder stack: Qwen3 attention (q/k norm) and MoE MLPs."""
        moe = MoEConfig(
            hidden_size=self.hidden_size,
            moe_intermediate_size=self.moe_intermediate_size,
            num_experts=self.num_experts,
            num_experts_per_tok=self.num_experts_per_tok,
            norm_topk_prob=self.norm_topk_prob,
            shared_expert_intermediate_size=self.shared_expert_intermediate_size,
            hidden_act=self.hidden_act,
        )
        return LlamaConfigLite.of(
            self,
            qk_norm=True,
            hidden_act=self.hidden_act,
            moe=moe,
            mlp_only_layers=self.mlp_only_layers,
            decoder_sparse_step=self.decoder_sparse_step,
        )


class Qwen3OmniThinker(PagedARModel):
    """The thinker component (module docstring).

    PREFILL payloads are ``ARPrefillInput`` whose ``prompt`` is token ids (the chat template's)
    or a ``ThinkerPrompt`` (media);
    AR_TOKEN payloads are ``ARStepInput``. Frames are 1-tuples of text ids; ``hidden`` streams
    each fed token's state at ``talker_layer`` (the final one without a talker), ``[n,
    hidden]`` float32: what the talker reads at media tokens.

    Attributes:
        embed_weight: ``[vocab, hidden]`` (``thinker.model.embed_tokens.weight``).
        lm_head: ``[vocab, hidden]`` (``thinker.lm_head.weight``).
        talker_layer: ``talker_config.accept_hidden_layer`` (0: the input embeddings, ``k``:
            decoder layer ``k - 1``'s output, the layer count: the final normed state), or
            None (no talker).

    Raises:
        ValueError: a ``talker_layer`` outside ``[0, num_hidden_layers]``.
    """

    stream_prompt_rows = True
    _expert_prefix = "thinker.model."
    SERVING_STATE = (*PagedARModel.SERVING_STATE, "_routing", "_kept")
    position_rows = 3
    prefix_caching = True  # a realtime session's turns (``Request.cache_salt``)

    def __init__(
        self,
        config: ThinkerTextConfig,
        kv: KVCacheConfig,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        batch_invariant: bool = False,
        deepstack_layers: int = 0,
        talker_layer: int | None = None,
    ):
        if talker_layer is not None and not 0 <= talker_layer <= config.num_hidden_layers:
            raise ValueError(
                f"talker_config.accept_hidden_layer {talker_layer} outside [0, "
                f"{config.num_hidden_layers}]"
            )
        super().__init__(config.llama(), kv, device, dtype, batch_invariant)
        self.config = config
        self.deepstack_layers = deepstack_layers
        self.talker_layer = talker_layer
        # id(input rows) of a running serving forward -> the kept layer output [N, hidden]
        self._kept: dict[int, list[torch.Tensor]] = {}
        stack = self.llama.config
        self.llama.rotary_emb = MRotaryEmbedding(
            config.head_dim,
            stack.rope_theta,
            stack.max_position_embeddings,
            config.mrope_section,
            self.device,
            interleaved=True,
        )
        shape = (config.vocab_size, config.hidden_size)
        self.embed_weight = torch.zeros(shape, device=self.device, dtype=dtype)
        self.lm_head = torch.zeros(shape, device=self.device, dtype=dtype)
        self._routing: dict[str, list[torch.Tensor]] = {}

    def load_weights(self, state: Mapping[str, torch.Tensor]) -> None:
        """Load the text model from thinker tensors by official name, ``thinker.`` removed
        (``model.*``, ``lm_head.weight``; ``audio_tower.*`` / ``visual.*`` are skipped).

        Raises:
            ValueError: tensors of no part of the thinker, or no ``lm_head.weight`` while
                the embeddings are not tied.
            KeyError / RuntimeError: a missing or mis-shaped text-model tensor.
        """
        model = {k.removeprefix("model."): v for k, v in state.items() if k.startswith("model.")}
        known = {f"model.{k}" for k in model} | {"lm_head.weight"}
        unknown = [k for k in state if k not in known and not k.startswith(ENCODER_PREFIXES)]
        if unknown:
            raise ValueError(f"unexpected thinker tensors: {sorted(unknown)[:5]}")
        if "embed_tokens.weight" not in model:
            raise KeyError("missing thinker tensor model.embed_tokens.weight")
        head = state.get("lm_head.weight")
        if head is None and not self.config.tie_word_embeddings:
            raise ValueError("no thinker lm_head.weight and tie_word_embeddings is False")
        self.embed_weight.copy_(model["embed_tokens.weight"])
        self.lm_head.copy_(model["embed_tokens.weight"] if head is None else head)
        self.llama.load_hf_state_dict(model)

    def _weight_tensors(self) -> dict[str, torch.Tensor]:
        """The text model's tensors by their official names: ``thinker.model.*`` (a MoE
        layer's experts fused as transformers 5 holds them, ``mlp.experts.gate_up_proj`` /
        ``mlp.experts.down_proj``; the published per-expert names are ``_weight_aliases``),
        ``thinker.model.embed_tokens.weight`` and ``thinker.lm_head.weight`` (unless tied).
        The encoders take no updates (not served yet)."""
        stack = self.llama.state_dict(keep_vars=True).items()
        tensors = {f"thinker.model.{k}": v for k, v in stack}
        tensors["thinker.model.embed_tokens.weight"] = self.embed_weight
        if not self.config.tie_word_embeddings:
            tensors["thinker.lm_head.weight"] = self.lm_head
        return tensors

    def _weights_updated(self, names: set[str]) -> None:
        """A tied head follows the embeddings."""
        if self.config.tie_word_embeddings and "thinker.model.embed_tokens.weight" in names:
            self.lm_head.copy_(self.embed_weight)

    def routing(self, seq_id: str) -> torch.Tensor:
        """The experts sequence ``seq_id``'s computed tokens were routed to, LongTensor
        ``[T, sparse layers, k]`` on the CPU (tokens in the order computed: prompt, then each
        step).

        Raises:
            KeyError: no such live sequence.
        """
        pieces = self._routing[seq_id]
        if not pieces:  # a group member forked from a computed prompt, before its first step
            sparse = sum(layer.sparse for layer in self.llama.layers)
            return torch.zeros(0, sparse, self.config.num_experts_per_tok, dtype=torch.long)
        return torch.cat(pieces).cpu()

    def free_sequence(self, seq_id: str) -> None:
        """Free the sequence's KV blocks and its routing record."""
        self._routing.pop(seq_id, None)
        super().free_sequence(seq_id)

    @torch.inference_mode()
    def teacher_forced_logits(
        self,
        prompt_ids: Sequence[int] | ThinkerPrompt,
        generated: Sequence[int] = (),
        incremental: bool = False,
    ) -> torch.Tensor:
        """Logits ``[len(generated) + 1, 1, vocab]`` float32: row i is the distribution token
        i was drawn from (row 0 after the prompt); ``incremental`` feeds ``generated`` one
        decode step at a time (the serving path).

        Raises:
            KVCacheFullError: the sequence does not fit the KV pool. ValueError: an id outside
                the vocab.
        """
        frames = tuple((int(t),) for t in generated)
        seq_id = self.scorer.teacher_seq_id()
        head = () if incremental else frames
        prompt = prompt_ids if isinstance(prompt_ids, ThinkerPrompt) else tuple(prompt_ids)
        first = ARPrefillInput(seq_id, prompt, head, (), None, None)
        steps = [ARStepInput(seq_id, f, i + 1, (), None, None) for i, f in enumerate(frames)]
        return self.scorer.teacher_forced(first, steps if incremental else [])

    # ------------------------------------------------------------ hooks
    def _on_admit(self, unit: ARPrefillInput) -> None:
        """A (re)started sequence's routing starts empty (a recompute after a preemption
        records its prompt again; a group member forked from a computed prompt has no rows
        for it)."""
        self._routing[unit.seq_id] = []

    def _forward(
        self, rows: torch.Tensor, positions: torch.Tensor, seq_ids: list[str], query_lens: list[int]
    ) -> torch.Tensor:
        """Final hidden states ``[N, hidden]``; with ``talker_layer``, ``[N, 2 * hidden]``:
        final | the talker's layer (module docstring)."""
        kept: list[torch.Tensor] = []
        if self.talker_layer is not None:
            self._kept[id(rows)] = kept
        try:
            hidden = super()._forward(rows, positions, seq_ids, query_lens)
        finally:
            self._kept.pop(id(rows), None)
        if self.last_routing is not None:
            pieces = self.last_routing.split(query_lens)
            for seq_id, piece in zip(seq_ids, pieces, strict=True):
                self._routing.setdefault(seq_id, []).append(piece)  # no host sync here
        if self.talker_layer is None:
            return hidden
        if self.talker_layer == 0:
            kept.append(self._lm_inputs(rows, query_lens).to(hidden.dtype))
        elif self.talker_layer == self.config.num_hidden_layers:
            kept.append(hidden)
        if len(kept) != 1:
            raise RuntimeError(
                f"the thinker's forward kept {len(kept)} states of layer {self.talker_layer} "
                "for the talker (its stack must call _after_layer's hook once per layer)"
            )
        return torch.cat([hidden, kept[0]], dim=1)

    def _prefill_inputs(self, unit: ARPrefillInput) -> torch.Tensor:
        """Embeddings ``[L + len(generated), hidden]``; a ``ThinkerPrompt``'s encoder rows
        at its placeholder tokens (transformers' ``masked_scatter``)."""
        prompt = unit.prompt
        ids = prompt.ids if isinstance(prompt, ThinkerPrompt) else prompt
        if len(ids) == 0:
            raise ValueError(f"empty thinker prompt for sequence {unit.seq_id!r}")
        frames = [(int(t),) for t in ids] + [tuple(f) for f in unit.generated]
        id_tensor = self._frame_ids(frames, self.config.vocab_size)
        rows = self.embed_weight[id_tensor]
        if isinstance(prompt, ThinkerPrompt) and prompt.media_rows:
            placeholders = torch.tensor(prompt.placeholder_ids, device=self.device)
            is_media = torch.isin(id_tensor, placeholders)
            is_media[len(ids) :] = False
            rows[is_media] = torch.cat(prompt.media_rows).to(self.device, rows.dtype)
        if not self.deepstack_layers:
            return rows
        extra = rows.new_zeros(rows.shape[0], self.deepstack_layers * rows.shape[1])
        if isinstance(prompt, ThinkerPrompt) and prompt.deepstack:
            if len(prompt.deepstack) != self.deepstack_layers:
                raise ValueError(
                    f"{len(prompt.deepstack)} deepstack layers for a thinker of "
                    f"{self.deepstack_layers}"
                )
            visual = torch.isin(id_tensor, torch.tensor(prompt.visual_ids, device=self.device))
            visual[len(ids) :] = False
            extra[visual] = torch.cat(prompt.deepstack, dim=1).to(self.device, rows.dtype)
        return torch.cat([rows, extra], dim=1)

    def _lm_inputs(self, rows: torch.Tensor, query_lens: list[int]) -> torch.Tensor:
        return rows[:, : self.config.hidden_size] if self.deepstack_layers else rows

    def _after_layer(self, rows: torch.Tensor) -> Any:
        # None outside a serving forward (and in a training copy)
        kept = self._kept.get(id(rows)) if self._kept else None
        layer = self.talker_layer
        inside = layer is not None and 0 < layer < self.config.num_hidden_layers
        keep_after = layer - 1 if inside else -1  # type: ignore[operator]
        if not self.deepstack_layers and kept is None:
            return None
        width = self.config.hidden_size
        deep = self.deepstack_layers
        extra = rows[:, width:].view(rows.shape[0], deep, width) if deep else None

        def add(i: int, hidden: torch.Tensor) -> torch.Tensor:
            if kept is not None and i == keep_after:
                kept.append(hidden)  # the layer's output, before its deepstack features
            return hidden + extra[:, i] if i < deep else hidden  # type: ignore[index]

        return add

    def _prompt_positions(self, prompt: Any) -> tuple[torch.Tensor, int] | None:
        if not isinstance(prompt, ThinkerPrompt):
            return None
        return torch.from_numpy(prompt.positions), prompt.rope_delta

    def _step_inputs(self, units: Sequence[ARStepInput]) -> torch.Tensor:
        ids = self._frame_ids([tuple(u.last) for u in units], self.config.vocab_size)
        rows = self.embed_weight[ids]
        if not self.deepstack_layers:
            return rows
        return torch.cat(
            [rows, rows.new_zeros(rows.shape[0], self.deepstack_layers * rows.shape[1])], 1
        )

    def _head(self, hidden: torch.Tensor, seq_id: str) -> torch.Tensor:
        final = hidden[:, : self.config.hidden_size]  # a serving forward's kept half dropped
        return self._linear_rows(final.to(self.dtype), self.lm_head).unsqueeze(1)

    def _stream(self, rows: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """The talker's layer of each fed token (the final state without a talker),
        ``[n, hidden]`` float32 on the CPU."""
        width = self.config.hidden_size
        kept = hidden[:, width:] if self.talker_layer is not None else hidden
        return kept.float().cpu()


def load_thinker(
    checkpoint: Any,
    kv: KVCacheConfig,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    batch_invariant: bool = False,
) -> Qwen3OmniThinker:
    """The thinker text model of a ``loader.Qwen3OmniCheckpoint``, loaded.

    Raises:
        ValueError / KeyError / RuntimeError: a bad config value or tensor (see
            ``ThinkerTextConfig.from_dict``, ``Qwen3OmniThinker.load_weights``).
    """
    config = ThinkerTextConfig.from_dict(checkpoint.config)
    thinker = Qwen3OmniThinker(
        config,
        kv,
        device,
        dtype,
        batch_invariant,
        deepstack_layers(checkpoint),
        talker_layer(checkpoint),
    )
    state = {k.removeprefix("thinker."): v for k, v in checkpoint.tensors("thinker.").items()}
    thinker.load_weights(state)
    return thinker


def deepstack_layers(checkpoint: Any) -> int:
    """How many thinker layers take deepstack features: ``len(vision_config.
    deepstack_visual_indexes)`` when the checkpoint holds the vision encoder, else 0."""
    vision = checkpoint.config.get("thinker_config", {}).get("vision_config") or {}
    if not any(n.startswith("thinker.visual.") for n in checkpoint.tensor_names()):
        return 0
    return len(vision.get("deepstack_visual_indexes", (8, 16, 24)))


def talker_layer(checkpoint: Any) -> int | None:
    """``talker_config.accept_hidden_layer`` (transformers' default 18) when the checkpoint
    has a talker, else None."""
    if not checkpoint.has_talker:
        return None
    return int(checkpoint.config["talker_config"].get("accept_hidden_layer", 18))
