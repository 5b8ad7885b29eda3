"""The ``chatterbox`` card: T3 samples 25 Hz speech tokens with classifier-free guidance
(AR_DECODE on the shared paged AR component), S3Gen's flow turns them into 50 Hz mel in 10
Euler steps with its own guidance (DENOISE, one DENOISE_STEP unit per step, batched across
requests), HiFT makes 24 kHz audio (AUDIO_DECODE).

Program: ``frontend`` (``punc_norm``, ``tokenizer.json``, the voice -> ``T3Prompt`` and S3Gen
voice prompt; checked at submission) -> ``decode`` (``ARDecodeLoop`` on ``t3``: the stop-of-speech
id ends it; tokens go on ``tokens``) -> ``flow`` (``DenoiseLoop`` on ``s3gen``: windows that
grow as T3's tokens arrive, ``flow_windows``, ids >= 6561 dropped as upstream) -> ``vocode``
(``AudioDecodeLoop`` on ``hift``: each flow chunk's mel with ``hift_context`` frames of context)
-> ``usage``. ``flow_chunk_tokens=0`` is the reference setting: one flow window and one HiFT
call over the whole utterance once T3 has finished, with upstream's noise layouts.

Voices: the folder's ``conds.pt`` is the default voice; ``default`` and OpenAI's voice names
speak it. A folder whose ``s3gen.safetensors`` holds S3Gen's tokenizer and speaker encoder (the
published one does) clones a reference clip (``Capability.VOICE_CLONING``): the ``cloner``
component (no loop runs on it) makes a voice's spec as ``prepare_conditionals`` does
(``clone.py``), which ``POST /v1/audio/voices`` saves and the inline ``ref_audio`` fields make
per request; a request naming a spec speaks it. Sampling defaults are
``ChatterboxTTS.generate``'s: temperature 0.8, top-p 1.0, ``min_p`` 0.05, repetition penalty
1.2 once per generated id, at most 1000 tokens; ``exaggeration`` and ``cfg_weight`` are request
fields (``SamplingParams``) over the card's options.
Upstream watermarks its output (resemble-perth); this card does not (docs/models/chatterbox.md).
"""

from __future__ import annotations

import functools
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
    ProgramContext,
    Request,
    derived_seed,
)
from omnistep.layers.device import check_device
from omnistep.loops.ar_decode import ARDecodeConfig
from omnistep.loops.audio_decode import AudioDecodeConfig
from omnistep.loops.denoise import DenoiseConfig, Window, whole_utterance
from omnistep.models.chatterbox.clone import VoiceCloner, voice_from_spec
from omnistep.models.chatterbox.frontend import (
    DEFAULT_CFG_WEIGHT,
    DEFAULT_EXAGGERATION,
    FLOW_SEED_KEY,
    ChatterboxFrontend,
    TextTokenizer,
)
from omnistep.models.chatterbox.hift import SAMPLE_RATE
from omnistep.models.chatterbox.loader import (
    ChatterboxCheckpointError,
    check_folder,
    has_clone_encoders,
    load_clone_encoders,
    load_hift,
    load_s3gen,
    load_t3,
    load_voice,
)
from omnistep.models.chatterbox.s3gen import CFG_RATE, NUM_STEPS, SPEECH_VOCAB
from omnistep.models.chatterbox.stages import FlowDenoiser, FlowStart, HiFTVocoder
from omnistep.models.chatterbox.t3 import T3Config
from omnistep.runners.card_parts import (
    ar_decode_loop,
    audio_decode_loop,
    component_enroller,
    denoise_loop,
    output_usage,
    request_sampling,
    require_weights,
)
from omnistep.runners.options import ServingOptions
from omnistep.sampling import SamplingRow

CARD_ID = "chatterbox"
WHOLE_UTTERANCE = 1 << 30
"""HiFT's chunk in frames in the reference setting: the whole mel (upstream's one call)."""
LOOKAHEAD_TOKENS = 3
"""S3Gen's encoder's ``pre_lookahead_len``: tokens a streamed chunk waits for after its own."""


@dataclass(frozen=True)
class ChatterboxOptions(ServingOptions):
    """Serving options: ``ServingOptions`` (T3's KV cache, batching, dtype) and

    Attributes:
        max_new_tokens: cap on T3's speech tokens (upstream 1000: 40 s).
        exaggeration: emotion exaggeration (upstream 0.5); None keeps the voice's stored value.
        cfg_weight: T3's classifier-free guidance weight (upstream 0.5; 0: no guidance).
        flow_steps: S3Gen's Euler steps (upstream 10).
        flow_cfg_rate: S3Gen's guidance rate (upstream 0.7).
        flow_chunk_tokens: the streamed form: S3Gen solves its first chunk once T3 has this
            many tokens (and the 3 look-ahead tokens after them), each later chunk covering
            as many tokens as all before it (``flow_windows``), and HiFT decodes each chunk's
            mel as it lands (``hift_context`` frames each side). 0: the reference setting:
            one flow window and one HiFT call over the whole utterance once T3 has finished,
            with upstream's noise layouts (what the parity tests compare).
        hift_context: HiFT's mel frames of context on each side of a streamed chunk.
    """

    max_new_tokens: int = 1000
    exaggeration: float | None = DEFAULT_EXAGGERATION
    cfg_weight: float = DEFAULT_CFG_WEIGHT
    flow_steps: int = NUM_STEPS
    flow_cfg_rate: float = CFG_RATE
    flow_chunk_tokens: int = 0
    hift_context: int = 16

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.flow_chunk_tokens < 0 or self.hift_context < 0:
            raise ValueError(
                f"flow_chunk_tokens and hift_context must be >= 0, got "
                f"{self.flow_chunk_tokens} and {self.hift_context}"
            )
        if self.flow_chunk_tokens and 2 * self.flow_chunk_tokens <= self.hift_context:
            raise ValueError(
                f"flow_chunk_tokens ({self.flow_chunk_tokens}) must give more than hift_context "
                f"({self.hift_context}) mel frames"
            )


