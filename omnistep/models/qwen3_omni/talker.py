"""Qwen3-Omni's talker: its decoder stack and codebook-0 head (``TalkerStack``, checked on its
own), its prompt (``TalkerIds``, ``build_talker_prompt``) and the component on the shared
Qwen3 speech talker (``Qwen3OmniTalker``, ``runners.codec_talker.CodecTalker``).

The talker's text model is transformers' ``Qwen3OmniMoeTalkerModel``: a Qwen3-MoE stack like
the thinker's (``thinker.ThinkerTextConfig`` read from ``talker_config``) whose MoE blocks add a
gated shared expert (``shared_expert_intermediate_size``; ``layers.moe.MoEFeedForward``), no
top-k renormalisation (``norm_topk_prob`` false), then ``codec_head`` ``[vocab, hidden]``: the
logits of codebook 0 (codes, then the control and speaker ids). ``codec_embedding`` ``[vocab,
hidden]`` embeds codebook 0 on the input side. The code predictor that fills codebooks 1..15
inside each step is the shared ``layers.code_predictor``.

The prompt, as ``Qwen3OmniMoeForConditionalGeneration.generate`` builds it for a text-only
chat (every row ``codec part + text_projection(thinker embed_tokens[text id])``, the codec part
zero where there is none):

- the user rows: every token of the thinker prompt inside a user turn (``<|im_start|>user``
  through its ``<|im_end|>\n``, every user turn, in order; system and earlier assistant turns
  are left out), text only;
- 9 assistant rows: text ids ``<|im_start|>``, ``assistant``, ``\n``, ``tts_pad`` x4,
  ``tts_bos``, the reply's first token; codec ids none x3, ``nothink``, ``think_bos``,
  ``think_eos``, the speaker id, ``codec_pad``, ``codec_bos``;
- decode step ``k`` (feeding frame ``k``) adds the text id of the reply's token ``k + 1``, the
  reply's last fed token followed by ``tts_eos`` (the thinker's final sampled token, its EOS
  or the one cut by ``max_new_tokens``, is never fed and is not spoken), then ``tts_pad`` for
  every later step (``talker_loop.ReplyTrack``).

Media prompts (audio, image, video parts; ``generate``'s ``_get_talker_user_parts``): a user
row whose thinker token is an audio, image or video placeholder is
``hidden_projection(thinker state)`` alone (no codec part, no text part), the state being the
thinker's ``accept_hidden_layer`` output at that token (``thinker.Qwen3OmniThinker``'s
``talker_layer``). The talker's rope is the thinker's interleaved MRoPE with its own
``mrope_section``; its positions are the thinker prompt's (``runners.mrope.rope_index``) at the
user rows, each lowered by the number of rows left out before it (the system and earlier
assistant turns: text, one position each), then the 9 assistant rows one apart; decode steps
continue at ``row + rope_delta``. For a text-only or audio prompt these are ``0, 1, 2, ...``
(plain rope), as in transformers; for an image or video they equal what its
``get_rope_index`` gives on the talker's ids. (transformers' talker does not take
``use_audio_in_video`` and its config has no ``audio_config``, so its ``generate`` fails on a
prompt holding audio and an image or video, or a video with its track; here those run with
the thinker's positions re-based the same way.)

Sampling (``TalkerSampling``): transformers' ``generate`` defaults, temperature 0.9, top_k 50,
top_p 1.0, repetition penalty 1.05 over the codebook-0 history, the top 1024 ids but EOS
suppressed; the code predictor samples with top_k 50, top_p 0.8 (greedy when the talker is).

Imports numpy, torch, ``omnistep.kv``, ``omnistep.layers``, ``omnistep.loops``,
``omnistep.runners``, ``omnistep.sampling``, this family's ``thinker`` (its config).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from omnistep.kv import KVCacheConfig
from omnistep.layers.code_predictor import CodePredictorConfig
from omnistep.layers.linear import linear
from omnistep.layers.llama import LlamaConfigLite, LlamaModel
from omnistep.layers.rope import MRotaryEmbedding
from omnistep.loops.ar_decode import ARPrefillInput
from omnistep.models.qwen3_omni.thinker import ThinkerTextConfig
from omnistep.runners.codec_talker import CodecTalker, CodecTalkerSampling, CodecTalkerSizes
from omnistep.sampling import SamplingRow

NO_CODEC = -1
"""``TalkerPrompt.codec_ids`` entry of a row without a codec part."""
THINKER_EMBED = "thinker.model.embed_tokens.weight"
"""The thinker tensor the talker's text rows read."""


