"""The ``chattts`` card: GPT decode (AR_DECODE) streaming hidden states into the vocoder
(AUDIO_DECODE), both batched across requests.

Program: ``frontend`` (voice -> speaker vector, text -> code prompt) -> ``decode`` (an
ARDecodeLoop on the ``gpt`` component: a PREFILL unit, then one AR_TOKEN unit per frame of 4
codes; each frame's hidden state goes on the ``hidden_stream`` Channel) and, at the same time,
``vocode`` (an AudioDecodeLoop on the ``vocoder`` component: Decoder + Vocos on chunks of hidden
states with left context and look-ahead) -> ``usage``.

Voices: a ChatTTS speaker string (the official compressed format), ``seed:N`` (a random speaker
drawn from seed N), an OpenAI voice name (a fixed speaker: ``seed:1000+i`` for the i-th name), or
nothing (a speaker drawn from the request's seed, as upstream draws one at random). Random
speakers are drawn from chattts 0.2.5's speaker statistics, shipped with omnistep (the published
folder has none), or from the folder's ``asset/spk_stat.pt`` when present. A checkpoint of another
GPT width without that file has no statistics: only speaker strings are accepted, and a request
without a voice uses upstream's ``[empty_spk]`` prompt.

This module declares the card only: the kernel nodes are in ``frontend``, the GPT in ``gpt``,
the vocoder in ``vocoder`` (run by the runner plane's ``ChunkVocoder``), the files in ``loader``.

Sampling defaults are upstream ``infer_code``'s: temperature 0.3, top_p 0.7, top_k 20,
repetition penalty 1.05 over 16 frames, max 2048 new frames; ``speed`` picks ``[speed_N]``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from omnistep.core import (
    OPENAI_VOICES,
    Capability,
    ComponentSpec,
    KernelNode,
    LoopNode,
    ModelCard,
    Program,
    Request,
)
from omnistep.layers.device import check_device
from omnistep.loops import AudioDecodeConfig
from omnistep.loops.ar_decode import ARDecodeConfig
from omnistep.models.chattts.frontend import ChatTTSFrontend, refine_frontend
from omnistep.models.chattts.gpt import ChatTTSGPT, GPTConfig
from omnistep.models.chattts.loader import ChatTTSFiles
from omnistep.models.chattts.prompt import ChatTTSTokenizer
from omnistep.models.chattts.speaker import speaker_statistics
from omnistep.models.chattts.vocoder import load_vocoder
from omnistep.runners.card_parts import (
    ar_decode_loop,
    audio_decode_loop,
    output_usage,
    request_sampling,
    require_weights,
)
from omnistep.runners.options import ServingOptions
from omnistep.runners.vocoder import ChunkVocoder
from omnistep.sampling import SamplingRow

CARD_ID = "chattts"
SAMPLE_RATE = 24000


@dataclass(frozen=True)
class ChatTTSOptions(ServingOptions):
    """Serving options of the card: ``ServingOptions`` (the GPT's KV cache, batching, dtype)
    and

    Attributes:
        max_new_tokens: cap on generated frames (upstream: 2048).
        first_chunk, chunk: vocoder chunk sizes in frames (tokens); 1 token = 512 samples.
        chunk_growth, max_chunk: later chunks grow by this factor up to this many frames, so
            the recomputed context costs less per frame once audio is playing.
        left_context, lookahead: vocoder context in frames on each side of a chunk.
        trim_threshold: edge samples with ``|x| <=`` this are trimmed; None keeps every sample.
        refine_text: run upstream's refine-text stage (adds prosody tokens such as
            ``[uv_break]``) before the code stage; off by default.
    """

    max_new_tokens: int = 2048
    # Receptive field of Decoder+Vocos: 52 tokens each side. Left context covers it; the
    # look-ahead is shorter to cut time to first audio: measured on full-size random weights
    # (bench/README.md), look-ahead 12 leaves an error of -84 dB near joins (max 5e-5 vs 1e-6
    # elsewhere, no step at the join), 8 leaves -54 dB (2e-3), 16 is exact to float rounding.
    first_chunk: int = 4
    chunk: int = 48
    # Every chunk recomputes left_context + lookahead = 64 frames of Decoder+Vocos; chunks of
    # 48, 96, 192, 384 frames bring that from 1.3x to 0.17x of the frames kept.
    chunk_growth: float = 2.0
    max_chunk: int = 384
    left_context: int = 52
    lookahead: int = 12
    trim_threshold: float | None = 1e-4
    refine_text: bool = False


REFINE_SAMPLING = {"temperature": 0.7, "top_p": 0.7, "top_k": 20, "repetition_penalty": 1.0}
"""Upstream ``RefineTextParams`` defaults; the request's sampling fields apply to the code stage."""
REFINE_MAX_NEW_TOKENS = 384


def make_refine_sampling(eos_token_id: int):
    """``Request -> SamplingRow`` for the refine-text stage (fixed upstream defaults)."""
    row = SamplingRow(**REFINE_SAMPLING, penalty_window=16, eos_token_id=eos_token_id, min_keep=3)
    return lambda req: row


def make_sampling(eos_token_id: int):
    """``Request -> SamplingRow`` with upstream ``infer_code`` defaults for unset fields."""

    defaults = {
        "temperature": 0.3,
        "top_p": 0.7,
        "top_k": 20,
        "repetition_penalty": 1.05,
        "min_new_tokens": 0,
    }

    def build(req: Request) -> SamplingRow:
        return request_sampling(
            req, defaults, penalty_window=16, eos_token_id=eos_token_id, min_keep=3
        )

    return build


