"""The Qwen3-TTS talker as a component: a Qwen3 LM over codebook 0 of the 12 Hz codec, on a paged
KV cache, batched across requests, with its code predictor filling codebooks 1..15 inside the same
step.

Mirrors qwen_tts 0.1.1 (core/models/modeling_qwen3_tts.py): ``Qwen3TTSTalkerModel`` (Qwen3
decoder layers: q/k/v/o without bias, per-head ``q_norm``/``k_norm`` RMSNorm before rope, SwiGLU,
RMSNorm; ``codec_embedding`` ``[vocab, hidden]``, ``text_embedding`` ``[text_vocab,
text_hidden]``), ``Qwen3TTSTalkerForConditionalGeneration`` (``text_projection``: a two-layer MLP
with bias ``text_hidden -> text_hidden -> hidden``; ``codec_head`` ``[vocab, hidden]``) and
``Qwen3TTSTalkerCodePredictorModelForConditionalGeneration`` (a small Qwen3 stack with
``num_code_groups - 1`` codec embeddings of the talker's width, ``small_to_mtp_projection`` when
the widths differ, one ``lm_head`` per codebook: the shared ``omnistep.layers.code_predictor``,
configured from the checkpoint's ``code_predictor_config``).

Every talker input row is ``codec part + text_projection(text_embedding(text id))``:

- prompt rows (``Qwen3TTSPrompt``, built by ``omnistep.models.qwen3_tts.prompt``): a text id per
  row, plus a codec id's ``codec_embedding`` row where the layout has one; a cloned voice
  (``CloneRows``, Base checkpoints) adds a row whose codec part is its speaker embedding (the
  x-vector, upstream ``generate_speaker_prompt``) and one row per reference frame whose codec
  part is the frame's 16 codebook embeddings summed (upstream ``generate_icl_prompt``);
- the row of generated frame ``k`` (fed by the AR_TOKEN unit that samples frame ``k + 1``): the
  frame's 16 codebook embeddings summed (``codec_embedding`` for code 0, the predictor's
  ``codec_embedding[j - 1]`` for code ``j``) plus the text track's id for step ``k`` (upstream
  ``trailing_text_hidden[:, generation_step]``): text token ``k + 1`` of the utterance in
  streaming-text mode, then ``tts_eos``, then ``tts_pad`` for every later step. The id comes
  with the step (``ARStepInput.extra``), from the loop's text track
  (``Qwen3TTSTalkerLoop``), so text can stream into a running request.

One unit (PREFILL or AR_TOKEN) = one frame: talker forward -> ``codec_head`` -> sample codebook 0
(repetition penalty over the codebook-0 history, the top 1024 ids but EOS suppressed, EOS masked
for the first ``min_new_tokens``) -> the code predictor's 15 sub-steps, batched across every
request of the batch: its input rows are the talker's final (normed) hidden state and
``codec_embedding(code 0)``, then each sampled code's embedding; sub-step ``j`` reads
``lm_head[j - 1]`` and samples code ``j``. Each sub-step runs on a small dense per-frame KV cache
(16 rows at most, dropped after the frame). Every id of the frame is drawn from the request's own
generator (16 uniforms per frame, in codebook order; ``omnistep.sampling.sample``), so a
request's codes do not depend on its batch. A frame whose code 0 is EOS carries zeros in codebooks
1..15 (they are not sampled; their log-probs are 0).

Rope: the talker's interleaved mRoPE gets three equal position components in TTS
(``get_rope_index``: ``cumsum(attention_mask) - 1`` expanded to three rows, decode positions
continuing with a zero delta), so every frequency reads the same angle and it is exactly 1-D rope
over ``head_dim`` (``LlamaModel``'s ``RotaryEmbedding``; tests/test_qwen3_tts_talker.py checks
it bitwise against upstream's ``apply_multimodal_rotary_pos_emb``). The predictor uses plain rope,
positions ``0..15`` per frame.

Prefill/decode, KV admission, preemption and batching are the shared
``omnistep.runners.paged_ar.PagedARModel``'s; the rows, the two-stage sampling above and the
scoring are the shared ``omnistep.runners.codec_talker.CodecTalker``'s (Qwen3-Omni's talker
is one too); this module gives the prompt layout.

Prefix sharing: the samples of one group (``Request.group``) with one voice and one text share
one prefill (``PagedARModel`` finds equal prompts by the content hash of their rows). Across
requests, a voice's rows (``Qwen3TTSPrompt.voice_rows``: the instruction if any, the role ids,
the codec control rows with the language and the speaker id, or a cloned voice's x-vector and
the ICL rows that pair its transcript's ids with its reference frames) are the same whatever the
text, so ``_prompt_prefix`` names them (labelled by the clone's content key, if any, and those
rows' ids): every request of the voice prefills them apart from its text rows, computed once and
kept by ``PagedARModel`` (its "Prefixes", found by the rows' content hash); the other requests
share their blocks and compute only the rest (a CustomVoice prompt in the streaming layout: 1 of
its 9-10 rows). ``drop_voice`` forgets a cloned voice's kept rows.

Imports torch, ``omnistep.core``, ``omnistep.kv``, ``layers``, ``loops``, ``sampling``.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from omnistep.core import (
    Channel,
    Done,
    ExecutionProfile,
    LoopResult,
    ModelInstance,
    Pending,
    ProgramContext,
    Request,
    WorkPlan,
)
from omnistep.kv import KVCacheConfig
from omnistep.layers.code_predictor import CodePredictorConfig
from omnistep.layers.llama import LlamaConfigLite
from omnistep.loops.ar_decode import (
    ARDecodeConfig,
    ARDecodeLoop,
    ARDecodeState,
    ARPrefillInput,
)
from omnistep.models.qwen3_tts.loader import (
    GenerationDefaults,
    Qwen3TTSCheckpoint,
    Qwen3TTSConfig,
)
from omnistep.runners.codec_talker import CodecTalker, CodecTalkerSampling, CodecTalkerSizes
from omnistep.sampling import (
    SamplingRow,
)

NEG_INF = float("-inf")
NO_CODEC = -1
"""``Qwen3TTSPrompt.codec_ids`` entry of a row without a codec part."""
SPEAKER_ROW = -2
"""``Qwen3TTSPrompt.codec_ids`` entry of the row whose codec part is the cloned voice's speaker
embedding (``CloneRows.speaker_embedding``)."""
REF_FRAME_ROW = -3
"""``Qwen3TTSPrompt.codec_ids`` entry of a row whose codec part is the next reference frame of
the cloned voice (``CloneRows.ref_codes``, in order), its 16 codebook embeddings summed."""


# ---------------------------------------------------------------- configs
MIN_NEW_TOKENS = 2
"""Upstream ``generate`` masks the codec EOS for the first two frames (``min_new_tokens=2``)."""


def talker_sizes(config: Qwen3TTSConfig) -> CodecTalkerSizes:
    """The shared talker's sizes: ``text_projection`` is ``text_hidden -> text_hidden ->
    hidden`` with SiLU; the text table is the talker's own ``text_embedding``."""
    t = config.talker
    return CodecTalkerSizes(
        vocab_size=t.vocab_size,
        hidden_size=t.hidden_size,
        text_vocab_size=t.text_vocab_size,
        text_hidden_size=t.text_hidden_size,
        projection_size=t.text_hidden_size,
        num_code_groups=t.num_code_groups,
        eos_id=config.ids.codec_eos,
    )


