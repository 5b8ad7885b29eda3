"""The offline Python API: an engine a script or an RL trainer drives, without a server.

``OmniEngine`` is the synchronous form (vLLM's ``LLM`` habit: build it, call it, close it; usable
from a plain script, from inside a training loop, and from a notebook whose event loop is
running); ``AsyncOmniEngine`` is the same API as coroutines. Both build their engine from the
``FAMILY[=PATH]`` specs ``omnistep serve --model`` takes (``omnistep.launch.load_engine``), on
``cpu`` or ``cuda``, and offer:

- ``generate(texts)``: audio for each text (a progress bar on a terminal, a progress line
  every 5 s elsewhere), ``SpeechOutput``s.
- ``rollout(inputs, n, seed)``: ``n`` samples of each input (a text; for a chat card also a
  conversation: ``ChatMessage``s whose parts hold audio, images or video), a ``RolloutGroup``
  per input. The
  samples of one input form a group (``Request.group``): AR components prefill the input once
  and share its KV blocks by reference. Sample ``k`` runs with seed ``seed + k`` and equals the
  same request sent alone with that seed. Each sample carries, per AR loop of the card's
  program (ChatTTS: ``decode``; Qwen2.5-Omni: ``think`` and ``talk``; toy: ``decode``), every
  sampled action with its log-prob per codebook in the asked mode, the weight version of each
  step, the prompt as the component consumed it, the stop reason and the loop's seed; and the
  audio when asked.
- ``trainer(reference=False)``: a ``Trainer``, the trainer's own copy of the served weights
  (``trainer.weights()`` for the optimizer; a frozen reference copy for a KL term): serving
  changes only through ``update_weights``, so an optimizer step never touches a running
  rollout.
- ``score(samples, trainer=)``: the log-probs of recorded actions recomputed by a
  teacher-forced forward of the same component code with autograd on and no KV cache
  (``PagedARModel.score_logprobs``), on the trainer's copy so a loss backpropagates into
  ``trainer.weights()``; equal to the recorded ones (see ``score``). A loop's samples are
  packed ``batch_size`` per forward (``PagedARModel.score_batch``); ``entropy=True`` adds
  each step's entropy per codebook, ``masked=True`` zeroes the ids ``LoopActions.mask`` says
  were not sampled.
- ``update_weights(tensors, safetensors path or trainer)``: in place, atomically, between
  steps (``AsyncEngine.apply_weights``), versions only going up.

Log-prob modes: ``"processed"``, the distribution actually sampled (temperature, repetition
penalty, top-p/top-k, EOS mask); ``"policy"``, ``log_softmax(logits / temperature)`` with no
truncation, what a PPO/GRPO importance ratio uses.

A product-plane module: imports engine, core, launch, the registry's ``DEFAULT_MODEL`` (and
safetensors for weight files; torch only through the components ``score`` calls).
"""

from __future__ import annotations

import asyncio
import os
import secrets
import sys
import threading
import time
import uuid
from collections.abc import Coroutine, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from omnistep.core import (
    Capability,
    ChatMessage,
    DenoiseStepRecord,
    ExecutionProfile,
    FlowPatches,
    InvalidRequestError,
    LoopNode,
    Modality,
    ModelInstance,
    Request,
    SamplingParams,
    WordTiming,
)
from omnistep.core.request import MAX_SEED
from omnistep.engine import AsyncEngine, WeightUpdate
from omnistep.engine.collect import Collected, collect
from omnistep.engine.openmp import release_openmp_team, releasing
from omnistep.launch import load_engine
from omnistep.models.registry import DEFAULT_MODEL

LOGPROB_MODES = ("processed", "policy")
"""``rollout``'s log-prob modes (see the module docstring)."""
MAX_GROUP_SIZE = 256
"""The most samples ``rollout`` takes per input."""

T = TypeVar("T")


@dataclass(frozen=True)
class SpeechOutput:
    """One text's audio.

    Attributes:
        text: the input text.
        audio: float32 ``[num_samples]`` in [-1, 1], mono.
        sample_rate: Hz of ``audio``.
        seed: the seed the request ran with (drawn when none was given).
        words: each spoken word and its start and end in ``audio`` (seconds), from models
            with word timestamps (hibari, kokoro, piper); empty from the others.
    """

    text: str
    audio: np.ndarray
    sample_rate: int
    seed: int
    words: tuple[WordTiming, ...] = ()

    @property
    def duration_s(self) -> float:
        """Seconds of audio."""
        return self.audio.size / self.sample_rate if self.sample_rate else 0.0


@dataclass(frozen=True)
class LoopActions:
    """The actions one AR loop sampled for one rollout sample.

    Attributes:
        tokens: int64 ``[T, num_codebooks]``: every sampled frame, the last one included (its
            EOS when ``stop_reason`` is ``"eos"``).
        logprobs: float32 ``[T, num_codebooks]``: each id's log-prob in ``mode``.
        mode: ``"processed"`` or ``"policy"``.
        weight_versions: int64 ``[T]``: the weight version each step ran under.
        stop_reason: ``"eos"`` (sampled its EOS) or ``"length"`` (reached its token cap).
        seed: the loop's generator seed.
        prompt: the prompt as the loop's component consumed it (ChatTTS: its
            ``ChatTTSPromptInput``, ids and speaker vector; the Qwen thinker: token ids; the
            Qwen talker: a ``TalkerPrompt`` holding the thinker rows it read, float32
            ``[L, E]`` and ``[E]``, and the condition of each of its ``T - 1`` decode steps;
            the toy: its prompt ids), what a teacher-forced replay (``score``) needs.
        mask: bool ``[T, num_codebooks]``: True where the id was a sampled action, False
            where it was not (an EOS frame's codebooks other than those holding EOS:
            Qwen3-TTS does not sample codebooks 1..15 there and records 0s, ChatTTS samples
            them but drops the frame, so they act on nothing); a loss masks the rest
            (``score(..., masked=True)``). None: every id (built without one).
        routing: a MoE component's routing (Qwen3-Omni's thinker and talker), int16
            ``[T, MoE layers, k]``: for each sampled frame ``i``, the experts each MoE layer
            routed the row whose output frame ``i`` was drawn from (the prompt's last row
            for frame 0, the row fed frame ``i - 1`` after), most probable first, recorded
            from the step's own forward. None: a dense stack (or not recorded).
        prompt_routing: int16 ``[prompt rows - 1, MoE layers, k]``: the same for the
            prompt's other rows (a group's members share their prompt's); with ``routing``
            every row of the teacher-forced forward, what ``score(..., routing_replay=True)``
            replays. None when unknown (a dense stack; rows taken from a prefix cache).
        flow: the loop's continuous actions when each of its steps also solves a flow for
            a patch (VoxCPM2's ``decode``: ``FlowPatches``, every step's patch and, with
            ``flow_noise_level`` > 0, each SDE step's state, mean, std and log-prob
            ``[T, S]``); None for the other loops.
    """

    tokens: np.ndarray
    logprobs: np.ndarray
    mode: str
    weight_versions: np.ndarray
    stop_reason: str
    seed: int
    prompt: Any
    mask: np.ndarray | None = None
    routing: np.ndarray | None = None
    prompt_routing: np.ndarray | None = None
    flow: FlowPatches | None = None

    def replay_routing(self) -> np.ndarray | None:
        """int16 ``[prompt rows - 1 + T, MoE layers, k]``: ``prompt_routing`` then
        ``routing``, one row per row of the teacher-forced forward (Rollout Routing Replay);
        None when either is unknown."""
        if self.routing is None or self.prompt_routing is None:
            return None
        return np.concatenate([self.prompt_routing, self.routing])

    def sampled(self) -> np.ndarray:
        """bool ``[T, num_codebooks]``: ``mask``, or all True when it is None."""
        if self.mask is not None:
            return self.mask
        return np.ones(self.tokens.shape, dtype=bool)

    @property
    def media(self) -> tuple[str, ...]:
        """The ``MediaItem.sha256`` of the media the loop's prompt held, in prompt order (the
        Qwen thinker's prompt over a conversation with audio, images or video); empty
        otherwise."""
        return tuple(getattr(self.prompt, "media", ()) or ())

    @property
    def prompt_ids(self) -> list[int] | None:
        """The prompt's token ids when the loop's prompt is token ids (the Qwen thinker, the
        toy: what ``/v1/score`` replays), else None: ChatTTS's prompt holds a speaker vector
        beside its ids, the Qwen talkers' prompts are rows of another model."""
        return prompt_token_ids(self.prompt)


