"""The ``qwen3_tts`` card: the talker (with its code predictor) decodes 16-codebook frames
(AR_DECODE) that stream into the 12 Hz speech tokenizer's causal decoder (AUDIO_DECODE), both
batched across requests; the text is a second track of the talker and may stream into a running
request (``Capability.STREAMING_TEXT_INPUT``).

Program: ``frontend`` (voice, language, instructions -> ``Qwen3TTSVoice``; checked at
submission) -> ``decode`` (``TalkerTextLoop`` on the ``talker`` component: one PREFILL unit,
then one AR_TOKEN unit per frame; each frame's 16 codes go on ``codes_stream``) and, at the same
time, ``vocode`` (an AudioDecodeLoop on the ``codec`` component: chunks of new frames, the
component keeping each request's decoder state between them; no look-ahead:
``codec.codec_decode_config``) -> ``usage``.

Text: the request's text arrives on ``TEXT_INPUT_SLOT`` (whole, or in pieces with
``Request.text_input``); ``IncrementalTokenizer`` turns it into the same ids tokenizing the whole
text gives. Two prompt layouts, as upstream (``prompt`` module docstring); their audio differs:

- non-streaming (``non_streaming_mode=True``): the whole text in the prompt; the prefill waits
  for the end of the text. The default of a whole-text request (``/v1/audio/speech``, the
  offline API, ``say``) on CustomVoice and VoiceDesign, as upstream ``generate_custom_voice`` /
  ``generate_voice_design`` default.
- streaming text (``non_streaming_mode=False``): the first text id goes in the prompt, the rest
  feed decode step ``k`` (then ``tts_eos``, then ``tts_pad``). So the prefill waits for the
  first word and each step for its word: speech starts before the text is complete, and the
  codes equal those of the whole text in this layout with the same seed. The default of text
  that streams in (``Request.text_input``: the speech WebSocket), and of a whole-text Base
  request (upstream ``generate_voice_clone`` defaults to it).

``Request.non_streaming_mode`` (the speech API's ``non_streaming_mode`` field) picks a layout
for one request; ``Qwen3TTSOptions.non_streaming_text`` for every request that does not
(``text_layout``). ``max_new_tokens`` counts as upstream's does (``talker_frames``): it bounds
the codebook-0 samples, and upstream never completes the last one into a frame, so a request
gets at most ``max_new_tokens - 1`` frames (EOS ends it earlier).

Voices by variant (``tts_model_type`` of the folder):

- ``custom_voice``: a speaker of ``talker_config.spk_id`` by name (any case), or an OpenAI voice
  name mapped by ``OPENAI_SPEAKERS`` (to the first of its speakers the folder has); default
  ``DEFAULT_SPEAKERS``' first present. ``instructions`` is passed to 1.7B folders and dropped
  for 0.6B ones, as upstream ``generate_custom_voice`` does.
- ``voice_design``: no speaker; ``instructions`` (OpenAI's field) describes the voice and is
  required (``Capability.VOICE_DESIGN``).
- ``base``: cloned voices only (``Capability.VOICE_CLONING``). ``POST /v1/audio/voices`` with
  a reference clip and its transcript runs the card's ``voice_enroller`` (the ``encoder``
  component: speaker encoder + the speech tokenizer's encoder, ``clone.VoiceCloneComponent``)
  and saves the spec (``clone.VoiceClonePrompt.to_spec``) under a name; a request names it as
  its voice (the server swaps the name for the spec; a raw spec works too). The talker prompt
  then holds the speaker embedding and the ICL block (``prompt`` module docstring), and the
  audio loop decodes with the reference codes as left context (``codec.CodecPrefix``; their
  samples are dropped, as upstream cuts them). A request without a voice is refused (400).
  ``instructions`` is dropped (upstream's clone path takes none). Text streamed into a Base
  request: the ICL layout puts the first ``len(ref codes) + 1 - len(transcript ids)`` text
  ids in the prompt, so the prefill waits until that much text is final or the text ended
  (about the reference clip's length in text: speech starts once the streamed text is
  longer than the reference, instead of after its first word); then each step reads its id
  as for the other variants, and the codes equal those of the whole text.

``language``: ``auto`` (default) or a ``codec_language_id`` name; dialect speakers switch
``auto``/``chinese`` to their dialect as upstream. Sampling defaults come from the folder's
``generation_config.json`` (top-k 50, top-p 1.0, temperature 0.9, repetition penalty 1.05 on
codebook 0, the same for the code predictor); a request's temperature/top-p/top-k/repetition
penalty apply to codebook 0, and temperature 0 makes both stages greedy.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from omnistep.core import (
    OPENAI_VOICES,
    TEXT_INPUT_SLOT,
    Capability,
    Channel,
    ComponentSpec,
    Done,
    InvalidRequestError,
    KernelNode,
    LoopKind,
    LoopNode,
    LoopSpec,
    ModelCard,
    ModelInstance,
    Pending,
    Program,
    ProgramContext,
    Request,
    WorkPlan,
    WorkUnitKind,
    call_component,
)
from omnistep.layers.device import check_device
from omnistep.loops import AudioDecodeLoop
from omnistep.loops.ar_decode import ARDecodeConfig
from omnistep.models.qwen3_tts.clone import (
    VoiceCloneComponent,
    VoiceCloneEncoder,
    VoiceClonePrompt,
)
from omnistep.models.qwen3_tts.codec import (
    CodecDecoderComponent,
    CodecDecoderConfig,
    CodecPrefix,
    codec_decode_config,
    codec_from_checkpoint,
)
from omnistep.models.qwen3_tts.loader import Qwen3TTSCheckpoint, Qwen3TTSConfig
from omnistep.models.qwen3_tts.prompt import (
    REF_TAIL_IDS,
    ROLE_IDS,
    TAIL_IDS,
    TalkerPromptParts,
    build_prompt,
    clone_text_needed,
    instruct_text,
    ref_text,
)
from omnistep.models.qwen3_tts.talker import (
    CloneRows,
    Qwen3TTSSampling,
    Qwen3TTSTalker,
    Qwen3TTSTalkerLoop,
    Qwen3TTSTalkerState,
)
from omnistep.runners.options import ServingOptions
from omnistep.text.incremental import IncrementalTokenizer

CARD_ID = "qwen3-tts"
SERVED_VARIANTS = ("custom_voice", "voice_design", "base")
CLONE_CACHE_SIZE = 64
"""Parsed cloned voices (specs) the frontend keeps, most recently used first."""

DEFAULT_SPEAKERS = ("vivian", "ryan", "serena", "aiden")
"""The default CustomVoice speaker: the first of these the folder has (else its first)."""

OPENAI_SPEAKERS: dict[str, tuple[str, ...]] = {
    "alloy": ("vivian",),
    "ash": ("ryan",),
    "ballad": ("uncle_fu",),
    "coral": ("serena",),
    "echo": ("aiden",),
    "fable": ("dylan",),
    "onyx": ("eric",),
    "nova": ("ono_anna",),
    "sage": ("sohee",),
    "shimmer": ("serena",),
    "verse": ("ryan",),
}
"""OpenAI voice name -> CustomVoice speakers, first present wins (the published 12Hz
CustomVoice speakers: vivian, serena, ono_anna, sohee are female; ryan, aiden, uncle_fu, dylan,
eric male)."""


@dataclass(frozen=True)
class Qwen3TTSOptions(ServingOptions):
    """Serving options of the card: ``ServingOptions`` (the talker's KV cache, batching, the
    talker/codec dtype) and

    Attributes:
        max_new_tokens: the default cap, counted as upstream's (``talker_frames``: at most
            ``max_new_tokens - 1`` frames; None: ``generation_config.json``'s).
        first_chunk, chunk, chunk_growth, max_chunk, bucket_frames: the vocoder's chunk
            schedule in frames (1 frame = 1920 samples = 80 ms); see ``codec_decode_config``.
            The first chunk is the prefill's own frame: audio starts after one talker forward
            and one codec frame (``bench/qwen3_tts.py``, issue 13 notes: TTFA at C=1 0.07x of
            qwen-tts's first utterance with it against 0.11x with 2 frames, and TTFA p99 at
            C=8 / C=4 1.32 against 1.57: the codec's first chunk, linear in the batch, is
            half as large beside the same fixed prefill).
        first_audio_alone: a request's talker waits while its first codec chunk is decoded,
            its second step included (``ModelCard.first_audio_alone``; EDF scheduling only):
            the chunk then has both cores. Bench TTFA p50: with 2-frame first chunks, C=4
            0.57-0.69 s against 0.92-1.05 s beside the talker; with 1-frame ones, C=1
            0.20-0.23 s against 0.28-0.30 s when only later steps waited.
        codec_stream_state: the codec keeps each request's decoder state (KV cache, conv
            inputs) between chunks, so a chunk costs its own frames only; False: every chunk
            re-reads its exact left context (580 frames published; the same samples, slower;
            ``bucket_frames`` applies only then).
        non_streaming_text: the prompt layout of requests that do not choose one
            (``Request.non_streaming_mode``): True the non-streaming layout (whole text in the
            prompt; text that streams in then starts speaking only once it is complete), False
            the streaming-text layout, None (default) per request as ``text_layout`` says.
    """

    max_new_tokens: int | None = None
    first_chunk: int = 1
    chunk: int = 8
    chunk_growth: float = 2.0
    max_chunk: int = 64
    bucket_frames: int = 64
    codec_stream_state: bool = True
    non_streaming_text: bool | None = None
    first_audio_alone: bool = True


NON_STREAMING_BY_DEFAULT = frozenset({"custom_voice", "voice_design"})
"""Variants whose upstream public call (``generate_custom_voice``, ``generate_voice_design``)
defaults to ``non_streaming_mode=True``; ``generate_voice_clone`` (Base) defaults to False."""


def text_layout(req: Request, tts_model_type: str, default: bool | None = None) -> bool:
    """Whether ``req`` uses the non-streaming layout (whole text in the prompt).

    The request's ``non_streaming_mode`` if set, else the card's ``default``
    (``Qwen3TTSOptions.non_streaming_text``) if set, else: text that streams in
    (``req.text_input``) the streaming layout, a whole text the default of upstream's public
    call for the variant (``NON_STREAMING_BY_DEFAULT``).
    """
    if req.non_streaming_mode is not None:
        return req.non_streaming_mode
    if default is not None:
        return default
    return not req.text_input and tts_model_type in NON_STREAMING_BY_DEFAULT


def talker_frames(max_new_tokens: int) -> int:
    """Most frames a request with this ``max_new_tokens`` gets: ``max_new_tokens - 1``, at
    least 1. Upstream's ``generate`` counts codebook-0 samples; the last one's codebooks
    1..15 come from the forward that would feed it, which never runs, so upstream returns
    one frame fewer than ``max_new_tokens`` (and fails on 1, where omnistep gives 1 frame)."""
    return max(1, max_new_tokens - 1)


@dataclass(frozen=True)
class Qwen3TTSVoice:
    """What the frontend decided for a request: the speaker (CustomVoice) or None, the
    language name, the tokenised instruction (or None), and for a cloned voice (Base) its
    prompt rows and its transcript's ids (``prompt.ref_text`` tokenised, sliced
    ``[ROLE_IDS:-REF_TAIL_IDS]``)."""

    speaker: str | None
    language: str
    instruct_ids: tuple[int, ...] | None
    clone: CloneRows | None = None
    ref_ids: tuple[int, ...] = ()


class TextTrack:
    """The request's text as talker ids, read lazily from its ``TEXT_INPUT_SLOT`` channel.

    ``first``: the utterance's first text id once final (None before). ``non_streaming``: the
    request's layout (``text_layout``). As a channel of decode step ids (``len``, ``[k]``,
    ``closed``; what ``Qwen3TTSTalkerLoop`` reads): streaming layout: ``head``, then the text
    ids from ``skip`` on as they become final, then ``tts_eos``, closed once the text ended
    (``skip`` 1 and no head, unless ``configure`` set the prompt's); non-streaming layout (or
    a cloned voice's prompt holding the whole text): empty, closed once the text ended (the
    prompt holds it all).
    """

    def __init__(self, source: Channel, backend: Any, eos_id: int, non_streaming: bool):
        self.source = source
        self.tokenizer = IncrementalTokenizer(backend)
        self.eos_id = eos_id
        self.non_streaming = non_streaming
        self.streaming = not non_streaming
        self.skip = 1
        self.head: tuple[int, ...] = ()
        self.ids: list[int] = []  # every final text id
        self._read = 0

    def configure(self, parts: TalkerPromptParts) -> None:
        """Follow the built prompt: the text ids it holds are not fed again."""
        self.streaming = parts.streams_text
        self.skip = parts.consumed
        self.head = parts.head

    def pull(self) -> None:
        """Tokenise the text pieces that arrived since the last call."""
        while self._read < len(self.source):
            self.ids += self.tokenizer.feed(self.source[self._read])
            self._read += 1
        if self.source.closed and not self.tokenizer.finished:
            self.ids += self.tokenizer.finish()

    @property
    def ended(self) -> bool:
        """The text is complete (every id is final)."""
        self.pull()
        return self.tokenizer.finished

    @property
    def closed(self) -> bool:
        return self.ended

    @property
    def first(self) -> int | None:
        self.pull()
        return self.ids[0] if self.ids else None

    def _items(self) -> list[int]:
        if not self.streaming:
            return []
        eos = [self.eos_id] if self.ended and self.ids else []
        return [*self.head, *self.ids[self.skip :], *eos]

    def __len__(self) -> int:
        self.pull()
        return len(self._items())

    def __getitem__(self, index: int) -> int:
        self.pull()
        return self._items()[index]


class TalkerTextLoop(Qwen3TTSTalkerLoop):
    """The talker loop of the card: each request's layout is ``text_layout``'s; its prompt is
    built once the text allows (streaming layout: the first word is final, or with a cloned
    voice ``clone_text_needed`` ids, or the text ended; non-streaming: the text ended), its
    text track is the request's ``TEXT_INPUT_SLOT`` through ``TextTrack``, and it makes at
    most ``talker_frames(max_new_tokens)`` frames."""

    def __init__(
        self,
        config: ARDecodeConfig,
        qwen: Qwen3TTSConfig,
        tokenizer: Any,
        role_ids: Sequence[int],
        non_streaming: bool | None = None,
    ):
        super().__init__(config, track_slot=TEXT_INPUT_SLOT, pad_id=qwen.ids.tts_pad)
        self.qwen = qwen
        self.backend = tokenizer.backend_tokenizer
        self.role_ids = tuple(role_ids)
        self.non_streaming = non_streaming

    def init(self, req: Request, model: ModelInstance, ctx: ProgramContext) -> Qwen3TTSTalkerState:
        state = super().init(req, model, ctx)
        state.max_new_tokens = talker_frames(state.max_new_tokens)
        state.track = TextTrack(  # type: ignore[assignment]
            ctx.slots[TEXT_INPUT_SLOT],
            self.backend,
            self.qwen.ids.tts_eos,
            text_layout(req, self.qwen.tts_model_type, self.non_streaming),
        )
        return state

    def next(self, state: Qwen3TTSTalkerState) -> WorkPlan | Done | Pending:
        if isinstance(state.prompt, Qwen3TTSVoice):
            track: TextTrack = state.track  # type: ignore[assignment]
            voice = state.prompt
            ended = track.ended
            if track.non_streaming:
                ready = ended
            elif voice.clone is not None:
                ready = ended or len(track.ids) >= clone_text_needed(voice.clone, voice.ref_ids)
            else:
                ready = track.first is not None
            if not ready:
                if ended:
                    raise InvalidRequestError("the input text is empty", param="input")
                return Pending("waiting for the text")
            if not track.ids:
                raise InvalidRequestError("the input text is empty", param="input")
            whole = track.non_streaming or voice.clone is not None
            text = track.ids if whole else track.ids[:1]
            parts = build_prompt(
                self.qwen,
                [*self.role_ids, *text, *([0] * TAIL_IDS)],
                voice.speaker,
                voice.language,
                voice.instruct_ids,
                non_streaming=track.non_streaming,
                clone=voice.clone,
                ref_ids=voice.ref_ids,
                text_complete=ended,
            )
            track.configure(parts)
            state.prompt = parts.prompt
        return super().next(state)


class _Frontend:
    """The ``frontend`` kernel node: voice, language and instructions, checked at submission;
    binds ``voice`` (a ``Qwen3TTSVoice``) and ``codec_prefix`` (a cloned voice's reference
    codes as a ``CodecPrefix``, else None)."""

    def __init__(self, config: Qwen3TTSConfig, tokenizer: Any):
        self.config = config
        self.tokenizer = tokenizer
        speakers = sorted(config.spk_id)
        self.default_speaker = next((s for s in DEFAULT_SPEAKERS if s in config.spk_id), None)
        if self.default_speaker is None and speakers:
            self.default_speaker = speakers[0]
        self.clones = config.tts_model_type == "base"
        self._parse_clone = functools.lru_cache(maxsize=CLONE_CACHE_SIZE)(self._clone_of_spec)

    def _clone_of_spec(self, spec: str) -> tuple[CloneRows, tuple[int, ...], CodecPrefix]:
        """A cloned voice's prompt rows, transcript ids and codec prefix from its spec.

        Raises:
            InvalidRequestError: param "voice": not a spec, a damaged one, or one made with a
                checkpoint of other sizes.
        """
        try:
            prompt = VoiceClonePrompt.from_spec(spec)
        except InvalidRequestError:
            raise InvalidRequestError(
                f"unknown voice '{spec[:64]}': this Qwen3-TTS Base model speaks only in cloned "
                "voices; create one with POST /v1/audio/voices (a reference clip and its "
                "transcript) and name it",
                param="voice",
                code="unknown_voice",
            ) from None
        talker = self.config.talker
        codebook = min(
            talker.code_predictor.vocab_size, self.config.speech_tokenizer.decoder.codebook_size
        )
        prompt.check_fits(talker.hidden_size, talker.num_code_groups, codebook)
        if prompt.num_frames < 1:
            raise InvalidRequestError("this cloned voice has no reference frames", param="voice")
        ids = self.tokenizer.encode(ref_text(prompt.ref_text), add_special_tokens=False)
        ref_ids = tuple(int(i) for i in ids[ROLE_IDS:-REF_TAIL_IDS])
        if not ref_ids:
            raise InvalidRequestError("this cloned voice has an empty transcript", param="voice")
        rows = CloneRows(prompt.speaker_embedding, prompt.ref_codes)
        return rows, ref_ids, CodecPrefix(torch.from_numpy(prompt.ref_codes.copy()))

    def clone(self, voice: str | None) -> tuple[CloneRows, tuple[int, ...], CodecPrefix]:
        """A Base request's cloned voice (see ``_clone_of_spec``; parsed specs are cached).

        Raises:
            InvalidRequestError: no voice (code ``missing_required_parameter``), or a voice
                that is not a cloned voice of this model.
        """
        if not voice:
            raise InvalidRequestError(
                "this Qwen3-TTS Base model speaks only in cloned voices: create one with "
                "POST /v1/audio/voices (multipart: name, model, audio_sample, transcript) and "
                "name it in 'voice', or send the clip with the request as 'ref_audio' and its "
                "transcript as 'ref_text'",
                param="voice",
                code="missing_required_parameter",
            )
        return self._parse_clone(voice)

    def speaker(self, voice: str | None) -> str | None:
        if self.config.tts_model_type != "custom_voice":
            return None  # VoiceDesign: the instruction is the voice
        if voice is None:
            return self.default_speaker
        if voice in OPENAI_SPEAKERS:
            found = next((s for s in OPENAI_SPEAKERS[voice] if s in self.config.spk_id), None)
            return found or self.default_speaker
        if voice.lower() not in self.config.spk_id:
            known = ", ".join(sorted(self.config.spk_id))
            raise InvalidRequestError(
                f"unknown voice '{voice}'; this model's speakers: {known}; or one of the "
                f"OpenAI names {', '.join(OPENAI_SPEAKERS)}",
                param="voice",
                code="unknown_voice",
            )
        return voice.lower()

    def check_voice(self, voice: str) -> None:
        """The card's ``voice_validator``: raises InvalidRequestError for a voice it rejects
        (Base: anything but a cloned voice's spec that fits this checkpoint)."""
        if self.clones:
            self.clone(voice)
        else:
            self.speaker(voice)

    def instruct_ids(self, req: Request) -> tuple[int, ...] | None:
        instructions = (req.instructions or "").strip()
        kind = self.config.tts_model_type
        if kind == "voice_design" and not instructions:
            raise InvalidRequestError(
                "this Qwen3-TTS VoiceDesign model needs 'instructions' describing the voice",
                param="instructions",
                code="missing_required_parameter",
            )
        if not instructions or kind == "base":
            return None  # upstream's clone path takes no instructions
        if kind == "custom_voice" and self.config.tts_model_size == "0b6":
            return None
        ids = self.tokenizer.encode(instruct_text(instructions), add_special_tokens=False)
        return tuple(int(i) for i in ids)

    def __call__(self, ctx: ProgramContext) -> None:
        req = ctx.request
        language = req.language or "auto"
        if self.clones:
            clone, ref_ids, prefix = self.clone(req.voice)
            voice = Qwen3TTSVoice(None, language, None, clone, ref_ids)
        else:
            voice, prefix = Qwen3TTSVoice(self.speaker(req.voice), language, None), None
        # the prompt layout's checks (speaker, language) now, with a stand-in text id
        build_prompt(self.config, [0] * (ROLE_IDS + 1 + TAIL_IDS), voice.speaker, voice.language)
        ctx.slots["voice"] = dataclasses.replace(voice, instruct_ids=self.instruct_ids(req))
        ctx.slots["codec_prefix"] = prefix


def make_sampling(config: Qwen3TTSConfig):
    """``Request -> Qwen3TTSSampling``: the checkpoint's defaults; the request's sampling
    fields on codebook 0 and its ``subtalker_*`` fields on the code predictor (codebooks
    1..15); greedy in both stages at temperature 0 unless a ``subtalker_temperature`` is
    given. The predictor's log-probs (``processed`` and ``policy``) are those of the row it
    actually sampled with."""

    def build(req: Request) -> Qwen3TTSSampling:
        sp = req.sampling
        greedy = sp.temperature == 0
        base = Qwen3TTSSampling.from_defaults(config, greedy=greedy)
        talker = base.talker
        updates = {
            name: getattr(sp, name)
            for name in ("top_p", "top_k", "repetition_penalty")
            if getattr(sp, name) is not None
        }
        if sp.temperature is not None and not greedy:
            updates["temperature"] = sp.temperature
        if sp.min_new_tokens is not None:
            updates["min_new_tokens"] = max(sp.min_new_tokens, talker.min_new_tokens)
        sub = {
            field: getattr(sp, f"subtalker_{field}")
            for field in ("temperature", "top_p", "top_k")
            if getattr(sp, f"subtalker_{field}") is not None
        }
        return dataclasses.replace(
            base,
            talker=dataclasses.replace(talker, **updates),
            predictor=dataclasses.replace(base.predictor, **sub),
        )

    return build


def _enroll(model: ModelInstance, audio: Any, sample_rate: int, transcript: str) -> str:
    """The Base card's ``voice_enroller``: the ``encoder`` component's ``enroll`` (a clone
    spec), through ``call_component`` (so also when the component is a remote actor)."""
    return call_component(model.components["encoder"], "enroll", audio, sample_rate, transcript)


def _forget(frontend: _Frontend):
    """The Base card's ``voice_forgetter``: drop the talker's kept prompt prefixes of the
    deleted voice (``PagedARModel`` keeps a cloned voice's rows for the requests that use it;
    they would otherwise age out of its LRU). A spec the card cannot read is ignored."""

    def forget(model: ModelInstance, spec: str) -> None:
        try:
            rows, _, _ = frontend.clone(spec)
        except InvalidRequestError:
            return
        call_component(model.components["talker"], "drop_voice", rows.key)

    return forget


def _usage(tokenizer: Any):
    """The ``usage`` node: input text ids and output frames."""

    def usage(ctx: ProgramContext) -> None:
        text = "".join(ctx.slots[TEXT_INPUT_SLOT][:])
        ctx.usage["input_tokens"] = len(tokenizer.encode(text, add_special_tokens=False))
        ctx.usage["output_tokens"] = len(ctx.slots["codes"])

    return usage


def build_card(
    path: str | None = None, options: Qwen3TTSOptions | None = None, **overrides
) -> ModelCard:
    """The Qwen3-TTS card on a published folder ``path`` (CustomVoice, VoiceDesign or Base).

    Raises:
        InvalidRequestError: no path given.
        Qwen3TTSCheckpointError: a missing or malformed file (named).
    """
    if path is None:
        raise InvalidRequestError(
            "the qwen3_tts family needs weights: --model qwen3_tts=/path/to/Qwen3-TTS-12Hz-...",
            param="model",
        )
    opts = options or Qwen3TTSOptions(**overrides)
    checkpoint = Qwen3TTSCheckpoint.open(path)
    config = checkpoint.config
    if config.tts_model_type not in SERVED_VARIANTS:
        raise InvalidRequestError(
            f"{path}: Qwen3-TTS '{config.tts_model_type}' folders are not served; use a "
            f"{', '.join(SERVED_VARIANTS)} folder",
            param="model",
        )
    base = config.tts_model_type == "base"
    tokenizer = checkpoint.tokenizer()
    role_ids = tokenizer.encode("<|im_start|>assistant\n", add_special_tokens=False)
    if len(role_ids) != ROLE_IDS:
        raise InvalidRequestError(
            f"{path}: the tokenizer splits '<|im_start|>assistant\\n' into {len(role_ids)} ids, "
            f"not {ROLE_IDS}",
            param="model",
        )
    frontend = _Frontend(config, tokenizer)
    decoder_config = CodecDecoderConfig.of(config.speech_tokenizer.decoder)
    sample_rate = config.speech_tokenizer.output_sample_rate

    def build_talker(device: str) -> Qwen3TTSTalker:
        check_device(device)
        talker_config = config.talker
        kv = opts.kv_config(
            talker_config.num_hidden_layers,
            talker_config.num_key_value_heads,
            talker_config.head_dim,
        )
        return Qwen3TTSTalker.from_checkpoint(
            checkpoint, kv, device, opts.dtype, opts.batch_invariant
        )

    def build_codec(device: str) -> CodecDecoderComponent:
        check_device(device)
        decoder = codec_from_checkpoint(checkpoint, device, opts.dtype)
        return CodecDecoderComponent(decoder, opts.batch_invariant)

    def build_encoder(device: str) -> VoiceCloneComponent:
        check_device(device)
        return VoiceCloneComponent(
            VoiceCloneEncoder.from_checkpoint(checkpoint, device, opts.dtype)
        )

    decode = ARDecodeConfig(
        loop_id="decode",
        component="talker",
        prompt_slot="voice",
        make_sampling=make_sampling(config),
        max_new_tokens=opts.max_new_tokens or config.generation.max_new_tokens,
        eos_token_ids=(config.ids.codec_eos,),
        eos_codebooks=(0,),
        stream_slot="codes_stream",
        penalty_window=0,
    )
    vocode = codec_decode_config(
        decoder_config,
        loop_id="vocode",
        component="codec",
        in_slot="codes_stream",
        first_chunk=opts.first_chunk,
        chunk=opts.chunk,
        chunk_growth=opts.chunk_growth,
        max_chunk=opts.max_chunk,
        bucket_frames=opts.bucket_frames,
        sample_rate=sample_rate,
        extras_slot="codec_prefix",
        stream_state=opts.codec_stream_state,
    )
    program = Program(
        inputs=("request", TEXT_INPUT_SLOT),
        nodes=(
            KernelNode("frontend", frontend, needs=("request",), binds=("voice", "codec_prefix")),
            LoopNode(
                "decode",
                "decode",
                needs=("voice", TEXT_INPUT_SLOT),
                binds="codes",
                streams=("codes_stream",),
            ),
            LoopNode("vocode", "vocode", needs=("codes_stream", "codec_prefix"), binds="samples"),
            KernelNode("usage", _usage(tokenizer), needs=("codes", "samples")),
        ),
    )
    voices = tuple(sorted(config.spk_id)) if config.tts_model_type == "custom_voice" else ()
    components = (
        ComponentSpec("talker", build_talker, opts.max_batch_size, "talker + code predictor"),
        ComponentSpec("codec", build_codec, opts.max_batch_size, "12 Hz codec decoder"),
    )
    capabilities = {Capability.TEXT_TO_SPEECH, Capability.STREAMING_TEXT_INPUT}
    if base:
        components += (
            ComponentSpec("encoder", build_encoder, 1, "speaker + speech-tokenizer encoders"),
        )
        capabilities.add(Capability.VOICE_CLONING)
    if config.tts_model_type == "voice_design":
        capabilities.add(Capability.VOICE_DESIGN)
    return ModelCard(
        card_id=CARD_ID,
        family="qwen3_tts",
        components=components,
        loops=(
            LoopSpec(
                "decode",
                LoopKind.AR_DECODE,
                (WorkUnitKind.PREFILL, WorkUnitKind.AR_TOKEN),
                ("talker",),
                lambda: TalkerTextLoop(
                    decode, config, tokenizer, role_ids, opts.non_streaming_text
                ),
            ),
            LoopSpec(
                "vocode",
                LoopKind.AUDIO_DECODE,
                (WorkUnitKind.AUDIO_CHUNK,),
                ("codec",),
                lambda: AudioDecodeLoop(vocode),
            ),
        ),
        program=program,
        first_audio_alone=opts.first_audio_alone,
        capabilities=frozenset(capabilities),
        sample_rate=sample_rate,
        voices=voices + tuple(v for v in OPENAI_VOICES if v in OPENAI_SPEAKERS and voices),
        default_voice=frontend.default_speaker,
        voice_validator=frontend.check_voice,
        voice_enroller=_enroll if base else None,
        voice_forgetter=_forget(frontend) if base else None,
        parity=frozenset({"C0", "C1", "C2", "C3", "stream", "reference"}),
        description=f"Qwen3-TTS 12Hz {config.tts_model_type} ({config.tts_model_size}): talker "
        "+ code predictor -> causal codec decoder, 24 kHz; text streams into running requests.",
    )
