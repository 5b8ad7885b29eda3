"""The ``qwen3_omni`` card: MoE thinker -> MoE talker with the in-step code predictor ->
code2wav (the causal 12.5 Hz codec decoder), 24 kHz.

Program: ``frontend`` (chat template -> prompt ids, voice -> the talker's speaker id) ->
``think`` (an ARDecodeLoop on the ``thinker``: text deltas streamed as decoded, each sampled id
put on the ``thinker_ids`` channel) and, at the same time, ``talk`` (the ``TalkerLoop`` on the
``talker``: its prefill waits for the reply's first token, each later step for the next one,
so speech frames come while the thinker is still writing) -> ``vocode`` (an AudioDecodeLoop on
``code2wav``, the runner plane's ``CodecDecoderComponent`` keeping each stream's decoder state:
chunks of new frames, the first chunk the talker's first frame) -> ``usage``. The audio stages
run only when audio output is asked for. For a media prompt the thinker's loop
(``talker_loop.ThinkLoop``) also hands the talker its ``accept_hidden_layer`` states of the
prompt's audio, image and video tokens (``thinker_media``), which the talker's prompt reads
through ``hidden_projection`` (``talker`` module docstring).

Media input (``Capability.AUDIO_INPUT`` and ``TRANSCRIPTION`` when the folder holds
``thinker.audio_tower.*``, ``IMAGE_INPUT`` and ``VIDEO_INPUT`` when it holds
``thinker.visual.*``; ``use_audio_in_video`` interleaves by time): the frontend also binds
the request's media items; ``encode`` (an ``EncodeLoop`` on the ``encoder``, the runner
plane's ``MediaEncoderRunner`` over
``encoders.Qwen3OmniEncoders``: one ENCODE unit per item, batched with other requests' items of
its kind, outputs reused by content hash; only for requests with media) -> ``media_prompt``
(the shared ``runners.media_prompt.MediaPromptNode``: placeholders expanded, encoder rows and
M-RoPE positions, a ``ThinkerPrompt``) -> ``think``.

A checkpoint without a talker (``enable_audio_output`` false: the Thinking and Captioner
variants) is served as text only (``Capability.CHAT_TEXT``, no voices). A thinking checkpoint
(its chat template opens ``<think>`` in the assistant turn: Thinking) streams the reply's text
before ``</think>`` as reasoning (``thinking.ThinkingLoop``: the chat API's
``reasoning_content``, as vLLM returns it). A text-only checkpoint whose template does not
think is the Captioner (``variant``): one audio clip in, its description out, no text prompt
(``CaptionerFrontend``).

Sampling: the thinker's from ``generation_config.json`` under the request's fields (greedy when
the file does not sample, transformers' behaviour); the talker's transformers' ``generate``
defaults (``talker.TALKER_GENERATE_DEFAULTS``), greedy with ``talker_greedy`` (tests). A
request's ``max_tokens`` caps the thinker; the talker's cap is ``talker_max_new_tokens - 1``
frames, as transformers counts (its last codebook-0 sample gets no residual codes).

This module declares the card only: ``frontend``, ``thinker``, ``talker`` and ``talker_loop``,
``loader`` (code2wav through ``layers.codec_decoder``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from omnistep.core import (
    Capability,
    ChatMessage,
    ComponentSpec,
    KernelNode,
    LoopNode,
    MediaItem,
    Modality,
    ModelCard,
    ModelInstance,
    Program,
    Request,
    call_component,
)
from omnistep.layers.codec_decoder import SAMPLE_RATE
from omnistep.layers.device import check_device
from omnistep.loops.ar_decode import ARDecodeConfig, ARDecodeLoop
from omnistep.models.qwen3_omni.audio_encoder import min_audio_samples
from omnistep.models.qwen3_omni.encoders import Qwen3OmniEncoders, read_settings
from omnistep.models.qwen3_omni.frontend import CaptionerFrontend, ChatFrontend, load_tokenizer
from omnistep.models.qwen3_omni.loader import Qwen3OmniCheckpoint
from omnistep.models.qwen3_omni.talker import (
    THINKER_EMBED,
    TalkerIds,
    load_talker,
    talker_sampling,
)
from omnistep.models.qwen3_omni.talker_loop import MEDIA_SLOT, TalkerLoop, ThinkLoop
from omnistep.models.qwen3_omni.thinker import ThinkerTextConfig, load_thinker
from omnistep.models.qwen3_omni.thinking import THINK_END, THINK_START, ThinkingLoop
from omnistep.runners.card_parts import (
    ar_decode_loop,
    audio_decode_loop,
    output_usage,
    require_weights,
)
from omnistep.runners.codec_vocoder import CodecDecoderComponent, codec_decode_config
from omnistep.runners.encoder import MediaEncoderRunner
from omnistep.runners.media_prompt import MediaRules, language_name, media_stages
from omnistep.runners.mrope import MediaTokenIds
from omnistep.runners.options import ServingOptions
from omnistep.sampling.generation import generation_eos_ids, generation_sampling

CARD_ID = "qwen3-omni"
"""The card's alias (and its id where the folder's name cannot be one)."""


def served_id(root: Path) -> str:
    """The model id clients send: the checkpoint folder's name (``Qwen3-Omni-30B-A3B-Instruct``
    for a Hugging Face download), or ``CARD_ID`` when that name has spaces or unprintable
    characters."""
    name = root.name
    ok = 0 < len(name) <= 200 and name.isprintable() and not any(c.isspace() for c in name)
    return name if ok else CARD_ID


@dataclass(frozen=True)
class Qwen3OmniOptions(ServingOptions):
    """Serving options: ``ServingOptions`` (``kv_cache_gb`` for each LM's paged KV cache,
    thinker and talker; batching; dtype) and

    Attributes:
        thinker_max_new_tokens: the thinker's cap (transformers' generate: 1024).
        talker_max_new_tokens: the talker's codebook-0 samples cap (4096), frames one fewer.
        talker_greedy: argmax in both talker stages (transformers' ``talker_do_sample=False``).
        first_chunk, chunk, chunk_growth, max_chunk: code2wav's chunk schedule in frames (1
            frame = 1920 samples = 80 ms; ``codec_decode_config``); the first chunk is the
            talker's first frame.
        first_audio_alone: a request's thinker and talker wait while its first audio chunk is
            made (``ModelCard.first_audio_alone``; EDF only).
        encoder_cache_items: encoder outputs kept by content hash (``MediaEncoderRunner``),
            so a conversation's repeated media is encoded once.
    """

    thinker_max_new_tokens: int = 1024
    talker_max_new_tokens: int = 4096
    talker_greedy: bool = False
    first_chunk: int = 1
    chunk: int = 8
    chunk_growth: float = 2.0
    max_chunk: int = 64
    first_audio_alone: bool = True
    encoder_cache_items: int = 64


ASR_INSTRUCTION = "Transcribe the {language} audio into text."
"""The instruction ``transcription_messages`` puts after the audio (Instruct and Thinking)."""

AUDIO_PREFIX = "thinker.audio_tower."
VISION_PREFIX = "thinker.visual."


def variant(checkpoint: Qwen3OmniCheckpoint, tokenizer: Any) -> str:
    """``instruct`` (a talker: ``enable_audio_output`` true), ``thinking`` (no talker, the
    template opens ``<think>``) or ``captioner`` (no talker, a template that does not think:
    Qwen3-Omni-30B-A3B-Captioner)."""
    if checkpoint.has_talker:
        return "instruct"
    return "thinking" if thinks(tokenizer) else "captioner"


def transcription_messages(
    audio: MediaItem, language: str | None, prompt: str | None
) -> tuple[ChatMessage, ...]:
    """The card's ``transcription_prompt`` (Instruct, Thinking): one user message, the audio
    then ``ASR_INSTRUCTION`` with ``language_name(language)``; ``prompt`` is not used.
    Answered as text only.

    Raises:
        InvalidRequestError: an unknown ``language``.
    """
    del prompt
    instruction = ASR_INSTRUCTION.format(language=language_name(language))
    return (ChatMessage("user", instruction, (audio, instruction)),)


def caption_messages(
    audio: MediaItem, language: str | None, prompt: str | None
) -> tuple[ChatMessage, ...]:
    """The Captioner's ``transcription_prompt``: one user message holding the audio alone (the
    Captioner takes no text prompt; ``language`` and ``prompt`` are not used). Its answer is
    the clip's description."""
    del language, prompt
    return (ChatMessage("user", "", (audio,)),)