def make_sampling(eos_token_id: int):
    """``Request -> SamplingRow`` with ``ChatterboxTTS.generate``'s defaults for unset fields:
    temperature 0.8, top-p 1.0, min-p 0.05, repetition penalty 1.2 applied once per id over
    every generated token (transformers' processor, as upstream)."""

    defaults = {
        "temperature": 0.8,
        "top_p": 1.0,
        "top_k": 0,
        "repetition_penalty": 1.2,
        "min_new_tokens": 0,
    }

    def build(req: Request) -> SamplingRow:
        return request_sampling(
            req,
            defaults,
            min_p=0.05,
            penalty_compounds=False,
            penalty_window=4096,
            eos_token_id=eos_token_id,
            min_keep=1,
        )

    return build


def flow_windows(first_tokens: int, lookahead: int = LOOKAHEAD_TOKENS):
    """S3Gen's streamed schedule, in mel frames (2 per token): chunk ``k`` outputs frames up
    to ``2 first_tokens 2^k`` (each chunk as long as all before it) and waits for the
    ``lookahead`` tokens after them; its window re-solves every frame from the first
    (``Window(0, out_start, out_end, out_end + 2 lookahead)``: S3Gen's encoder and estimator
    attend over the whole utterance, as upstream's ``finalize=False`` re-runs them), the
    frames already streamed kept. Once T3 has finished, the rest is one last window without
    look-ahead. Depends on frame positions only (``DenoiseConfig.next_window``)."""
    ahead = 2 * lookahead

    def next_window(out_start: int, available: int, complete: bool) -> Window | None:
        out_end = max(2 * first_tokens, 2 * out_start)
        if available >= out_end + ahead:
            return Window(0, out_start, out_end, out_end + ahead)
        if complete and available > out_start:
            return Window(0, out_start, available, available)
        return None

    return next_window


def _is_speech(item) -> bool:
    """Whether a T3 item is an S3 token: upstream drops T3's other ids before S3Gen."""
    return int(item[0]) < SPEECH_VOCAB


