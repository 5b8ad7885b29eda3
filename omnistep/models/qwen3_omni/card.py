"""The ``qwen3_omni`` card: MoE thinker -> MoE talker with the in-step code predictor ->
code2wav (the causal 12.5 Hz codec decoder), 24 kHz.

Program: ``frontend`` (chat template -> prompt ids, voice -> the talker's speaker id) ->
``think`` (an ARDecodeLoop on the ``thinker``: text deltas streamed as decoded, each sampled id
put on the ``thinker_ids`` channel) and, at the same time, ``talk`` (the ``TalkerLoop`` on the
``talker``: its prefill waits for the reply's first token, each later step for the next one,
so speech frames come while the thinker is still writing) -> ``vocode`` (an AudioDecodeLoop on
``code2wav``, the runner plane's ``CodecDecoderComponent`` keeping each stream's decoder state:
chunks of new frames, the first chunk the talker's first frame) -> ``usage``. The audio stages
run only when audio output is asked for.

A checkpoint without a talker (``enable_audio_output`` false: the Thinking and Captioner
variants) is served as text only (``Capability.CHAT_TEXT``, no voices). A thinking checkpoint
(its chat template opens ``<think>`` in the assistant turn: Thinking) streams the reply's text
before ``</think>`` as reasoning (``thinking.ThinkingLoop``: the chat API's
``reasoning_content``, as vLLM returns it).

Sampling: the thinker's from ``generation_config.json`` under the request's fields (greedy when
the file does not sample, transformers' behaviour); the talker's transformers' ``generate``
defaults (``talker.TALKER_GENERATE_DEFAULTS``), greedy with ``talker_greedy`` (tests). A
request's ``max_tokens`` caps the thinker; the talker's cap is ``talker_max_new_tokens - 1``
frames, as transformers counts (its last codebook-0 sample gets no residual codes).

This module declares the card only: ``frontend``, ``thinker``, ``talker`` and ``talker_loop``,
``loader`` (code2wav through ``layers.codec_decoder``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from omnistep.core import (
    Capability,
    ComponentSpec,
    InvalidRequestError,
    KernelNode,
    LoopKind,
    LoopNode,
    LoopSpec,
    Modality,
    ModelCard,
    ModelInstance,
    Program,
    ProgramContext,
    Request,
    WorkUnitKind,
    call_component,
)
from omnistep.layers.codec_decoder import SAMPLE_RATE
from omnistep.layers.device import check_device
from omnistep.loops import AudioDecodeLoop
from omnistep.loops.ar_decode import ARDecodeConfig, ARDecodeLoop
from omnistep.models.qwen3_omni.frontend import ChatFrontend, load_tokenizer
from omnistep.models.qwen3_omni.loader import Qwen3OmniCheckpoint
from omnistep.models.qwen3_omni.talker import (
    THINKER_EMBED,
    TalkerIds,
    load_talker,
    talker_sampling,
)
from omnistep.models.qwen3_omni.talker_loop import TalkerLoop
from omnistep.models.qwen3_omni.thinker import ThinkerTextConfig, load_thinker
from omnistep.models.qwen3_omni.thinking import THINK_END, THINK_START, ThinkingLoop
from omnistep.runners.codec_vocoder import CodecDecoderComponent, codec_decode_config
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
    """

    thinker_max_new_tokens: int = 1024
    talker_max_new_tokens: int = 4096
    talker_greedy: bool = False
    first_chunk: int = 1
    chunk: int = 8
    chunk_growth: float = 2.0
    max_chunk: int = 64
    first_audio_alone: bool = True


def _usage(ctx: ProgramContext) -> None:
    ctx.usage["output_tokens"] = len(ctx.slots["text_ids"])


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
    if path is None:
        raise InvalidRequestError(
            "the qwen3_omni family needs weights: --model qwen3_omni=/path/to/dir",
            param="model",
        )
    opts = options or Qwen3OmniOptions(**overrides)
    checkpoint = Qwen3OmniCheckpoint.open(path)
    config = checkpoint.config
    tokenizer = load_tokenizer(str(checkpoint.root))
    generation = checkpoint.generation_config()
    audio = checkpoint.has_talker
    ids = TalkerIds.from_config(config) if audio else None
    frontend = ChatFrontend(tokenizer, ids.speakers if ids else {})
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

    def build_code2wav(device: str) -> CodecDecoderComponent:
        check_device(device)
        decoder = checkpoint.load_code2wav(device, opts.dtype)
        return CodecDecoderComponent(decoder, opts.batch_invariant, "Qwen3-Omni's code2wav")

    think = ARDecodeConfig(
        loop_id="think",
        component="thinker",
        prompt_slot="chat_ids",
        make_sampling=generation_sampling(generation),
        max_new_tokens=opts.thinker_max_new_tokens,
        eos_token_ids=generation_eos_ids(generation, tokenizer),
        stream_slot="thinker_ids",
        detokenize=lambda token_ids: tokenizer.decode(token_ids, skip_special_tokens=True),
    )
    nodes: list[Any] = [
        KernelNode("frontend", frontend, needs=("request",), binds=("chat_ids", "speaker")),
        LoopNode("think", "think", needs=("chat_ids",), binds="text_ids", streams=("thinker_ids",)),
    ]
    components = [
        ComponentSpec("thinker", build_thinker, opts.max_batch_size, "MoE thinker LM"),
    ]
    lm_units = (WorkUnitKind.PREFILL, WorkUnitKind.AR_TOKEN)
    think_loop = ThinkingLoop if thinks(tokenizer) else ARDecodeLoop
    loops = [
        LoopSpec("think", LoopKind.AR_DECODE, lm_units, ("thinker",), lambda: think_loop(think))
    ]
    capabilities = {Capability.CHAT_TEXT}
    if audio:
        nodes, components, loops = _audio_stages(
            nodes, components, loops, checkpoint, opts, ids, think, build_talker, build_code2wav
        )
        capabilities.add(Capability.CHAT_AUDIO)
    nodes.append(
        KernelNode("usage", _usage, needs=("text_ids", *(("codes", "samples") if audio else ())))
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
        parity=frozenset({"C0", "C1", "C3", "reference"}),
        description="Qwen3-Omni: MoE thinker -> MoE talker + code predictor -> code2wav, 24 kHz."
        if audio
        else "Qwen3-Omni (text only: no talker in this checkpoint): MoE thinker.",
    )


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
        prompt_slot="chat_ids",
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
    lm_units = (WorkUnitKind.PREFILL, WorkUnitKind.AR_TOKEN)
    nodes = [
        *nodes,
        LoopNode(
            "talk",
            "talk",
            needs=("chat_ids", "thinker_ids", "speaker"),
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
        LoopSpec(
            "talk",
            LoopKind.AR_DECODE,
            lm_units,
            ("talker",),
            lambda: TalkerLoop(talk, ids, thinker_cap),
        ),
        LoopSpec(
            "vocode",
            LoopKind.AUDIO_DECODE,
            (WorkUnitKind.AUDIO_CHUNK,),
            ("code2wav",),
            lambda: AudioDecodeLoop(vocode),
        ),
    ]
    return nodes, components, loops


def _refresh_talker_text_rows(model: ModelInstance, tensors: Mapping[str, Any]) -> None:
    """After a weight update: the talker keeps a copy of the thinker's embeddings (its text
    rows); copy them again when those changed."""
    embed = tensors.get(THINKER_EMBED)
    if embed is not None:
        call_component(model.components["talker"], "refresh_text_embeds", embed)
