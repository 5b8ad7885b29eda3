"""The ``qwen2_5_omni`` card: thinker -> talker -> token2wav (DiT ODE + BigVGAN).

Program: ``frontend`` (chat template -> prompt ids, voice -> speaker) -> ``think`` (an
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
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from omnistep.core import (
    OPENAI_VOICES,
    Capability,
    Channel,
    ComponentSpec,
    DenoiseStepRecord,
    Done,
    ExecutionProfile,
    InvalidRequestError,
    KernelNode,
    LoopKind,
    LoopNode,
    LoopResult,
    LoopSpec,
    Modality,
    ModelCard,
    ModelFilesError,
    ModelInstance,
    Pending,
    Program,
    ProgramContext,
    Request,
    WorkPlan,
    WorkUnitKind,
    call_component,
)
from omnistep.kv import KVCacheConfig
from omnistep.layers.device import check_device
from omnistep.layers.training import require_training_copy, training_copy
from omnistep.loops import AudioDecodeConfig, AudioDecodeLoop
from omnistep.loops.ar_decode import ARDecodeConfig, ARDecodeLoop, ARDecodeState, ARPrefillInput
from omnistep.loops.denoise import (
    DenoiseConfig,
    DenoiseInput,
    DenoiseLoop,
    DenoiseOutput,
    whole_utterance,
)
from omnistep.models.qwen2_5_omni.dit import DiT, DiTChunking, DiTConfig
from omnistep.models.qwen2_5_omni.loader import QwenOmniFiles
from omnistep.models.qwen2_5_omni.talker import (
    TALKER_GENERATE_DEFAULTS,
    TalkerPrompt,
    condition_for_step,
    load_talker,
)
from omnistep.models.qwen2_5_omni.thinker import load_thinker
from omnistep.models.qwen2_5_omni.token2wav import load_token2wav_part
from omnistep.runners.flow_matching import FlowStep, FrameNoise
from omnistep.runners.options import ServingOptions
from omnistep.runners.vocoder import ChunkVocoder
from omnistep.sampling import SamplingRow

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
    """

    thinker_max_new_tokens: int = 1024
    talker_max_new_tokens: int = 4096
    talker_sampling: SamplingRow | None = None
    first_chunk: int = 20
    chunk: int | None = None
    vocoder_context: int = 34
    dit_chunking: DiTChunking | None = field(default_factory=DiTChunking)
    first_audio_alone: bool = True


def thinker_sampling(generation: dict[str, Any]):
    """``Request -> SamplingRow`` for the thinker: request fields, else generation_config's."""
    greedy = not generation.get("do_sample", False)

    def build(req: Request) -> SamplingRow:
        sp = req.sampling
        return SamplingRow(
            temperature=float(
                sp.or_default("temperature", 0.0 if greedy else generation.get("temperature", 1.0))
            ),
            top_p=float(sp.or_default("top_p", generation.get("top_p", 1.0))),
            top_k=int(sp.or_default("top_k", generation.get("top_k", 0) or 0)),
            repetition_penalty=float(
                sp.or_default("repetition_penalty", generation.get("repetition_penalty", 1.0))
            ),
            min_keep=1,
        )

    return build


def thinker_eos_ids(generation: dict[str, Any], tokenizer) -> tuple[int, ...]:
    """The thinker's end tokens: ``generation_config.json``'s ``eos_token_id`` (an id or a
    list), as transformers' generate stops; ``<|im_end|>`` when the file does not say."""
    eos = generation.get("eos_token_id")
    if eos is None:
        return (int(tokenizer.convert_tokens_to_ids("<|im_end|>")),)
    return tuple(int(i) for i in (eos if isinstance(eos, list) else [eos]))


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


@dataclass
class TalkerState(ARDecodeState):
    """The talker's decode state plus its view of the thinker's rows."""

    rows: Channel = field(default_factory=Channel)
    speaker_bos_id: int | None = None


