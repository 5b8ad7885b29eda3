"""The talker's decode loop of Qwen3-Omni: AR decode of 16-codebook frames whose prompt and
per-step text ids come from the thinker's reply as it streams (``ReplyTrack``), on the shared
``ARDecodeLoop``.

The thinker's loop streams each sampled text id (a 1-tuple frame; its EOS is not streamed) on
the ``thinker_ids`` channel. The talker's prefill waits for the reply's first token; decode step
``k`` waits for reply token ``k + 1`` (so the talker runs one token behind the thinker) until
the thinker is done; then ``tts_eos`` once and ``tts_pad`` for every later step (module
docstring of ``talker``). A reply cut by the thinker's token cap ends at its last fed token, as
transformers' ``generate`` (the cut token is never fed to the thinker, so it has no embedding
row there).

A media prompt (a ``ThinkerPrompt``) also needs the thinker's ``accept_hidden_layer`` states
of its audio, image and video tokens: the thinker's loop (``ThinkLoop``) puts them on the
``thinker_media`` channel, ``[tokens, hidden]`` float32, from its first prefill's streamed
rows (one per prompt row, ``Qwen3OmniThinker._stream``), when the request asks for audio;
the talker's prefill waits for them (``talker.TalkerMedia``).

Imports: ``omnistep.core``, ``omnistep.loops``, ``omnistep.runners``, this family's ``talker``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from omnistep.core import (
    Channel,
    Done,
    ExecutionProfile,
    LoopResult,
    Modality,
    ModelInstance,
    Pending,
    ProgramContext,
    Request,
    StepResult,
    WorkPlan,
)
from omnistep.loops.ar_decode import ARDecodeConfig, ARDecodeLoop, ARDecodeState, ARPrefillInput
from omnistep.models.qwen3_omni.talker import (
    ASSISTANT_HEAD,
    TalkerIds,
    TalkerMedia,
    TalkerPrompt,
    assistant_start,
    build_talker_prompt,
)
from omnistep.runners.media_prompt import ThinkerPrompt

MEDIA_SLOT = "thinker_media"
"""The channel of a media prompt's thinker states for the talker (``ThinkLoop``)."""


@dataclass
class ThinkState(ARDecodeState):
    """The thinker's decode state plus the channel its media states go to (None: the
    request does not speak, or its prompt has no media)."""

    media: Channel | None = None


class ThinkLoop(ARDecodeLoop):
    """The Instruct card's thinker loop: ``ARDecodeLoop``, and for a spoken answer to a media
    prompt, the streamed rows of the prompt's placeholder tokens (the thinker's
    ``accept_hidden_layer`` states) put once on ``media_slot`` (module docstring).

    Raises (from ``advance``):
        RuntimeError: the first prefill streamed other than one row per prompt row.
    """

    def __init__(self, config: ARDecodeConfig, media_slot: str = MEDIA_SLOT):
        super().__init__(config)
        self.media_slot = media_slot

    def init(self, req: Request, model: ModelInstance, ctx: ProgramContext) -> ThinkState:
        base = super().init(req, model, ctx)
        fields_ = {f.name: getattr(base, f.name) for f in dataclasses.fields(base)}
        speaks = Modality.AUDIO in req.output_modalities
        media = speaks and isinstance(base.prompt, ThinkerPrompt) and bool(base.prompt.media_rows)
        return ThinkState(**fields_, media=ctx.slots[self.media_slot] if media else None)

    def advance(self, state: ThinkState, result: StepResult) -> ThinkState:
        out = result.output
        if state.media is not None and not out.preempted and len(state.media) == 0:
            prompt = state.prompt
            rows = out.hidden
            if not isinstance(rows, torch.Tensor) or rows.shape[0] != len(prompt.ids):
                raise RuntimeError("the thinker's prefill did not stream one row per prompt row")
            ids = torch.tensor(prompt.ids)
            marks = torch.isin(ids, torch.tensor(prompt.placeholder_ids))
            state.media.put(rows[marks])
        return super().advance(state, result)


class ReplyTrack:
    """The assistant turn's fed ids: the generation prompt's tail (``<|im_start|>assistant\\n``
    and whatever the template put after it), then the thinker's streamed reply ids, at most
    ``cap - 1`` of them (a reply cut at ``cap`` tokens never fed its last one).

    Args:
        head: the thinker prompt's ids from its last ``<|im_start|>assistant`` on.
        reply: the thinker's stream (1-tuples of ids); closed when the thinker is done.
        cap: the thinker's token cap for this request.
        ids: the config's ids (``tts_eos``, ``tts_pad``).
    """

    def __init__(self, head: Sequence[int], reply: Channel, cap: int, ids: TalkerIds):
        self.head = tuple(int(t) for t in head)
        self.reply = reply
        self.cap = cap
        self.ids = ids

    @property
    def closed(self) -> bool:
        """The thinker is done: every fed id is known."""
        return self.reply.closed

    def __len__(self) -> int:
        return len(self.head) + min(len(self.reply), max(0, self.cap - 1))

    def fed(self, i: int) -> int:
        """Fed assistant id ``i`` (``i < len(self)``)."""
        if i < len(self.head):
            return self.head[i]
        return int(self.reply[i - len(self.head)][0])

    def prompt_head(self) -> tuple[int, ...] | None:
        """The first ``ASSISTANT_HEAD`` fed ids, None while they have not arrived."""
        if len(self) < ASSISTANT_HEAD:
            return None
        return tuple(self.fed(i) for i in range(ASSISTANT_HEAD))

    def step_id(self, step: int) -> int | None:
        """The text id decode step ``step`` adds: fed id ``ASSISTANT_HEAD + step``, then
        ``tts_eos`` once the thinker is done, then ``tts_pad``; None while it has not
        arrived."""
        i = ASSISTANT_HEAD + step
        if i < len(self):
            return self.fed(i)
        if not self.closed:
            return None
        return self.ids.tts_eos if i == len(self) else self.ids.tts_pad