def suppressed_ids(config: Qwen3TTSConfig) -> list[int]:
    """Ids ``generate`` suppresses when sampling codebook 0: the top 1024 of the talker vocab
    except the codec EOS (``CodecTalkerSizes.suppressed_ids``)."""
    return talker_sizes(config).suppressed_ids()


class Qwen3TTSSampling(CodecTalkerSampling):
    """One request's sampling rows: ``talker`` for codebook 0, ``predictor`` for 1..15."""

    __slots__ = ()

    @classmethod
    def from_defaults(
        cls,
        config: Qwen3TTSConfig,
        defaults: GenerationDefaults | None = None,
        greedy: bool = False,
        penalty_window: int | None = None,
    ) -> Qwen3TTSSampling:
        """Rows for ``defaults`` (None: the checkpoint's ``config.generation``, i.e.
        ``generation_config.json`` over upstream's hard defaults, as upstream's
        ``_merge_generate_kwargs`` picks them). ``greedy`` forces temperature 0 in both stages
        (``do_sample=False, subtalker_dosample=False``). Codebook 0: top-k/top-p/temperature,
        a repetition penalty counting each distinct codebook-0 id of the history once
        (transformers' ``RepetitionPenaltyLogitsProcessor``; ``penalty_window`` defaults to
        ``max_new_tokens``: all of it), EOS masked for ``MIN_NEW_TOKENS`` frames. Codebooks
        1..15: top-k/top-p/temperature only."""
        d = config.generation if defaults is None else defaults
        talker_t = 0.0 if greedy or not d.do_sample else d.temperature
        sub_t = 0.0 if greedy or not d.subtalker_dosample else d.subtalker_temperature
        talker = SamplingRow(
            temperature=talker_t,
            top_p=d.top_p,
            top_k=d.top_k,
            repetition_penalty=d.repetition_penalty,
            penalty_window=d.max_new_tokens if penalty_window is None else penalty_window,
            penalty_compounds=False,
            min_new_tokens=MIN_NEW_TOKENS,
            eos_token_id=config.ids.codec_eos,
            min_keep=1,
        )
        predictor = SamplingRow(
            temperature=sub_t, top_p=d.subtalker_top_p, top_k=d.subtalker_top_k, min_keep=1
        )
        return cls(talker, predictor)