def build_card(
    path: str | None = None, options: ChatTTSOptions | None = None, **overrides
) -> ModelCard:
    """The ChatTTS card on the official checkpoint folder ``path``.

    Raises:
        InvalidRequestError: no path given.
        ModelFilesError: the folder or one of its files is missing (named, with the layout).
    """
    path = require_weights("chattts", path)
    opts = options or ChatTTSOptions(**overrides)
    files = ChatTTSFiles.locate(path)
    # shapes only: the card is built in the serving process, weights load in build_gpt
    embed_shapes = files.shapes("asset/Embed.safetensors")
    config = GPTConfig.from_json(
        files.asset / "gpt" / "config.json",
        num_vq=sum(1 for k in embed_shapes if k.startswith("emb_code.") and k.endswith(".weight")),
        num_audio_tokens=int(embed_shapes["emb_code.0.weight"][0]),
        num_text_tokens=int(embed_shapes["emb_text.weight"][0]),
    )
    tokenizer = ChatTTSTokenizer(files.asset / "tokenizer")
    spk_stat = speaker_statistics(files.spk_stat(), config.hidden_size)
    frontend = ChatTTSFrontend(tokenizer, spk_stat, config.hidden_size)

    def build_gpt(device: str) -> ChatTTSGPT:
        check_device(device)
        head_dim = config.hidden_size // config.num_attention_heads
        kv = opts.kv_config(config.num_hidden_layers, config.num_key_value_heads, head_dim)
        gpt = ChatTTSGPT(config, kv, device, opts.dtype, opts.batch_invariant)
        gpt.load_weights(
            files.tensors("asset/gpt/model.safetensors"), files.tensors("asset/Embed.safetensors")
        )
        return gpt

    def build_vocoder(device: str) -> ChunkVocoder:
        # Same-shaped windows run as one batch; a batched row differs from the row alone by
        # ~1e-6 (the Vocos input convolution picks its CPU kernel by shape).
        check_device(device)
        vocoder = load_vocoder(files.asset, device, torch.float32)
        return ChunkVocoder(vocoder, "ChatTTS vocoder", opts.batch_invariant)

    decode = ARDecodeConfig(
        loop_id="decode",
        component="gpt",
        prompt_slot="prompt",
        make_sampling=make_sampling(config.eos_token_id),
        max_new_tokens=opts.max_new_tokens,
        eos_token_ids=(config.eos_token_id,),
        stream_slot="hidden_stream",
        stream_hidden=True,
    )
    vocode = AudioDecodeConfig(
        loop_id="vocode",
        component="vocoder",
        in_slot="hidden_stream",
        sample_rate=SAMPLE_RATE,
        first_chunk=opts.first_chunk,
        chunk=opts.chunk,
        chunk_growth=opts.chunk_growth,
        max_chunk=opts.max_chunk,
        left_context=opts.left_context,
        lookahead=opts.lookahead,
        trim_threshold=opts.trim_threshold,
    )
    refine = ARDecodeConfig(
        loop_id="refine",
        component="gpt",
        prompt_slot="refine_prompt",
        make_sampling=make_refine_sampling(tokenizer.refine_eos_id),
        max_new_tokens=REFINE_MAX_NEW_TOKENS,
        eos_token_ids=(tokenizer.refine_eos_id,),
        seed_offset=1,
        shape_tag="text",
    )
    refine_nodes = (
        (
            KernelNode(
                "refine_frontend",
                refine_frontend(tokenizer),
                needs=("request",),
                binds=("refine_prompt",),
            ),
            LoopNode("refine", "refine", needs=("refine_prompt",), binds="refined"),
        )
        if opts.refine_text
        else ()
    )
    frontend_needs = ("request", "refined") if opts.refine_text else ("request",)
    program = Program(
        inputs=("request",),
        nodes=(
            *refine_nodes,
            KernelNode("frontend", frontend, needs=frontend_needs, binds=("prompt",)),
            LoopNode(
                "decode", "decode", needs=("prompt",), binds="codes", streams=("hidden_stream",)
            ),
            LoopNode("vocode", "vocode", needs=("hidden_stream",), binds="samples"),
            KernelNode("usage", output_usage("codes"), needs=("codes", "samples")),
        ),
    )
    return ModelCard(
        card_id=CARD_ID,
        family="chattts",
        components=(
            ComponentSpec("gpt", build_gpt, opts.max_batch_size, "ChatTTS GPT (Llama) + heads"),
            ComponentSpec("vocoder", build_vocoder, opts.max_batch_size, "Decoder + Vocos"),
        ),
        loops=(
            ar_decode_loop(decode),
            ar_decode_loop(refine),
            audio_decode_loop(vocode),
        ),
        program=program,
        capabilities=frozenset({Capability.TEXT_TO_SPEECH}),
        sample_rate=SAMPLE_RATE,
        voices=OPENAI_VOICES,
        voice_validator=frontend.check_voice,
        parity=frozenset({"C0", "C1", "C2", "C3", "stream", "reference"}),
        description="ChatTTS: GPT multi-codebook decode + Decoder/Vocos vocoder, 24 kHz.",
    )