@dataclass
class TalkerStack:
    """The talker's decoder stack with its codec embedding and codebook-0 head.

    Attributes:
        config: the talker's text config.
        llama: the MoE decoder stack (``LlamaModel``, no cache needed for ``codec_logits``).
        codec_embedding: ``[vocab, hidden]`` (``talker.model.codec_embedding.weight``).
        codec_head: ``[vocab, hidden]`` (``talker.codec_head.weight``).
    """

    config: ThinkerTextConfig
    llama: LlamaModel
    codec_embedding: torch.Tensor
    codec_head: torch.Tensor

    @torch.inference_mode()
    def codec_logits(
        self, inputs_embeds: torch.Tensor, routing: list[torch.Tensor] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One sequence's rows through the stack (causal, positions 0..N-1: a text-only
        talker prompt's MRoPE positions are all equal, which is plain RoPE).

        Args:
            inputs_embeds: ``[N, hidden]``.

        Returns:
            (codebook-0 logits ``[N, vocab]``, final hidden states ``[N, hidden]``), in the
            stack's dtype.
        """
        hidden = self.llama.forward_dense(inputs_embeds.to(self.codec_head.dtype))
        return hidden @ self.codec_head.T, hidden


def load_talker_stack(
    checkpoint: Any, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32
) -> TalkerStack:
    """The talker stack of a ``loader.Qwen3OmniCheckpoint``, loaded strictly.

    Raises:
        Qwen3OmniCheckpointError: the checkpoint has no talker.
        KeyError / RuntimeError: a missing or mis-shaped tensor (named).
    """
    checkpoint.need_talker("talker")
    config = ThinkerTextConfig.from_dict(checkpoint.config, "talker_config")
    tensors = checkpoint.tensors("talker.")
    llama = LlamaModel(config.llama(), device=device, dtype=dtype).eval()
    model = {
        k.removeprefix("talker.model."): v
        for k, v in tensors.items()
        if k.startswith("talker.model.") and not k.startswith("talker.model.codec_embedding.")
    }
    llama.load_hf_state_dict(model)
    for name in ("talker.model.codec_embedding.weight", "talker.codec_head.weight"):
        if name not in tensors:
            raise KeyError(f"missing talker tensor {name}")
    return TalkerStack(
        config,
        llama,
        tensors["talker.model.codec_embedding.weight"].to(device, dtype),
        tensors["talker.codec_head.weight"].to(device, dtype),
    )


# ---------------------------------------------------------------- ids and prompt
@dataclass(frozen=True)
class TalkerIds:
    """The ids of ``config.json`` the talker's prompt uses: thinker-vocab ids
    (``im_start``, ``user``, ``assistant``, ``tts_pad``/``tts_bos``/``tts_eos``: top level)
    and codec ids (``talker_config``: ``codec_pad_id``, ``codec_bos_id``,
    ``codec_eos_token_id``, ``codec_nothink_id``, ``codec_think_bos_id``,
    ``codec_think_eos_id``, ``speaker_id`` name -> id)."""

    im_start: int
    user: int
    assistant: int
    tts_pad: int
    tts_bos: int
    tts_eos: int
    codec_pad: int
    codec_bos: int
    codec_eos: int
    codec_nothink: int
    codec_think_bos: int
    codec_think_eos: int
    speakers: Mapping[str, int]

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> TalkerIds:
        """From the parsed ``config.json``.

        Raises:
            KeyError: a missing id (named).
        """
        talker = config["talker_config"]

        def get(section: Mapping[str, Any], key: str, where: str) -> int:
            if section.get(key) is None:
                raise KeyError(f"config.json has no {where}{key}")
            return int(section[key])

        top = {k: get(config, f"{k}_token_id", "") for k in ("im_start", "user", "assistant")}
        tts = {k: get(config, f"tts_{k}_token_id", "") for k in ("pad", "bos", "eos")}
        codec = {
            k: get(talker, key, "talker_config.")
            for k, key in (
                ("codec_pad", "codec_pad_id"),
                ("codec_bos", "codec_bos_id"),
                ("codec_eos", "codec_eos_token_id"),
                ("codec_nothink", "codec_nothink_id"),
                ("codec_think_bos", "codec_think_bos_id"),
                ("codec_think_eos", "codec_think_eos_id"),
            )
        }
        speakers = {str(k).lower(): int(v) for k, v in (talker.get("speaker_id") or {}).items()}
        if not speakers:
            raise KeyError("config.json has no talker_config.speaker_id")
        return cls(
            **top,
            tts_pad=tts["pad"],
            tts_bos=tts["bos"],
            tts_eos=tts["eos"],
            **codec,
            speakers=speakers,
        )


@dataclass(frozen=True, slots=True, eq=False)
class TalkerPrompt:
    """The PREFILL prompt of one talker sequence (``build_talker_prompt``).

    Attributes:
        text_ids: one thinker-vocab id per row (the row's text part).
        codec_ids: one per row: a codec id whose embedding is added, or ``NO_CODEC``.
        replay_text: text ids of decode steps already run (step ``k`` fed frame ``k``): a
            re-prefill after a preemption, or a scored trajectory, replays generated frame
            ``k`` with ``replay_text[k]``.
        media_index: the rows that are ``hidden_projection`` of ``media_rows`` (a media
            prompt's user-turn audio, image and video tokens), ascending.
        media_rows: float32 ``[len(media_index), thinker hidden]`` (CPU): the thinker's
            ``accept_hidden_layer`` states of those tokens; None without media.
        positions: int64 ``[3, len(text_ids)]`` M-RoPE positions of a media prompt; None:
            row ``i`` at ``i``.
        rope_delta: rows after the prompt sit at ``row + rope_delta``.

    Raises:
        ValueError: no rows, or lengths that differ.
    """

    text_ids: tuple[int, ...]
    codec_ids: tuple[int, ...]
    replay_text: tuple[int, ...] = ()
    media_index: tuple[int, ...] = ()
    media_rows: torch.Tensor | None = None
    positions: np.ndarray | None = None
    rope_delta: int = 0

    def __post_init__(self) -> None:
        if not self.text_ids or len(self.text_ids) != len(self.codec_ids):
            raise ValueError(
                f"a talker prompt needs as many codec ids as text ids (>= 1), got "
                f"{len(self.text_ids)} and {len(self.codec_ids)}"
            )
        rows = 0 if self.media_rows is None else self.media_rows.shape[0]
        if rows != len(self.media_index):
            raise ValueError(f"{rows} media rows for {len(self.media_index)} media positions")
        if self.positions is not None and self.positions.shape != (3, len(self.text_ids)):
            raise ValueError(f"positions {self.positions.shape} for {len(self.text_ids)} rows")

    def key(self) -> tuple:
        """A content key: equal keys give equal talker inputs (prompts compare by identity:
        they may hold tensors)."""
        media = None if self.media_rows is None else self.media_rows.numpy().tobytes()
        pos = None if self.positions is None else self.positions.tobytes()
        return self.text_ids, self.codec_ids, self.media_index, media, pos


ASSISTANT_HEAD = 4
"""Assistant ids the prefill holds: ``<|im_start|>``, ``assistant``, ``\\n`` and the reply's
first token."""


def user_rows(prompt_ids: Sequence[int], ids: TalkerIds) -> list[int]:
    """Indices of the tokens of ``prompt_ids`` inside user turns: each token whose last
    ``<|im_start|>`` at or before it is followed by ``user`` (transformers' role mask; tokens
    before any ``<|im_start|>`` take the role of the prompt's second token)."""
    out, role = [], prompt_ids[1] if len(prompt_ids) > 1 else None
    for i, token in enumerate(prompt_ids):
        if token == ids.im_start:
            role = prompt_ids[i + 1] if i + 1 < len(prompt_ids) else None
        if role == ids.user:
            out.append(i)
    return out


def user_ids(prompt_ids: Sequence[int], ids: TalkerIds) -> list[int]:
    """The tokens of ``prompt_ids`` inside user turns (``user_rows``)."""
    return [int(prompt_ids[i]) for i in user_rows(prompt_ids, ids)]


@dataclass(frozen=True, eq=False)
class TalkerMedia:
    """What a media prompt adds to the talker's prompt.

    Attributes:
        placeholder_ids: the thinker's audio, image and video token ids.
        rows: float32 ``[tokens, thinker hidden]``: the thinker's ``accept_hidden_layer``
            state of every placeholder token of the prompt, in order (any turn).
        positions: int64 ``[3, len(prompt)]``: the thinker prompt's M-RoPE positions.
    """

    placeholder_ids: tuple[int, ...]
    rows: torch.Tensor
    positions: np.ndarray


def _media_part(
    prompt_ids: Sequence[int], user: list[int], media: TalkerMedia
) -> tuple[tuple[int, ...], torch.Tensor | None]:
    """(talker rows of the user turns' placeholder tokens, their ``media.rows``)."""
    marks = [i for i, t in enumerate(prompt_ids) if t in media.placeholder_ids]
    if len(marks) != media.rows.shape[0]:
        raise ValueError(f"{media.rows.shape[0]} thinker rows for {len(marks)} media tokens")
    row_of = {i: j for j, i in enumerate(user)}
    picked = [(row_of[i], k) for k, i in enumerate(marks) if i in row_of]
    if not picked:
        return (), None
    return tuple(r for r, _ in picked), media.rows[[k for _, k in picked]]


def _talker_positions(
    user: list[int], positions: np.ndarray, num_rows: int
) -> tuple[np.ndarray, int]:
    """The talker prompt's ``[3, num_rows]`` positions and rope delta: the thinker's at the
    user rows, each lowered by the rows left out before it, then one apart (module
    docstring)."""
    index = np.asarray(user, dtype=np.int64)
    head = positions[:, index] - (index - np.arange(len(index)))[None]
    start = int(head.max()) + 1 if len(index) else 0
    tail = start + np.arange(num_rows - len(index), dtype=np.int64)
    table = np.concatenate([head, np.broadcast_to(tail, (3, len(tail)))], axis=1)
    return table.astype(np.int64), int(table.max()) + 1 - num_rows


def assistant_start(prompt_ids: Sequence[int], ids: TalkerIds) -> int:
    """Index of the last ``<|im_start|>`` followed by ``assistant`` (the generation prompt).

    Raises:
        ValueError: the prompt has none.
    """
    for i in range(len(prompt_ids) - 2, -1, -1):
        if prompt_ids[i] == ids.im_start and prompt_ids[i + 1] == ids.assistant:
            return i
    raise ValueError("the thinker prompt has no '<|im_start|>assistant' to answer after")


def build_talker_prompt(
    prompt_ids: Sequence[int],
    head: Sequence[int],
    speaker_id: int,
    ids: TalkerIds,
    media: TalkerMedia | None = None,
) -> TalkerPrompt:
    """The talker's prompt (module docstring) for a thinker prompt (placeholders expanded),
    the first ``ASSISTANT_HEAD`` ids of the assistant turn (``head``: from ``<|im_start|>``
    on, through the reply's first token) and, for a media prompt, its ``TalkerMedia``.

    Raises:
        ValueError: ``head`` is not ``ASSISTANT_HEAD`` ids; media rows that do not match the
            prompt's placeholder tokens.
    """
    if len(head) != ASSISTANT_HEAD:
        raise ValueError(f"the assistant head must be {ASSISTANT_HEAD} ids, got {len(head)}")
    user = user_rows(prompt_ids, ids)
    text = [*(prompt_ids[i] for i in user), *head[:3], *[ids.tts_pad] * 4, ids.tts_bos, head[3]]
    codec = [NO_CODEC] * (len(user) + 3) + [
        ids.codec_nothink,
        ids.codec_think_bos,
        ids.codec_think_eos,
        int(speaker_id),
        ids.codec_pad,
        ids.codec_bos,
    ]
    prompt = TalkerPrompt(tuple(int(t) for t in text), tuple(codec))
    if media is None:
        return prompt
    index, rows = _media_part(prompt_ids, user, media)
    positions, delta = _talker_positions(user, media.positions, len(text))
    return dataclasses.replace(
        prompt, media_index=index, media_rows=rows, positions=positions, rope_delta=delta
    )


# ---------------------------------------------------------------- sampling
@dataclass(frozen=True)
class TalkerGenerateDefaults:
    """transformers' ``Qwen3OmniMoeForConditionalGeneration.generate`` talker arguments and
    the code predictor's sampling there (``prepare_inputs_for_generation``)."""

    temperature: float = 0.9
    top_k: int = 50
    top_p: float = 1.0
    repetition_penalty: float = 1.05
    predictor_top_k: int = 50
    predictor_top_p: float = 0.8
    predictor_temperature: float = 1.0


TALKER_GENERATE_DEFAULTS = TalkerGenerateDefaults()


def talker_sampling(
    eos_id: int,
    greedy: bool = False,
    max_frames: int = 4096,
    defaults: TalkerGenerateDefaults = TALKER_GENERATE_DEFAULTS,
) -> CodecTalkerSampling:
    """Both stages' rows; ``greedy`` (``talker_do_sample=False``, mirrored onto the code
    predictor) takes the argmax in both, the repetition penalty still applied to codebook 0
    (each distinct id of the whole history, up to ``max_frames``, once: transformers'
    ``RepetitionPenaltyLogitsProcessor`` over the generated codes)."""
    d = defaults
    talker = SamplingRow(
        temperature=0.0 if greedy else d.temperature,
        top_p=d.top_p,
        top_k=d.top_k,
        repetition_penalty=d.repetition_penalty,
        penalty_window=max_frames,
        penalty_compounds=False,
        eos_token_id=eos_id,
        min_keep=1,
    )
    predictor = SamplingRow(
        temperature=0.0 if greedy else d.predictor_temperature,
        top_p=d.predictor_top_p,
        top_k=d.predictor_top_k,
        min_keep=1,
    )
    return CodecTalkerSampling(talker, predictor)


# ---------------------------------------------------------------- the component
def talker_sizes(config: Mapping[str, Any]) -> CodecTalkerSizes:
    """The shared talker's sizes from ``config.json``: ``text_projection`` is
    ``thinker_hidden_size -> text_config.intermediate_size -> hidden_size`` with
    ``hidden_act``; the text table is the thinker's ``embed_tokens``."""
    talker = config["talker_config"]
    text = talker["text_config"]
    thinker = ThinkerTextConfig.from_dict(config)
    return CodecTalkerSizes(
        vocab_size=int(text["vocab_size"]),
        hidden_size=int(text["hidden_size"]),
        text_vocab_size=thinker.vocab_size,
        text_hidden_size=int(talker.get("thinker_hidden_size", thinker.hidden_size)),
        projection_size=int(text["intermediate_size"]),
        num_code_groups=int(talker.get("num_code_groups", 16)),
        eos_id=int(talker["codec_eos_token_id"]),
        hidden_act=str(text.get("hidden_act", "silu")),
    )


def predictor_config(config: Mapping[str, Any]) -> CodePredictorConfig:
    """``talker_config.code_predictor_config`` as the shared predictor's config (rope from
    transformers 5's ``rope_parameters``).

    Raises:
        ValueError: bad sizes or a rope other than default.
    """
    raw = dict(config["talker_config"]["code_predictor_config"])
    rope = dict(raw.get("rope_parameters") or {})
    if rope.get("rope_type", "default") != "default":
        raise ValueError(f"code_predictor_config: unsupported rope {rope!r}")
    raw.setdefault("rope_theta", rope.get("rope_theta", 1000000.0))
    defaults = {"hidden_act": "silu", "attention_bias": False, "rms_norm_eps": 1e-6}
    fields = {**defaults, **raw}
    fields.setdefault("head_dim", fields["hidden_size"] // fields["num_attention_heads"])
    fields.setdefault("num_key_value_heads", fields["num_attention_heads"])
    fields.setdefault("max_position_embeddings", 32768)
    return CodePredictorConfig.of(SimpleNamespace(**fields))


class Qwen3OmniTalker(CodecTalker):
    """The talker component on the shared Qwen3 speech talker (module docstring).

    PREFILL payloads are ``ARPrefillInput`` with a ``TalkerPrompt``; AR_TOKEN payloads
    ``ARStepInput`` whose ``extra`` is the step's thinker-vocab text id. ``text_embedding``
    holds the thinker's ``embed_tokens`` (``refresh_text_embeds`` copies it again after a
    thinker weight update).
    """

    def __init__(
        self,
        config: Mapping[str, Any],
        kv: KVCacheConfig,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        batch_invariant: bool = False,
    ):
        text = ThinkerTextConfig.from_dict(config, "talker_config")
        self.text_config = text
        stack: LlamaConfigLite = text.llama()
        sizes = talker_sizes(config)
        super().__init__(stack, sizes, predictor_config(config), kv, device, dtype, batch_invariant)
        self.llama.rotary_emb = MRotaryEmbedding(
            text.head_dim,
            self.llama.config.rope_theta,
            self.llama.config.max_position_embeddings,
            text.mrope_section,
            self.device,
            interleaved=True,
        )
        factory = {"device": self.device, "dtype": dtype}
        inner, th, h = sizes.projection_size, sizes.text_hidden_size, sizes.hidden_size
        self.media_fc1_weight = torch.zeros(inner, th, **factory)
        self.media_fc1_bias = torch.zeros(inner, **factory)
        self.media_fc2_weight = torch.zeros(h, inner, **factory)
        self.media_fc2_bias = torch.zeros(h, **factory)

    _expert_prefix = "talker.model."
    text_gate = True  # media rows: hidden_projection in the codec part, text gated off
    position_rows = 3  # the thinker's interleaved M-RoPE (plain rope for text prompts)

    def _weight_tensors(self) -> dict[str, torch.Tensor]:
        """Every live talker tensor by its official name (``talker.model.*``, its MoE
        experts fused as ``LlamaModel`` holds them: ``mlp.experts.gate_up_proj`` /
        ``down_proj``, the published per-expert names being ``_weight_aliases``;
        ``talker.text_projection.*``, ``talker.hidden_projection.*``,
        ``talker.codec_head.weight``, ``talker.code_predictor.*``); the thinker's embedding
        is the thinker's."""
        stack = self.llama.state_dict(keep_vars=True).items()
        tensors = {f"talker.model.{k}": v for k, v in stack}
        tensors["talker.model.codec_embedding.weight"] = self.codec_embedding
        tensors["talker.text_projection.linear_fc1.weight"] = self.fc1_weight
        tensors["talker.text_projection.linear_fc1.bias"] = self.fc1_bias
        tensors["talker.text_projection.linear_fc2.weight"] = self.fc2_weight
        tensors["talker.text_projection.linear_fc2.bias"] = self.fc2_bias
        tensors["talker.hidden_projection.linear_fc1.weight"] = self.media_fc1_weight
        tensors["talker.hidden_projection.linear_fc1.bias"] = self.media_fc1_bias
        tensors["talker.hidden_projection.linear_fc2.weight"] = self.media_fc2_weight
        tensors["talker.hidden_projection.linear_fc2.bias"] = self.media_fc2_bias
        tensors["talker.codec_head.weight"] = self.codec_head
        return {**tensors, **self.predictor.weight_tensors()}

    def load_weights(self, state: Mapping[str, torch.Tensor]) -> None:
        """Load the talker's tensors by official name (``talker.*``: the stack's MoE experts
        by their published per-expert names) and ``THINKER_EMBED`` into ``text_embedding``.

        Raises:
            KeyError: a missing tensor (named). ValueError: a mis-shaped or unexpected one.
            RuntimeError: a missing, unexpected or mis-shaped stack tensor (named).
        """
        stack_prefix = "talker.model."
        own = "talker.model.codec_embedding.weight"
        if THINKER_EMBED not in state:
            raise KeyError(f"missing thinker tensor {THINKER_EMBED} (the talker's text rows)")
        rest = {k: v for k, v in state.items() if not k.startswith(stack_prefix) or k == own}
        targets = self._weight_tensors()
        self._copy_named(
            {k: v for k, v in targets.items() if not k.startswith(stack_prefix) or k == own},
            rest,
            "talker.",
        )
        self._copy_named({THINKER_EMBED: self.text_embedding}, state, THINKER_EMBED)
        stack = {
            k.removeprefix(stack_prefix): v
            for k, v in state.items()
            if k.startswith(stack_prefix) and k != own
        }
        self.llama.load_hf_state_dict(stack)

    def refresh_text_embeds(self, embed: torch.Tensor) -> None:
        """Copy the thinker's updated ``embed_tokens`` ``[vocab, thinker_hidden]``."""
        with torch.no_grad():
            self.text_embedding.copy_(embed)

    def _prefill_inputs(self, unit: ARPrefillInput) -> torch.Tensor:
        """Prompt rows then one row per replayed frame, ``[L + n, hidden + thinker_hidden +
        1]``: a media row holds ``hidden_projection`` of its thinker state in the codec part,
        zeros in the text part and gate 0; every other row gate 1."""
        prompt = unit.prompt
        if not isinstance(prompt, TalkerPrompt):
            raise ValueError(f"talker PREFILL needs a TalkerPrompt, got {type(prompt).__name__}")
        rows = self._prompt_inputs(self._codec_rows(prompt.codec_ids), prompt.text_ids, unit)
        gate = rows.new_ones(rows.shape[0], 1)
        if prompt.media_rows is None:
            return torch.cat([rows, gate], dim=1)
        index = torch.tensor(prompt.media_index, dtype=torch.long, device=self.device)
        projected = self._hidden_projection(prompt.media_rows.to(self.device, self.dtype))
        media = torch.cat(
            [projected, projected.new_zeros(len(index), rows.shape[1] - projected.shape[1])], 1
        )
        rows = rows.index_copy(0, index, media.to(rows.dtype))
        return torch.cat([rows, gate.index_fill(0, index, 0.0)], dim=1)

    def _hidden_projection(self, states: torch.Tensor) -> torch.Tensor:
        """``talker.hidden_projection`` of thinker states ``[M, thinker_hidden]`` ->
        ``[M, hidden]`` (transformers' ``Qwen3OmniMoeTalkerResizeMLP``)."""
        inner = self._act(linear(states, self.media_fc1_weight, self.media_fc1_bias))
        return linear(inner, self.media_fc2_weight, self.media_fc2_bias)

    def _step_inputs(self, units: Sequence[Any]) -> torch.Tensor:
        rows = super()._step_inputs(units)
        return torch.cat([rows, rows.new_ones(rows.shape[0], 1)], dim=1)

    def _prompt_positions(self, prompt: Any) -> tuple[torch.Tensor, int] | None:
        if not isinstance(prompt, TalkerPrompt) or prompt.positions is None:
            return None
        return torch.from_numpy(prompt.positions), prompt.rope_delta


def load_talker(
    state: Mapping[str, torch.Tensor],
    config: Mapping[str, Any],
    kv: KVCacheConfig,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    batch_invariant: bool = False,
) -> Qwen3OmniTalker:
    """A ``Qwen3OmniTalker`` for ``config.json`` with ``state``'s tensors (``talker.*`` and
    ``THINKER_EMBED``, official names)."""
    talker = Qwen3OmniTalker(config, kv, device, dtype, batch_invariant)
    talker.load_weights(state)
    return talker