class TalkerLoop(ARDecodeLoop):
    """AR decode of codec ids conditioned on the thinker's streamed rows.

    ``thinker_rows`` holds the prompt rows ``[L, E]`` first, then one reply row per thinker
    step (``r_0, r_1, ...``, the EOS step's included). The PREFILL waits for ``r_0``; decode
    step ``t`` waits for ``r_t`` until the thinker is done (then TEXT_EOS, then TEXT_PAD).
    """

    def __init__(self, config: ARDecodeConfig, rows_slot: str = "thinker_rows"):
        super().__init__(config)
        self.rows_slot = rows_slot

    def init(self, req: Request, model: ModelInstance, ctx: ProgramContext) -> TalkerState:
        base = super().init(req, model, ctx)
        fields_ = {f.name: getattr(base, f.name) for f in dataclasses.fields(base)}
        return TalkerState(
            **fields_,
            rows=ctx.slots[self.rows_slot],
            speaker_bos_id=ctx.slots["speaker"]["bos_token"],
        )

    def next(self, state: TalkerState) -> WorkPlan | Done | Pending:
        rows = state.rows
        if len(rows) < 2:  # prompt rows and r_0
            return Done() if rows.closed else Pending()
        plan = super().next(state)
        if isinstance(plan, Done):
            return plan
        replies = rows[1:]
        if isinstance(plan.payload, ARPrefillInput):
            replay = []
            for t in range(1, len(state.frames) + 1):
                cond = condition_for_step(t, replies, rows.closed)
                if cond is None:
                    return Pending()
                replay.append(cond)
            prompt = TalkerPrompt(rows[0], replies[0], state.speaker_bos_id, tuple(replay))
            plan.payload = dataclasses.replace(plan.payload, prompt=prompt)
            return plan
        cond = condition_for_step(len(state.frames), replies, rows.closed)
        if cond is None:
            return Pending()
        plan.payload = dataclasses.replace(plan.payload, extra=cond)
        return plan

    def finalize(self, state: TalkerState) -> LoopResult:
        """Under ROLLOUT the recorded prompt is the ``TalkerPrompt`` a replay of the whole
        trajectory needs: the thinker's prompt rows, ``r_0``, the speaker bos id, and the
        condition of every decode step that ran (``T - 1`` for ``T`` recorded frames)."""
        result = super().finalize(state)
        rows = state.rows
        if state.profile is ExecutionProfile.ROLLOUT and len(rows) >= 2:
            replies = rows[1:]
            replay = []
            for t in range(1, len(state.trajectory)):
                # a step ran only once its condition existed, and conditions never change
                cond = condition_for_step(t, replies, rows.closed)
                if cond is None:
                    raise RuntimeError(f"talker step {t} ran without its thinker condition")
                replay.append(cond)
            result.info["prompt"] = TalkerPrompt(
                rows[0], replies[0], state.speaker_bos_id, tuple(replay)
            )
        return result


class _Frontend:
    """Chat template -> prompt ids; voice -> speaker entry of ``spk_dict.pt``."""

    def __init__(self, tokenizer, speakers: dict[str, dict[str, Any]]):
        self.tokenizer = tokenizer
        self.speakers = speakers
        self.default_speaker = next(iter(speakers))

    def speaker_name(self, voice: str | None) -> str:
        """The speaker of ``voice`` (None and OpenAI voice names: the first speaker); also the
        card's ``voice_validator``.

        Raises:
            InvalidRequestError: (code ``unknown_voice``) not a speaker of the checkpoint.
        """
        voice = voice or self.default_speaker
        if voice in OPENAI_VOICES:
            voice = self.default_speaker
        if voice not in self.speakers:
            raise InvalidRequestError(
                f"unknown voice '{voice}'; choose one of {', '.join(self.speakers)} (or an "
                "OpenAI voice name)",
                param="voice",
                code="unknown_voice",
            )
        return voice

    def __call__(self, ctx: ProgramContext) -> None:
        req = ctx.request
        if not req.messages:
            raise InvalidRequestError("messages are required", param="messages")
        voice = self.speaker_name(req.voice)
        messages = [{"role": m.role, "content": m.content} for m in req.messages]
        ids = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=True
        )["input_ids"]
        ctx.slots["thinker_prompt"] = tuple(int(i) for i in ids)
        ctx.slots["speaker"] = self.speakers[voice]
        ctx.usage["input_tokens"] = len(ids)


@dataclass(frozen=True, slots=True, eq=False)
class Token2WavStart:
    """A window's first DENOISE_STEP payload: its codec ids ``[n]``, the voice's ``cond``
    ``[1, enc_emb_dim]`` and ``ref_mel`` ``[1, L, mel_dim]``, the window's initial noise
    float32 ``[repeats n, mel_dim]`` (``frame_noise`` of the request seed, CPU), its first
    mel frame ``offset`` in the utterance and the frames it keeps ``[out_start, out_end)``;
    the SDE's ``noise_level`` (``SamplingParams.flow_noise_level``; 0: the ODE) and
    ``sde_seed`` (the request seed)."""

    codes: tuple[int, ...]
    cond: torch.Tensor
    ref_mel: torch.Tensor
    noise: torch.Tensor
    offset: int = 0
    out_start: int = 0
    out_end: int = 0
    noise_level: float = 0.0
    sde_seed: int = 0


