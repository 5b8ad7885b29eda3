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

Positions are ``0, 1, 2, ...`` (text-only: the talker's MRoPE is plain rope). Sampling
(``TalkerSampling``): transformers' ``generate`` defaults, temperature 0.9, top_k 50, top_p
1.0, repetition penalty 1.05 over the codebook-0 history, the top 1024 ids but EOS suppressed;
the code predictor samples with top_k 50, top_p 0.8 (greedy when the talker is).
``talker.hidden_projection`` (media rows of the prompt) is not used yet: media prompts are not
served.

Imports torch, ``omnistep.kv``, ``omnistep.layers``, ``omnistep.loops``, ``omnistep.runners``,
``omnistep.sampling``, this family's ``thinker`` (its config).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch

from omnistep.kv import KVCacheConfig
from omnistep.layers.code_predictor import CodePredictorConfig
from omnistep.layers.llama import LlamaConfigLite, LlamaModel
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


@dataclass(frozen=True, slots=True)
class TalkerPrompt:
    """The PREFILL prompt of one talker sequence (``build_talker_prompt``).

    Attributes:
        text_ids: one thinker-vocab id per row (the row's text part).
        codec_ids: one per row: a codec id whose embedding is added, or ``NO_CODEC``.
        replay_text: text ids of decode steps already run (step ``k`` fed frame ``k``): a
            re-prefill after a preemption, or a scored trajectory, replays generated frame
            ``k`` with ``replay_text[k]``.

    Raises:
        ValueError: no rows, or lengths that differ.
    """

    text_ids: tuple[int, ...]
    codec_ids: tuple[int, ...]
    replay_text: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not self.text_ids or len(self.text_ids) != len(self.codec_ids):
            raise ValueError(
                f"a talker prompt needs as many codec ids as text ids (>= 1), got "
                f"{len(self.text_ids)} and {len(self.codec_ids)}"
            )

    def key(self) -> tuple:
        """A content key: equal keys give equal talker inputs."""
        return self.text_ids, self.codec_ids


ASSISTANT_HEAD = 4
"""Assistant ids the prefill holds: ``<|im_start|>``, ``assistant``, ``\\n`` and the reply's
first token."""


def user_ids(prompt_ids: Sequence[int], ids: TalkerIds) -> list[int]:
    """The tokens of ``prompt_ids`` inside user turns: each token whose last
    ``<|im_start|>`` at or before it is followed by ``user`` (transformers' role mask; tokens
    before any ``<|im_start|>`` take the role of the prompt's second token)."""
    out, role = [], prompt_ids[1] if len(prompt_ids) > 1 else None
    for i, token in enumerate(prompt_ids):
        if token == ids.im_start:
            role = prompt_ids[i + 1] if i + 1 < len(prompt_ids) else None
        if role == ids.user:
            out.append(int(token))
    return out


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
    prompt_ids: Sequence[int], head: Sequence[int], speaker_id: int, ids: TalkerIds
) -> TalkerPrompt:
    """The talker's prompt (module docstring) for a thinker prompt and the first
    ``ASSISTANT_HEAD`` ids of the assistant turn (``head``: from ``<|im_start|>`` on, through
    the reply's first token).

    Raises:
        ValueError: ``head`` is not ``ASSISTANT_HEAD`` ids.
    """
    if len(head) != ASSISTANT_HEAD:
        raise ValueError(f"the assistant head must be {ASSISTANT_HEAD} ids, got {len(head)}")
    user = user_ids(prompt_ids, ids)
    text = [*user, *head[:3], *[ids.tts_pad] * 4, ids.tts_bos, head[3]]
    codec = [NO_CODEC] * (len(user) + 3) + [
        ids.codec_nothink,
        ids.codec_think_bos,
        ids.codec_think_eos,
        int(speaker_id),
        ids.codec_pad,
        ids.codec_bos,
    ]
    return TalkerPrompt(tuple(int(t) for t in text), tuple(codec))


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
        super().__init__(
            stack,
            talker_sizes(config),
            predictor_config(config),
            kv,
            device,
            dtype,
            batch_invariant,
        )

    _expert_prefix = "talker.model."

    def _weight_tensors(self) -> dict[str, torch.Tensor]:
        """Every live talker tensor by its official name (``talker.model.*``, its MoE
        experts fused as ``LlamaModel`` holds them: ``mlp.experts.gate_up_proj`` /
        ``down_proj``, the published per-expert names being ``_weight_aliases``;
        ``talker.text_projection.*``, ``talker.codec_head.weight``,
        ``talker.code_predictor.*``); the thinker's embedding is the thinker's."""
        stack = self.llama.state_dict(keep_vars=True).items()
        tensors = {f"talker.model.{k}": v for k, v in stack}
        tensors["talker.model.codec_embedding.weight"] = self.codec_embedding
        tensors["talker.text_projection.linear_fc1.weight"] = self.fc1_weight
        tensors["talker.text_projection.linear_fc1.bias"] = self.fc1_bias
        tensors["talker.text_projection.linear_fc2.weight"] = self.fc2_weight
        tensors["talker.text_projection.linear_fc2.bias"] = self.fc2_bias
        tensors["talker.codec_head.weight"] = self.codec_head
        return {**tensors, **self.predictor.weight_tensors()}

    def load_weights(self, state: Mapping[str, torch.Tensor]) -> None:
        """Load the talker's tensors by official name (``talker.*``: the stack's MoE experts
        by their published per-expert names; ``hidden_projection``, for media rows, is
        skipped) and ``THINKER_EMBED`` into ``text_embedding``.

        Raises:
            KeyError: a missing tensor (named). ValueError: a mis-shaped or unexpected one.
            RuntimeError: a missing, unexpected or mis-shaped stack tensor (named).
        """
        stack_prefix = "talker.model."
        own = "talker.model.codec_embedding.weight"
        if THINKER_EMBED not in state:
            raise KeyError(f"missing thinker tensor {THINKER_EMBED} (the talker's text rows)")
        skipped = ("talker.hidden_projection.", stack_prefix)
        rest = {k: v for k, v in state.items() if not k.startswith(skipped) or k == own}
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
        """Prompt rows then one row per replayed frame, ``[L + n, hidden + thinker_hidden]``."""
        prompt = unit.prompt
        if not isinstance(prompt, TalkerPrompt):
            raise ValueError(f"talker PREFILL needs a TalkerPrompt, got {type(prompt).__name__}")
        return self._prompt_inputs(self._codec_rows(prompt.codec_ids), prompt.text_ids, unit)


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