RolloutInput = str | tuple[ChatMessage, ...]
"""One rollout input: a text, or a conversation (chat cards)."""


def check_rollout_args(
    inputs: str | Sequence[str | ChatMessage | Sequence[ChatMessage]],
    n: int,
    seed: int | None,
    logprobs: str,
) -> tuple[list[RolloutInput], int]:
    """``rollout``'s checks of its arguments, before anything runs: the inputs as a list and
    the base seed (drawn when ``seed`` is None).

    Raises:
        InvalidRequestError: ``n`` outside [1, ``MAX_GROUP_SIZE``], an unknown log-prob mode,
            no inputs, a seed that is not an integer in [0, 2**63-1-n].
    """
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= MAX_GROUP_SIZE:
        raise InvalidRequestError(
            f"n must be an integer in [1, {MAX_GROUP_SIZE}], got {n!r}", param="n"
        )
    if logprobs not in LOGPROB_MODES:
        raise InvalidRequestError(
            f"logprobs must be one of {', '.join(LOGPROB_MODES)}, got {logprobs!r}",
            param="logprobs",
        )
    inputs = [_rollout_input(x, i) for i, x in enumerate(_texts(inputs, "inputs"))]
    if not inputs:
        raise InvalidRequestError("inputs is empty", param="inputs")
    if seed is None:
        seed = secrets.randbelow(MAX_SEED - MAX_GROUP_SIZE + 1)
    if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed <= MAX_SEED - n:
        raise InvalidRequestError(
            f"seed must be an integer in [0, 2**63-1-n], got {seed!r}", param="seed"
        )
    return inputs, seed


def _rollout_input(item: Any, index: int) -> RolloutInput:
    """A rollout input as a text or a tuple of ``ChatMessage``s (one message: a conversation
    of one).

    Raises:
        InvalidRequestError: neither a string nor ``ChatMessage``s (param ``input``, as
            ``Request`` names a bad text; the message names ``inputs[i]``).
    """
    if isinstance(item, str):
        return item
    if isinstance(item, ChatMessage):
        return (item,)
    if isinstance(item, Sequence) and item and all(isinstance(m, ChatMessage) for m in item):
        return tuple(item)
    raise InvalidRequestError(
        f"inputs[{index}] must be a string or a non-empty list of ChatMessage, got "
        f"{type(item).__name__}",
        param="input",
    )


def prompt_token_ids(prompt: Any) -> list[int] | None:
    """``prompt`` as a list of ints when it is a sequence of ints, else None."""
    if isinstance(prompt, str | bytes) or not isinstance(prompt, Sequence | np.ndarray):
        return None
    if not all(isinstance(t, int | np.integer) and not isinstance(t, bool) for t in prompt):
        return None
    return [int(t) for t in prompt]


@dataclass(frozen=True)
class LoopScore:
    """What ``score(..., entropy=True)`` gives per AR loop.

    Attributes:
        logprobs: ``[T, num_codebooks]`` float32, as ``score`` gives without ``entropy``.
        entropy: ``[T, num_codebooks]`` float32: the entropy (nats) of the distribution each
            id was scored under (processed or policy, as the log-probs), with a graph to the
            weights when the log-probs have one; None when not asked for.
        flow: ``[T, S]`` float64: the log-prob of each recorded SDE step of each step's
            patch (a loop with ``LoopActions.flow``: VoxCPM2), else None.
    """

    logprobs: Any
    entropy: Any
    flow: Any = None


@dataclass(frozen=True)
class DenoiseSteps:
    """The SDE steps one denoise loop sampled for one rollout sample (Flow-GRPO policy steps:
    Qwen2.5-Omni's DiT with ``SamplingParams.flow_noise_level`` > 0), window by window and
    step by step, in the order they ran.

    Attributes:
        steps: the ``DenoiseStepRecord`` of each step: ``t``, ``t_next``, ``x``, ``mean``,
            ``x_next`` (float32 ``[frames, mel_dim]`` of its window), ``std``, ``logprob``,
            ``window`` and ``weight_version``; what ``score`` replays.
        noise_level: the SDE's noise scale ``a``.
        seed: the request seed (the initial noise's and the SDE noise's).
    """

    steps: tuple[DenoiseStepRecord, ...]
    noise_level: float
    seed: int

    @property
    def logprobs(self) -> np.ndarray:
        """float64 ``[S]``: each step's Gaussian log-prob summed over its window's elements."""
        return np.array([r.logprob for r in self.steps], dtype=np.float64)

    @property
    def weight_versions(self) -> np.ndarray:
        """int64 ``[S]``: the weight version each step ran under."""
        return np.array([r.weight_version for r in self.steps], dtype=np.int64)


@dataclass(frozen=True)
class RolloutSample:
    """One sample of a group.

    Attributes:
        index: ``k``, its place in the group.
        seed: the request seed, ``seed + k``.
        loops: the actions of each AR loop that ran, by program node name.
        text: the text it streamed (chat cards), else ``""``.
        audio: float32 ``[num_samples]`` when audio was asked for, else None.
        sample_rate: Hz of ``audio`` (0 without audio).
        sampling: the request's ``SamplingParams``: ``score`` rebuilds each loop's sampling
            row from it with the card's ``make_sampling``, as the loop did.
        model: the card id the sample ran on.
        denoise: the SDE steps of each denoise loop that sampled some (cascade cards asked
            for ``flow_noise_level`` > 0), by program node name; empty otherwise.
        replica: the rollout replica that ran it (``RolloutReplicas``: every sample of a
            group has the same one); None when it ran in this process.
    """

    index: int
    seed: int
    loops: dict[str, LoopActions]
    text: str
    audio: np.ndarray | None
    sample_rate: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    model: str = ""
    denoise: dict[str, DenoiseSteps] = field(default_factory=dict)
    replica: int | None = None