@dataclass
class TalkerState(ARDecodeState):
    """The talker's decode state plus the reply it speaks and the thinker prompt (its ids;
    ``media_prompt``: the ``ThinkerPrompt`` of a media prompt, ``media``: the channel of its
    thinker states)."""

    track: ReplyTrack | None = None
    thinker_prompt: tuple[int, ...] = ()
    speaker_id: int = 0
    talker_prompt: TalkerPrompt | None = None
    media_prompt: ThinkerPrompt | None = None
    media: Channel | None = None


class TalkerLoop(ARDecodeLoop):
    """AR decode of Qwen3-Omni talker frames with the thinker's reply as its text track.

    Args:
        config: the loop's settings; ``prompt_slot`` holds the thinker prompt (ids, or a
            ``ThinkerPrompt``), ``eos_token_ids=(codec_eos,)``, ``eos_codebooks=(0,)``.
        ids: the config's ids.
        reply_slot: the channel of the thinker's streamed ids.
        speaker_slot: the slot holding the request's speaker codec id.
        thinker_cap: ``thinker_cap(request)``: the thinker loop's token cap for the request.
        media_slot: the channel of a media prompt's thinker states (``ThinkLoop``).
    """

    def __init__(
        self,
        config: ARDecodeConfig,
        ids: TalkerIds,
        thinker_cap: Callable[[Request], int],
        reply_slot: str = "thinker_ids",
        speaker_slot: str = "speaker",
        media_slot: str = MEDIA_SLOT,
    ):
        super().__init__(config)
        self.ids = ids
        self.thinker_cap = thinker_cap
        self.reply_slot = reply_slot
        self.speaker_slot = speaker_slot
        self.media_slot = media_slot

    def init(self, req: Request, model: ModelInstance, ctx: ProgramContext) -> TalkerState:
        base = super().init(req, model, ctx)
        fields_ = {f.name: getattr(base, f.name) for f in dataclasses.fields(base)}
        media = base.prompt if isinstance(base.prompt, ThinkerPrompt) else None
        prompt = tuple(int(t) for t in (base.prompt if media is None else media.ids))
        head = prompt[assistant_start(prompt, self.ids) :]
        track = ReplyTrack(head, ctx.slots[self.reply_slot], self.thinker_cap(req), self.ids)
        return TalkerState(
            **fields_,
            track=track,
            thinker_prompt=prompt,
            speaker_id=int(ctx.slots[self.speaker_slot]),
            media_prompt=media,
            media=ctx.slots[self.media_slot] if media is not None else None,
        )

    def _talker_media(self, state: TalkerState) -> TalkerMedia | None:
        """The media prompt's ``TalkerMedia`` (None for a text prompt, or while its thinker
        states have not arrived: ``state.media`` still empty).

        Raises:
            RuntimeError: the thinker ended without putting its states.
        """
        prompt = state.media_prompt
        if not prompt.media_rows:  # type: ignore[union-attr]
            rows = torch.zeros(0, 0)
        elif len(state.media) == 0:  # type: ignore[arg-type]
            if state.media.closed:  # type: ignore[union-attr]
                raise RuntimeError("the thinker ended without its media states for the talker")
            return None
        else:
            rows = state.media[0]  # type: ignore[index]
        return TalkerMedia(prompt.placeholder_ids, rows, prompt.positions)  # type: ignore[union-attr]

    def _replay(self, state: TalkerState, steps: int) -> tuple[int, ...] | None:
        texts = []
        for step in range(steps):
            text_id = state.track.step_id(step)  # type: ignore[union-attr]
            if text_id is None:
                return None
            texts.append(text_id)
        return tuple(texts)

    def next(self, state: TalkerState) -> WorkPlan | Done | Pending:
        if state.talker_prompt is None:
            head = state.track.prompt_head()  # type: ignore[union-attr]
            if head is None:  # an empty reply has nothing to speak
                return Done() if state.track.closed else Pending("waiting for the reply")  # type: ignore[union-attr]
            media = None
            if state.media_prompt is not None:
                media = self._talker_media(state)
                if media is None:
                    return Pending("waiting for the thinker's media states")
            state.talker_prompt = build_talker_prompt(
                state.thinker_prompt, head, state.speaker_id, self.ids, media
            )
            state.prompt = state.talker_prompt
        plan = super().next(state)
        if isinstance(plan, Done):
            return plan
        if isinstance(plan.payload, ARPrefillInput):
            replay = self._replay(state, len(state.frames))
            if replay is None:
                return Pending("waiting for the reply")
            prompt = dataclasses.replace(state.talker_prompt, replay_text=replay)
            plan.payload = dataclasses.replace(plan.payload, prompt=prompt)
            return plan
        text_id = state.track.step_id(len(state.frames) - 1)  # type: ignore[union-attr]
        if text_id is None:
            return Pending("waiting for the reply")
        plan.payload = dataclasses.replace(plan.payload, extra=text_id)
        return plan

    def finalize(self, state: TalkerState) -> LoopResult:
        """Under ROLLOUT the recorded prompt is the ``TalkerPrompt`` with the text ids of the
        ``T - 1`` decode steps that ran, so ``score`` replays the trajectory."""
        result = super().finalize(state)
        if state.profile is ExecutionProfile.ROLLOUT and state.talker_prompt is not None:
            replay = self._replay(state, max(0, len(state.trajectory) - 1))
            if replay is None:
                raise RuntimeError("a talker step ran without its text id")
            result.info["prompt"] = dataclasses.replace(state.talker_prompt, replay_text=replay)
        return result
