"""Generic loops: the chunk schedule, edge-only trimming, stage overlap and deadlock detection."""

import numpy as np
import pytest

from omnistep.audio import trim_silence
from omnistep.core import (
    Capability,
    ComponentSpec,
    LoopKind,
    LoopNode,
    LoopSpec,
    Modality,
    ModelCard,
    ModelInstance,
    Pending,
    Program,
    Request,
    SamplingParams,
    StepResult,
    WorkUnitKind,
)
from omnistep.core.program import Channel
from omnistep.engine import AsyncEngine
from omnistep.loops import AudioDecodeConfig, AudioDecodeLoop
from omnistep.loops.audio_decode import AudioDecodeState
from omnistep.models.toy.card import build_card as build_toy
from omnistep.models.toy.lm import ToyLM
from omnistep.parity import collect


def _loop(**kw) -> AudioDecodeLoop:
    cfg = dict(
        loop_id="a",
        component="v",
        in_slot="s",
        sample_rate=10,
        first_chunk=2,
        chunk=4,
        left_context=3,
        lookahead=2,
    )
    return AudioDecodeLoop(AudioDecodeConfig(**{**cfg, **kw}))


def test_chunk_schedule_waits_for_lookahead_and_flushes_on_close():
    loop = _loop()
    assert loop.chunk_bounds(0, 0, 3, closed=False) is None  # needs 2 + 2 frames
    assert loop.chunk_bounds(0, 0, 4, closed=False) == (2, 4)
    assert loop.chunk_bounds(1, 2, 7, closed=False) is None
    assert loop.chunk_bounds(1, 2, 8, closed=False) == (6, 8)
    assert loop.chunk_bounds(2, 6, 8, closed=True) == (8, 8)
    assert loop.chunk_bounds(3, 8, 8, closed=True) is None


def test_chunks_grow_geometrically_up_to_the_cap():
    loop = _loop(chunk=4, chunk_growth=2.0, max_chunk=20)
    assert [loop.config.chunk_size(i) for i in range(6)] == [2, 4, 8, 16, 20, 20]
    assert [_loop().config.chunk_size(i) for i in range(4)] == [2, 4, 4, 4]
    # chunk 2 (8 frames) starts at frame 6 and waits for 2 frames of look-ahead
    assert loop.chunk_bounds(2, 6, 15, closed=False) is None
    assert loop.chunk_bounds(2, 6, 16, closed=False) == (14, 16)
    with pytest.raises(ValueError, match="chunk_growth"):
        _loop(chunk_growth=0.5)
    with pytest.raises(ValueError, match="max_chunk"):
        _loop(max_chunk=3)


def test_plan_carries_left_context_and_lookahead():
    loop = _loop()
    channel = Channel()
    for i in range(12):
        channel.put(i)
    state = AudioDecodeState(request_id="r", loop_id="a", channel=channel, decoded=6, step=2)
    plan = loop.next(state)
    assert plan.payload.frames == tuple(range(3, 12))
    assert (plan.payload.left, plan.payload.chunk, plan.payload.right) == (3, 4, 2)
    empty = AudioDecodeState(request_id="r", loop_id="a", channel=Channel())
    assert isinstance(loop.next(empty), Pending)


def test_stream_state_sends_new_frames_with_the_stream_id_and_frees_on_release():
    """``stream_state``: units carry only the chunk's frames, ``left`` 0, the request's
    ``seq_id`` and the chunk's start; batching keys are bucketed chunk sizes; ``release`` frees
    the component's state (once) and a component without ``free_sequence`` is fine."""

    class Owner:
        freed: list[str] = []

        def free_sequence(self, seq_id: str) -> None:
            self.freed.append(seq_id)

    with pytest.raises(ValueError, match="stream_state needs left_context 0"):
        _loop(stream_state=True)
    loop = _loop(left_context=0, lookahead=0, stream_state=True, window_buckets=(2, 4))
    channel = Channel()
    for i in range(9):
        channel.put(i)
    channel.close()
    owner = Owner()
    model = type("M", (), {"components": {"v": owner}})()
    ctx = type("Ctx", (), {"slots": {"s": channel}})()
    state = loop.init(Request("m", text="x", request_id="r1"), model, ctx)
    state.decoded, state.step = 6, 2
    plan = loop.next(state)  # the last chunk: 3 frames (the channel is closed at 9)
    assert plan.payload.frames == (6, 7, 8)
    assert (plan.payload.left, plan.payload.chunk, plan.payload.start) == (0, 3, 6)
    assert plan.payload.seq_id == "r1/a" and plan.shape.dims == (4,)
    loop.release(state)
    loop.release(state)
    assert owner.freed == ["r1/a"]
    stateless = _loop()
    plain = stateless.init(Request("m", text="x", request_id="r2"), None, ctx)
    assert plain.seq_id is None and stateless.next(plain).payload.seq_id is None
    stateless.release(plain)  # nothing to free, no component needed
    bare = type("M", (), {"components": {"v": object()}})()
    loop.release(loop.init(Request("m", text="x"), bare, ctx))  # no free_sequence: fine


def test_trimming_drops_only_edges():
    rng = np.random.default_rng(0)
    pieces = [
        np.zeros(5),
        np.r_[np.zeros(3), rng.normal(size=4)],
        np.zeros(6),
        np.r_[rng.normal(size=3), np.zeros(2)],
        np.zeros(4),
    ]
    loop = _loop(trim_threshold=1e-3)
    state = AudioDecodeState(request_id="r", loop_id="a", channel=Channel())
    out = [p for piece in pieces for p in loop._trim(state, piece.astype(np.float32))]
    expected = trim_silence(np.concatenate(pieces).astype(np.float32), threshold=1e-3)
    assert np.array_equal(np.concatenate(out), expected)
    assert (np.concatenate(out) == 0).sum() == 6 + 0, "interior silence is kept"