@dataclass(frozen=True)
class RolloutGroup:
    """The ``n`` samples of one input.

    Attributes:
        input: the input text, or the conversation (``ChatMessage``s).
        group: the group id its requests carried (``Request.group``).
        samples: ``n`` samples, sample ``k`` at index ``k``.
    """

    input: RolloutInput
    group: str
    samples: list[RolloutSample]


class Trainer:
    """A trainer's own copy of a served model (``AsyncOmniEngine.trainer``): what an RL
    optimizer changes is never what serves. Serving changes only through ``update_weights``
    (which records a new version), so an optimizer step taken while a rollout runs changes
    none of its frames: asynchronous (off-policy) RL is safe.

    Attributes:
        card_id: the served model it copies.
        policy: the copy (``ModelInstance.training_copy``): ``score`` runs on it.
        reference: a frozen copy of the weights as they were when the trainer was made, for
            a KL term (``score(..., reference=True)``), or None (not asked for).
        version: the serving weight version the copy last matched (it was made at, or last
            sent by ``update_weights``).
    """

    def __init__(self, card_id: str, model: ModelInstance, version: int, reference: bool):
        self.card_id = card_id
        self.policy = model.training_copy()
        self.reference = model.training_copy() if reference else None
        self.version = version
        self._taken: dict[str, Any] = {}

    def weights(self, names: Sequence[str] | None = None) -> dict[str, Any]:
        """The copy's tensors by checkpoint name (``ModelInstance.weight_specs``' names; all
        when ``names`` is None), set to require grad: what the optimizer takes. ``score``
        computes from them. ``update_weights(trainer)`` sends every tensor taken here.

        Raises:
            KeyError: a name no copied component has.
        """
        wanted = None if names is None else set(names)
        out: dict[str, Any] = {}
        for component in self.policy.components.values():
            if getattr(component, "serving", True):
                continue  # shared with serving: nothing to train there
            own = list(component.weight_specs())  # type: ignore[attr-defined]
            picked = own if wanted is None else [n for n in own if n in wanted]
            if picked:
                out.update(component.trainable_weights(picked))  # type: ignore[attr-defined]
        missing = sorted((wanted or set()) - set(out))
        if missing:
            raise KeyError(f"no trainable tensor(s) {', '.join(missing[:5])} in {self.card_id}")
        self._taken.update(out)
        return out

    def state(self) -> dict[str, Any]:
        """Detached copies of every tensor ``weights`` handed out: what ``update_weights``
        sends to serving.

        Raises:
            InvalidRequestError: no tensor was taken yet.
        """
        if not self._taken:
            raise InvalidRequestError(
                "the trainer has handed out no weights yet (call trainer.weights() first)",
                param="weights",
            )
        return {name: tensor.detach().clone() for name, tensor in self._taken.items()}