def thinks(tokenizer: Any) -> bool:
    """Whether the chat template opens the reasoning in the assistant turn (the Thinking
    checkpoint's does: ``<|im_start|>assistant\\n<think>\\n``)."""
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "x"}], add_generation_prompt=True, tokenize=False
    )
    turn = prompt.rpartition("<|im_start|>assistant")[2]
    return THINK_START in turn and THINK_END not in turn


def _wants_audio(req: Request) -> bool:
    return Modality.AUDIO in req.output_modalities


def build_card(
    path: str | None = None, options: Qwen3OmniOptions | None = None, **overrides: Any
) -> ModelCard:
    """The Qwen3-Omni card on an official checkpoint folder ``path``.

    Raises:
        InvalidRequestError: no path given.
        ModelFilesError: the folder or one of its files is missing or wrong (named).
    """
    path = require_weights("qwen3_omni", path)
    opts = options or Qwen3OmniOptions(**overrides)
    checkpoint = Qwen3OmniCheckpoint.open(path)
    config = checkpoint.config
    tokenizer = load_tokenizer(str(checkpoint.root))
    generation = checkpoint.generation_config()
    audio = checkpoint.has_talker
    ids = TalkerIds.from_config(config) if audio else None
    kind = variant(checkpoint, tokenizer)
    names = checkpoint.tensor_names()
    hears = any(n.startswith(AUDIO_PREFIX) for n in names)
    sees = any(n.startswith(VISION_PREFIX) for n in names)
    settings = read_settings(checkpoint.root)
    media_caps = frozenset(
        ({Capability.AUDIO_INPUT} if hears else set())
        | ({Capability.IMAGE_INPUT, Capability.VIDEO_INPUT} if sees else set())
    )
    audio_end = tokenizer.convert_tokens_to_ids("<|audio_end|>")
    token_ids = dataclasses.replace(
        MediaTokenIds.from_config(config, audio_end=audio_end), interleave="time"
    )
    rules = MediaRules(
        media_caps,
        int(settings["sampling_rate"]),
        float(settings["chunk_length"]),
        min_audio_samples(int(settings["hop_length"]), int(settings["n_fft"])),
        token_ids,
        ThinkerTextConfig.from_dict(config).max_position_embeddings,
    )
    make_frontend = CaptionerFrontend if kind == "captioner" else ChatFrontend
    frontend = make_frontend(tokenizer, ids.speakers if ids else {}, rules)
    merge = int(config["thinker_config"].get("vision_config", {}).get("spatial_merge_size", 2))
    # Weights load only in the builders: the serving process builds the card too. The thinker
    # leaves its embedding here for the talker, which otherwise reads that tensor itself.
    shared_embed: dict[str, torch.Tensor] = {}

    def kv_for(text: ThinkerTextConfig):
        return opts.kv_config(text.num_hidden_layers, text.num_key_value_heads, text.head_dim)

    def build_thinker(device: str):
        check_device(device)
        thinker = load_thinker(
            checkpoint,
            kv_for(ThinkerTextConfig.from_dict(config)),
            device,
            opts.dtype,
            opts.batch_invariant,
        )
        if audio:
            shared_embed["weight"] = thinker.embed_weight
        return thinker

    def build_talker(device: str):
        check_device(device)
        state = checkpoint.tensors("talker.")
        embed = shared_embed.pop("weight", None)
        state[THINKER_EMBED] = (
            embed if embed is not None else checkpoint.tensors(THINKER_EMBED)[THINKER_EMBED]
        )
        kv = kv_for(ThinkerTextConfig.from_dict(config, "talker_config"))
        return load_talker(state, config, kv, device, opts.dtype, opts.batch_invariant)

    def build_encoder(device: str) -> MediaEncoderRunner:
        check_device(device)
        encoders = Qwen3OmniEncoders.from_checkpoint(checkpoint, device=device, dtype=opts.dtype)
        return MediaEncoderRunner(
            encoders.encode_items, opts.batch_invariant, opts.encoder_cache_items
        )

    def build_code2wav(device: str) -> CodecDecoderComponent:
        check_device(device)
        decoder = checkpoint.load_code2wav(device, opts.dtype)
        return CodecDecoderComponent(decoder, opts.batch_invariant, "Qwen3-Omni's code2wav")

    think = ARDecodeConfig(
        loop_id="think",
        component="thinker",
        prompt_slot="thinker_prompt",
        make_sampling=generation_sampling(generation),
        max_new_tokens=opts.thinker_max_new_tokens,
        eos_token_ids=generation_eos_ids(generation, tokenizer),
        stream_slot="thinker_ids",
        detokenize=lambda token_ids: tokenizer.decode(token_ids, skip_special_tokens=True),
    )
    stages = media_stages(
        media_caps,
        build_encoder,
        opts.max_batch_size,
        "audio tower + vision encoder",
        token_ids,
        merge,
        rules.max_prompt_tokens,
    )
    nodes: list[Any] = [
        KernelNode(
            "frontend", frontend, needs=("request",), binds=("chat_ids", "media", "speaker")
        ),
        *stages.nodes,
        LoopNode(
            "think",
            "think",
            needs=("thinker_prompt",),
            binds="text_ids",
            streams=("thinker_ids", MEDIA_SLOT) if audio else ("thinker_ids",),
        ),
    ]
    components = [
        *stages.components,
        ComponentSpec("thinker", build_thinker, opts.max_batch_size, "MoE thinker LM"),
    ]
    think_loop = ThinkingLoop if thinks(tokenizer) else ThinkLoop if audio else ARDecodeLoop
    loops = [
        *stages.loops,
        ar_decode_loop(think, think_loop),
    ]
    capabilities = {Capability.CHAT_TEXT, *media_caps}
    if hears:
        capabilities.add(Capability.TRANSCRIPTION)
    if audio:
        nodes, components, loops = _audio_stages(
            nodes, components, loops, checkpoint, opts, ids, think, build_talker, build_code2wav
        )
        capabilities.add(Capability.CHAT_AUDIO)
    nodes.append(
        KernelNode(
            "usage",
            output_usage("text_ids"),
            needs=("text_ids", *(("codes", "samples") if audio else ())),
        )
    )
    return ModelCard(
        card_id=served_id(checkpoint.root),
        aliases=(CARD_ID,) if served_id(checkpoint.root) != CARD_ID else (),
        family="qwen3_omni",
        components=tuple(components),
        loops=tuple(loops),
        program=Program(inputs=("request",), nodes=tuple(nodes)),
        capabilities=frozenset(capabilities),
        sample_rate=SAMPLE_RATE,
        voices=tuple(ids.speakers) if ids else (),
        default_voice=frontend.default_speaker,
        voice_validator=frontend.speaker_name if audio else None,
        on_weights_updated=_refresh_talker_text_rows if audio else None,
        first_audio_alone=opts.first_audio_alone,
        media_sample_rate=int(settings["sampling_rate"]),
        transcription_prompt=(
            None
            if not hears
            else caption_messages
            if kind == "captioner"
            else transcription_messages
        ),
        parity=frozenset({"C0", "C1", "C3", "reference"}),
        description=DESCRIPTIONS[kind],
    )


