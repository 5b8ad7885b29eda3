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

This module declares the card only: ``frontend`` (voices), ``text_loop`` (the talker loop with
its text track), ``talker``, ``codec``, ``clone``, ``prompt``, ``loader``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from omnistep.core import (
    OPENAI_VOICES,
    TEXT_INPUT_SLOT,
    Capability,
    ComponentSpec,
    InvalidRequestError,
    KernelNode,
    LoopNode,
    ModelCard,
    ModelInstance,
    Program,
    ProgramContext,
    Request,
    call_component,
)
from omnistep.layers.codec_decoder import CodecDecoderConfig
from omnistep.layers.device import check_device
from omnistep.loops.ar_decode import ARDecodeConfig
from omnistep.models.qwen3_tts.clone import VoiceCloneComponent, VoiceCloneEncoder
from omnistep.models.qwen3_tts.codec import (
    CodecDecoderComponent,
    codec_decode_config,
    codec_from_checkpoint,
)
from omnistep.models.qwen3_tts.frontend import OPENAI_SPEAKERS, Qwen3TTSFrontend
from omnistep.models.qwen3_tts.loader import Qwen3TTSCheckpoint, Qwen3TTSConfig
from omnistep.models.qwen3_tts.prompt import ROLE_IDS
from omnistep.models.qwen3_tts.talker import Qwen3TTSSampling, Qwen3TTSTalker
from omnistep.models.qwen3_tts.text_loop import TalkerTextLoop
from omnistep.runners.card_parts import (
    ar_decode_loop,
    audio_decode_loop,
    component_enroller,
    require_weights,
)
from omnistep.runners.options import ServingOptions

CARD_ID = "qwen3-tts"
SERVED_VARIANTS = ("custom_voice", "voice_design", "base")


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


def _forget(frontend: Qwen3TTSFrontend):
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
    path = require_weights("qwen3_tts", path, "/path/to/Qwen3-TTS-12Hz-...")
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
    frontend = Qwen3TTSFrontend(config, tokenizer)
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
        return CodecDecoderComponent(decoder, opts.batch_invariant, "the Qwen3-TTS codec decoder")

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
            ar_decode_loop(
                decode,
                lambda c: TalkerTextLoop(c, config, tokenizer, role_ids, opts.non_streaming_text),
            ),
            audio_decode_loop(vocode),
        ),
        program=program,
        first_audio_alone=opts.first_audio_alone,
        capabilities=frozenset(capabilities),
        sample_rate=sample_rate,
        voices=voices + tuple(v for v in OPENAI_VOICES if v in OPENAI_SPEAKERS and voices),
        default_voice=frontend.default_speaker,
        voice_validator=frontend.check_voice,
        voice_enroller=component_enroller("encoder") if base else None,
        voice_forgetter=_forget(frontend) if base else None,
        parity=frozenset({"C0", "C1", "C2", "C3", "stream", "reference"}),
        description=f"Qwen3-TTS 12Hz {config.tts_model_type} ({config.tts_model_size}): talker "
        "+ code predictor -> causal codec decoder, 24 kHz; text streams into running requests.",
    )