class AsyncOmniEngine:
    """The offline API as coroutines, over an ``AsyncEngine`` (see the module docstring).

    Args:
        engine: a built engine; ``from_specs`` builds one.
    """

    def __init__(self, engine: AsyncEngine):
        self.engine = engine

    @classmethod
    def from_specs(
        cls,
        models: str | Sequence[str] = DEFAULT_MODEL,
        device: str = "cpu",
        *,
        max_batch_size: int = 64,
        kv_cache_gb: float | None = None,
        batch_invariant: bool = False,
        executor: str = "inprocess",
        **options: Any,
    ) -> AsyncOmniEngine:
        """Build and load the models of ``FAMILY[=PATH]`` specs (as ``omnistep serve
        --model``), on ``device`` (``"cpu"``, ``"cuda"``, ``"cuda:N"``).

        ``kv_cache_gb`` and ``batch_invariant`` go to the families that take them (ChatTTS,
        Qwen2.5-Omni); ``batch_invariant`` makes a request's output bit-identical whatever runs
        beside it (what ``score`` parity and group sharing are exact under). ``options``: other
        ``load_engine`` settings (``scheduling``, ``request_timeout``...).

        Raises:
            OmnistepError: an unknown family, missing model files, a missing package.
        """
        specs = [models] if isinstance(models, str) else list(models)
        engine = load_engine(
            specs,
            device,
            max_batch_size,
            executor=executor,
            kv_cache_gb=kv_cache_gb,
            batch_invariant=batch_invariant or None,
            **options,
        )
        return cls(engine)

    @property
    def model_ids(self) -> tuple[str, ...]:
        """Every model name requests may use."""
        return self.engine.model_ids()

    def card_id(self, model: str | None) -> str:
        """The card id serving ``model`` (a model id or alias), or the first served card's id
        for None.

        Raises:
            ModelNotFoundError: no model answers to ``model``.
        """
        if model is not None:
            return self.engine.resolve(model).card.card_id
        return next(iter(self.engine.models))

    async def generate(
        self,
        texts: Sequence[str],
        *,
        model: str | None = None,
        voice: str | None = None,
        seed: int | None = None,
        sampling: SamplingParams | None = None,
        speed: float = 1.0,
        progress: bool | None = None,
    ) -> list[SpeechOutput]:
        """Audio for each text, all submitted at once (they batch; a single string is one
        text). With ``seed``, text ``i`` runs with seed ``seed + i``; without, each draws one
        (reported in its output).

        ``progress``: True: a progress bar; None (default): a bar when stderr is a terminal,
        else a line on stderr every ``PROGRESS_LINE_S`` seconds; False: nothing.

        Raises:
            InvalidRequestError: a bad text, voice or setting (before anything runs).
            RequestFailedError: a request failed while running.
        """
        texts = _texts(texts, "texts")
        card_id = self.card_id(model)
        requests = [
            Request(
                card_id,
                text=text,
                voice=voice,
                speed=speed,
                seed=None if seed is None else seed + i,
                sampling=sampling or SamplingParams(),
            )
            for i, text in enumerate(texts)
        ]
        done = await self._run_all(requests, progress, "speech")
        return [
            SpeechOutput(
                text, c.audio, c.sample_rate, c.seed, tuple(w for k in c.chunks for w in k.words)
            )
            for text, c in zip(texts, done, strict=True)
        ]

    async def rollout(
        self,
        inputs: str | Sequence[str | ChatMessage | Sequence[ChatMessage]],
        *,
        n: int = 1,
        seed: int = 0,
        model: str | None = None,
        voice: str | None = None,
        sampling: SamplingParams | None = None,
        logprobs: str = "processed",
        audio: bool = False,
        progress: bool | None = None,
    ) -> list[RolloutGroup]:
        """``n`` samples of each input under the ROLLOUT profile (see the module docstring).

        Sample ``k`` of every input runs with seed ``seed + k`` (``seed=None``: a random base,
        reported in each sample's ``seed``). A single string is one input. A chat card
        (Qwen2.5-Omni) takes a text input as one user message, or a conversation
        (``ChatMessage``s, their parts holding ``MediaItem``s: audio, images, video, as the
        chat API builds them), and speaks its reply when ``audio`` is set; the thinker loop's
        ``LoopActions.media`` then records the media hashes.
        Give a fixed ``voice`` where the card draws a random speaker per seed (ChatTTS
        without a voice): only equal prompts share their prefill.

        Raises:
            InvalidRequestError: ``n`` outside [1, ``MAX_GROUP_SIZE``], a seed that is not a
                non-negative integer, an unknown log-prob mode, no inputs, an input that is
                not a string, a bad input or setting.
            RequestFailedError: a request failed while running.
        """
        inputs, seed = check_rollout_args(inputs, n, seed, logprobs)
        card_id = self.card_id(model)
        card = self.engine.models[card_id].card
        groups = [f"rollout-{uuid.uuid4().hex[:12]}/{i}" for i in range(len(inputs))]
        requests = [
            self._rollout_request(card, text, voice, seed + k, sampling, audio, group)
            for text, group in zip(inputs, groups, strict=True)
            for k in range(n)
        ]
        done = await self._run_all(requests, progress, "rollout")
        out = []
        for i, (text, group) in enumerate(zip(inputs, groups, strict=True)):
            samples = [
                _sample(k, requests[i * n + k], done[i * n + k], logprobs, audio) for k in range(n)
            ]
            out.append(RolloutGroup(text, group, samples))
        return out

    async def prompts(
        self,
        item: str | Sequence[ChatMessage],
        *,
        seed: int,
        model: str | None = None,
        voice: str | None = None,
        sampling: SamplingParams | None = None,
    ) -> dict[str, Any]:
        """The prompt each AR loop of a rollout sample of ``item`` consumes, by loop name:
        the sample's program run as far as its first token (``max_new_tokens=1``, text out),
        so a sample whose prompt is not plain ids (a conversation with media) can be replayed
        by ``score`` from its input.

        Raises:
            InvalidRequestError: a bad input or setting.
            RequestFailedError: the request failed while running.
        """
        card = self.engine.models[self.card_id(model)].card
        one = replace(sampling or SamplingParams(), max_new_tokens=1, min_new_tokens=None)
        request = self._rollout_request(
            card, _rollout_input(item, 0), voice, seed, one, False, None
        )
        done = await collect(self.engine, request)
        return {name: info.get("prompt") for name, info in done.rollout_info.items()}

    @staticmethod
    def _rollout_request(card, item, voice, seed, sampling, audio, group) -> Request:
        common = {
            "voice": voice,
            "seed": seed,
            "sampling": sampling or SamplingParams(),
            "profile": ExecutionProfile.ROLLOUT,
            "group": group,
        }
        if Capability.TEXT_TO_SPEECH in card.capabilities:
            if not isinstance(item, str):
                raise InvalidRequestError(
                    f"model '{card.card_id}' reads text, not a conversation: give texts",
                    param="inputs",
                )
            return Request(card.card_id, text=item, **common)
        modalities = {Modality.TEXT, Modality.AUDIO} if audio else {Modality.TEXT}
        return Request(
            card.card_id,
            messages=(ChatMessage("user", item),) if isinstance(item, str) else item,
            output_modalities=frozenset(modalities),
            **common,
        )

    async def _run_all(
        self, requests: list[Request], progress: bool | None, label: str
    ) -> list[Collected]:
        """Submit the requests (at most the engine's ``max_queued`` in flight, so any number
        can run); their collected streams, in order (a progress bar counts finished
        requests)."""
        bar = _progress_bar(len(requests), label, progress)
        # The engine refuses more than ``max_queued`` unfinished requests: keep at most that
        # many of these in flight; the rest wait here, in order (a group's samples stay
        # together).
        window = asyncio.Semaphore(max(1, self.engine.config.max_queued))

        async def one(request: Request) -> Collected:
            try:
                async with window:
                    return await collect(self.engine, request)
            finally:
                if bar is not None:
                    bar.update(1)

        streams = [asyncio.ensure_future(one(r)) for r in requests]
        try:
            return list(await asyncio.gather(*streams))
        except BaseException:
            for task in streams:
                task.cancel()
            await asyncio.gather(*streams, return_exceptions=True)
            raise
        finally:
            if bar is not None:
                bar.close()

    async def trainer(self, model: str | None = None, reference: bool = False) -> Trainer:
        """A ``Trainer`` of ``model``: its own copy of the weights served now (and, with
        ``reference``, a frozen second copy for a KL term). Copying runs on a worker thread.

        Raises:
            ModelNotFoundError: an unknown model.
            NotImplementedError: nothing of the model can be copied here (the Ray executor).
        """
        card_id = self.card_id(model)
        instance = self.engine.models[card_id]
        version = self.engine.weight_versions[card_id]
        return await asyncio.to_thread(releasing(Trainer), card_id, instance, version, reference)

    async def score(
        self,
        samples: RolloutSample | RolloutGroup | Sequence[RolloutSample | RolloutGroup],
        *,
        mode: str | None = None,
        loops: Sequence[str] | None = None,
        match_serving: bool = True,
        trainer: Trainer | None = None,
        reference: bool = False,
        entropy: bool = False,
        masked: bool = False,
        batch_size: int = 16,
        routing_replay: bool = False,
    ) -> list[dict[str, Any]]:
        """``score_samples`` on a worker thread (the event loop keeps serving meanwhile);
        see there. The tensors' graphs work from any thread."""
        return await asyncio.to_thread(
            releasing(score_samples),
            self.engine,
            samples,
            mode=mode,
            loops=loops,
            match_serving=match_serving,
            trainer=trainer,
            reference=reference,
            entropy=entropy,
            masked=masked,
            batch_size=batch_size,
            routing_replay=routing_replay,
        )

    async def update_weights(
        self,
        weights: Mapping[str, Any] | str | Path | Trainer,
        *,
        model: str | None = None,
        version: int | None = None,
        mode: str = "pause",
        check_finite: bool = True,
    ) -> int:
        """Swap the weights in place (``AsyncEngine.apply_weights``): ``weights`` are tensors
        by the checkpoint's own names, the path of a safetensors file holding them, or a
        ``Trainer`` (the tensors it handed out; its model unless ``model`` says otherwise, and
        its ``version`` becomes the new one). Returns the new version (``apply_weights`` for
        what was cast).

        Raises:
            FileNotFoundError: no such file.
            InvalidRequestError: a file that is not safetensors.
            WeightVersionError: ``version`` not above the current one (nothing changed).
            WeightUpdateError: an unknown name, a wrong shape, a dtype that cannot be cast,
                NaN/Inf values with ``check_finite`` (nothing changed).
        """
        done = await self.apply_weights(
            weights, model=model, version=version, mode=mode, check_finite=check_finite
        )
        return done.version

    async def apply_weights(
        self,
        weights: Mapping[str, Any] | str | Path | Trainer,
        *,
        model: str | None = None,
        version: int | None = None,
        mode: str = "pause",
        check_finite: bool = True,
    ) -> WeightUpdate:
        """``update_weights``, answering the ``WeightUpdate`` (model, version, casts)."""
        trainer = weights if isinstance(weights, Trainer) else None
        if trainer is not None:
            model = model or trainer.card_id
            tensors: Mapping[str, Any] = await asyncio.to_thread(trainer.state)
        else:
            tensors = await asyncio.to_thread(releasing(read_weights), weights)
        card_id = self.card_id(model)
        done = await self.engine.apply_weights(card_id, tensors, version, mode, check_finite)
        if trainer is not None and card_id == trainer.card_id:
            trainer.version = done.version
        return done

    async def close(self) -> None:
        """Abort what runs and stop the engine."""
        await self.engine.shutdown()


