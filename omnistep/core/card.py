"""Model cards: the deployable unit as data (components, loops, program, capabilities).

A family module builds a ``ModelCard`` with a factory; ``ModelInstance.load`` builds its components
on a device, ``ModelInstance.assemble`` takes components built elsewhere (remote stand-ins).
Stdlib only (components are built by the card's own factories).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from omnistep.core.contracts import Component, Loop
from omnistep.core.enums import Capability, LoopKind, WorkUnitKind
from omnistep.core.errors import CardValidationError, InvalidRequestError, WeightUpdateError
from omnistep.core.program import TEXT_INPUT_SLOT, Program

if TYPE_CHECKING:
    from omnistep.core.request import ChatMessage, MediaItem


def call_component(component: Component, method: str, *args: object) -> object:
    """``component.<method>(*args)``, on every replica when the component runs elsewhere (a
    stand-in offering ``call_all``, such as the Ray executor's ``RemoteComponent``). Returns
    the method's result (a remote component's: its first replica's; the replicas hold the
    same weights, so a method computing from them returns the same everywhere)."""
    call_all = getattr(type(component), "call_all", None)
    if callable(call_all):
        return component.call_all(method, *args)  # type: ignore[attr-defined]
    return getattr(component, method)(*args)


def local_method(component: Component, method: str, name: str) -> Callable[..., object]:
    """``component.<method>`` when this process holds the component itself: what needs the
    component's tensors here (``score``'s forwards with autograd) rather than on a replica.

    Raises:
        NotImplementedError: the component has no such method (another family, or a stand-in
            for a component running in another process, as with the Ray executor); ``name``
            is the component's name in the card, for the message.
    """
    bound = getattr(component, method, None)
    if bound is None:
        raise NotImplementedError(
            f"component '{name}' cannot score here: it has no {method} in this process (with "
            "the Ray executor components run in actors; score needs the in-process executor)"
        )
    return bound


def dtype_name(dtype: object) -> str:
    """A dtype's name without its library: ``torch.float32`` and numpy's ``float32`` are both
    ``"float32"`` (weight updates compare them)."""
    return str(dtype).removeprefix("torch.")


FLOAT_DTYPES = frozenset({"float16", "bfloat16", "float32", "float64"})
"""Floating dtypes a weight update may be cast between (by ``dtype_name``)."""


@dataclass
class PreparedWeights:
    """A checked weight update (``ModelInstance.check_weights``).

    Attributes:
        parts: tensors by component, then by checkpoint name, in the model's dtypes.
        casts: one ``"name: from -> to"`` line per tensor cast to the model's dtype.
    """

    parts: dict[str, dict[str, object]] = field(default_factory=dict)
    casts: list[str] = field(default_factory=list)

    def flat(self) -> dict[str, object]:
        """Every tensor by checkpoint name."""
        return {name: value for part in self.parts.values() for name, value in part.items()}


def _library(value: object):
    """The module of ``value``'s array library (``torch`` or ``numpy``) when it is loaded:
    core imports neither, a tensor of one means that one is loaded."""
    import sys

    return sys.modules.get(type(value).__module__.split(".")[0])


def _cast(value: object, dtype: str) -> object | None:
    """``value`` (a torch tensor or numpy array) cast to dtype ``dtype`` (a ``dtype_name``);
    None when its library has no such dtype (numpy has no bfloat16)."""
    lib = _library(value)
    target = getattr(lib, dtype, None) if lib is not None else None
    if target is None:
        return None
    if hasattr(value, "to") and not hasattr(value, "astype"):  # torch
        return value.to(target)  # type: ignore[attr-defined]
    return value.astype(target)  # type: ignore[attr-defined]


def count_nonfinite(value: object) -> int:
    """How many NaN or +-Inf values a floating torch tensor or numpy array holds (0 for
    integer tensors and other objects).

    A torch tensor is first read once by ``torch.aminmax`` (no temporary; a NaN propagates to
    both ends, an Inf shows at one): ~15x faster than ``isfinite`` + sum on a CPU, which
    made the NaN/Inf check most of an in-process ``update_weights`` (900 MB of ChatTTS GPT:
    ~1 s of 1.3 s). Only a tensor that fails it is counted."""
    lib = _library(value)
    if lib is None or not hasattr(lib, "isfinite"):
        return 0
    if lib.__name__ == "torch":
        if not value.is_floating_point() or value.numel() == 0:  # type: ignore[attr-defined]
            return 0
        low, high = lib.aminmax(value)
        if bool(lib.isfinite(low)) and bool(lib.isfinite(high)):
            return 0
        return int((~lib.isfinite(value)).sum())
    if getattr(getattr(value, "dtype", None), "kind", "") not in ("f", "c"):
        return 0
    return int((~lib.isfinite(value)).sum())


@dataclass(frozen=True)
class ComponentSpec:
    """One expert of a card.

    Attributes:
        name: the component's name in the card (``gpt``, ``vocoder``, ``voice``).
        build: ``build(device) -> Component``; ``device`` is ``"cpu"``, ``"cuda"``, ``"cuda:1"``...
            Weights load here, not in the card's factory: the serving process builds every
            card, also when its components run elsewhere (the Ray executor), so the card
            itself holds only what loops and program nodes read (configs, tokenizers).
        max_batch_size: most units of one ShapeSignature this component runs in one call.
        description: one line for ``/v1/models`` and logs.
        max_concurrency: batches of this component that may run at once, on different executor
            workers; more than 1 only for components whose ``execute`` is thread-safe and keeps
            no state between calls that another call could change (an ONNX session does; a KV
            cache does not).
    """

    name: str
    build: Callable[[str], Component]
    max_batch_size: int = 8
    description: str = ""
    max_concurrency: int = 1


@dataclass(frozen=True)
class LoopSpec:
    """A loop of a card.

    Attributes:
        loop_id: unique within the card.
        kind: the loop's LoopKind.
        unit_kinds: the WorkUnitKinds its plans use.
        components: names of the components its plans run on.
        build: ``build() -> Loop``.
    """

    loop_id: str
    kind: LoopKind
    unit_kinds: tuple[WorkUnitKind, ...]
    components: tuple[str, ...]
    build: Callable[[], Loop]


@dataclass(frozen=True)
class ModelCard:
    """The deployable unit.

    Attributes:
        card_id: the model id clients use.
        family: the registry family that built it (``piper``, ``chattts``, ``toy``).
        components, loops, program: see ComponentSpec, LoopSpec, Program.
        capabilities: what endpoints it serves.
        sample_rate: native output sample rate in Hz.
        aliases: other model ids that route here (e.g. ``tts-1``).
        voices: voice names accepted in ``Request.voice`` (None stands for ``default_voice``).
        default_voice: the voice used when a request names none.
        parity: the parity claims its tests enforce (``C0``, ``C1``, ``C3``, ``stream``...).
        description: one line for ``/v1/models``.
        max_starting: under deadline-aware admission, requests of this card that may wait for
            their first audio at once; newcomers beyond it queue until one starts playing.
            Set by cards whose units gain nothing from batching (a burst then starts a few
            at a time, each group once the previous has audio to spare); None (batched AR
            models, where starting together is cheaper) admits a burst at once.
        first_audio_alone: under deadline-aware scheduling, while a request has published no
            audio and a unit of one of its audio stages (its DENOISE and AUDIO_DECODE loops:
            the unit that makes its first chunk, or one on the way to it) is queued or
            running, its AR units wait: the first chunk runs without the request's own
            thinker or talker beside it, which only work ahead of playback then. Set by the
            Qwen2.5-Omni cascade: with the talker beside it, the DiT's first window took 2.4x
            longer on the 2-core CPU (both run Python between their kernels), time to first
            audio 0.34-0.42 s against 0.24-0.26 s alone (tiny checkpoint, ``bench/omni.py``).
            False: a request's units run beside each other whenever workers are free.
            AR plans already queued when an audio-stage unit becomes ready are taken back too
            (the fold whose codes made it ready queues the AR loop's next plan first): on
            ``bench/omni.py`` (C=1 chunked/whole TTFA, paired runs) 0.40-0.45 against
            0.45-0.56 when that step ran beside the first window, C=8 throughput the same
            within noise; Qwen3-TTS (whose talker's second step and first codec chunk both
            wait on the prefill's frame) TTFA p50 0.20-0.23 s at C=1 against 0.28-0.30 s.
        voice_validator: ``voice_validator(voice)`` raises InvalidRequestError (param
            ``voice``) for a voice the card would reject, without running a request; None
            accepts exactly ``voices``. Set by cards that accept more than their named voices
            (ChatTTS speaker strings and ``seed:N``). See ``validate_voice``.
        on_weights_updated: ``on_weights_updated(model, tensors)`` after a weight update, for
            copies one component keeps of another's weights (the Qwen talker's rows of the
            thinker's embeddings; call them with ``call_component``, which also reaches
            components running elsewhere); None: nothing to refresh.
        voice_enroller: ``voice_enroller(model, audio, sample_rate, transcript) -> spec`` makes
            a voice from a reference clip (float32 mono ``[N]`` numpy samples at
            ``sample_rate`` Hz) and what it says: a string that ``validate_voice`` accepts and
            a request may name as its voice (stored as a saved voice's spec). It runs off the
            event loop (``AsyncEngine.clone_voice``) and reaches its components with
            ``call_component``; it raises InvalidRequestError for a clip or transcript it
            rejects. Set with ``Capability.VOICE_CLONING``; None: the card cannot clone.
        media_sample_rate: the rate (Hz) chat audio inputs are resampled to before the card
            sees them (``Capability.AUDIO_INPUT``); 16 kHz is what Whisper-style audio towers
            (Qwen2.5-Omni's) take.
        voice_forgetter: ``voice_forgetter(model, spec)`` when a saved voice is deleted: frees
            what the card keeps for it (Qwen3-TTS: the voice's kept prompt prefix in the
            talker's KV cache). Run between steps (``AsyncEngine.forget_voice``), reaching its
            components with ``call_component``; None: the card keeps nothing per voice.
        transcription_prompt: ``transcription_prompt(audio, language, prompt) -> messages``:
            the chat (a tuple of ``ChatMessage``) that asks the card to transcribe ``audio``
            (a mono float32 ``MediaItem`` at ``media_sample_rate``), in the layout its authors
            use for ASR (e.g. a system prompt, then a user turn holding the audio and an
            instruction); ``language`` (ISO-639-1, or None) and ``prompt`` (text to continue
            or vocabulary to prefer, or None) are OpenAI's transcription hints, which the hook
            may fold into its instruction or ignore. Set with ``Capability.TRANSCRIPTION``;
            None: the card does not transcribe.
        speech_system_prompt: the system prompt the model's authors require for spoken
            answers (Qwen2.5-Omni's "You are Qwen, a virtual human..."): a realtime session
            answering with audio leads its chat with it, verbatim, and puts the session's
            ``instructions`` after it as a second system message. Chat requests are sent as
            the client wrote them. None: the card needs none.
    """

    card_id: str
    family: str
    components: tuple[ComponentSpec, ...]
    loops: tuple[LoopSpec, ...]
    program: Program
    capabilities: frozenset[Capability]
    sample_rate: int
    aliases: tuple[str, ...] = ()
    voices: tuple[str, ...] = ()
    default_voice: str | None = None
    parity: frozenset[str] = field(default_factory=frozenset)
    description: str = ""
    max_starting: int | None = None
    first_audio_alone: bool = False
    voice_validator: Callable[[str], object] | None = field(default=None, compare=False, repr=False)
    on_weights_updated: Callable[[ModelInstance, Mapping[str, object]], None] | None = field(
        default=None, compare=False, repr=False
    )
    voice_enroller: Callable[[ModelInstance, object, int, str], str] | None = field(
        default=None, compare=False, repr=False
    )
    voice_forgetter: Callable[[ModelInstance, str], None] | None = field(
        default=None, compare=False, repr=False
    )
    media_sample_rate: int = 16_000
    transcription_prompt: (
        Callable[[MediaItem, str | None, str | None], tuple[ChatMessage, ...]] | None
    ) = field(default=None, compare=False, repr=False)
    speech_system_prompt: str | None = None

    @property
    def model_ids(self) -> tuple[str, ...]:
        """The card id followed by its aliases."""
        return (self.card_id, *self.aliases)

    def validate_voice(self, voice: str) -> None:
        """Check that a request may name ``voice``, without running one (used to vet saved
        voices).

        Raises:
            InvalidRequestError: (param ``voice``) the card would reject ``voice``; code
                ``unknown_voice`` for a name outside ``voices`` when the card has no
                ``voice_validator``, else the validator's.
        """
        if self.voice_validator is not None:
            self.voice_validator(voice)
        elif voice not in self.voices:
            choices = ", ".join(self.voices) or "none"
            raise InvalidRequestError(
                f"unknown voice '{voice}' for model '{self.card_id}'; choose one of {choices}",
                param="voice",
                code="unknown_voice",
            )

    def validate(self) -> ModelCard:
        """Structural check (parity C0); returns self.

        Raises:
            CardValidationError: duplicate names, loops naming unknown components, program slots
                that no node binds, a default voice outside ``voices``, a bad batch size, the
                program input ``TEXT_INPUT_SLOT`` without ``Capability.STREAMING_TEXT_INPUT``
                or the reverse, ``Capability.VOICE_CLONING`` without a ``voice_enroller`` or
                the reverse, ``Capability.TRANSCRIPTION`` without ``AUDIO_INPUT`` and a
                ``transcription_prompt`` or the reverse.
        """
        comp_names = [c.name for c in self.components]
        loop_ids = [lp.loop_id for lp in self.loops]
        for kind, names in (("component", comp_names), ("loop", loop_ids)):
            if len(set(names)) != len(names):
                raise CardValidationError(f"card '{self.card_id}': duplicate {kind} names {names}")
        for comp in self.components:
            for field_name in ("max_batch_size", "max_concurrency"):
                if getattr(comp, field_name) < 1:
                    raise CardValidationError(
                        f"card '{self.card_id}': component '{comp.name}' {field_name} must be >= 1"
                    )
        for loop in self.loops:
            unknown = [c for c in loop.components if c not in comp_names]
            if unknown:
                raise CardValidationError(
                    f"card '{self.card_id}': loop '{loop.loop_id}' uses unknown components "
                    f"{unknown}"
                )
        if self.default_voice is not None and self.default_voice not in self.voices:
            raise CardValidationError(
                f"card '{self.card_id}': default voice '{self.default_voice}' not in voices"
            )
        if self.sample_rate <= 0:
            raise CardValidationError(f"card '{self.card_id}': sample_rate must be positive")
        clones = Capability.VOICE_CLONING in self.capabilities
        if clones != (self.voice_enroller is not None):
            raise CardValidationError(
                f"card '{self.card_id}': the capability {Capability.VOICE_CLONING} and a "
                "voice_enroller go together"
            )
        transcribes = Capability.TRANSCRIPTION in self.capabilities
        if transcribes != (self.transcription_prompt is not None) or (
            transcribes and Capability.AUDIO_INPUT not in self.capabilities
        ):
            raise CardValidationError(
                f"card '{self.card_id}': the capability {Capability.TRANSCRIPTION} needs "
                f"{Capability.AUDIO_INPUT} and a transcription_prompt, and the reverse"
            )
        streams_text = Capability.STREAMING_TEXT_INPUT in self.capabilities
        if streams_text != (TEXT_INPUT_SLOT in self.program.inputs):
            raise CardValidationError(
                f"card '{self.card_id}': the capability {Capability.STREAMING_TEXT_INPUT} and "
                f"the program input '{TEXT_INPUT_SLOT}' go together"
            )
        self.program.validate(set(loop_ids))
        return self


@dataclass
class ModelInstance:
    """A card with its components built on a device and its loops instantiated."""

    card: ModelCard
    components: dict[str, Component]
    loops: dict[str, Loop]
    device: str = "cpu"

    @classmethod
    def load(cls, card: ModelCard, device: str = "cpu") -> ModelInstance:
        """Validate ``card`` and build every component on ``device`` and every loop.

        Raises:
            CardValidationError: see ``ModelCard.validate``.
            Whatever a component's builder raises (missing files, bad config).
        """
        card.validate()
        components = {spec.name: spec.build(device) for spec in card.components}
        loops = {spec.loop_id: spec.build() for spec in card.loops}
        return cls(card=card, components=components, loops=loops, device=device)

    @classmethod
    def assemble(
        cls, card: ModelCard, components: Mapping[str, Component], device: str = "cpu"
    ) -> ModelInstance:
        """Validate ``card`` and instantiate its loops around ``components`` built elsewhere
        (stand-ins for components that run in other processes), building none of its own.

        ``device`` is where the loops make per-request state (random generators).

        Raises:
            CardValidationError: see ``ModelCard.validate``, or ``components`` not naming
                exactly the card's components.
        """
        card.validate()
        expected = [spec.name for spec in card.components]
        if sorted(components) != sorted(expected):
            raise CardValidationError(
                f"card '{card.card_id}' has components {expected}; got {sorted(components)}"
            )
        loops = {spec.loop_id: spec.build() for spec in card.loops}
        return cls(card=card, components=dict(components), loops=loops, device=device)

    def weight_specs(self) -> dict[str, tuple[str, tuple[int, ...], str]]:
        """Every tensor a weight update may change, by the checkpoint's own name: ``(component,
        shape, dtype)`` (dtype by ``dtype_name``, e.g. ``"float32"``, equal for torch and numpy
        tensors). Read from
        each component that offers ``weight_specs()``; components without it (vocoders,
        ONNX voices) take no updates."""
        specs: dict[str, tuple[str, tuple[int, ...], str]] = {}
        for name, component in self.components.items():
            report = getattr(component, "weight_specs", None)
            if callable(report):
                for tensor, (shape, dtype) in report().items():
                    specs[tensor] = (name, tuple(shape), dtype_name(dtype))
        return specs

    def check_weights(
        self, tensors: Mapping[str, object], check_finite: bool = True
    ) -> PreparedWeights:
        """Check a weight update against ``weight_specs`` without changing anything; returns
        the tensors grouped by component, floating tensors of another floating dtype cast to
        the model's (a published bf16 checkpoint file into a float32 model: each cast listed
        in ``PreparedWeights.casts``).

        ``check_finite`` (default on) refuses floating tensors holding NaN or +-Inf: one pass
        over every value (``count_nonfinite``: one ``aminmax`` read, ~7 GB/s on a CPU core);
        a trainer that checks its own tensors may turn it off. A component may refuse values
        its own way (``weight_problems(tensors) -> list[str]``, always asked: a weight-norm
        ``v`` with an output channel of norm 0, which would fold to NaN).

        Raises:
            WeightUpdateError: an empty update, an unknown name, a tensor whose shape differs
                from the model's or whose dtype cannot be cast to it (integer <-> floating), a
                non-finite value, or a value a component refuses (every problem is listed).
        """
        specs = self.weight_specs()
        if not specs:
            raise WeightUpdateError(
                self.card.card_id, ["this model takes no weight updates (no component offers any)"]
            )
        problems = [] if tensors else ["no tensors given"]
        prepared = PreparedWeights()
        for name, value in tensors.items():
            if name not in specs:
                problems.append(f"unknown tensor '{name}'")
                continue
            component, shape, dtype = specs[name]
            got_shape = tuple(getattr(value, "shape", ()))
            got_dtype = dtype_name(getattr(value, "dtype", type(value).__name__))
            cast = got_dtype != dtype and {got_dtype, dtype} <= FLOAT_DTYPES
            if got_shape == shape and cast:
                value = _cast(value, dtype)
            if got_shape != shape or (got_dtype != dtype and (not cast or value is None)):
                problems.append(
                    f"'{name}' is {got_dtype} {list(got_shape)}, the model's is {dtype} "
                    f"{list(shape)}"
                )
                continue
            bad = count_nonfinite(value) if check_finite else 0
            if bad:
                problems.append(
                    f"'{name}' holds {bad} NaN/Inf value(s) (pass check_finite=False to allow)"
                )
                continue
            if cast:
                prepared.casts.append(f"{name}: {got_dtype} -> {dtype}")
            prepared.parts.setdefault(component, {})[name] = value
        for component, part in prepared.parts.items():
            ask = getattr(self.components[component], "weight_problems", None)
            if callable(ask):
                problems += ask(part)
        if problems:
            raise WeightUpdateError(self.card.card_id, problems)
        return prepared

    def update_weights(
        self,
        tensors: Mapping[str, object] | PreparedWeights,
        version: int,
        check_finite: bool = True,
    ) -> None:
        """Copy ``tensors`` (checkpoint names, see ``weight_specs``) into the components in
        place, all checked first (``check_weights``: on any problem nothing changes; a
        ``PreparedWeights`` was checked already), and set every updated component's
        ``weight_version`` to ``version``. Each component refreshes what it derives from its
        weights (pre-packed linears, folded heads). Call it only between steps: the engine's
        ``update_weights`` does.

        Raises:
            WeightUpdateError: see ``check_weights``.
        """
        if not isinstance(tensors, PreparedWeights):
            tensors = self.check_weights(tensors, check_finite)
        for component, part in tensors.parts.items():
            target = self.components[component]
            target.update_weights(part)  # type: ignore[attr-defined]
            target.weight_version = version  # type: ignore[attr-defined]
        if self.card.on_weights_updated is not None:
            self.card.on_weights_updated(self, tensors.flat())

    def training_copy(self) -> ModelInstance:
        """A trainer's copy of this model: each component offering ``training_copy()`` (those
        that take weight updates and can be scored: AR stacks, a DiT) copied with weights of
        its own, the others (vocoders, ONNX voices: nothing to train) shared; the loops are
        shared (they keep no per-request state). The copy scores and hands out
        ``trainable_weights``; it never serves. Costs one copy of the trained components'
        weights.

        Raises:
            NotImplementedError: no component can be copied here (components running in other
                processes, as with the Ray executor, or a model with nothing to train).
        """
        components: dict[str, Component] = {}
        copied = 0
        for name, component in self.components.items():
            make = getattr(component, "training_copy", None)
            if callable(make):
                components[name] = make()
                copied += 1
            else:
                components[name] = component
        if not copied:
            raise NotImplementedError(
                f"model '{self.card.card_id}' has no component a trainer can copy in this "
                "process (nothing to train, or components running elsewhere, as with Ray)"
            )
        return ModelInstance(self.card, components, self.loops, self.device)

    def spec(self, component: str) -> ComponentSpec:
        """The component's spec. Raises KeyError for an unknown name."""
        for spec in self.card.components:
            if spec.name == component:
                return spec
        raise KeyError(component)

    def max_batch_size(self, component: str) -> int:
        """The component's max batch size from its spec."""
        return self.spec(component).max_batch_size