DESCRIPTIONS = {
    "instruct": "Qwen3-Omni: MoE thinker -> MoE talker + code predictor -> code2wav, 24 kHz.",
    "thinking": "Qwen3-Omni Thinking (text only: no talker in this checkpoint): MoE thinker.",
    "captioner": "Qwen3-Omni Captioner: one audio clip in, its description out (text).",
}


def _audio_stages(
    nodes, components, loops, checkpoint, opts, ids, think, build_talker, build_code2wav
):
    """The talker and code2wav: their components, loops and program nodes added."""
    max_cap = think.max_new_tokens

    def thinker_cap(req: Request) -> int:
        """The thinker loop's cap for ``req`` (``ARDecodeLoop.init`` with the request's)."""
        return min(req.sampling.max_new_tokens or max_cap, max_cap)

    talk = ARDecodeConfig(
        loop_id="talk",
        component="talker",
        prompt_slot="thinker_prompt",
        make_sampling=lambda req: talker_sampling(
            ids.codec_eos, opts.talker_greedy, opts.talker_max_new_tokens
        ),
        max_new_tokens=max(1, opts.talker_max_new_tokens - 1),
        eos_token_ids=(ids.codec_eos,),
        eos_codebooks=(0,),
        stream_slot="codes_stream",
        penalty_window=0,
        seed_offset=1,
        honor_request_cap=False,
    )
    vocode = codec_decode_config(
        checkpoint.code2wav_config(),
        loop_id="vocode",
        component="code2wav",
        in_slot="codes_stream",
        first_chunk=opts.first_chunk,
        chunk=opts.chunk,
        chunk_growth=opts.chunk_growth,
        max_chunk=opts.max_chunk,
    )
    nodes = [
        *nodes,
        LoopNode(
            "talk",
            "talk",
            needs=("thinker_prompt", "thinker_ids", MEDIA_SLOT, "speaker"),
            binds="codes",
            streams=("codes_stream",),
            when=_wants_audio,
        ),
        LoopNode("vocode", "vocode", needs=("codes_stream",), binds="samples", when=_wants_audio),
    ]
    components = [
        *components,
        ComponentSpec("talker", build_talker, opts.max_batch_size, "MoE talker + code predictor"),
        ComponentSpec("code2wav", build_code2wav, opts.max_batch_size, "code2wav (causal codec)"),
    ]
    loops = [
        *loops,
        ar_decode_loop(talk, lambda c: TalkerLoop(c, ids, thinker_cap)),
        audio_decode_loop(vocode),
    ]
    return nodes, components, loops


def _refresh_talker_text_rows(model: ModelInstance, tensors: Mapping[str, Any]) -> None:
    """After a weight update: the talker keeps a copy of the thinker's embeddings (its text
    rows); copy them again when those changed."""
    embed = tensors.get(THINKER_EMBED)
    if embed is not None:
        call_component(model.components["talker"], "refresh_text_embeds", embed)