DIT_PREFIX = "token2wav.code2wav_dit_model."
"""The official checkpoint's prefix of the DiT's tensors."""


@dataclass(frozen=True, slots=True, eq=False)
class WindowState:
    """The DiT's state of one window between DENOISE_STEP units: the ODE state and the start
    it came from (what a recorded step's replay needs)."""

    ode: Any
    start: Token2WavStart


class DiTComponent:
    """Runs DENOISE_STEP units: a window's start builds its ODE state (speaker features, the
    window's noise), then every unit is one solver step, all units of a call in the same DiT
    forwards (``batch_invariant``: each unit alone, so its numbers never depend on the batch;
    batched forwards differ from one unit's by float rounding, ~1e-6).

    With SDE noise (the start's ``noise_level`` > 0) each step is a Flow-GRPO policy step
    (``omnistep.runners.flow_matching.sde_terms``); a unit that asks for its record gets a
    ``DenoiseStepRecord`` (``score_steps`` recomputes its log-prob).
    """

    serving: bool = True
    """False on a ``training_copy``: it scores and trains, and never runs units."""

    def __init__(self, dit: DiT, batch_invariant: bool = False):
        self.dit = dit
        self.batch_invariant = batch_invariant
        self.weight_version = 0

    @torch.inference_mode()
    def execute(self, kind: WorkUnitKind, payloads: list[DenoiseInput]) -> list[DenoiseOutput]:
        if not self.serving:
            raise RuntimeError("a training copy of the DiT does not serve")
        if kind is not WorkUnitKind.DENOISE_STEP:
            raise ValueError(f"the DiT cannot run {kind}")
        windows = [p.state if p.state is not None else self._start(p.start) for p in payloads]
        states = [w.ode for w in windows]
        if self.batch_invariant:
            stepped = [new for state in states for new in self.dit.ode_step([state])]
        else:
            stepped = self.dit.ode_step(states)
        outputs = []
        for payload, window, new in zip(payloads, windows, stepped, strict=True):
            result = DiT.finalize(new)[0].T.contiguous() if new.done else None  # [frames, mel]
            record = None
            if payload.record and new.last is not None:
                record = self._record(new.last, window.start)
            outputs.append(DenoiseOutput(WindowState(new, window.start), new.done, result, record))
        return outputs

    def _start(self, start: Token2WavStart) -> WindowState:
        device = self.dit.device
        ode = self.dit.initial_state(
            torch.tensor([start.codes], device=device),
            start.cond.to(device),
            start.ref_mel.to(device),
            noise=start.noise.unsqueeze(0),
            offset=start.offset,
            noise_level=start.noise_level,
            sde_seed=start.sde_seed,
        )
        return WindowState(ode, start)

    def _record(self, step: FlowStep, start: Token2WavStart) -> DenoiseStepRecord:
        frames = step.x.shape[1]
        window = (start.offset, start.out_start, start.out_end, start.offset + frames)
        return DenoiseStepRecord(
            step=step.step,
            t=step.t,
            t_next=step.t_next,
            x=step.x[0].numpy(),
            mean=step.mean[0].numpy(),
            std=step.std,
            x_next=step.x_next[0].numpy(),
            logprob=float(step.logprob[0]),
            window=window,
            weight_version=self.weight_version,
            conditioning=start,
        )

    # -- weights (checkpoint names: ``token2wav.code2wav_dit_model.*``)

    def _weights(self) -> dict[str, torch.Tensor]:
        return {DIT_PREFIX + name: p for name, p in self.dit.named_parameters()}

    def weight_specs(self) -> dict[str, tuple[tuple[int, ...], str]]:
        """``name -> (shape, dtype)`` of every DiT tensor a weight update may change, by the
        official checkpoint's names."""
        return {name: (tuple(t.shape), str(t.dtype)) for name, t in self._weights().items()}

    @torch.no_grad()
    def update_weights(self, tensors: Mapping[str, Any]) -> None:
        """Copy checked tensors (``ModelInstance.check_weights``) into the DiT in place; the
        pre-packed CPU linears repack on their next call (their weights' versions changed)."""
        targets = self._weights()
        for name, value in tensors.items():
            targets[name].copy_(torch.as_tensor(value))

    def training_copy(self) -> DiTComponent:
        """A trainer's copy (``omnistep.layers.training``): its own DiT weights, equal to
        these; it scores (``score_steps``) and hands out ``trainable_weights``, and never
        serves."""
        return training_copy(self)

    def trainable_weights(self, names: list[str] | None = None) -> dict[str, torch.Tensor]:
        """A training copy's DiT parameters by checkpoint name (all when ``names`` is None),
        set to require grad: what a Flow-GRPO trainer's optimizer takes (``score_steps``
        computes from them). Send new values to serving with the engine's
        ``update_weights``.

        Raises:
            ServingWeightsError: this component serves (take ``training_copy()`` first).
            KeyError: a name the DiT does not have.
        """
        require_training_copy(self)
        weights = self._weights()
        chosen = {n: weights[n] for n in (weights if names is None else names)}
        for tensor in chosen.values():
            tensor.requires_grad_(True)
        return chosen

    def score_steps(self, records: list[DenoiseStepRecord]) -> torch.Tensor:
        """The log-probs of recorded SDE steps recomputed (``DiT.step_logprob``: the same code
        as serving), float64 ``[S]`` in the records' order. Autograd follows the caller's
        grad mode on a training copy; on the serving component never (no graph reaches
        serving weights)."""
        with torch.set_grad_enabled(torch.is_grad_enabled() and not self.serving):
            return self._score_steps(records)

    def _score_steps(self, records: list[DenoiseStepRecord]) -> torch.Tensor:
        out = []
        for r in records:
            start: Token2WavStart = r.conditioning
            step = FlowStep(
                step=r.step,
                t=r.t,
                t_next=r.t_next,
                x=torch.as_tensor(r.x)[None],
                mean=torch.as_tensor(r.mean)[None],
                std=r.std,
                x_next=torch.as_tensor(r.x_next)[None],
                logprob=torch.tensor([r.logprob], dtype=torch.float64),
                offset=start.offset,
            )
            codes = torch.tensor([start.codes], device=self.dit.device)
            out.append(
                self.dit.step_logprob(codes, start.cond, start.ref_mel, step, start.noise_level)
            )
        if not out:
            return torch.zeros(0, dtype=torch.float64, device=self.dit.device)
        return torch.cat(out)