class OmniEngine:
    """The synchronous offline API (see the module docstring): each call runs the matching
    ``AsyncOmniEngine`` coroutine on an event loop in a background thread and waits for it,
    so it works from a plain script, a training loop, or a notebook with a running loop.

    Args: as ``AsyncOmniEngine.from_specs``. Use it as a context manager, or call ``close``.
    """

    def __init__(
        self, models: str | Sequence[str] = DEFAULT_MODEL, device: str = "cpu", **kwargs: Any
    ):
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="omnistep-offline", daemon=True
        )
        self._thread.start()
        try:
            self._async = self._call(_build(models, device, kwargs))
        except BaseException:
            self._stop()
            raise

    @property
    def engine(self) -> AsyncEngine:
        """The engine underneath (its ``stats()``, ``weight_versions``)."""
        return self._async.engine

    @property
    def model_ids(self) -> tuple[str, ...]:
        """Every model name requests may use."""
        return self._async.model_ids

    def generate(self, texts: Sequence[str], **kwargs: Any) -> list[SpeechOutput]:
        """See ``AsyncOmniEngine.generate``."""
        return self._call(self._async.generate(texts, **kwargs))

    def rollout(self, inputs: Sequence[str], **kwargs: Any) -> list[RolloutGroup]:
        """See ``AsyncOmniEngine.rollout``."""
        return self._call(self._async.rollout(inputs, **kwargs))

    def score(
        self,
        samples: RolloutSample | RolloutGroup | Sequence[RolloutSample | RolloutGroup],
        **kwargs: Any,
    ) -> list[dict[str, Any]]:
        """See ``score_samples``; runs on the caller's thread (the engine keeps serving on
        its own)."""
        if not self._thread.is_alive():
            raise RuntimeError("this OmniEngine is closed")
        return score_samples(self.engine, samples, **kwargs)

    def trainer(self, model: str | None = None, reference: bool = False) -> Trainer:
        """See ``AsyncOmniEngine.trainer``."""
        return self._call(self._async.trainer(model, reference))

    def update_weights(
        self, weights: Mapping[str, Any] | str | Path | Trainer, **kwargs: Any
    ) -> int:
        """See ``AsyncOmniEngine.update_weights``."""
        return self._call(self._async.update_weights(weights, **kwargs))

    def apply_weights(
        self, weights: Mapping[str, Any] | str | Path | Trainer, **kwargs: Any
    ) -> WeightUpdate:
        """See ``AsyncOmniEngine.apply_weights``."""
        return self._call(self._async.apply_weights(weights, **kwargs))

    def close(self) -> None:
        """Stop the engine and its thread (idempotent)."""
        if self._thread.is_alive():
            try:
                self._call(self._async.close())
            finally:
                self._stop()

    def __enter__(self) -> OmniEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        if not self._thread.is_alive():
            coro.close()  # never awaited: close it (no "never awaited" warning)
            raise RuntimeError("this OmniEngine is closed")
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        release_openmp_team()  # the caller's thread waits: its idle team would slow the engine's
        try:
            return future.result()  # type: ignore[arg-type]
        except BaseException:
            # Ctrl-C (KeyboardInterrupt) in the caller: the call's requests stop too, instead
            # of running on in the background thread.
            future.cancel()
            raise

    def _stop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)


async def _build(models, device, kwargs) -> AsyncOmniEngine:
    """``AsyncOmniEngine.from_specs`` on the background loop (models load off the caller's
    thread; the engine's asyncio objects belong to that loop)."""
    return await asyncio.to_thread(releasing(AsyncOmniEngine.from_specs), models, device, **kwargs)


