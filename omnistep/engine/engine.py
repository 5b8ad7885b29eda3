"""AsyncEngine: runs every request's program, with all loops' steps going through one scheduler.

One engine step is: take the next batch from the scheduler, execute it in the executor, fold each
output back into its loop, publish what the loop emitted, and queue the loop's next plan.

``AsyncEngine`` submits, steps, aborts and ends requests; the rest is in collaborators it calls,
one module each: ``Admission`` (EDF request admission, ``admission.py``), ``WeightUpdates``
(weight versions, pause and drain, ``weights.py``), ``Voices`` (clone and forget a voice,
``voices.py``), ``FirstAudioHold`` (``first_audio.py``), and ``measure_occupancy``
(``metrics.py``). Its public methods for them delegate, so callers see one object.
"""

from __future__ import annotations

import asyncio
import logging
import math
import secrets
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterable, Mapping
from typing import Any

from omnistep.core import (
    TEXT_INPUT_SLOT,
    Capability,
    CardValidationError,
    Channel,
    Done,
    EngineOverloadedError,
    InvalidRequestError,
    KernelNode,
    LoopNode,
    ModelInstance,
    ModelNotFoundError,
    Pending,
    ProgramContext,
    Request,
    RequestAbortedError,
    RequestFailedError,
    RequestTimeoutError,
    StepResult,
    StreamChunk,
    WorkPlan,
    check_text,
)
from omnistep.core.request import MAX_SEED
from omnistep.engine.admission import ADMISSION_POLL_S, Admission
from omnistep.engine.config import EngineConfig
from omnistep.engine.deadlines import (
    AdmissionPolicy,
    CapacityMeter,
    PlaybackClock,
    UnitCostMeter,
)
from omnistep.engine.executor import ComponentHealth, Executor, InProcessExecutor, Outcome
from omnistep.engine.first_audio import FirstAudioHold
from omnistep.engine.metrics import EngineMetrics, Occupancy, measure_occupancy
from omnistep.engine.scheduler import Batch, LiveLoop, Scheduler
from omnistep.engine.stream import RequestRun, RequestStream, StreamEnd
from omnistep.engine.voices import Voices
from omnistep.engine.weights import WeightUpdate, WeightUpdates
from omnistep.kv import KVPool, kv_pool

log = logging.getLogger("omnistep.engine")