async def test_audio_starts_before_decoding_ends():
    eng = AsyncEngine([ModelInstance.load(build_toy())])
    out = await collect(
        eng, Request("toy", text="overlap", seed=2, sampling=SamplingParams(max_new_tokens=40))
    )
    await eng.shutdown()
    kinds = [c.modality for c in out.chunks]
    first_audio = kinds.index(Modality.AUDIO)
    last_text = len(kinds) - 1 - kinds[::-1].index(Modality.TEXT)
    assert first_audio < last_text, "the vocoder loop must run while tokens are decoded"


@pytest.mark.parametrize(("first", "chunk", "lookahead"), [(1, 3, 0), (2, 5, 2), (7, 7, 4)])
async def test_chunk_schedule_does_not_change_the_audio(first, chunk, lookahead):
    """The toy vocoder is frame-local, so any schedule must give the same samples."""
    reqs = [Request("toy", text="same audio", seed=4, sampling=SamplingParams(max_new_tokens=30))]
    base = ModelInstance.load(build_toy())
    other = ModelInstance.load(
        build_toy(first_chunk=first, chunk_tokens=chunk, lookahead=lookahead)
    )
    outs = []
    for model in (base, other):
        eng = AsyncEngine([model])
        outs.append(
            await collect(
                eng,
                reqs[0].__class__(
                    **{f: getattr(reqs[0], f) for f in ("model", "text", "seed", "sampling")}
                ),
            )
        )
        await eng.shutdown()
    assert np.array_equal(outs[0].audio, outs[1].audio)


class _Stuck:
    loop_id = "stuck"
    kind = LoopKind.AUDIO_DECODE

    def init(self, req, model, ctx):
        from omnistep.core import LoopState

        return LoopState(request_id=req.request_id, loop_id=self.loop_id)

    def next(self, state):
        return Pending()

    def advance(self, state, result: StepResult):
        return state

    def finalize(self, state):
        raise AssertionError("never finishes")

    def release(self, state):
        pass


async def test_a_loop_waiting_forever_fails_its_request():
    card = ModelCard(
        card_id="stuck",
        family="test",
        components=(ComponentSpec("lm", ToyLM),),
        loops=(
            LoopSpec("stuck", LoopKind.AUDIO_DECODE, (WorkUnitKind.AUDIO_CHUNK,), ("lm",), _Stuck),
        ),
        program=Program(
            nodes=(LoopNode("wait", "stuck", needs=("request",)),), inputs=("request",)
        ),
        capabilities=frozenset({Capability.TEXT_TO_SPEECH}),
        sample_rate=8000,
    )
    eng = AsyncEngine([ModelInstance.load(card)])
    with pytest.raises(RuntimeError, match="deadlock"):
        eng.add_request(Request("stuck", text="x"))
    assert eng.stats()["live_requests"] == 0
    await eng.shutdown()


class _ScriptedLM:
    """Answers PREFILL/AR_TOKEN units with a fixed token script; hidden = the step index."""

    def __init__(self, script):
        self.script = script
        self.freed = []

    def execute(self, kind, payloads):
        from omnistep.loops.ar_decode import ARPrefillInput, ARStepOutput

        outs = []
        for p in payloads:
            step = len(p.generated) if isinstance(p, ARPrefillInput) else p.num_generated
            outs.append(ARStepOutput((self.script[step],), (0.0,), hidden=step))
        return outs

    def free_sequence(self, seq_id):
        self.freed.append(seq_id)


@pytest.mark.parametrize("stream_on_eos", [False, True])
async def test_ar_loop_detokenizes_streams_and_stops_on_any_eos(stream_on_eos):
    from omnistep.core import KernelNode
    from omnistep.loops.ar_decode import ARDecodeConfig, ARDecodeLoop

    script = [ord(c) for c in "héllo wörld"] + [1, 99]  # 1 and 2 are both EOS
    lm = _ScriptedLM(script)
    cfg = ARDecodeConfig(
        loop_id="lm",
        component="lm",
        prompt_slot="prompt",
        make_sampling=lambda req: None,
        eos_token_ids=(2, 1),
        stream_slot="rows",
        stream_hidden=True,
        stream_on_eos=stream_on_eos,
        detokenize=lambda ids: "".join(map(chr, ids)),
    )
    seen = {}

    def keep(ctx):
        seen["rows"] = list(ctx.slots["rows"])

    card = ModelCard(
        card_id="scripted",
        family="test",
        components=(ComponentSpec("lm", lambda device: lm),),
        loops=(
            LoopSpec(
                "lm",
                LoopKind.AR_DECODE,
                (WorkUnitKind.PREFILL, WorkUnitKind.AR_TOKEN),
                ("lm",),
                lambda: ARDecodeLoop(cfg),
            ),
        ),
        program=Program(
            inputs=("request", "prompt"),
            nodes=(
                LoopNode("decode", "lm", needs=("prompt",), binds="tokens", streams=("rows",)),
                KernelNode("keep", keep, needs=("tokens",)),
            ),
        ),
        capabilities=frozenset({Capability.CHAT_TEXT}),
        sample_rate=8000,
    )
    eng = AsyncEngine([ModelInstance.load(card)])
    out = await collect(eng, Request("scripted", text="x", seed=1))
    await eng.shutdown()
    assert out.text == "héllo wörld"
    n = len("héllo wörld")
    assert seen["rows"] == list(range(n + 1 if stream_on_eos else n))
    assert lm.freed, "the loop frees its sequence"