def score_samples(
    engine: AsyncEngine,
    samples: RolloutSample | RolloutGroup | Sequence[RolloutSample | RolloutGroup],
    *,
    mode: str | None = None,
    loops: Sequence[str] | None = None,
    match_serving: bool = True,
    trainer: Trainer | None = None,
    reference: bool = False,
    entropy: bool = False,
    masked: bool = False,
    batch_size: int = 16,
    routing_replay: bool = False,
) -> list[dict[str, Any]]:
    """Recompute the log-probs of rollout samples' recorded actions (train = serve).

    For each sample and each of its AR loops, a teacher-forced forward of the loop's
    component over the recorded prompt and frames, with the same layers, kernels and sampling
    processing as serving, no KV cache and autograd on (the caller's grad mode). With a
    ``trainer`` it runs on the trainer's copy, so a loss on the result backpropagates into
    ``trainer.weights()``; with ``reference`` too, on the trainer's frozen reference copy
    (the weights when the trainer was made: a KL term's log-probs). Without one it runs on
    the serving weights, which never require grad (no graph; the numbers are the same while
    the trainer's copy matches the served version). Each step is scored with the loop's
    sampling row for the sample's ``SamplingParams`` (``make_sampling``), the history window
    and frame count the loop gave it. The component's serving state (KV cache, sequences) is
    not touched: this may run while the engine serves.

    Under ``batch_invariant`` the result equals the recorded ``LoopActions.logprobs`` (in the
    same mode) to the bit on CPU; in the default mode it equals them where serving's kernels
    were batch-invariant by themselves, else within float32 rounding (docs/rl.md, "Scoring").
    A sample whose sequence was preempted and recomputed replayed its frames in a prefill's
    shapes: equal within rounding (~1e-6), not to the bit.

    Args:
        samples: a ``RolloutSample``, a ``RolloutGroup``, or a sequence of either (groups are
            flattened in order).
        mode: ``"processed"`` or ``"policy"`` for every loop; None: each loop's recorded mode.
        loops: the loop names to score, or one name (default: all the sample recorded).
        match_serving: ``True`` reruns serving's exact attention calls (one per decoded
            frame); ``False`` one causal attention call over the whole sequence (faster on a
            GPU, equal within ~1e-5).
        entropy: also each step's entropy per codebook (nats) of the distribution scored
            (processed or policy, as the log-probs): each AR loop's value is then a
            ``LoopScore`` (``logprobs``, ``entropy``). Torch families only.
        masked: set the entries that were not sampled (``LoopActions.mask`` False) to 0 in
            the log-probs and entropies (no gradient there): a summed loss ignores them.
        batch_size: trajectories of one loop per teacher-forced forward. The samples' AR
            loops of one card, loop and mode are packed (``PagedARModel.score_batch``: every
            GEMM over all their rows, attention per sequence); each sample's result equals
            its own scoring to the bit under ``batch_invariant``, and within float32
            rounding of the larger GEMMs otherwise (docs/rl.md, "Scoring").
        routing_replay: Rollout Routing Replay for MoE components (Qwen3-Omni's thinker and
            talker): every MoE layer of the teacher-forced forward uses the experts the
            rollout recorded (``LoopActions.replay_routing()``) instead of its router's
            choice, their weights still the router's probabilities (so gradients reach the
            router). Every AR loop scored must have recorded its routing.

    A denoise loop's SDE steps (``RolloutSample.denoise``, Flow-GRPO) are scored the same
    way: each step's mean recomputed by the component's own code (the window's conditioning,
    the RK4 step and the SDE drift) with autograd on, then its Gaussian log-prob at the
    recorded ``x_next``; equal to the recorded ``DenoiseSteps.logprobs`` within float32
    rounding of the mean (relative ~1e-7; bit-equal for a step that ran alone).

    Returns:
        One dict per sample, in order: loop name -> log-probs ``[T, num_codebooks]``
        float32 (the shape of ``LoopActions.logprobs``), row ``i`` for recorded frame ``i``;
        a denoise loop -> float64 ``[S]``, one per recorded step.
        torch families (ChatTTS ``decode``/``refine``, Qwen ``think`` and ``talk``): a
        ``torch.Tensor`` on the component's device with a graph to the weights when grad
        is enabled. The numpy toy: an ``np.ndarray`` (no autograd).

    Raises:
        InvalidRequestError: an unknown mode or loop name, a sample of a model not served (or
            not the trainer's), ``reference`` without a trainer made with one, or
            ``routing_replay`` for a loop that recorded no routing (a dense model).
        NotImplementedError: a loop or component that cannot score (a card's non-AR loop, or
            components running in other processes, as with the Ray executor).
    """
    if mode is not None and mode not in LOGPROB_MODES:
        raise InvalidRequestError(
            f"mode must be one of {', '.join(LOGPROB_MODES)}, got {mode!r}", param="mode"
        )
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
        raise InvalidRequestError(
            f"batch_size must be a positive integer, got {batch_size!r}", param="batch_size"
        )
    copy = _scoring_copy(trainer, reference)
    flat = flatten_samples(samples)
    out: list[dict[str, Any]] = [{} for _ in flat]
    # (card, loop name, mode) -> (sample index, sample, actions): scored together
    pending: dict[tuple[str, str, str], list[tuple[int, RolloutSample, LoopActions]]] = {}
    flows: dict[tuple[str, str, str], list[tuple[int, RolloutSample, LoopActions]]] = {}
    for i, sample in enumerate(flat):
        card_id = sample.model or next(iter(engine.models))
        model = _scoring_model(engine, card_id, copy, trainer)
        for name in _loop_names(sample, loops):
            out[i][name] = None  # keeps the sample's loop order
            if name in sample.denoise:
                loop = model.loops[_loop_id(model, name)]
                out[i][name] = loop.score_steps(model, list(sample.denoise[name].steps))
                continue
            actions = sample.loops[name]
            _check_actions(model, name, actions, i)
            key = (card_id, name, mode or actions.mode)
            if actions.flow is not None:  # an AR loop with an inner flow solve (VoxCPM2)
                flows.setdefault(key, []).append((i, sample, actions))
                continue
            pending.setdefault(key, []).append((i, sample, actions))
    for (card_id, name, loop_mode), items in flows.items():
        model = _scoring_model(engine, card_id, copy, trainer)
        scored = _score_flow_loop(model, name, items, loop_mode, match_serving, entropy, batch_size)
        for (i, _, actions), score in zip(items, scored, strict=True):
            out[i][name] = _masked(score, actions, masked)
    for (card_id, name, loop_mode), items in pending.items():
        model = _scoring_model(engine, card_id, copy, trainer)
        loop = model.loops[_loop_id(model, name)]
        try:
            scores = _score_loop(
                loop,
                model,
                items,
                loop_mode,
                match_serving,
                entropy,
                batch_size,
                f"{card_id}/{name}",
                routing_replay,
            )
        except ValueError as exc:  # recorded actions the component refuses (ids, widths)
            if isinstance(exc, InvalidRequestError):
                raise
            raise InvalidRequestError(
                f"loop '{name}' of '{card_id}' cannot replay these actions: {exc}",
                param="samples",
            ) from exc
        for (i, _, actions), (logprobs, ent) in zip(items, scores, strict=True):
            if masked:
                logprobs, ent = (
                    _mask(logprobs, actions),
                    None if ent is None else _mask(ent, actions),
                )
            out[i][name] = LoopScore(logprobs, ent) if entropy else logprobs
    return out


def with_replayed_conditioning(
    engine: AsyncEngine, sample: RolloutSample, prompts: Mapping[str, Any]
) -> RolloutSample:
    """``sample`` with the ``conditioning`` of every denoise loop's recorded steps rebuilt
    (steps read back from a rollout answer carry none): ``prompts`` (``AsyncOmniEngine.prompts``
    of the sample's input) holds each denoise loop's ``DenoiseReplay``, which rebuilds its
    windows' starts from the sample's actions of the AR loop that streams into it (its frames
    before an EOS frame, as that loop streamed them); the ``k``-th window of the steps (their
    ``window`` changing) takes the ``k``-th start.

    Raises:
        InvalidRequestError: a denoise loop the input's program did not run, or steps of more
            windows than the actions give (param ``groups``).
    """
    model = engine.resolve(sample.model)
    denoise = {}
    for name, steps in sample.denoise.items():
        replay = prompts.get(name)
        if not hasattr(replay, "starts"):
            raise InvalidRequestError(
                f"the conditioning of denoise loop '{name}' cannot be rebuilt from the input",
                param="groups",
            )
        starts = replay.starts(_streamed_items(model, name, sample))
        records, k, window = [], -1, None
        for record in steps.steps:
            if record.window != window:
                k, window = k + 1, record.window
            if k >= len(starts):
                raise InvalidRequestError(
                    f"denoise loop '{name}' recorded steps of more windows than its input makes",
                    param="groups",
                )
            records.append(replace(record, conditioning=starts[k]))
        denoise[name] = replace(steps, steps=tuple(records))
    return replace(sample, denoise=denoise)


def _streamed_items(model: ModelInstance, name: str, sample: RolloutSample) -> list[tuple]:
    """The items denoise loop ``name`` read: the frames of the AR loop whose node streams its
    input slot, up to its EOS frame (an EOS frame is not streamed).

    Raises:
        InvalidRequestError: the sample has no actions of that loop.
    """
    in_slot = model.loops[_loop_id(model, name)].config.in_slot
    feeder = next(
        (node.name for node in model.card.program.nodes if in_slot in getattr(node, "streams", ())),
        None,
    )
    if feeder not in sample.loops:
        raise InvalidRequestError(
            f"denoise loop '{name}' needs the actions of the loop that feeds it ({feeder})",
            param="groups",
        )
    actions = sample.loops[feeder]
    tokens = actions.tokens[: len(actions.tokens) - (actions.stop_reason == "eos")]
    return [tuple(int(t) for t in row) for row in tokens]


def _scoring_model(
    engine: AsyncEngine, card_id: str, copy: ModelInstance | None, trainer: Trainer | None
) -> ModelInstance:
    """The model a sample of ``card_id`` is scored on (the serving one, or ``copy``)."""
    if card_id not in engine.models:
        raise InvalidRequestError(f"model '{card_id}' is not served here", param="model")
    if copy is not None and card_id != trainer.card_id:  # type: ignore[union-attr]
        raise InvalidRequestError(
            f"a sample of '{card_id}' cannot be scored by the trainer of '{trainer.card_id}'",  # type: ignore[union-attr]
            param="samples",
        )
    return engine.models[card_id] if copy is None else copy