# ---------------------------------------------------------------- payloads
@dataclass(frozen=True, eq=False)
class CloneRows:
    """What a cloned voice puts in the talker's prompt (upstream ``VoiceClonePromptItem`` in ICL
    mode, without its transcript, which the prompt holds as text ids).

    Attributes:
        speaker_embedding: float32 ``[hidden]``, the x-vector (cast to the talker's dtype).
        ref_codes: int64 ``[T, num_code_groups]``, the reference clip's codes.
        key: a content digest of both (sha256 hex), for prompt keys; computed.

    Raises:
        ValueError: wrong ranks or dtypes.
    """

    speaker_embedding: np.ndarray
    ref_codes: np.ndarray
    key: str = field(init=False)

    def __post_init__(self) -> None:
        emb = np.ascontiguousarray(self.speaker_embedding)
        codes = np.ascontiguousarray(self.ref_codes)
        if emb.dtype != np.float32 or emb.ndim != 1:
            raise ValueError("speaker_embedding must be float32 [hidden]")
        if codes.dtype != np.int64 or codes.ndim != 2:
            raise ValueError("ref_codes must be int64 [T, num_code_groups]")
        digest = hashlib.sha256(emb.tobytes())
        digest.update(np.asarray(codes.shape, dtype=np.int64).tobytes())
        digest.update(codes.tobytes())
        object.__setattr__(self, "speaker_embedding", emb)
        object.__setattr__(self, "ref_codes", codes)
        object.__setattr__(self, "key", digest.hexdigest())

    @property
    def num_frames(self) -> int:
        """T, the reference frames."""
        return int(self.ref_codes.shape[0])