class AsyncEngine:
    """Serves requests for a set of loaded model instances.

    Args:
        models: loaded card instances; each answers to its card id and aliases.
        config: engine settings.
        executor: runs batches; defaults to ``InProcessExecutor``. A ``RayExecutor`` runs
            them in Ray actors, addressed by model id and component name.

    Raises:
        CardValidationError: (a ValueError) two models claim the same model id.
    """

    def __init__(
        self,
        models: Iterable[ModelInstance],
        config: EngineConfig | None = None,
        executor: Executor | None = None,
    ):
        self.config = config or EngineConfig()
        self.models: dict[str, ModelInstance] = {}
        self._by_id: dict[str, ModelInstance] = {}
        for model in models:
            self.models[model.card.card_id] = model
            for model_id in model.card.model_ids:
                if model_id in self._by_id:
                    raise CardValidationError(
                        f"model id '{model_id}' is claimed by two cards (a model given twice?)"
                    )
                self._by_id[model_id] = model
        self._executor = executor or InProcessExecutor(self.config.num_workers)
        self._busy: Counter[tuple[str, str]] = Counter()
        self._pools: dict[tuple[str, str], KVPool | None] = {}
        self._scheduler = Scheduler(self._max_batch_size, self._kv_pool)
        self._runs: dict[str, RequestRun] = {}
        self._edf = self.config.scheduling == "edf"
        self._capacity = CapacityMeter()
        self._unit_cost = UnitCostMeter()
        self._admission: Admission | None = None  # EDF with an admission guard only
        if self._edf and self.config.admission_guard_s is not None:
            self._admission = Admission(
                AdmissionPolicy(self.config.admission_guard_s, self.config.admission_max_wait_s),
                self._capacity,
                runs=lambda: self._runs.values(),
                unit_seconds=self._unit_seconds,
                parallel=self._parallel,
                release=self._release_held,
                first_audio_s=self.config.first_audio_s,
            )
        self._wake = asyncio.Event()
        self._executor.attach(self.models.values(), wake=self._wake.set)
        self._task: asyncio.Task | None = None
        self._steps: set[asyncio.Task] = set()  # running ``step`` tasks
        self._num_running = 0  # batches dispatched whose executor call has not returned
        self.units_by_kind: Counter[str] = Counter()
        self.batch_sizes: Counter[int] = Counter()
        self.metrics = EngineMetrics(self.models)  # counts for /metrics (omnistep.server.metrics)
        self._weights = WeightUpdates(
            self.models,
            self.resolve,
            busy=self._model_busy,
            runs=lambda: self._runs.values(),
            resume=self._resume_drained,
            wake=self._wake.set,
        )
        self._voices = Voices(self.resolve, self._weights)
        self._first_audio = FirstAudioHold(
            self._scheduler, self._priority, self._wake.set, self._edf
        )

    # ----------------------------------------------------------------- public API
    def resolve(self, model_id: str) -> ModelInstance:
        """The model instance serving ``model_id`` (a card id or alias).

        Raises:
            ModelNotFoundError: no model answers to ``model_id``; its message lists those
                that do (``model_ids``).
        """
        try:
            return self._by_id[model_id]
        except KeyError:
            raise ModelNotFoundError(model_id, self.model_ids()) from None

    def model_ids(self) -> tuple[str, ...]:
        """Every id a request may name, card by card: each card id, then its aliases."""
        return tuple(self._by_id)

    @property
    def weight_versions(self) -> dict[str, int]:
        """The weight version each card runs (0: as loaded), by card id."""
        return self._weights.versions

    def add_request(self, request: Request, clock: PlaybackClock | None = None) -> RequestStream:
        """Validate and start ``request``; returns its stream. Must be called on the event loop.

        Kernel nodes that are ready at submission (tokenize, voice lookup) run here, so bad input
        raises here, before anything is streamed.

        ``clock``: the playback clock of a stream this request continues (e.g. the
        ``RequestStream.clock`` of a WebSocket session's previous sentence): the request's
        deadlines follow it (when the audio already published on it runs out) and its audio
        counts on it; a request continuing a stream that has audio is admitted at once (it is
        no newcomer). None: a new clock, its first audio due ``config.first_audio_s`` after now.

        Raises:
            ModelNotFoundError: unknown model id.
            EngineOverloadedError: ``config.max_queued`` requests are already unfinished.
            ComponentUnavailableError: a component of the model has no live replica (the
                executor replaces a dead one; ``Executor.check_available``).
            InvalidRequestError: duplicate request id, or input the card rejects.
        """
        model = self.resolve(request.model)
        self._executor.check_available(model.card.card_id)
        if len(self._runs) >= self.config.max_queued:
            self.metrics.rejected(model.card.card_id)
            raise EngineOverloadedError(
                f"The server is busy ({self.config.max_queued} requests in progress); "
                "retry shortly.",
                retry_after=self.config.retry_after,
            )
        if request.request_id in self._runs:
            raise InvalidRequestError(
                f"duplicate request id '{request.request_id}'", param="request_id"
            )
        if request.seed is None:
            request.seed = secrets.randbelow(MAX_SEED + 1)
        ctx = ProgramContext(request=request, model=model, profile=request.profile)
        ctx.slots.update({name: request for name in model.card.program.inputs})
        self._bind_text_input(model, ctx)  # replaces the request in TEXT_INPUT_SLOT
        now = time.monotonic()
        continues = clock is not None and clock.started
        if clock is None:
            clock = PlaybackClock(now, self.config.first_audio_s)
        run = RequestRun(model=model, ctx=ctx, stream=RequestStream(request, self, ctx, clock))
        run.clock = clock
        run.waiting_since = now
        # a weight update drains the model, or EDF admission holds a newcomer: it starts later
        if self._weights.hold(run) or (
            self._admission is not None and self._admission.holds(run, now, continues)
        ):
            run.held = []
        self._runs[request.request_id] = run
        try:
            self._advance_program(run)
        except Exception:
            self._release(run)
            raise
        timeout = self.config.request_timeout
        if timeout is not None and not run.finished:
            run.timer = asyncio.get_running_loop().call_later(timeout, self._expire, run)
        self._ensure_running()
        return run.stream

    @staticmethod
    def _bind_text_input(model: ModelInstance, ctx: ProgramContext) -> None:
        """Bind ``TEXT_INPUT_SLOT`` (a program input of a card that reads streamed text) to the
        request's text channel (see ``TEXT_INPUT_SLOT``).

        Raises:
            InvalidRequestError: ``text_input`` on a card without that capability.
        """
        request = ctx.request
        streams = Capability.STREAMING_TEXT_INPUT in model.card.capabilities
        if request.text_input and not streams:
            raise InvalidRequestError(
                f"model '{model.card.card_id}' cannot take text while it speaks (text_input); "
                "send the whole text",
                param="input",
                code="text_input_unsupported",
            )
        if not streams:
            return
        channel = Channel()
        if request.text:
            channel.put(request.text)
        if not request.text_input:
            channel.close()
        ctx.slots[TEXT_INPUT_SLOT] = channel

    def append_text(self, request_id: str, text: str) -> None:
        """Add ``text`` to a running request's input (one made with ``Request.text_input``);
        its loops waiting for text are asked again at once. Empty text changes nothing.

        Raises:
            InvalidRequestError: no such running request, a request not made with
                ``text_input``, text after ``end_text``, or ``text`` not a valid string.
        """
        check_text(text, "text")
        run, channel = self._text_input(request_id)
        if channel.closed:
            raise InvalidRequestError(
                f"request '{request_id}' takes no more text (end_text was called)", param="text"
            )
        if text:
            channel.put(text)
            self._poke(run)

    def end_text(self, request_id: str) -> None:
        """End a running request's input text (idempotent): its loops finish what they have.

        Raises:
            InvalidRequestError: no such running request, or one not made with ``text_input``.
        """
        run, channel = self._text_input(request_id)
        if not channel.closed:
            channel.close()
            self._poke(run)

    def _text_input(self, request_id: str) -> tuple[RequestRun, Channel]:
        run = self._runs.get(request_id)
        if run is None or run.finished:
            raise InvalidRequestError(
                f"request '{request_id}' is not running", param="request_id", code="not_running"
            )
        channel = run.ctx.slots.get(TEXT_INPUT_SLOT)
        if not run.ctx.request.text_input or channel is None:
            raise InvalidRequestError(
                f"request '{request_id}' was not made with text_input", param="request_id"
            )
        return run, channel

    def _poke(self, run: RequestRun) -> None:
        """Ask the request's parked loops again (new input arrived from outside)."""
        try:
            self._repoll(run)
        except Exception as exc:  # noqa: BLE001 - a loop bug fails its request only
            self._fail(run, exc, TEXT_INPUT_SLOT)

    async def update_weights(
        self,
        model_id: str,
        tensors: Mapping[str, Any],
        version: int | None = None,
        mode: str = "pause",
        check_finite: bool = True,
    ) -> int:
        """``apply_weights``; returns only the new version."""
        done = await self.apply_weights(model_id, tensors, version, mode, check_finite)
        return done.version

    async def apply_weights(
        self,
        model_id: str,
        tensors: Mapping[str, Any],
        version: int | None = None,
        mode: str = "pause",
        check_finite: bool = True,
    ) -> WeightUpdate:
        """Swap a model's weights in place, atomically, between steps.

        ``tensors`` use the checkpoint's own names (``ModelInstance.weight_specs``); all are
        checked before anything changes (``ModelInstance.check_weights``: unknown name, wrong
        shape, a dtype that cannot be cast, NaN/Inf values unless ``check_finite`` is False, a
        weight-norm ``v`` with an output channel of norm 0);
        floating tensors of another floating dtype are cast to the model's and listed in the
        answer's ``casts``. Modes:

        - ``"pause"``: the model's units stop being dispatched, running batches finish, the
          weights change, and every request goes on with them (its later steps record the new
          version).
        - ``"drain"``: new requests for the model are held (not refused), the running ones
          finish on the old weights, the weights change, then the held ones start.

        ``version``: the new version number, above the current one (default: the current one
        + 1): versions only go up, so every recorded step's version names one set of weights.
        Every derived copy (pre-packed linears, folded heads, rows another component keeps) is
        refreshed. Updates of one model run one at a time.

        Raises:
            ModelNotFoundError: unknown model id.
            InvalidRequestError: an unknown mode, a ``version`` that is not an integer in
                [0, 2**62] (``MAX_WEIGHT_VERSION``).
            WeightVersionError: ``version`` is not above the current one (nothing changed).
            WeightUpdateError: a tensor the model rejects (see above); nothing changed.
        """
        return await self._weights.apply(model_id, tensors, version, mode, check_finite)

    async def forget_voice(self, model_id: str, spec: str) -> None:
        """Free what the card keeps for a voice that was deleted (its ``voice_forgetter``;
        nothing when the card keeps nothing): the model's units pause, running batches finish,
        the card forgets, work resumes. A spec the card cannot read is ignored (nothing of it
        can be kept).

        Raises:
            ModelNotFoundError: unknown model id.
        """
        await self._voices.forget(model_id, spec)

    async def clone_voice(
        self, model_id: str, audio: Any, sample_rate: int, transcript: str
    ) -> str:
        """Make a voice of ``model_id`` from a reference clip and its transcript; returns the
        voice's spec (what a request may name as its voice; ``POST /v1/audio/voices`` saves it
        under a name).

        Runs the card's ``voice_enroller`` on the engine's enrollment thread (one enrollment
        at a time; seconds at the published sizes), so the event loop and running requests go
        on meanwhile.

        Args:
            audio: float mono samples ``[N]`` (converted to float32).
            sample_rate: their rate in Hz.
            transcript: what the clip says.

        Raises:
            ModelNotFoundError: unknown model id.
            InvalidRequestError: the model cannot clone voices (param ``model``, code
                ``voice_cloning_unsupported``), samples that are not a 1-D float array, a
                sample rate that is not a positive int, or what the card rejects (a clip too
                short or too long, an empty transcript).
        """
        return await self._voices.clone(model_id, audio, sample_rate, transcript)

    def _model_busy(self, card_id: str) -> bool:
        """Whether a batch of the card is being executed."""
        return any(n for (model_id, _), n in self._busy.items() if model_id == card_id)

    def _resume_drained(self, run: RequestRun) -> None:
        """Start a request a weight drain held: its plans join the queue, or the admission
        queue when it is an audio request under EDF admission (still a newcomer)."""
        if self._admission is None or not self._admission.requeue(run):
            self._release_held(run)

    def _release_held(self, run: RequestRun) -> None:
        """Queue the plans a held request's loops made while it waited (admission, a drain)."""
        held, run.held = run.held or [], None
        for live in held:
            if live.plan is not None:
                self._scheduler.enqueue(live, self._priority(run, live))

    async def generate(self, request: Request) -> AsyncIterator[StreamChunk]:
        """Start ``request`` and yield its chunks; closing the iterator early aborts it."""
        stream = self.add_request(request)
        try:
            async for chunk in stream:
                yield chunk
        finally:
            stream.cancel()

    def abort(self, request_id: str, reason: str | None = None) -> bool:
        """Stop a request before its next step and free what it holds; its stream raises
        ``RequestAbortedError`` with ``reason`` (default: "request ID was aborted"). False if
        not running."""
        run = self._runs.get(request_id)
        if run is None:
            return False
        self._end(run, RequestAbortedError(reason or f"request {request_id} was aborted"))
        return True

    def abort_all(self, reason: str | None = None) -> int:
        """``abort`` every unfinished request (a server's shutdown); returns how many."""
        return sum(self.abort(request_id, reason) for request_id in list(self._runs))

    def stats(self) -> dict[str, int]:
        """What the engine holds now, for health checks and leak tests: unfinished requests
        (``waiting_requests`` of them wait for admission), their live loops, units queued in
        the scheduler, batches being executed, and KV cache blocks in use (summed over the
        components that keep a paged KV cache; see ``omnistep.kv.kv_usage``). All are 0 when the
        engine is idle."""
        return self.occupancy().totals()

    def component_health(self) -> list[ComponentHealth]:
        """The replicas of the components the executor runs elsewhere (Ray actors: live,
        recovering, failed, deaths and restarts); empty in process. For ``/health`` and the
        metrics."""
        return self._executor.health()

    def occupancy(self) -> Occupancy:
        """``stats()`` broken down by model, component and loop kind, plus free KV blocks, for
        the Prometheus gauges; every label that can occur is listed, with 0 when idle."""
        return measure_occupancy(
            self.models, self._runs.values(), self._busy, self._scheduler.num_queued
        )

    async def shutdown(self) -> None:
        """Abort every request, stop the step loop and the executor."""
        for request_id in list(self._runs):
            self.abort(request_id)
        task, self._task = self._task, None
        try:
            if task is not None:
                task.cancel()
                # Not ``await task`` under ``suppress(CancelledError)``: that also swallowed a
                # cancellation of the caller (a Ctrl-C or a timeout around shutdown).
                await asyncio.wait({task})
        finally:
            self._executor.close()
            self._voices.close()

    # ----------------------------------------------------------------- step loop
    def _ensure_running(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._step_loop())
        self._wake.set()

    async def _step_loop(self) -> None:
        """Keep up to ``num_workers`` batches running, each in a ``step`` task that folds its
        own batch; sleep until ``_wake`` says a worker freed up or a plan was queued."""
        try:
            while True:
                self._wake.clear()
                if self._admission is not None and self._admission.waiting:
                    self._admission.admit_waiting()
                while self._num_running < self.config.num_workers:
                    batch = self._scheduler.next_batch(self._can_run)
                    if batch is None:
                        break
                    self._busy[(batch.model_id, batch.component)] += 1
                    self._num_running += 1
                    self._capacity.batch_started(time.monotonic())
                    task = asyncio.create_task(self.step(batch))
                    self._steps.add(task)
                    task.add_done_callback(self._step_done)
                await self._sleep()
        finally:  # shutdown cancels this task: leave no step behind
            for task in list(self._steps):
                task.cancel()

    async def _sleep(self) -> None:
        """Wait for ``_wake``; at most ``ADMISSION_POLL_S`` while requests wait for admission
        (admission also changes with time).

        A timer sets the event instead of ``asyncio.wait_for``: on Python 3.11, ``wait_for``
        returns the result instead of raising when its task is cancelled after the awaited
        event fired but before the task resumed (cpython gh-86296), and ``shutdown`` cancels
        this loop right after a step woke it, so the cancellation was lost and ``shutdown``
        hung (Ctrl-C during ``omnistep say --file``)."""
        timer = None
        if self._admission is not None and self._admission.waiting:
            timer = asyncio.get_running_loop().call_later(ADMISSION_POLL_S, self._wake.set)
        try:
            await self._wake.wait()
        finally:
            if timer is not None:
                timer.cancel()

    def _unit_seconds(self, model_id: str, plan: WorkPlan) -> float:
        """A unit's expected run time: its ``resources.est_seconds`` when the loop gives one,
        else its ``num_tokens`` times the measured seconds per token of its component."""
        return plan.resources.est_seconds or self._unit_cost.estimate(
            (model_id, plan.component, plan.kind), plan.resources.num_tokens
        )

    def _parallel(self, model: ModelInstance) -> int:
        """Batches of ``model`` that can run at once: its most concurrent component's
        capacity, at most ``num_workers``."""
        card_id = model.card.card_id
        most = max(
            self._executor.capacity(card_id, spec.name, spec.max_concurrency)
            for spec in model.card.components
        )
        return max(1, min(self.config.num_workers, most))

    def _priority(self, run: RequestRun, live: LiveLoop | None = None) -> float | None:
        """The scheduler priority of the loop's next unit under EDF: the request's playback
        deadline less the unit's expected run time (its ``resources.est_seconds`` when the
        loop gives one, else its ``num_tokens`` times the measured seconds per token of its
        component); None (ready order) under FCFS. A unit of a kind never measured yet goes
        first (-inf): with a cost estimate of 0 it would wait behind every measured unit of
        its request, possibly until they end (a cascade's DiT behind its thinker and talker),
        and it would never be measured. (A prefill whose KV blocks are not free waits in the
        scheduler, whatever its priority: it is not dispatched to fail.)"""
        if not self._edf or run.clock is None:
            return None
        if live is None or live.plan is None:
            return run.clock.deadline()
        plan = live.plan
        key = (live.model_id, plan.component, plan.kind)
        measurable = not plan.resources.est_seconds and plan.resources.num_tokens > 0
        if measurable and not self._unit_cost.known(key):
            return -math.inf
        return run.clock.deadline() - self._unit_seconds(live.model_id, plan)

    def _step_done(self, task: asyncio.Task) -> None:
        self._steps.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("engine step failed", exc_info=task.exception())

    def _can_run(self, model_id: str, component: str) -> bool:
        if self._weights.is_paused(model_id):
            return False
        spec = self.models[model_id].spec(component)
        limit = self._executor.capacity(model_id, component, spec.max_concurrency)
        return self._busy[(model_id, component)] < limit

    async def step(self, batch: Batch) -> None:
        """Execute one batch and fold its outputs back into the loops."""
        model = self.models[batch.model_id]
        tokens = sum(e.plan.resources.num_tokens for e in batch.entries if e.plan is not None)
        try:
            outcomes = await self._executor.run(
                model.components[batch.component],
                batch.kind,
                batch.payloads,
                model_id=batch.model_id,
                name=batch.component,
            )
        finally:
            self._busy[(batch.model_id, batch.component)] -= 1
            self._num_running -= 1
            self._capacity.batch_finished(time.monotonic())
            self._wake.set()
        size = len(batch.entries)
        timed = next((o for o in outcomes if isinstance(o, StepResult)), None)
        if timed is not None:
            self._unit_cost.observe(
                (batch.model_id, batch.component, batch.kind), tokens, timed.seconds
            )
        self.units_by_kind[batch.kind.value] += size
        self.batch_sizes[size] += 1
        self.metrics.batches[(batch.model_id, batch.component, batch.kind, size)] += 1
        for live, outcome in zip(batch.entries, outcomes, strict=True):
            self._fold(live, outcome)

    def _fold(self, live: LiveLoop, outcome: Outcome) -> None:
        live.in_flight = False
        run = self._runs.get(live.request_id)
        if run is None or run.finished:
            live.loop.release(live.state)  # aborted while running: free it now
            return
        plan = live.plan  # names the unit in errors; ``_schedule`` replaces ``live.plan``
        if isinstance(outcome, Exception):
            self._fail(run, outcome, plan.label if plan else live.node.name)
            return
        try:
            live.state = state = live.loop.advance(live.state, outcome)
            if state.outbox:
                self._publish(run, state.outbox)
            self._schedule(run, live)
            if run.parked:
                self._repoll(run)  # releases what waited for the first audio, when it may
            else:
                self._first_audio.update(run)
        except Exception as exc:  # noqa: BLE001 - a loop bug fails its request only
            self._fail(run, exc, plan.label if plan else live.node.name)

    # ----------------------------------------------------------------- programs
    def _advance_program(self, run: RequestRun) -> None:
        """Start every node whose needed slots are bound; finish the request when all are done."""
        progressed = True
        while progressed and not run.finished:
            progressed = False
            for node in run.model.card.program.nodes:
                if node.name in run.started or any(s not in run.ctx.slots for s in node.needs):
                    continue
                run.started.add(node.name)
                progressed = True
                if isinstance(node, KernelNode):
                    node.fn(run.ctx)
                    self._publish(run, run.ctx.outbox)
                    run.done.add(node.name)
                else:
                    self._start_loop(run, node)
        if not run.finished and len(run.done) == len(run.model.card.program.nodes):
            self._end(run, None)
        self._check_progress(run)

    def _start_loop(self, run: RequestRun, node: LoopNode) -> None:
        for slot in node.streams:
            run.ctx.slots[slot] = Channel()
        if node.when is not None and not node.when(run.ctx.request):
            for slot in node.streams:
                run.ctx.slots[slot].close()
            if node.binds:
                run.ctx.slots[node.binds] = None
            run.done.add(node.name)
            return
        loop = run.model.loops[node.loop_id]
        state = loop.init(run.ctx.request, run.model, run.ctx)
        live = LiveLoop(run.ctx.request.request_id, run.model.card.card_id, node, loop, state)
        run.live[node.name] = live
        self._schedule(run, live)

    def _schedule(self, run: RequestRun, live: LiveLoop) -> None:
        """Ask the loop for its next plan: queue it, park the loop (Pending) or finish it."""
        plan = live.loop.next(live.state)
        live.plan = None
        if isinstance(plan, Pending):
            run.parked.append(live)
        elif isinstance(plan, Done):
            self._finish_loop(run, live)
        else:
            live.plan = plan
            if run.held is not None:  # waiting for admission
                run.held.append(live)
                return
            if self._first_audio.hold(run, live):
                return
            self._scheduler.enqueue(live, self._priority(run, live))
            self._wake.set()

    def _finish_loop(self, run: RequestRun, live: LiveLoop) -> None:
        result = live.loop.finalize(live.state)
        live.loop.release(live.state)
        for slot in live.node.streams:
            run.ctx.slots[slot].close()
        del run.live[live.node.name]
        if live.node.binds:
            run.ctx.slots[live.node.binds] = result.value
        if result.trajectory is not None:
            run.ctx.trajectories[live.node.name] = result.trajectory
        if result.info is not None:
            run.ctx.rollout_info[live.node.name] = result.info
        cached = int(result.metrics.get("cached_tokens", 0))
        if cached:  # prompt rows its AR loops found in the prefix cache
            run.ctx.usage["cached_tokens"] = run.ctx.usage.get("cached_tokens", 0) + cached
        run.done.add(live.node.name)
        self._repoll(run)
        self._advance_program(run)

    def _repoll(self, run: RequestRun) -> None:
        """Ask parked loops again (another loop of the request made progress); a request whose
        live loops are all parked can never progress and fails."""
        while run.parked and not run.finished:
            parked, run.parked = run.parked, []
            for live in parked:
                self._schedule(run, live)
            if len(run.parked) == len(parked):
                break
        self._first_audio.update(run)
        self._check_progress(run)

    @staticmethod
    def _check_progress(run: RequestRun) -> None:
        """Raise if the request's loops are all parked: nothing could ever wake them."""
        if not run.parked or run.finished or run.held is not None:
            return
        text_input = run.ctx.slots.get(TEXT_INPUT_SLOT)
        if text_input is not None and not text_input.closed:
            return  # the loops wait for the client's text (the request timeout still applies)
        if not any(live.queued or live.in_flight for live in run.live.values()):
            names = ", ".join(live.node.name for live in run.parked)
            raise RuntimeError(f"program deadlock: loops {names} wait for input that never comes")

    def _publish(self, run: RequestRun, outbox: list[StreamChunk]) -> None:
        clock = run.clock
        for chunk in outbox:
            if chunk.audio is not None and clock is not None and chunk.sample_rate:
                now, seconds = time.monotonic(), len(chunk.audio) / chunk.sample_rate
                if run.audio_s == 0.0 and seconds > 0.0:
                    self.metrics.first_audio(run.model.card.card_id, now - run.waiting_since)
                run.audio_s += seconds
                clock.on_audio(now, seconds)
                self._capacity.on_audio(now, seconds)
            chunk.seq = run.next_seq
            chunk.request_id = run.ctx.request.request_id
            run.next_seq += 1
            run.stream.put(chunk)
        outbox.clear()

    # ----------------------------------------------------------------- endings
    def _expire(self, run: RequestRun) -> None:
        """``config.request_timeout`` passed: abort the request if it is still running."""
        timeout = self.config.request_timeout
        if run.finished or timeout is None:
            return
        log.warning("request %s timed out after %g s", run.ctx.request.request_id, timeout)
        message = f"The request did not finish within the server's {timeout:g} s limit."
        self._end(run, RequestTimeoutError(message, timeout))

    def _fail(self, run: RequestRun, exc: Exception, where: str) -> None:
        log.warning("request %s failed in %s: %r", run.ctx.request.request_id, where, exc)
        if isinstance(exc, InvalidRequestError):  # input found bad late (a kernel node after
            self._end(run, exc)  # ENCODE): the client's error, a 400, not a failure (500)
            return
        error = RequestFailedError(f"{where}: {type(exc).__name__}: {exc}")
        error.__cause__ = exc
        self._end(run, error)

    def _end(self, run: RequestRun, error: BaseException | None) -> None:
        """Finish a request: release its loops and close its stream (with ``error`` if given)."""
        if run.finished:
            return
        self._release(run)
        wall_s = time.monotonic() - run.waiting_since
        self.metrics.request_ended(run.model.card.card_id, error, wall_s, run.audio_s)
        run.stream.put(StreamEnd(error))

    def _release(self, run: RequestRun) -> None:
        run.finished = True
        if run.timer is not None:
            run.timer.cancel()
        run.parked.clear()
        run.held_for_audio.clear()
        for live in run.live.values():
            self._scheduler.remove(live)
            if not live.in_flight:  # in-flight loops are released when their batch returns
                live.loop.release(live.state)
        run.live.clear()
        self._runs.pop(run.ctx.request.request_id, None)
        self._wake.set()  # freed KV blocks may admit a waiting prefill

    def _kv_pool(self, model_id: str, component: str) -> KVPool | None:
        """The component's KV pool for the scheduler's admission (looked up once: the
        components are fixed once the executor attached)."""
        key = (model_id, component)
        if key not in self._pools:
            self._pools[key] = kv_pool(self.models[model_id].components[component])
        return self._pools[key]

    def _max_batch_size(self, model_id: str, component: str) -> int:
        return min(self.config.max_batch_size, self.models[model_id].max_batch_size(component))