def _flow_start(steps_seed_key: int):
    def make_start(req: Request, ctx: ProgramContext, items: list, window) -> FlowStart | None:
        tokens = [int(item[0]) for item in items[: window.end // 2]]  # S3 ids (_is_speech)
        if not tokens:
            return None
        seed = derived_seed(req.seed, steps_seed_key)
        level = float(req.sampling.or_default("flow_noise_level", 0.0))
        frames = None if window.out_end == window.end else window.out_end
        voice = ctx.slots["voice"]
        return FlowStart(torch.tensor(tokens, dtype=torch.long), voice, seed, level, frames)

    return make_start


def build_card(
    path: str | None = None, options: ChatterboxOptions | None = None, **overrides
) -> ModelCard:
    """The Chatterbox card on the published folder ``path`` (``ResembleAI/chatterbox``).

    Raises:
        InvalidRequestError: no path given.
        ChatterboxCheckpointError: a missing or malformed file (named).
    """
    path = require_weights("chatterbox", path)
    opts = options or ChatterboxOptions(**overrides)
    root = check_folder(path)
    tokenizer = TextTokenizer(root / "tokenizer.json")
    clones = has_clone_encoders(root)
    t3_config = T3Config()
    cloned = None
    if clones:
        parse = functools.partial(voice_from_spec, speaker_dim=t3_config.speaker_dim)
        cloned = functools.lru_cache(maxsize=64)(parse)
    frontend = ChatterboxFrontend(
        tokenizer, load_voice(root), opts.cfg_weight, opts.exaggeration, cloned
    )

    def build_t3(device: str):
        check_device(device)
        layers, hidden = _t3_geometry(root)
        kv = opts.kv_config(layers, hidden // t3_config.head_dim, t3_config.head_dim)
        return load_t3(root, kv, device, opts.dtype, opts.batch_invariant)

    def build_flow(device: str):
        check_device(device)
        flow = load_s3gen(root, device)
        streamed = opts.flow_chunk_tokens > 0
        return FlowDenoiser(
            flow, opts.flow_steps, opts.flow_cfg_rate, opts.batch_invariant, streamed
        )

    def build_hift(device: str):
        check_device(device)
        context = opts.hift_context if opts.flow_chunk_tokens else None
        return HiFTVocoder(load_hift(root, device), context)

    def build_cloner(device: str):
        check_device(device)
        return VoiceCloner(*load_clone_encoders(root, device))

    first = opts.flow_chunk_tokens
    decode = ARDecodeConfig(
        loop_id="decode",
        component="t3",
        prompt_slot="prompt",
        make_sampling=make_sampling(t3_config.stop_speech),
        max_new_tokens=opts.max_new_tokens,
        eos_token_ids=(t3_config.stop_speech,),
        stream_slot="tokens",
        penalty_window=4096,
    )
    flow = DenoiseConfig(
        loop_id="flow",
        component="s3gen",
        in_slot="tokens",
        stream_slot="mel",
        make_start=_flow_start(FLOW_SEED_KEY),
        frames_per_item=2,
        next_window=flow_windows(first) if first else whole_utterance,
        keep_item=_is_speech,
    )
    vocode = _vocode_config(first, opts.hift_context)
    program = Program(
        inputs=("request",),
        nodes=(
            KernelNode(
                "frontend", frontend, needs=("request",), binds=("prompt", "voice", "hift_seed")
            ),
            LoopNode("decode", "decode", needs=("prompt",), binds="speech", streams=("tokens",)),
            LoopNode(
                "flow", "flow", needs=("tokens", "voice"), binds="mel_frames", streams=("mel",)
            ),
            LoopNode("vocode", "vocode", needs=("mel", "hift_seed"), binds="samples"),
            KernelNode("usage", output_usage("speech"), needs=("speech", "samples")),
        ),
    )
    return ModelCard(
        card_id=CARD_ID,
        family="chatterbox",
        components=(
            ComponentSpec("t3", build_t3, opts.max_batch_size, "T3 Llama with CFG"),
            ComponentSpec("s3gen", build_flow, opts.max_batch_size, "S3Gen flow matching"),
            ComponentSpec("hift", build_hift, opts.max_batch_size, "HiFT vocoder"),
            *(
                [ComponentSpec("cloner", build_cloner, 1, "S3 tokenizer, CAMPPlus, voice encoder")]
                if clones
                else []
            ),
        ),
        loops=(
            ar_decode_loop(decode),
            denoise_loop(flow),
            audio_decode_loop(vocode),
        ),
        program=program,
        capabilities=frozenset(
            {Capability.TEXT_TO_SPEECH, *([Capability.VOICE_CLONING] if clones else [])}
        ),
        sample_rate=SAMPLE_RATE,
        voices=("default", *OPENAI_VOICES),
        default_voice="default",
        voice_validator=frontend.check_voice,
        voice_enroller=component_enroller("cloner") if clones else None,
        parity=frozenset({"C0", "C1", "stream", "reference"}),
        # streamed: T3 waits while the first flow window and HiFT chunk run (else its steps,
        # due first under EDF, run before them to T3's end)
        first_audio_alone=opts.flow_chunk_tokens > 0,
        description="Chatterbox: T3 Llama over 25 Hz speech tokens with CFG -> S3Gen flow "
        "matching -> HiFT, 24 kHz.",
    )


def _vocode_config(first_tokens: int, context: int) -> AudioDecodeConfig:
    """HiFT's chunks: in the streamed form they end ``context`` frames before the flow's
    chunks end (``flow_windows``: 2 x 2^k first_tokens frames), so each waits for its
    look-ahead only within the flow chunk that has landed; every unit carries the mel from
    frame 0 (the F0 whose sum is the source's phase). ``first_tokens`` 0: one chunk, the
    whole mel."""
    common = dict(
        loop_id="vocode",
        component="hift",
        in_slot="mel",
        sample_rate=SAMPLE_RATE,
        extras_slot="hift_seed",
    )
    if not first_tokens:
        return AudioDecodeConfig(**common, first_chunk=WHOLE_UTTERANCE, chunk=WHOLE_UTTERANCE)
    return AudioDecodeConfig(
        **common,
        first_chunk=2 * first_tokens - context,
        chunk=2 * first_tokens,
        chunk_growth=2.0,
        max_chunk=WHOLE_UTTERANCE,
        left_context=WHOLE_UTTERANCE,
        lookahead=context,
        report_frames=True,  # else a chunk waits behind T3's steps: no audio before T3 ends
    )


def _t3_geometry(root) -> tuple[int, int]:
    """T3's layer count and width from ``t3_cfg.safetensors``' header (no tensors read).

    Raises:
        ChatterboxCheckpointError: the file lacks ``speech_emb.weight``.
    """
    from safetensors import safe_open

    with safe_open(root / "t3_cfg.safetensors", "pt") as f:
        names = list(f.keys())  # noqa: SIM118 (safe_open is not iterable)
        if "speech_emb.weight" not in names:
            raise ChatterboxCheckpointError(
                f"{root / 't3_cfg.safetensors'} has no speech_emb.weight"
            )
        hidden = f.get_slice("speech_emb.weight").get_shape()[1]
    return len({k.split(".")[2] for k in names if k.startswith("tfmr.layers.")}), hidden