@dataclass(frozen=True, slots=True)
class Qwen3TTSPrompt:
    """The PREFILL prompt of one talker sequence (built by ``prompt.build_prompt``).

    Attributes:
        text_ids: one text-vocab id per prompt row (its projected embedding is the row's text
            part).
        codec_ids: one per prompt row: a talker codec id whose embedding is added,
            ``NO_CODEC``, ``SPEAKER_ROW`` or ``REF_FRAME_ROW`` (those two need ``clone``).
        replay_text: the text-track ids of decode steps already run (step ``k`` fed frame
            ``k``): a re-prefill after a preemption, or a scored trajectory, replays generated
            frame ``k`` with ``replay_text[k]``; it needs one per replayed frame.
        clone: the cloned voice whose embedding and reference frames the ``SPEAKER_ROW`` /
            ``REF_FRAME_ROW`` rows carry (one ``REF_FRAME_ROW`` per reference frame), or None.
        voice_rows: the first rows that depend on the voice (speaker, instruction or cloned
            voice), the language and the layout only, not on the text to speak
            (``build_prompt`` sets it; 0: none): requests of one voice share their K/V
            (``Qwen3TTSTalker._prompt_prefix``).

    Raises:
        ValueError: lengths that differ, marker rows without a clone, a reference-row count
            other than the clone's frames, or ``voice_rows`` outside ``[0, rows]``.
    """

    text_ids: tuple[int, ...]
    codec_ids: tuple[int, ...]
    replay_text: tuple[int, ...] = ()
    clone: CloneRows | None = None
    voice_rows: int = 0

    def __post_init__(self) -> None:
        if not self.text_ids or len(self.text_ids) != len(self.codec_ids):
            raise ValueError(
                f"a prompt needs as many codec ids as text ids (>= 1), got "
                f"{len(self.text_ids)} and {len(self.codec_ids)}"
            )
        speaker_rows = self.codec_ids.count(SPEAKER_ROW)
        ref_rows = self.codec_ids.count(REF_FRAME_ROW)
        if self.clone is None and (speaker_rows or ref_rows):
            raise ValueError("speaker or reference-frame rows need the prompt's clone")
        if self.clone is not None and (speaker_rows > 1 or ref_rows != self.clone.num_frames):
            raise ValueError(
                f"a cloned voice's prompt has at most one speaker row and one row per reference "
                f"frame ({self.clone.num_frames}), got {speaker_rows} and {ref_rows}"
            )
        if not 0 <= self.voice_rows <= len(self.text_ids):
            raise ValueError(
                f"voice_rows must be in [0, {len(self.text_ids)}], got {self.voice_rows}"
            )

    def key(self) -> tuple:
        """A content key: equal keys give equal talker inputs (the voice included) and equal
        prefill pieces (``voice_rows``)."""
        clone = None if self.clone is None else self.clone.key
        return self.text_ids, self.codec_ids, clone, self.voice_rows

    def voice_key(self) -> tuple | None:
        """The key of the first ``voice_rows`` rows (None without them): the clone's content
        key (None for a speaker or an instruction) and those rows' text and codec ids
        (instruction, role ids, language, speaker id, layout, transcript)."""
        if not self.voice_rows:
            return None
        n = self.voice_rows
        clone = None if self.clone is None else self.clone.key
        return clone, self.text_ids[:n], self.codec_ids[:n]


