"""The ``higgs_audio_v2`` card: the DualFFN Llama (``lm``) decodes 8-codebook frames with the
codebook delay pattern (AR_DECODE), and the audio tokenizer's decoder (``codec``) turns the
undelayed frames into 24 kHz audio in chunks (AUDIO_DECODE), both batched across requests.

Program: ``frontend`` (voice, text -> ``HiggsPrompt``; checked at submission) -> ``decode``
(an ``ARDecodeLoop`` on ``lm``: one PREFILL unit, then one AR_TOKEN unit per step; the sampler's
``SamplingRow.delay`` forces the delay pattern's BOS/EOS ids, the loop stops at the all-EOS
step, and each undelayed frame goes on ``codes_stream`` once complete, ``stream_delay``) and,
at the same time, ``vocode`` (an ``AudioDecodeLoop`` with ``left_context`` and ``lookahead``
covering the decoder's receptive field, so chunks equal the whole decode) -> ``usage``.

Voices: none given (or an OpenAI voice name) speaks in the model's own voice (no reference
clip; upstream's "smart voice"); a voice spec ``{"ref_text": ..., "codes": [[8 ids], ...]}``
(JSON: a clip's audio tokenizer codes ``[T, 8]`` and transcript) clones it: the clip goes
in the prompt as an earlier assistant turn (``prompt`` module). Inline ``ref_audio`` +
``ref_text`` and ``POST /v1/audio/voices`` run the card's ``voice_enroller``: the ``encoder``
component (``encoder.py``: the tokenizer's HuBERT + DAC encoders and RVQ) makes that spec.

Sampling defaults: the folder's ``generation_config.json`` (temperature, top_k, top_p), else
transformers' (1.0, 50, 1.0); temperature 0 is greedy. No repetition penalty (transformers'
Higgs generation refuses one); ``penalty_window`` is ``num_codebooks`` only so the delay
pattern sees the EOS cascade's start.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import torch

from omnistep.core import (
    OPENAI_VOICES,
    Capability,
    ComponentSpec,
    InvalidRequestError,
    KernelNode,
    LoopNode,
    ModelCard,
    Program,
    ProgramContext,
    Request,
)
from omnistep.layers.device import check_device
from omnistep.loops.ar_decode import ARDecodeConfig
from omnistep.loops.audio_decode import AudioDecodeConfig
from omnistep.models.higgs_audio_v2.codec import (
    HiggsCodecDecoder,
    codec_component,
    codec_from_checkpoint,
)
from omnistep.models.higgs_audio_v2.encoder import encoder_from_checkpoint
from omnistep.models.higgs_audio_v2.lm import HiggsAudioV2LM
from omnistep.models.higgs_audio_v2.loader import HiggsCheckpoint
from omnistep.models.higgs_audio_v2.prompt import PromptBuilder, ReferenceClip
from omnistep.runners.card_parts import (
    ar_decode_loop,
    audio_decode_loop,
    component_enroller,
    request_sampling,
    require_weights,
)
from omnistep.runners.options import ServingOptions
from omnistep.sampling import SamplingRow
from omnistep.sampling.delay import DelayPattern

CARD_ID = "higgs-audio-v2"


@dataclass(frozen=True)
class HiggsOptions(ServingOptions):
    """Serving options: ``ServingOptions`` (the LM's KV cache, batching, dtype) and

    Attributes:
        audio_tokenizer: the audio tokenizer folder (default: ``audio_tokenizer/`` in the
            model folder).
        max_new_tokens: cap on sampled steps (25 steps = 1 s of audio, plus the 8-step delay).
        first_chunk, chunk, chunk_growth, max_chunk: the vocoder's chunk schedule in frames
            (1 frame = 960 samples = 40 ms).
        trim_threshold: edge samples with ``|x| <=`` this are trimmed; None keeps every sample.
    """

    audio_tokenizer: str | None = None
    max_new_tokens: int = 2048
    first_chunk: int = 4
    chunk: int = 16
    chunk_growth: float = 2.0
    max_chunk: int = 256
    trim_threshold: float | None = None


def _generation_defaults(checkpoint: HiggsCheckpoint) -> dict[str, float]:
    path = checkpoint.root / "generation_config.json"
    cfg = json.loads(path.read_text()) if path.is_file() else {}
    return {
        "temperature": float(cfg.get("temperature", 1.0)),
        "top_k": int(cfg.get("top_k", 50) or 0),
        "top_p": float(cfg.get("top_p", 1.0)),
    }


def make_sampling(pattern: DelayPattern, defaults: dict[str, float]):
    """``Request -> SamplingRow``: the request's temperature/top-p/top-k over the defaults,
    the delay pattern, no EOS mask.

    Raises (from the row builder):
        InvalidRequestError: a repetition penalty other than 1.
    """

    def build(req: Request) -> SamplingRow:
        sp = req.sampling
        if sp.repetition_penalty not in (None, 1.0):
            raise InvalidRequestError(
                "repetition_penalty is not supported by higgs_audio_v2 (its codebook logits "
                "take none, as transformers' Higgs generation refuses one)",
                param="repetition_penalty",
            )
        return request_sampling(
            req,
            {name: defaults[name] for name in ("temperature", "top_p", "top_k")},
            penalty_window=pattern.num_codebooks,
            min_keep=1,
            delay=pattern,
        )

    return build


class HiggsFrontend:
    """The ``frontend`` node and the card's ``voice_validator``."""

    def __init__(self, builder: PromptBuilder, codebook_size: int):
        self.builder = builder
        self.codebook_size = codebook_size

    def references(self, voice: str | None) -> tuple[ReferenceClip, ...]:
        """The reference clips of a voice (none for the default and OpenAI names).

        Raises:
            InvalidRequestError: an unknown name or a malformed spec (param ``voice``).
        """
        if voice is None or voice in OPENAI_VOICES or voice == "default":
            return ()
        try:
            spec = json.loads(voice)
            codes = torch.tensor(spec["codes"], dtype=torch.long)
            text = str(spec["ref_text"])
        except (ValueError, KeyError, TypeError) as exc:
            raise InvalidRequestError(
                f"unknown voice {voice[:40]!r}: use an OpenAI voice name, 'default', or a "
                '{"ref_text": ..., "codes": [[...], ...]} spec',
                param="voice",
                code="invalid_voice",
            ) from exc
        c = self.builder.pattern.num_codebooks
        if codes.dim() != 2 or codes.shape[1] != c or not len(codes):
            raise InvalidRequestError(
                f"voice codes must be [T, {c}]", param="voice", code="invalid_voice"
            )
        if int(codes.min()) < 0 or int(codes.max()) >= self.codebook_size:
            raise InvalidRequestError(
                f"voice codes must be in [0, {self.codebook_size})",
                param="voice",
                code="invalid_voice",
            )
        return (ReferenceClip(text, codes),)

    def check_voice(self, voice: str) -> None:
        """Raise InvalidRequestError (param ``voice``) for a voice the card cannot use."""
        self.references(voice)

    def __call__(self, ctx: ProgramContext) -> None:
        req = ctx.request
        if not req.text.strip():
            raise InvalidRequestError("input text is empty", param="input")
        prompt = self.builder.build(req.text, self.references(req.voice))
        ctx.slots["prompt"] = prompt
        ctx.usage["input_tokens"] = len(prompt.ids)


def _usage(pattern: DelayPattern):
    def usage(ctx: ProgramContext) -> None:
        ctx.usage["output_tokens"] = pattern.num_ready(len(ctx.slots["frames"]))

    return usage


def build_card(
    path: str | None = None, options: HiggsOptions | None = None, **overrides
) -> ModelCard:
    """The Higgs Audio v2 card on a folder in the transformers layout (``loader``).

    Raises:
        InvalidRequestError: no path given.
        HiggsCheckpointError: a missing or malformed file (named).
    """
    path = require_weights("higgs_audio_v2", path)
    opts = options or HiggsOptions(**overrides)
    checkpoint = HiggsCheckpoint.open(path, opts.audio_tokenizer)
    lm_cfg, codec_cfg = checkpoint.lm, checkpoint.codec
    pattern = DelayPattern(
        lm_cfg.num_codebooks, lm_cfg.audio_stream_bos_id, lm_cfg.audio_stream_eos_id
    )
    frontend = HiggsFrontend(
        PromptBuilder(checkpoint.tokenizer(), pattern), codec_cfg.codebook_size
    )
    context = HiggsCodecDecoder(codec_cfg, lm_cfg.num_codebooks).context_frames()

    def build_lm(device: str) -> HiggsAudioV2LM:
        check_device(device)
        kv = opts.kv_config(lm_cfg.num_hidden_layers, lm_cfg.num_key_value_heads, lm_cfg.head_dim)
        return HiggsAudioV2LM.from_checkpoint(
            checkpoint, kv, device, opts.dtype, opts.batch_invariant
        )

    def build_codec(device: str):
        check_device(device)
        return codec_component(codec_from_checkpoint(checkpoint, device), opts.batch_invariant)

    def build_encoder(device: str):
        check_device(device)
        return encoder_from_checkpoint(checkpoint, device)

    decode = ARDecodeConfig(
        loop_id="decode",
        component="lm",
        prompt_slot="prompt",
        make_sampling=make_sampling(pattern, _generation_defaults(checkpoint)),
        max_new_tokens=opts.max_new_tokens,
        eos_token_ids=(pattern.eos_id,),
        eos_all_codebooks=True,
        stream_slot="codes_stream",
        penalty_window=pattern.num_codebooks,
        stream_delay=pattern,
    )
    vocode = AudioDecodeConfig(
        loop_id="vocode",
        component="codec",
        in_slot="codes_stream",
        sample_rate=codec_cfg.sample_rate,
        first_chunk=opts.first_chunk,
        chunk=opts.chunk,
        chunk_growth=opts.chunk_growth,
        max_chunk=opts.max_chunk,
        left_context=context,
        lookahead=context,
        trim_threshold=opts.trim_threshold,
    )
    program = Program(
        inputs=("request",),
        nodes=(
            KernelNode("frontend", frontend, needs=("request",), binds=("prompt",)),
            LoopNode(
                "decode", "decode", needs=("prompt",), binds="frames", streams=("codes_stream",)
            ),
            LoopNode("vocode", "vocode", needs=("codes_stream",), binds="samples"),
            KernelNode("usage", _usage(pattern), needs=("frames", "samples")),
        ),
    )
    return ModelCard(
        card_id=CARD_ID,
        family="higgs_audio_v2",
        components=(
            ComponentSpec("lm", build_lm, opts.max_batch_size, "DualFFN Llama + audio head"),
            ComponentSpec("codec", build_codec, opts.max_batch_size, "audio tokenizer decoder"),
            ComponentSpec("encoder", build_encoder, 1, "audio tokenizer encoder (cloning)"),
        ),
        loops=(
            ar_decode_loop(decode),
            audio_decode_loop(vocode),
        ),
        program=program,
        capabilities=frozenset({Capability.TEXT_TO_SPEECH, Capability.VOICE_CLONING}),
        sample_rate=codec_cfg.sample_rate,
        voices=("default", *OPENAI_VOICES),
        default_voice="default",
        voice_validator=frontend.check_voice,
        voice_enroller=component_enroller("encoder"),
        parity=frozenset({"C0", "C1", "C2", "C3", "stream", "reference"}),
        description="Higgs Audio v2: DualFFN Llama, 8 delayed codebooks at 25 frames/s -> "
        "audio tokenizer decoder, 24 kHz.",
    )