def _loop_names(sample: RolloutSample, loops: str | Sequence[str] | None) -> list[str]:
    """The loops of ``sample`` to score (all it recorded when ``loops`` is None)."""
    recorded = [*sample.loops, *sample.denoise]
    if loops is None:
        return recorded
    names = [loops] if isinstance(loops, str) else list(loops)
    for name in names:
        if name not in recorded:
            raise InvalidRequestError(
                f"the sample has no loop '{name}' (it has {', '.join(recorded)})", param="loops"
            )
    return names


def _loop_id(model: ModelInstance, name: str) -> str:
    """The id of the loop program node ``name`` drives.

    Raises:
        InvalidRequestError: the card has no loop node of that name (a sample of another
            model, or a renamed loop).
    """
    for node in model.card.program.nodes:
        if node.name == name and isinstance(node, LoopNode):
            return node.loop_id
    raise InvalidRequestError(
        f"model '{model.card.card_id}' has no loop '{name}': a sample of another model?",
        param="samples",
    )


def _check_actions(model: ModelInstance, name: str, actions: LoopActions, index: int) -> None:
    """Refuse recorded actions no rollout of ``model`` could have made, before any forward:
    an AR loop the card does not run, ``tokens`` that are not integer ``[T >= 1, width]``
    with non-negative ids, a ``mask`` of another shape. (Ids above a codebook's vocab and a
    width the component does not sample are refused by the component's scorer.)

    Raises:
        InvalidRequestError: naming sample ``index`` and loop ``name`` (param ``samples``).
    """
    _loop_id(model, name)
    try:
        tokens = np.asarray(actions.tokens)
    except (TypeError, ValueError):  # ragged
        tokens = np.asarray(None)
    where = f"sample {index}, loop '{name}'"
    if (
        tokens.dtype.kind not in "iu"
        or tokens.ndim != 2
        or tokens.shape[0] < 1
        or tokens.shape[1] < 1
    ):
        raise InvalidRequestError(
            f"{where}: tokens must be an integer array [T >= 1, num_codebooks], got "
            f"{tokens.dtype} {tokens.shape}",
            param="samples",
        )
    if tokens.min() < 0:
        raise InvalidRequestError(f"{where}: tokens hold negative ids", param="samples")
    mask = actions.mask
    if mask is not None and np.shape(mask) != tokens.shape:
        raise InvalidRequestError(
            f"{where}: mask is {np.shape(mask)}, its tokens {tokens.shape}", param="samples"
        )


def _score_loop(
    loop: Any,
    model: ModelInstance,
    items: list[tuple[int, RolloutSample, LoopActions]],
    mode: str,
    match_serving: bool,
    entropy: bool,
    batch_size: int,
    label: str,
    routing_replay: bool = False,
) -> list[tuple[Any, Any]]:
    """``(log-probs, entropy or None)`` of each item's actions: ``batch_size`` trajectories
    per packed forward (``loop.score_batch``), or one by one (``loop.score``) for a loop
    without one; ``routing_replay``: each trajectory's recorded routing replayed.

    Raises:
        InvalidRequestError: ``routing_replay`` for an item that recorded no routing.
        NotImplementedError: a loop that cannot score (or replay routing)."""
    routings = None
    if routing_replay:
        routings = [a.replay_routing() for _, _, a in items]
        if any(r is None for r in routings):
            raise InvalidRequestError(
                f"loop '{label}' recorded no MoE routing to replay (a dense model, or a "
                "prompt taken from a prefix cache): score it without routing_replay",
                param="routing_replay",
            )
    requests = [
        Request(
            model.card.card_id,
            seed=sample.seed,
            sampling=sample.sampling,
            profile=ExecutionProfile.ROLLOUT,
        )
        for _, sample, _ in items
    ]
    batched = getattr(loop, "score_batch", None)
    if batched is not None:
        out: list[tuple[Any, Any]] = []
        for start in range(0, len(items), batch_size):
            part = items[start : start + batch_size]
            prompts = [a.prompt for _, _, a in part]
            tokens = [a.tokens for _, _, a in part]
            reqs = requests[start : start + batch_size]
            if routings is None:
                out += batched(model, reqs, prompts, tokens, mode, match_serving, entropy)
                continue
            replay = routings[start : start + batch_size]
            out += batched(
                model, reqs, prompts, tokens, mode, match_serving, entropy, routing=replay
            )
        return out
    scorer = getattr(loop, "score", None)
    if scorer is None or routings is not None:
        raise NotImplementedError(
            f"loop '{label}' cannot score"
            + (" with routing replay" if routings is not None else "")
        )
    if entropy:
        raise NotImplementedError(f"loop '{label}' gives no entropies")
    return [
        (scorer(model, req, a.prompt, a.tokens, mode, match_serving), None)
        for req, (_, _, a) in zip(requests, items, strict=True)
    ]


def _score_flow_loop(
    model: ModelInstance,
    name: str,
    items: list[tuple[int, RolloutSample, LoopActions]],
    mode: str,
    match_serving: bool,
    entropy: bool,
    batch_size: int,
) -> list[LoopScore]:
    """The ``LoopScore`` (stop log-probs, SDE log-probs in ``flow``) of each item's AR loop
    that recorded ``FlowPatches``: ``batch_size`` samples per packed forward (its loop's
    ``score_patches_batch``)."""
    loop = model.loops[_loop_id(model, name)]
    scorer = getattr(loop, "score_patches_batch", None)
    if scorer is None:
        raise NotImplementedError(f"loop '{name}' cannot score its patches")
    if entropy:
        raise NotImplementedError(f"loop '{name}' gives no entropies")
    out: list[LoopScore] = []
    for start in range(0, len(items), batch_size):
        part = items[start : start + batch_size]
        reqs = [
            Request(
                model.card.card_id,
                seed=sample.seed,
                sampling=sample.sampling,
                profile=ExecutionProfile.ROLLOUT,
            )
            for _, sample, _ in part
        ]
        scores = scorer(
            model,
            reqs,
            [a.prompt for _, _, a in part],
            [a.tokens for _, _, a in part],
            [a.flow for _, _, a in part],
            mode,
            match_serving,
        )
        out += [LoopScore(stop, None, sde) for stop, sde in scores]
    return out


def _masked(score: LoopScore, actions: LoopActions, masked: bool) -> LoopScore:
    return replace(score, logprobs=_mask(score.logprobs, actions)) if masked else score


def _mask(values: Any, actions: LoopActions) -> Any:
    """``values`` ``[T, num_codebooks]`` (numpy or torch) with the ids that were not sampled
    (``LoopActions.mask``) at 0; a torch tensor keeps its graph (no gradient there)."""
    sampled = actions.sampled()
    if isinstance(values, np.ndarray):
        return np.where(sampled, values, 0).astype(values.dtype)
    return values.masked_fill(~values.new_tensor(sampled, dtype=bool), 0.0)


