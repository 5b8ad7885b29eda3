"""The ``qwen2_5_omni`` card: thinker -> talker -> token2wav (DiT ODE + BigVGAN).

Program: ``frontend`` (chat template -> prompt ids, voice -> speaker, the request's media
items) -> ``encode`` (an ``EncodeLoop`` on the ``encoder``, a ``MediaEncoderRunner`` over the
audio tower and vision encoder: one ENCODE unit per item, batched with other requests' items
of its kind, outputs reused by content hash; only for requests with media) -> ``media_prompt``
(placeholders expanded, encoder rows and TMRoPE positions: a ``ThinkerPrompt``; text-only
prompts stay token ids) -> ``think`` (an
ARDecodeLoop on the ``thinker``: text deltas are streamed as decoded, and every step's talker
conditioning row goes on the ``thinker_rows`` Channel) and, at the same time, ``talk`` (the
``TalkerLoop`` on the ``talker``: it starts as soon as the thinker has streamed its prompt rows
and first reply row, and each later step waits only for the next row, so speech codes are
produced while the thinker is still writing) -> ``denoise`` (a DenoiseLoop on the ``dit``:
once the talker is done, every ODE step of the flow-matching solver is one DENOISE_STEP unit,
batched with other requests' steps; the initial noise comes from the request's seed, as
upstream's ``torch.manual_seed`` draw) -> ``vocode`` (an AudioDecodeLoop on ``bigvgan``: mel
chunks with the vocoder's full receptive field on each side, streamed) -> ``usage``. The audio
stages run only when audio output is asked for. The DiT runs whole-utterance (its block
attention, iterated over the ODE, spreads every code over every frame, so chunked DiT output
would not equal the whole decode); streaming starts at the vocoder.

Voices: the checkpoint's speakers (``spk_dict.pt``: Chelsie, Ethan); OpenAI voice names are
accepted and map to the first speaker (Chelsie). Thinker sampling defaults come from
``generation_config.json`` (greedy when it does not sample); the talker's are transformers'
``generate`` defaults (temperature 0.9, top_k 40, top_p 0.8, repetition penalty 1.05).

Media inputs (``Capability.AUDIO_INPUT``, ``IMAGE_INPUT``, ``VIDEO_INPUT``) are declared when
the folder holds both towers (``thinker.audio_tower.*`` and ``thinker.visual.*``); the
encoder then is a component of its own, and the card transcribes (``Capability.TRANSCRIPTION``:
``transcription_messages``, Qwen's ASR cookbook chat, answered by the thinker alone). A video's
audio track is not used
(``use_audio_in_video`` False).

This module declares the card only: ``frontend`` (kernel node, tokenizer), ``encoders`` and
``media_prompt`` (media), ``thinker``,
``talker`` and ``talker_loop``, ``dit`` and ``dit_component`` (the DENOISE_STEP component),
``bigvgan`` (run by the runner plane's ``ChunkVocoder``), ``loader``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
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
    ModelFilesError,
    ModelInstance,
    Program,
    Request,
    call_component,
)
from omnistep.kv import KVCacheConfig
from omnistep.layers.device import check_device
from omnistep.loops import AudioDecodeConfig
from omnistep.loops.ar_decode import ARDecodeConfig
from omnistep.loops.denoise import DenoiseConfig, whole_utterance
from omnistep.models.qwen2_5_omni.audio_encoder import min_audio_samples
from omnistep.models.qwen2_5_omni.dit import DiTChunking, DiTConfig
from omnistep.models.qwen2_5_omni.dit_component import DIT_PREFIX, DiTComponent, token2wav_starts
from omnistep.models.qwen2_5_omni.encoders import OmniEncoders
from omnistep.models.qwen2_5_omni.frontend import ChatFrontend, load_tokenizer
from omnistep.models.qwen2_5_omni.loader import QwenOmniFiles
from omnistep.models.qwen2_5_omni.talker import TALKER_GENERATE_DEFAULTS, load_talker
from omnistep.models.qwen2_5_omni.talker_loop import TalkerLoop
from omnistep.models.qwen2_5_omni.thinker import ENCODER_PREFIXES, load_thinker
from omnistep.models.qwen2_5_omni.token2wav import load_token2wav_part
from omnistep.runners.card_parts import (
    ar_decode_loop,
    audio_decode_loop,
    denoise_loop,
    output_usage,
    require_weights,
)
from omnistep.runners.encoder import MediaEncoderRunner
from omnistep.runners.media_features import read_preprocessor
from omnistep.runners.media_prompt import MediaRules, language_name, media_stages
from omnistep.runners.mrope import MediaTokenIds
from omnistep.runners.options import ServingOptions
from omnistep.runners.vocoder import ChunkVocoder
from omnistep.sampling import SamplingRow
from omnistep.sampling.generation import generation_eos_ids, generation_sampling

CARD_ID = "qwen2.5-omni"


@dataclass(frozen=True)
class QwenOmniOptions(ServingOptions):
    """Serving options: ``ServingOptions`` (``kv_cache_gb`` for each LM's paged KV cache,
    thinker and talker; batching; dtype) and

    Attributes:
        thinker_max_new_tokens, talker_max_new_tokens: caps (transformers' generate: 4096).
        first_chunk, chunk: BigVGAN chunk sizes in mel frames (240 samples each); a chunk of
            None follows the DiT's (its chunk's frames, 144 by default; 300 frames with the
            whole-utterance DiT), so each DiT chunk is voiced as it lands (a larger vocoder
            chunk would stall playback until enough DiT chunks piled up).
        vocoder_context: mel frames of context on each side of a BigVGAN chunk (its receptive
            field is 34 frames each side for the official geometry).
        dit_chunking: the DiT's chunk schedule (``DiTChunking``: chunk sizes, left context
            and look-ahead in DiT blocks; a first chunk of None holds BigVGAN's first chunk
            and its context, ``first_chunk + vocoder_context`` frames); None denoises the whole
            utterance once the talker is done (upstream's offline ``token2wav``).
        talker_sampling: fixed talker sampling settings (None: transformers' defaults; tests
            use greedy).
        first_audio_alone: a request's thinker and talker wait while its first audio chunk is
            being made (``ModelCard.first_audio_alone``; EDF scheduling only).
        encoder_cache_items: encoder outputs kept by content hash (``MediaEncoderRunner``),
            so a conversation's repeated media is encoded once.
    """

    thinker_max_new_tokens: int = 1024
    talker_max_new_tokens: int = 4096
    talker_sampling: SamplingRow | None = None
    first_chunk: int = 20
    chunk: int | None = None
    vocoder_context: int = 34
    dit_chunking: DiTChunking | None = field(default_factory=DiTChunking)
    first_audio_alone: bool = True
    encoder_cache_items: int = 64


MEDIA_CAPABILITIES = {
    "thinker.audio_tower.": (Capability.AUDIO_INPUT,),
    "thinker.visual.": (Capability.IMAGE_INPUT, Capability.VIDEO_INPUT),
}
"""The media inputs a folder's towers give, by tensor name prefix."""


SPEECH_SYSTEM_PROMPT = (
    "You are Qwen, a virtual human developed by the Qwen Team, Alibaba Group, capable of "
    "perceiving auditory and visual inputs, as well as generating text and speech."
)
"""The system prompt the official model card requires for spoken answers (its README and
``assets.QWEN_SPEECH_SYSTEM_PROMPT``; transformers only warns without it). Realtime sessions
lead with it (``ModelCard.speech_system_prompt``); chat requests are left as sent."""

ASR_SYSTEM_PROMPT = "You are a speech recognition model."
"""The system prompt of Qwen's ASR cookbook (``universal_audio_understanding.ipynb``)."""

ASR_INSTRUCTION = "Transcribe the {language} audio into text without any punctuation marks."
"""The cookbook's ASR instruction; ``{language}``: the language's English name."""


def transcription_messages(
    audio: MediaItem, language: str | None, prompt: str | None
) -> tuple[ChatMessage, ...]:
    """The card's ``transcription_prompt``: the layout of Qwen's ASR cookbook
    (``QwenLM/Qwen2.5-Omni`` ``cookbooks/universal_audio_understanding.ipynb``): the system
    message ``ASR_SYSTEM_PROMPT``, then a user message whose parts are the instruction
    (``ASR_INSTRUCTION`` with ``language_name(language)``) then the audio. ``prompt`` is not
    used (the cookbook has no place for it). Answered as text only (no talker).

    Raises:
        InvalidRequestError: an unknown ``language`` (``language_name``).
    """
    del prompt  # the cookbook's chat has no slot for a vocabulary prompt
    instruction = ASR_INSTRUCTION.format(language=language_name(language))
    return (
        ChatMessage("system", ASR_SYSTEM_PROMPT),
        ChatMessage("user", instruction, (instruction, audio)),
    )


def media_capabilities(files: QwenOmniFiles) -> frozenset[Capability]:
    """The media input capabilities of a folder: all three when it holds both towers (the
    encoder component loads both), else none."""
    names = files.tensor_names()
    present = [any(n.startswith(prefix) for n in names) for prefix in MEDIA_CAPABILITIES]
    if not all(present):
        return frozenset()
    return frozenset(c for caps in MEDIA_CAPABILITIES.values() for c in caps)


def talker_sampling(req: Request) -> SamplingRow:
    """transformers' talker ``generate`` defaults (the request's fields drive the thinker)."""
    d = TALKER_GENERATE_DEFAULTS
    return SamplingRow(
        temperature=d.temperature,
        top_p=d.top_p,
        top_k=d.top_k,
        repetition_penalty=d.repetition_penalty,
        min_keep=1,
    )


def build_card(
    path: str | None = None, options: QwenOmniOptions | None = None, **overrides: Any
) -> ModelCard:
    """The Qwen2.5-Omni card on an official checkpoint folder ``path``.

    Raises:
        InvalidRequestError: no path given.
        ModelFilesError: the folder or one of its files is missing (named, with the layout).
    """
    path = require_weights("qwen2_5_omni", path)
    opts = options or QwenOmniOptions(**overrides)
    files = QwenOmniFiles.locate(path)
    config = files.config()
    speakers = files.speakers()
    tokenizer = load_tokenizer(str(files.root))
    # Weights load only in the builders below: the serving process builds the card too (and,
    # with the Ray executor, builds no component). The thinker leaves its embedding here for
    # the talker, which otherwise reads that one tensor itself.
    thinker_embed: dict[str, torch.Tensor | None] = {}
    talker_cfg = config["talker_config"]
    text = config["thinker_config"].get("text_config", config["thinker_config"])
    eos_ids = generation_eos_ids(files.generation_config(), tokenizer)
    media_caps = media_capabilities(files)
    preprocessor = read_preprocessor(files.root)

    def kv_for(cfg: dict[str, Any]) -> KVCacheConfig:
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        num_kv_heads = cfg.get("num_key_value_heads", cfg["num_attention_heads"])
        return opts.kv_config(cfg["num_hidden_layers"], num_kv_heads, head_dim)

    def build_thinker(device: str):
        check_device(device)
        state = files.tensors("thinker.")
        state = {k: v for k, v in state.items() if not k.startswith(ENCODER_PREFIXES)}
        thinker_embed["weight"] = state.get("model.embed_tokens.weight")
        return load_thinker(state, config, kv_for(text), device, opts.dtype, opts.batch_invariant)

    def build_encoder(device: str) -> MediaEncoderRunner:
        check_device(device)
        encoders = OmniEncoders.from_folder(files.root, device=device, dtype=opts.dtype)
        return MediaEncoderRunner(
            encoders.encode_items, opts.batch_invariant, opts.encoder_cache_items
        )

    # Each half of token2wav reads only its own tensors, so a process that builds one of
    # them (a Ray actor) holds only its weights.
    def build_dit(device: str) -> DiTComponent:
        check_device(device)
        state = files.tensors(DIT_PREFIX)
        dit = load_token2wav_part("dit", state, config, device)
        return DiTComponent(dit, opts.batch_invariant)

    def build_bigvgan(device: str) -> ChunkVocoder:
        check_device(device)
        state = files.tensors("token2wav.code2wav_bigvgan_model.")
        bigvgan = load_token2wav_part("bigvgan", state, config, device)
        return ChunkVocoder(bigvgan, "BigVGAN", opts.batch_invariant, channels_first=True)

    dit_config = DiTConfig.from_dict(config["token2wav_config"].get("dit_config") or {})
    vocoder_chunk = opts.chunk
    if opts.dit_chunking is None:
        next_window = whole_utterance
        vocoder_chunk = vocoder_chunk or 300
    else:
        if dit_config.block_size % dit_config.repeats:
            raise ModelFilesError(
                f"token2wav dit_config.block_size ({dit_config.block_size}) must be a multiple "
                f"of repeats ({dit_config.repeats}) to stream the DiT in chunks"
            )

        chunking = opts.dit_chunking.covering(
            opts.first_chunk + opts.vocoder_context, dit_config.block_size
        )
        vocoder_chunk = vocoder_chunk or chunking.chunk_blocks * dit_config.block_size  # set

        def next_window(out_start: int, available: int, complete: bool):
            return chunking.next_window(out_start, available, complete, dit_config.block_size)

    def build_talker(device: str):
        check_device(device)
        if "weight" in thinker_embed:
            embed = thinker_embed.pop("weight")
        else:
            embed = files.tensors("thinker.model.embed_tokens.").get("weight")
        bos_ids = [int(s["bos_token"]) for s in speakers.values()]
        return load_talker(
            files.tensors("talker."),
            config,
            kv_for(talker_cfg),
            embed,
            device,
            opts.dtype,
            bos_ids,
            opts.batch_invariant,
        )

    think = ARDecodeConfig(
        loop_id="think",
        component="thinker",
        prompt_slot="thinker_prompt",
        make_sampling=generation_sampling(files.generation_config()),
        max_new_tokens=opts.thinker_max_new_tokens,
        eos_token_ids=eos_ids,
        stream_slot="thinker_rows",
        stream_hidden=True,
        stream_on_eos=True,
        detokenize=lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
    )
    talk = ARDecodeConfig(
        loop_id="talk",
        component="talker",
        prompt_slot="thinker_prompt",
        make_sampling=(
            talker_sampling if opts.talker_sampling is None else lambda req: opts.talker_sampling
        ),
        max_new_tokens=opts.talker_max_new_tokens,
        eos_token_ids=(
            int(talker_cfg["tts_codec_end_token_id"]),
            int(talker_cfg["tts_codec_pad_token_id"]),
        ),
        stream_slot="codec_stream",
        seed_offset=1,
        honor_request_cap=False,
    )
    denoise = DenoiseConfig(
        loop_id="denoise",
        component="dit",
        in_slot="codec_stream",
        stream_slot="mel_stream",
        make_start=token2wav_starts(dit_config.repeats, dit_config.mel_dim),
        frames_per_item=dit_config.repeats,
        next_window=next_window,
    )
    vocode = AudioDecodeConfig(
        loop_id="vocode",
        component="bigvgan",
        in_slot="mel_stream",
        sample_rate=24000,
        first_chunk=opts.first_chunk,
        chunk=vocoder_chunk,
        left_context=opts.vocoder_context,
        lookahead=opts.vocoder_context,
        report_frames=True,  # else it waits behind thinker and talker steps (EDF)
    )
    wants_audio = lambda req: Modality.AUDIO in req.output_modalities  # noqa: E731
    rules = MediaRules(
        media_caps,
        int(preprocessor["sampling_rate"]),
        float(preprocessor["chunk_length"]),
        min_audio_samples(int(preprocessor["hop_length"])),
        MediaTokenIds.from_config(config),
        int(text.get("max_position_embeddings", 32768)),
    )
    frontend = ChatFrontend(tokenizer, speakers, rules)
    thinker_cfg = config["thinker_config"]
    merge = int(thinker_cfg.get("vision_config", {}).get("spatial_merge_size", 2))
    stages = media_stages(
        media_caps,
        build_encoder,
        opts.max_batch_size,
        "audio tower + vision encoder",
        MediaTokenIds.from_config(config),
        merge,
        rules.max_prompt_tokens,
    )
    program = Program(
        inputs=("request",),
        nodes=(
            KernelNode(
                "frontend",
                frontend,
                needs=("request",),
                binds=("chat_ids", "media", "speaker"),
            ),
            *stages.nodes,
            LoopNode(
                "think",
                "think",
                needs=("thinker_prompt",),
                binds="text_ids",
                streams=("thinker_rows",),
            ),
            LoopNode(
                "talk",
                "talk",
                needs=("thinker_rows", "speaker"),
                binds="codes",
                streams=("codec_stream",),
                when=wants_audio,
            ),
            LoopNode(
                "denoise",
                "denoise",
                needs=("codec_stream", "speaker"),
                binds="mel_frames",
                streams=("mel_stream",),
                when=wants_audio,
            ),
            LoopNode("vocode", "vocode", needs=("mel_stream",), binds="samples", when=wants_audio),
            KernelNode("usage", output_usage("text_ids"), needs=("text_ids", "codes", "samples")),
        ),
    )
    asr = (Capability.TRANSCRIPTION,) if Capability.AUDIO_INPUT in media_caps else ()
    return ModelCard(
        card_id=CARD_ID,
        family="qwen2_5_omni",
        components=(
            *stages.components,
            ComponentSpec("thinker", build_thinker, opts.max_batch_size, "Qwen2.5 thinker LM"),
            ComponentSpec("talker", build_talker, opts.max_batch_size, "codec talker LM"),
            ComponentSpec("dit", build_dit, opts.max_batch_size, "token2wav DiT (flow matching)"),
            ComponentSpec("bigvgan", build_bigvgan, opts.max_batch_size, "token2wav BigVGAN"),
        ),
        loops=(
            *stages.loops,
            ar_decode_loop(think),
            ar_decode_loop(talk, TalkerLoop),
            denoise_loop(denoise),
            audio_decode_loop(vocode),
        ),
        program=program,
        capabilities=frozenset({Capability.CHAT_TEXT, Capability.CHAT_AUDIO, *media_caps, *asr}),
        sample_rate=24000,
        media_sample_rate=int(preprocessor["sampling_rate"]),
        voices=tuple(speakers),
        default_voice=next(iter(speakers)),
        voice_validator=frontend.speaker_name,
        on_weights_updated=_refresh_talker_text_rows,
        first_audio_alone=opts.first_audio_alone,
        transcription_prompt=transcription_messages if asr else None,
        speech_system_prompt=SPEECH_SYSTEM_PROMPT,
        parity=frozenset({"C0", "C1", "C3", "reference"}),
        description="Qwen2.5-Omni: thinker -> talker -> token2wav (DiT + BigVGAN), 24 kHz.",
    )


def _refresh_talker_text_rows(model: ModelInstance, tensors: Mapping[str, Any]) -> None:
    """After a weight update: the talker keeps rows of the thinker's embeddings (the text ids
    it reads); copy them again when those embeddings changed."""
    embed = tensors.get("thinker.model.embed_tokens.weight")
    if embed is not None:
        call_component(model.components["talker"], "refresh_text_embeds", embed)