# ---------------------------------------------------------------- the talker
class Qwen3TTSTalker(CodecTalker):
    """The talker component (see module docstring).

    PREFILL payloads are ``ARPrefillInput`` with a ``Qwen3TTSPrompt``; AR_TOKEN payloads are
    ``ARStepInput`` whose ``extra`` is the text-track id; ``sampling`` is a
    ``Qwen3TTSSampling``. Frames are ``num_code_groups`` ids; outputs carry no ``hidden``.
    Input rows are ``[codec part (hidden) | text embedding (text_hidden)]``; ``_lm_inputs``
    projects the text part and adds.

    The tensors, sampling and scoring are the shared ``runners.codec_talker.CodecTalker``'s
    (``text_embedding`` is the talker's own ``talker.model.text_embedding``); this class adds
    the prompt layout with its cloned-voice rows and the voice prefixes.
    """

    def __init__(
        self,
        config: Qwen3TTSConfig,
        kv: KVCacheConfig,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        batch_invariant: bool = False,
    ):
        t = config.talker
        predictor = CodePredictorConfig.of(t.code_predictor)
        stack = LlamaConfigLite.qwen3(t)
        super().__init__(stack, talker_sizes(config), predictor, kv, device, dtype, batch_invariant)
        self.config = config

    @classmethod
    def from_checkpoint(
        cls,
        checkpoint: Qwen3TTSCheckpoint,
        kv: KVCacheConfig,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        batch_invariant: bool = False,
    ) -> Qwen3TTSTalker:
        """Build the talker of an opened published folder and load its ``talker.*`` tensors
        (the loader checks their names and shapes).

        Raises:
            Qwen3TTSCheckpointError: a missing or misshapen tensor.
        """
        talker = cls(checkpoint.config, kv, device, dtype, batch_invariant)
        talker.load_weights(checkpoint.model_tensors(dtype=dtype, device=device))
        return talker

    # ------------------------------------------------------------ weights
    def load_weights(self, state: Mapping[str, torch.Tensor]) -> None:
        """Load the talker's tensors by their official names (``talker.*`` of
        ``model.safetensors``; other keys, e.g. ``speaker_encoder.*``, are ignored).

        Raises:
            KeyError: a missing tensor (named). ValueError: a mis-shaped or unexpected one.
        """
        self._copy_named(self._weight_tensors(), state, "talker.")

    def _weight_tensors(self) -> dict[str, torch.Tensor]:
        """Every live tensor by its official name (``talker.model.*``,
        ``talker.text_projection.*``, ``talker.codec_head.weight``,
        ``talker.code_predictor.*``)."""
        tensors = {f"talker.model.{k}": v for k, v in self.llama.state_dict(keep_vars=True).items()}
        tensors["talker.model.codec_embedding.weight"] = self.codec_embedding
        tensors["talker.model.text_embedding.weight"] = self.text_embedding
        tensors["talker.text_projection.linear_fc1.weight"] = self.fc1_weight
        tensors["talker.text_projection.linear_fc1.bias"] = self.fc1_bias
        tensors["talker.text_projection.linear_fc2.weight"] = self.fc2_weight
        tensors["talker.text_projection.linear_fc2.bias"] = self.fc2_bias
        tensors["talker.codec_head.weight"] = self.codec_head
        return {**tensors, **self.predictor.weight_tensors()}

    # ------------------------------------------------------------ rows
    def _prefill_inputs(self, unit: ARPrefillInput) -> torch.Tensor:
        """Prompt rows then one row per replayed frame, ``[L + n, hidden + text_hidden]``."""
        prompt = unit.prompt
        if not isinstance(prompt, Qwen3TTSPrompt):
            raise ValueError(f"talker PREFILL needs a Qwen3TTSPrompt, got {type(prompt).__name__}")
        vocab = self.config.talker.vocab_size
        if any(not REF_FRAME_ROW <= c < vocab for c in prompt.codec_ids):
            raise ValueError(f"prompt codec id outside [0, {vocab})")
        codec_ids = torch.tensor(prompt.codec_ids, dtype=torch.long, device=self.device)
        codec = self._codec_rows(prompt.codec_ids)
        if prompt.clone is not None:
            codec = self._clone_rows(codec, codec_ids, prompt.clone)
        return self._prompt_inputs(codec, prompt.text_ids, unit)

    def _clone_rows(
        self, codec: torch.Tensor, codec_ids: torch.Tensor, clone: CloneRows
    ) -> torch.Tensor:
        """``codec`` ``[L, hidden]`` with the speaker row set to the clone's x-vector (cast to
        the talker's dtype, as upstream ``generate_speaker_prompt``) and the reference rows to
        the reference frames' codebook embeddings, stacked and summed over the 16 codebooks as
        upstream ``generate_icl_prompt`` does (``cat(...).sum(1)``).

        Raises:
            ValueError: an embedding of another width, or malformed reference frames.
        """
        hidden = self.config.talker.hidden_size
        if clone.speaker_embedding.shape[0] != hidden:
            raise ValueError(
                f"the cloned voice's speaker embedding is {clone.speaker_embedding.shape[0]} "
                f"wide; the talker's hidden size is {hidden}"
            )
        codec = codec.clone()
        speaker = (codec_ids == SPEAKER_ROW).nonzero()[:, 0]
        if speaker.numel():
            embedding = torch.from_numpy(clone.speaker_embedding).to(self.device, self.dtype)
            codec[speaker] = embedding
        rows = (codec_ids == REF_FRAME_ROW).nonzero()[:, 0]
        if rows.numel():
            frames = self._frames(clone.ref_codes.tolist())
            tables = [self.codec_embedding, *self.predictor.codec_embedding]
            parts = [table[frames[:, j]] for j, table in enumerate(tables)]
            codec[rows] = torch.stack(parts, dim=1).sum(1)
        return codec

    def _prompt_prefix(self, prompt: Qwen3TTSPrompt) -> tuple[tuple, int] | None:
        """The voice's rows (``Qwen3TTSPrompt.voice_rows``, labelled by ``voice_key``)."""
        key = prompt.voice_key()
        return None if key is None else (key, prompt.voice_rows)

    def drop_voice(self, clone_key: str) -> int:
        """Forget the kept prefixes of the cloned voice with content key ``clone_key``
        (``CloneRows.key``); returns how many were dropped."""
        return self.drop_prefixes(lambda key: key[0] == clone_key)