def token2wav_starts(repeats: int, mel_dim: int):
    """``make_start`` of the denoise loop: a window's codes, the voice, and the window's rows
    of the request's ``frame_noise`` (drawn once per request, as far as the windows reach,
    kept in the request's ``dit_noise`` slot): a frame's noise depends on the seed and its
    position only, whatever the chunk schedule."""

    def make_start(req: Request, ctx: ProgramContext, items: list[Any], window: Any) -> Any:
        if not items:
            return None
        noise = ctx.slots.get("dit_noise")
        if noise is None:
            noise = ctx.slots["dit_noise"] = FrameNoise(int(req.seed or 0), mel_dim)
        speaker = ctx.slots["speaker"]
        codes = items[window.start // repeats : window.end // repeats]
        return Token2WavStart(
            tuple(int(frame[0]) for frame in codes),
            torch.as_tensor(speaker["cond"]).float(),
            torch.as_tensor(speaker["ref_mel"]).float(),
            noise.rows(window.start, window.end),
            window.start,
            window.out_start,
            window.out_end,
            float(req.sampling.flow_noise_level or 0.0),
            int(req.seed or 0),
        )

    return make_start


def _usage(ctx: ProgramContext) -> None:
    ctx.usage["output_tokens"] = len(ctx.slots["text_ids"])


def build_card(
    path: str | None = None, options: QwenOmniOptions | None = None, **overrides: Any
) -> ModelCard:
    """The Qwen2.5-Omni card on an official checkpoint folder ``path``.

    Raises:
        InvalidRequestError: no path given.
        ModelFilesError: the folder or one of its files is missing (named, with the layout).
    """
    if path is None:
        raise InvalidRequestError(
            "the qwen2_5_omni family needs weights: --model qwen2_5_omni=/path/to/dir",
            param="model",
        )
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
    eos_ids = thinker_eos_ids(files.generation_config(), tokenizer)

    def kv_for(cfg: dict[str, Any]) -> KVCacheConfig:
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        num_kv_heads = cfg.get("num_key_value_heads", cfg["num_attention_heads"])
        return opts.kv_config(cfg["num_hidden_layers"], num_kv_heads, head_dim)

    def build_thinker(device: str):
        check_device(device)
        state = files.tensors("thinker.")
        thinker_embed["weight"] = state.get("model.embed_tokens.weight")
        return load_thinker(state, config, kv_for(text), device, opts.dtype, opts.batch_invariant)

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
        make_sampling=thinker_sampling(files.generation_config()),
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
    frontend = _Frontend(tokenizer, speakers)
    program = Program(
        inputs=("request",),
        nodes=(
            KernelNode(
                "frontend",
                frontend,
                needs=("request",),
                binds=("thinker_prompt", "speaker"),
            ),
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
            KernelNode("usage", _usage, needs=("text_ids", "codes", "samples")),
        ),
    )
    lm_units = (WorkUnitKind.PREFILL, WorkUnitKind.AR_TOKEN)
    return ModelCard(
        card_id=CARD_ID,
        family="qwen2_5_omni",
        components=(
            ComponentSpec("thinker", build_thinker, opts.max_batch_size, "Qwen2.5 thinker LM"),
            ComponentSpec("talker", build_talker, opts.max_batch_size, "codec talker LM"),
            ComponentSpec("dit", build_dit, opts.max_batch_size, "token2wav DiT (flow matching)"),
            ComponentSpec("bigvgan", build_bigvgan, opts.max_batch_size, "token2wav BigVGAN"),
        ),
        loops=(
            LoopSpec(
                "think", LoopKind.AR_DECODE, lm_units, ("thinker",), lambda: ARDecodeLoop(think)
            ),
            LoopSpec("talk", LoopKind.AR_DECODE, lm_units, ("talker",), lambda: TalkerLoop(talk)),
            LoopSpec(
                "denoise",
                LoopKind.DENOISE,
                (WorkUnitKind.DENOISE_STEP,),
                ("dit",),
                lambda: DenoiseLoop(denoise),
            ),
            LoopSpec(
                "vocode",
                LoopKind.AUDIO_DECODE,
                (WorkUnitKind.AUDIO_CHUNK,),
                ("bigvgan",),
                lambda: AudioDecodeLoop(vocode),
            ),
        ),
        program=program,
        capabilities=frozenset({Capability.CHAT_TEXT, Capability.CHAT_AUDIO}),
        sample_rate=24000,
        voices=tuple(speakers),
        default_voice=next(iter(speakers)),
        voice_validator=frontend.speaker_name,
        on_weights_updated=_refresh_talker_text_rows,
        first_audio_alone=opts.first_audio_alone,
        parity=frozenset({"C0", "C1", "C3", "reference"}),
        description="Qwen2.5-Omni: thinker -> talker -> token2wav (DiT + BigVGAN), 24 kHz.",
    )


def _refresh_talker_text_rows(model: ModelInstance, tensors: Mapping[str, Any]) -> None:
    """After a weight update: the talker keeps rows of the thinker's embeddings (the text ids
    it reads); copy them again when those embeddings changed."""
    embed = tensors.get("thinker.model.embed_tokens.weight")
    if embed is not None:
        call_component(model.components["talker"], "refresh_text_embeds", embed)


class _QuietTokenIdChecks(logging.Filter):
    """Drops transformers' ``Model config: X_token_id must be None or an integer within the
    vocabulary`` warnings (14 of them for a Qwen2.5-Omni folder)."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not (
            message.startswith("Model config: ")
            and "_token_id must be `None` or an integer within the vocabulary" in message
        )


def load_tokenizer(root: str):
    """The folder's tokenizer (``AutoTokenizer``, local files only), without transformers'
    warnings about the config's token ids.

    Loading the tokenizer makes transformers read ``config.json`` and check every
    ``*_token_id`` of each sub-config against that sub-config's ``vocab_size``. The official
    talker config holds the thinker's ids (``tts_text_*``, ``vision_*``, ``audio_*``: 151647
    and up) beside its own codec vocabulary of 8448, so seven warnings come for the talker
    (and, in the tests' tiny folders, seven more for their tiny thinker vocabulary). They are
    harmless: those ids index the thinker's text embedding, never the talker's codec
    vocabulary, and omnistep reads config.json itself (transformers' config objects are not
    used).
    """
    from transformers import AutoTokenizer

    logger = logging.getLogger("transformers.configuration_utils")
    quiet = _QuietTokenIdChecks()
    logger.addFilter(quiet)
    try:
        return AutoTokenizer.from_pretrained(root, local_files_only=True)
    finally:
        logger.removeFilter(quiet)