def _scoring_copy(trainer: Trainer | None, reference: bool) -> ModelInstance | None:
    """The model instance ``score_samples`` runs on: the trainer's copy, its reference copy,
    or None (the serving model)."""
    if not reference:
        return None if trainer is None else trainer.policy
    if trainer is None or trainer.reference is None:
        raise InvalidRequestError(
            "reference=True scores on a trainer's frozen copy: make it with "
            "trainer(reference=True) and pass trainer=",
            param="reference",
        )
    return trainer.reference


def flatten_samples(
    samples: RolloutSample | RolloutGroup | Sequence[RolloutSample | RolloutGroup],
) -> list[RolloutSample]:
    """``score``'s samples as one list: groups flattened in order.

    Raises:
        InvalidRequestError: an item that is neither a ``RolloutSample`` nor a ``RolloutGroup``.
    """
    items = [samples] if isinstance(samples, RolloutSample | RolloutGroup) else list(samples)
    flat: list[RolloutSample] = []
    for item in items:
        if isinstance(item, RolloutGroup):
            flat.extend(item.samples)
        elif isinstance(item, RolloutSample):
            flat.append(item)
        else:
            raise InvalidRequestError(
                f"score takes RolloutSample or RolloutGroup items, got {type(item).__name__}",
                param="samples",
            )
    return flat


def _sample(k: int, request: Request, done: Collected, mode: str, audio: bool) -> RolloutSample:
    loops, denoise = {}, {}
    for name, records in done.trajectories.items():
        if records and isinstance(records[0], DenoiseStepRecord):
            level = request.sampling.flow_noise_level or 0.0
            denoise[name] = DenoiseSteps(tuple(records), float(level), int(request.seed or 0))
        else:
            loops[name] = _actions(records, done.rollout_info.get(name, {}), mode)
    return RolloutSample(
        index=k,
        seed=int(request.seed or 0),
        loops=loops,
        text=done.text,
        audio=done.audio if audio else None,
        sample_rate=done.sample_rate if audio else 0,
        sampling=request.sampling,
        model=request.model,
        denoise=denoise,
    )


def _actions(records: list, info: dict, mode: str) -> LoopActions:
    width = len(records[0].tokens) if records else 1
    field_name = "logprobs" if mode == "processed" else "policy_logprobs"
    mask = info.get("mask")
    routing = None
    if records and all(getattr(r, "routing", None) is not None for r in records):
        routing = np.stack([np.asarray(r.routing, dtype=np.int16) for r in records])
    prompt_routing = info.get("prompt_routing")
    return LoopActions(
        routing=routing,
        prompt_routing=None if prompt_routing is None else np.asarray(prompt_routing, np.int16),
        mask=None if mask is None else np.array(mask, dtype=bool).reshape(-1, width),
        tokens=np.array([r.tokens for r in records], dtype=np.int64).reshape(-1, width),
        logprobs=np.array([getattr(r, field_name) for r in records], dtype=np.float32).reshape(
            -1, width
        ),
        mode=mode,
        weight_versions=np.array([r.weight_version for r in records], dtype=np.int64),
        stop_reason=info.get("stop_reason", "length"),
        seed=int(info.get("seed", 0)),
        prompt=info.get("prompt"),
        flow=info.get("flow"),
    )


def read_weights(weights: Mapping[str, Any] | str | Path) -> Mapping[str, Any]:
    """Tensors by name from a mapping or a safetensors file (read with torch when it is
    installed, else as numpy arrays)."""
    if isinstance(weights, Mapping):
        return weights
    if not isinstance(weights, str | os.PathLike):
        raise InvalidRequestError(
            "weights must be a mapping of tensors or a safetensors file path, got "
            f"{type(weights).__name__}",
            param="weights",
        )
    path = Path(weights)
    if not path.is_file():
        raise FileNotFoundError(f"no weights file at {path}")
    try:
        from safetensors.torch import load_file
    except ImportError:  # a numpy-only install (the toy card)
        from safetensors.numpy import load_file
    try:
        return load_file(str(path))
    except Exception as exc:  # safetensors raises its own error type for a bad file
        raise InvalidRequestError(
            f"{path} is not a readable safetensors file: {exc}", param="weights"
        ) from None


def _texts(texts: str | Sequence[str], param: str) -> list[str]:
    """``texts`` as a list: a single string is one text (not its characters).

    Raises:
        InvalidRequestError: not a string or a sequence of them (the check of each text's
            type and content is ``Request``'s).
    """
    if isinstance(texts, str):
        return [texts]
    if not isinstance(texts, Sequence) and not hasattr(texts, "__iter__"):
        raise InvalidRequestError(
            f"{param} must be a string or a list of strings, got {type(texts).__name__}",
            param=param,
        )
    return list(texts)


PROGRESS_LINE_S = 5.0
"""Seconds between the progress lines ``generate`` and ``rollout`` print off a terminal."""


def _progress_bar(total: int, label: str, show: bool | None) -> Any:
    """Progress on stderr: a tqdm bar when ``show`` is True, or None and stderr is a
    terminal; a ``ProgressLines`` when ``show`` is None off a terminal (tqdm's bar would be
    hidden there, so a long run would be silent); None when ``show`` is False. Must be called
    on the event loop."""
    if show is False or total == 0:
        return None
    if show is None and not sys.stderr.isatty():
        return ProgressLines(total, label)
    from tqdm import tqdm

    return tqdm(total=total, desc=label, unit="req", file=sys.stderr)


class ProgressLines:
    """Progress off a terminal: while open, a line on stderr every ``interval`` seconds
    (``omnistep: speech 3/8 done, 15 s``), and a last one at ``close`` if any was printed
    (a run shorter than ``interval`` prints nothing). Created on the event loop.

    Args:
        total: requests to do.
        label: what they are (``speech``, ``rollout``).
        interval: seconds between lines (default ``PROGRESS_LINE_S``).
        stream: where to write (default: stderr at each line).
    """

    def __init__(
        self, total: int, label: str, interval: float | None = None, stream: Any = None
    ) -> None:
        self.total = total
        self.label = label
        self.interval = PROGRESS_LINE_S if interval is None else interval
        self.stream = stream
        self.done = 0
        self.printed = 0
        self.started = time.monotonic()
        self._task = asyncio.get_running_loop().create_task(self._beat())

    def update(self, n: int = 1) -> None:
        """``n`` more requests finished (tqdm's method name)."""
        self.done += n

    def close(self) -> None:
        """Stop the lines; print the last one if any was printed."""
        self._task.cancel()
        if self.printed:
            self._print()

    async def _beat(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            self._print()

    def _print(self) -> None:
        elapsed = time.monotonic() - self.started
        line = f"omnistep: {self.label} {self.done}/{self.total} done, {elapsed:.0f} s"
        print(line, file=self.stream or sys.stderr, flush=True)
        self.printed += 1


__all__ = [
    "LOGPROB_MODES",
    "AsyncOmniEngine",
    "DenoiseSteps",
    "LoopActions",
    "LoopScore",
    "OmniEngine",
    "RolloutGroup",
    "RolloutSample",
    "SpeechOutput",
    "score_samples",
    "with_replayed_conditioning",
]