# ---------------------------------------------------------------- the text track
def text_for_step(step: int, track: Sequence[int], closed: bool, pad_id: int) -> int | None:
    """The text-track id of decode step ``step`` (the step feeding frame ``step``).

    Args:
        track: text ids for steps ``0, 1, ...`` so far (streaming-text mode: the utterance's
            tokens after the first, then ``tts_eos``; non-streaming: empty).
        closed: no more ids will come.
        pad_id: ``tts_pad_token_id``, every step past a closed track.

    Returns:
        ``track[step]``; ``pad_id`` past a closed track; None while the id has not arrived
        (the loop waits).
    """
    if step < len(track):
        return int(track[step])
    return pad_id if closed else None


@dataclass
class Qwen3TTSTalkerState(ARDecodeState):
    """The talker's decode state plus its text track (a ``Channel`` of text ids)."""

    track: Channel = field(default_factory=Channel)


class Qwen3TTSTalkerLoop(ARDecodeLoop):
    """AR decode of Qwen3-TTS frames with the text track as a second input.

    ``track_slot`` holds a ``Channel`` of text ids, one per decode step (see
    ``text_for_step``): a card puts the whole trailing text (``build_prompt``'s ``trailing``)
    and closes it, or streams ids in as text arrives, then ``tts_eos``, then closes. An AR_TOKEN
    unit whose id has not arrived waits (``Pending``); a re-prefill replays its frames with
    theirs. Config: ``eos_token_ids=(codec_eos_token_id,)``, ``eos_codebooks=(0,)``,
    ``penalty_window=0`` (the penalty reads the whole codebook-0 history).
    """

    def __init__(self, config: ARDecodeConfig, track_slot: str, pad_id: int):
        super().__init__(config)
        self.track_slot = track_slot
        self.pad_id = pad_id

    def init(self, req: Request, model: ModelInstance, ctx: ProgramContext) -> Qwen3TTSTalkerState:
        base = super().init(req, model, ctx)
        fields_ = {f.name: getattr(base, f.name) for f in dataclasses.fields(base)}
        return Qwen3TTSTalkerState(**fields_, track=ctx.slots[self.track_slot])

    def _texts(self, state: Qwen3TTSTalkerState, steps: int) -> tuple[int, ...] | None:
        texts = []
        for step in range(steps):
            text_id = text_for_step(step, state.track, state.track.closed, self.pad_id)
            if text_id is None:
                return None
            texts.append(text_id)
        return tuple(texts)

    def next(self, state: Qwen3TTSTalkerState) -> WorkPlan | Done | Pending:
        plan = super().next(state)
        if isinstance(plan, Done):
            return plan
        if isinstance(plan.payload, ARPrefillInput):
            replay = self._texts(state, len(state.frames))
            if replay is None:
                return Pending("waiting for text")
            prompt = dataclasses.replace(plan.payload.prompt, replay_text=replay)
            plan.payload = dataclasses.replace(plan.payload, prompt=prompt)
            return plan
        step = len(state.frames) - 1
        text_id = text_for_step(step, state.track, state.track.closed, self.pad_id)
        if text_id is None:
            return Pending("waiting for text")
        plan.payload = dataclasses.replace(plan.payload, extra=text_id)
        return plan

    def finalize(self, state: Qwen3TTSTalkerState) -> LoopResult:
        """Under ROLLOUT the recorded prompt carries the text ids of the ``T - 1`` decode
        steps that ran, so ``score`` replays the trajectory."""
        result = super().finalize(state)
        if state.profile is ExecutionProfile.ROLLOUT:
            replay = self._texts(state, max(0, len(state.trajectory) - 1))
            if replay is None:
                raise RuntimeError("a talker step ran without its text id")
            result.info["prompt"] = dataclasses.replace(state.prompt, replay_text=replay)
        return result


def load_talker(
    state: Mapping[str, torch.Tensor],
    config: Qwen3TTSConfig,
    kv: KVCacheConfig,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    batch_invariant: bool = False,
) -> Qwen3TTSTalker:
    """Build a ``Qwen3TTSTalker`` for ``config`` (the loader's ``parse_config``) and load the
    talker's tensors from ``state`` (official names; other keys ignored)."""
    talker = Qwen3TTSTalker(config, kv, device, dtype, batch_invariant)
    talker.load_weights(state)
    return talker
