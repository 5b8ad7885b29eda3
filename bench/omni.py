"""Omni benchmark: the ``qwen2.5-omni`` card on omnistep vs. transformers' ``generate``.

What it measures
----------------
Both sides run the same small Qwen2.5-Omni checkpoint with seeded random weights, written once
into ``--root`` by ``omnistep.models.qwen2_5_omni.tiny.write_qwen_omni`` (``--size tiny``: the test
sizes, ``TINY_SIZES``; ``--size small``: wider and deeper LMs, DiT and BigVGAN, see ``SIZES``),
in this process, one side at a time, with the same torch intra-op thread count (``--threads``,
default 1: ``torch.set_num_threads`` and ``tests.qwen_omni_ref.reference.THREADS``).

Work per request: the chat-templated prompt (one of ``PROMPTS``, default system prompt), a
GREEDY thinker capped at ``--thinker-tokens`` N (default 24), a GREEDY talker (temperature 0, no
repetition penalty) capped at ``--talker-tokens`` T (default 128 codes = 2.56 s of audio), then
the DiT (10-point RK4 ODE, 36 guided forwards) and BigVGAN, 24 kHz. Random weights rarely
produce EOS, so most requests use both caps; the counts actually produced are recorded per
request on both sides.

* **omnistep, in-process.** ``AsyncEngine([ModelInstance.load(build_card(root,
  QwenOmniOptions(thinker_max_new_tokens=N, talker_max_new_tokens=T, talker_sampling=greedy)))])``
  with the default ``EngineConfig``. Requests: ``SamplingParams(temperature=0)``,
  ``ExecutionProfile.ROLLOUT``, ``output_modalities={TEXT, AUDIO}``, voice Chelsie, a different
  prompt and seed each. The caps are the card's options, not the request's ``max_new_tokens``:
  a request's ``max_new_tokens`` caps the thinker AND the talker (``ARDecodeLoop.init`` takes
  ``min(request cap, loop cap)`` for both loops), so ``SamplingParams(max_new_tokens=N)`` would
  cut the audio to N codes; the ``request_cap_check`` in the results shows it on one request.
  A burst of C submits C requests at once and drains them. Per burst: per request the time to
  first audio (TTFA: ``add_request`` -> first non-empty AUDIO ``StreamChunk``) and total time;
  thinker and talker tokens (``len(stream.trajectories["think"|"talk"])``), audio seconds; and
  aggregate thinker tok/s, talker tok/s and audio-s/s over the burst's wall time (first submit
  -> last chunk), the process CPU seconds, and each component's ``execute`` calls (kind, batch,
  seconds) with the busy time per component.
  Two DiT variants (``--dit``, default ``both``), each its own model and engine in this process:
  ``chunked``, ``dit_chunking=DiTChunking()`` (the card's default: the DiT denoises windows of
  whole attention blocks as the talker produces codes; ``--dit-chunking first/chunk/left/ahead``
  changes it) and ``whole``, ``dit_chunking=None`` (the whole utterance once the talker is done,
  the card before issue 15). Both run the same prompts and seeds at every level of every round,
  back to back (their order alternates between rounds), and must produce the same thinker
  tokens and talker codes (``dit_variant_check``).
* **transformers 5.24**, ``Qwen2_5OmniForConditionalGeneration`` loaded by
  ``tests.qwen_omni_ref.reference.load_reference`` (float32, eager attention), driven by
  ``reference.generate_audio`` (``model.generate`` after ``torch.manual_seed(seed)``,
  ``thinker_max_new_tokens=N``, ``talker_max_new_tokens=T``, ``talker_do_sample=False``,
  ``talker_repetition_penalty=1.0``, the config's talker EOS ids) for the same prompts and seeds,
  ONE AFTER THE OTHER. ``generate`` returns the audio only at its end, so its time to first
  audio is the whole ``generate`` time of the first request, and its "total for C" is the time
  from the first call to the end of the C-th. Its thinker / talker / token2wav times are recorded
  per request (wrapped ``thinker.generate``, ``talker.generate``, ``token2wav`` forward hooks).

Note: transformers 5.24's unpadded ``generate`` does not add the codec pad/bos embeddings to the
talker prefill (see ``reference.py``), omnistep does (the official behaviour), so greedy talker
codes can differ between the sides; the token counts normalise the throughput numbers.

Order: ``--rounds`` rounds (default 3) of ``omnistep C=<lowest>`` (each DiT variant),
``transformers sequential max(C)`` (unless ``--skip-transformers``), ``omnistep C=<other
levels>`` (each variant), after one unmeasured warm-up on each side. Headline numbers are
medians over rounds; "paired" ratios compare numbers of the same round.

Targets
-------
(a) at the highest level (8): omnistep aggregate audio-s/s >= 4x transformers' sequential
audio-s/s (the same ratio in thinker+talker tokens/s is printed beside it);
(b) at the lowest level (1): omnistep TTFA < transformers' time to its first audio;
(a) and (b) use the chunked variant when it runs. With both variants (issue 15, item 2):
(c) at the lowest level: TTFA of DiT chunked <= 0.5x DiT whole;
(d) at the highest level: aggregate audio-s/s of DiT chunked >= DiT whole.

How to run
----------
::

    .venv/bin/python bench/omni.py                          # C = 1,8, tiny sizes, 3 rounds
    .venv/bin/python bench/omni.py --concurrency 1,8 --root /tmp/omnistep-qwen-bench
    .venv/bin/python bench/omni.py --skip-transformers --dit both   # (c) and (d) only

It prints a table and the ratios and writes everything to ``bench/results/omni.json``
(``--out``). Wall-clock numbers depend on other load on the machine: ``os.getloadavg()`` and the
process CPU time are stored with each measurement.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gc
import json
import os
import platform
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import torch

from omnistep.bench.client import simulate_playback
from omnistep.core import (
    ChatMessage,
    ExecutionProfile,
    Modality,
    ModelInstance,
    Request,
    SamplingParams,
)
from omnistep.engine import AsyncEngine
from omnistep.models.qwen2_5_omni.card import QwenOmniOptions, build_card
from omnistep.models.qwen2_5_omni.dit import DiTChunking
from omnistep.sampling import SamplingRow

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    ExecTimer,
    StreamTiming,
    fmt,
    jsonable,
    load_avg,
    median,
    timed_streams,
    union_seconds,
)
from dit_joins import parse_setting  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
DEFAULT_ROOT = Path("/tmp/omnistep-qwen-bench")
DEFAULT_OUT = REPO / "bench" / "results" / "omni.json"
MARKER = "omni-bench-sizes.json"
SAMPLE_RATE = 24000
VOICE = "Chelsie"
GREEDY_TALKER = SamplingRow(temperature=0.0, min_keep=1)

# Greedy on the tiny seed-0 checkpoint, each of these prompts makes both sides use both caps
# (N = 24 thinker tokens, T = 128 codes): no thinker EOS, no talker EOS. Screened out: prompts
# whose talker emits EOS within 20 codes, and prompts where omnistep's thinker stops on
# <|endoftext|> while transformers' does not (it stops on <|im_end|> only).
PROMPTS = (
    "hello there, how are you today?",
    "say one short sentence with your voice",
    "can you speak about the picture",
    "thank you for the audio and the video",
    "one two three, yes or no",
    "what can i do for you this morning",
    "would you like to say something nice",
    "we have a short video with voice",
    "is it good weather there today",
    "say that with your voice please",
    "how is it with your time today",
    "tell me one thing about the picture",
    "nice to meet you, what is your name",
    "would you say hello to me",
    "what time is it there",
    "can you tell me about the video",
)

# QwenOmniSizes overrides per preset (validated by write_qwen_omni).
SIZES: dict[str, dict[str, Any]] = {
    "tiny": {},
    "small": {
        "hidden": 256,
        "layers": 4,
        "heads": 8,
        "kv_heads": 4,
        "intermediate": 512,
        "mrope_section": (4, 6, 6),
        "talker_hidden": 192,
        "talker_layers": 4,
        "talker_heads": 6,
        "talker_kv_heads": 2,
        "talker_head_dim": 32,
        "talker_intermediate": 512,
        "talker_mrope_section": (4, 6, 6),
        "dit_hidden": 128,
        "dit_layers": 6,
        "dit_heads": 8,
        "dit_look_backward_layers": (0, 4),
        "bigvgan_channels": 256,
    },
}


def _import_test_helpers() -> None:
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))


def messages_of(i: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}]


# ----------------------------------------------------------------------------- checkpoint


def ensure_checkpoint(root: Path, size: str) -> dict[str, Any]:
    """The checkpoint of preset ``size`` at ``root`` (written once; reused when its marker
    names the same sizes)."""
    _import_test_helpers()
    from omnistep.models.qwen2_5_omni.tiny import TINY_SIZES, write_qwen_omni

    sizes = dataclasses.replace(TINY_SIZES, **SIZES[size])
    want = json.dumps({"size": size, "sizes": dataclasses.asdict(sizes)}, sort_keys=True)
    marker = root / MARKER
    if marker.exists() and marker.read_text() == want:
        return {"written": False, "seconds": 0.0, "size": size}
    start = time.perf_counter()
    tmp = root.with_name(f"{root.name}.partial-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    write_qwen_omni(tmp, sizes, seed=0)
    (tmp / MARKER).write_text(want)
    if root.exists():
        shutil.rmtree(root)
    tmp.rename(root)
    return {"written": True, "seconds": round(time.perf_counter() - start, 1), "size": size}


def parameter_counts(root: Path) -> dict[str, int]:
    from safetensors import safe_open

    counts: dict[str, int] = {}
    for f in sorted(root.glob("model-*.safetensors")):
        with safe_open(str(f), "pt") as sf:
            for name in sf.keys():  # noqa: SIM118 - safe_open has no __iter__
                part = name.split(".", 1)[0]
                counts[part] = counts.get(part, 0) + _numel(sf.get_slice(name).get_shape())
    return counts


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


# ----------------------------------------------------------------------------- omnistep


# ``--dit`` variants: the DiT's chunk schedule of each (``QwenOmniOptions.dit_chunking``).
DIT_VARIANTS: dict[str, DiTChunking | None] = {"chunked": DiTChunking(), "whole": None}


class Ours:
    """One loaded omnistep model with its engine (all bursts on one event loop).

    ``dit_chunking``: the card's DiT chunk schedule (``DiTChunking``: streamed token2wav;
    None: the whole utterance once the talker is done); ``name`` labels its results."""

    def __init__(
        self,
        root: Path,
        thinker_tokens: int,
        talker_tokens: int,
        chunk: int | None = None,
        dit_chunking: DiTChunking | None = None,
        name: str = "omnistep",
    ):
        extra = {} if chunk is None else {"chunk": chunk}
        self.name = name
        self.options = QwenOmniOptions(
            kv_cache_gb=0.25,
            thinker_max_new_tokens=thinker_tokens,
            talker_max_new_tokens=talker_tokens,
            talker_sampling=GREEDY_TALKER,
            dit_chunking=dit_chunking,
            **extra,
        )
        start = time.perf_counter()
        self.model = ModelInstance.load(build_card(str(root), self.options))
        self.load_s = time.perf_counter() - start
        self.timers = {n: ExecTimer(c) for n, c in self.model.components.items()}
        self.engine = AsyncEngine([self.model])
        self.eos = set(self.model.loops["talk"].config.eos_token_ids)
        print(f"{name}: loaded in {self.load_s:.1f}s (dit_chunking={dit_chunking})", flush=True)

    def info(self) -> dict[str, Any]:
        opts = dataclasses.asdict(self.options)
        opts["dtype"] = str(opts["dtype"])
        return {
            "name": self.name,
            "options": opts,
            "load_s": round(self.load_s, 2),
            "engine_config": dataclasses.asdict(self.engine.config),
        }

    @staticmethod
    async def close_all(models: list[Ours]) -> None:
        """Shut every engine down, then cancel what their step loops leave behind (a pending
        ``Event.wait`` waiter each; cancelling after all shutdowns, as it cancels every task
        of the event loop)."""
        for m in models:
            await m.engine.shutdown()
        leftovers = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in leftovers:
            task.cancel()
        await asyncio.gather(*leftovers, return_exceptions=True)
        for m in models:
            del m.engine, m.model, m.timers
        gc.collect()

    def request(self, i: int, seed: int, sampling: SamplingParams | None = None) -> Request:
        return Request(
            "qwen2.5-omni",
            messages=tuple(ChatMessage(m["role"], m["content"]) for m in messages_of(i)),
            seed=seed,
            sampling=sampling or SamplingParams(temperature=0.0),
            profile=ExecutionProfile.ROLLOUT,
            output_modalities=frozenset({Modality.TEXT, Modality.AUDIO}),
            voice=VOICE,
        )

    def _request_figures(self, i: int, t: StreamTiming) -> dict[str, Any]:
        """Request ``i``'s figures: TTFA, the thinker's and talker's tokens, audio, and the
        underruns of a player started at its first chunk."""
        playback = simulate_playback(
            [at for at, _ in t.arrivals], [n / SAMPLE_RATE for _, n in t.arrivals]
        )
        traj = t.stream.trajectories
        talk = [int(r.tokens[0]) for r in traj.get("talk", [])]
        return {
            "prompt": i,
            "ttfa_s": t.ttfa_s,
            "total_s": t.total_s,
            "thinker_tokens": len(traj.get("think", [])),
            "talker_tokens": len(talk),
            "talker_eos": any(x in self.eos for x in talk),
            "audio_s": t.samples / SAMPLE_RATE,
            "audio_chunks": len(t.arrivals),
            "underruns": playback.count,
            "underrun_s": playback.total_s,
            "think": [int(r.tokens[0]) for r in traj.get("think", [])],
            "talk": talk,
        }

    async def burst(self, c: int, tag: str = "", quiet: bool = False) -> dict[str, Any]:
        for t in self.timers.values():
            t.log.clear()
        cpu0 = time.process_time()
        reqs = [self.request(i, seed=1000 + i) for i in range(c)]
        start, timed = await timed_streams(self.engine, reqs)
        per = [self._request_figures(i, t) for i, t in enumerate(timed)]
        wall = time.perf_counter() - start
        res = aggregate(c, wall, per)
        res["cpu_s"] = time.process_time() - cpu0
        res["tag"] = tag
        res["exec"] = {n: t.summary() for n, t in self.timers.items()}
        calls = {n: [(s, e) for _, _, s, e in t.log] for n, t in self.timers.items()}
        res["busy_s"] = {n: round(union_seconds(iv), 3) for n, iv in calls.items()}
        res["busy_s"]["any"] = round(union_seconds([x for iv in calls.values() for x in iv]), 3)
        res["loadavg"] = load_avg()
        if not quiet:
            print_run(self.name, tag, res)
        return res

    async def request_cap_check(self, n: int) -> dict[str, Any]:
        """One request with ``SamplingParams(temperature=0, max_new_tokens=n)``: how many
        thinker and talker tokens it gets (the request cap applies to both loops)."""
        stream = self.engine.add_request(
            self.request(0, seed=7, sampling=SamplingParams(temperature=0.0, max_new_tokens=n))
        )
        samples = 0
        async for chunk in stream:
            if chunk.audio is not None:
                samples += chunk.audio.size
        return {
            "request_max_new_tokens": n,
            "card_talker_max_new_tokens": self.options.talker_max_new_tokens,
            "thinker_tokens": len(stream.trajectories.get("think", [])),
            "talker_tokens": len(stream.trajectories.get("talk", [])),
            "audio_s": samples / SAMPLE_RATE,
        }


def aggregate(c: int, wall: float, per: list[dict[str, Any]]) -> dict[str, Any]:
    think = sum(p["thinker_tokens"] for p in per)
    talk = sum(p["talker_tokens"] for p in per)
    audio = sum(p["audio_s"] for p in per)
    ttfa = [p["ttfa_s"] for p in per if p["ttfa_s"] is not None]
    stalls = [p["underrun_s"] for p in per if "underrun_s" in p]  # streamed (omnistep) only
    return {
        "concurrency": c,
        "wall_s": wall,
        "thinker_tokens": think,
        "talker_tokens": talk,
        "audio_s": audio,
        "thinker_tok_s": think / wall,
        "talker_tok_s": talk / wall,
        "tok_s": (think + talk) / wall,
        "audio_s_per_s": audio / wall,
        "ttfa_first_s": per[0]["ttfa_s"],
        "ttfa_p50_s": median(ttfa),
        "ttfa_max_s": max(ttfa, default=float("nan")),
        "total_p50_s": median([p["total_s"] for p in per]),
        "total_max_s": max(p["total_s"] for p in per),
        "underrun_s_p50": median(stalls),
        "underrun_s_max": max(stalls, default=float("nan")),
        "requests": per,
    }


def print_run(side: str, tag: str, r: dict[str, Any]) -> None:
    print(
        f"  {side:<16} {tag:<10} C={r['concurrency']:<2} wall {r['wall_s']:6.2f}s  "
        f"TTFA p50 {r['ttfa_p50_s']:6.2f}s  think {r['thinker_tok_s']:6.1f} tok/s  "
        f"talk {r['talker_tok_s']:6.1f} tok/s  audio {r['audio_s_per_s']:5.2f} s/s  "
        f"cpu {r['cpu_s']:5.1f}s  load {r['loadavg'][0]}",
        flush=True,
    )


# ----------------------------------------------------------------------------- transformers


class Reference:
    """transformers' ``model.generate`` with audio output, one request at a time."""

    def __init__(self, root: Path, thinker_tokens: int, talker_tokens: int, threads: int):
        _import_test_helpers()
        from tests.qwen_omni_ref import reference

        reference.THREADS = threads
        self.ref = reference
        self.root = root
        self.n, self.t = thinker_tokens, talker_tokens
        start = time.perf_counter()
        self.model, _ = reference.load_reference(root)
        self.load_s = time.perf_counter() - start
        self.eos = set(reference.talker_eos_token_ids(root))
        self.phases: dict[str, float] = {}
        self._install_timers()
        print(f"transformers: loaded in {self.load_s:.1f}s", flush=True)

    def _install_timers(self) -> None:
        model = self.model

        def timed(name: str, fn: Any) -> Any:
            def wrapper(*args: Any, **kwargs: Any) -> Any:
                t0 = time.perf_counter()
                try:
                    return fn(*args, **kwargs)
                finally:
                    self.phases[name] = self.phases.get(name, 0.0) + time.perf_counter() - t0

            return wrapper

        # instance attributes: generate_audio's mock.patch of talker.generate wraps these
        model.thinker.generate = timed("thinker", model.thinker.generate)
        model.talker.generate = timed("talker", model.talker.generate)
        starts: list[float] = []

        def pre(_m: Any, _a: Any) -> None:
            starts.append(time.perf_counter())

        def post(_m: Any, _a: Any, _o: Any) -> None:
            dt = time.perf_counter() - starts.pop()
            self.phases["token2wav"] = self.phases.get("token2wav", 0.0) + dt

        model.token2wav.register_forward_pre_hook(pre)
        model.token2wav.register_forward_hook(post)

    def one(self, i: int, seed: int) -> dict[str, Any]:
        msgs = messages_of(i)
        prompt_len = int(self.ref.prompt_ids(self.root, msgs).numel())
        self.phases = {}
        cpu0, t0 = time.process_time(), time.perf_counter()
        text_ids, wav, codes = self.ref.generate_audio(
            self.root,
            msgs,
            speaker=VOICE,
            seed=seed,
            thinker_max_new_tokens=self.n,
            talker_max_new_tokens=self.t,
            return_codes=True,
            talker_do_sample=False,
            talker_repetition_penalty=1.0,
        )
        dt = time.perf_counter() - t0
        cpu = time.process_time() - cpu0
        talk = [int(x) for x in codes.tolist()]
        return {
            "prompt": i,
            "seconds": dt,
            "cpu_s": cpu,
            "thinker_tokens": int(text_ids.numel()) - prompt_len,
            "talker_tokens": len(talk),
            "talker_eos": any(x in self.eos for x in talk),
            "audio_s": wav.numel() / SAMPLE_RATE,
            "phases_s": {k: round(v, 3) for k, v in self.phases.items()},
            "think": [int(x) for x in text_ids[prompt_len:].tolist()],
            "talk": talk,
        }

    def sequential(self, c: int, tag: str = "", quiet: bool = False) -> dict[str, Any]:
        cpu0 = time.process_time()
        start = time.perf_counter()
        per = []
        for i in range(c):
            r = self.one(i, seed=1000 + i)
            r["ttfa_s"] = r["total_s"] = time.perf_counter() - start  # audio only at the end
            per.append(r)
        wall = time.perf_counter() - start
        res = {
            "cpu_s": time.process_time() - cpu0,
            "tag": tag,
            "loadavg": load_avg(),
            "requests": per,
            "wall_s": wall,
        }
        if not quiet:
            print_run("transformers", tag, {**aggregate(c, wall, per), **res})
        return res

    @staticmethod
    def level(seq: dict[str, Any], c: int) -> dict[str, Any]:
        """The first ``c`` requests of a sequential run as a level-``c`` result; its TTFA is
        the first request's ``generate`` time."""
        per = seq["requests"][:c]
        res = aggregate(c, per[-1]["total_s"], per)
        res["ttfa_p50_s"] = res["ttfa_first_s"] = per[0]["seconds"]
        res["cpu_s"] = sum(p["cpu_s"] for p in per)
        res["loadavg"] = seq["loadavg"]
        return res


# ----------------------------------------------------------------------------- driver


def variant_order(names: list[str], rnd: int) -> list[str]:
    """The DiT variants in the order round ``rnd`` runs them at each level: as given in odd
    rounds, reversed in even ones (so neither always runs first after the other's burst)."""
    return list(names) if rnd % 2 else list(reversed(names))


async def run_ours(
    ours: dict[str, Ours], levels: list[int], rnd: int, first: bool
) -> dict[str, dict[str, Any]]:
    """Bursts of the lowest level (``first``) or the others, every DiT variant at each level
    back to back: ``{variant: {str(C): burst}}``."""
    picked = levels[:1] if first else levels[1:]
    out: dict[str, dict[str, Any]] = {name: {} for name in ours}
    for c in picked:
        for name in variant_order(list(ours), rnd):
            out[name][str(c)] = await ours[name].burst(c, f"round {rnd}")
    return out


def run_all(args: argparse.Namespace, levels: list[int], variants: list[str]) -> dict[str, Any]:
    n, t = args.thinker_tokens, args.talker_tokens
    ref = None
    if not args.skip_transformers:
        ref = Reference(args.root, n, t, args.threads)
        ref.one(0, seed=1)  # warm-up
    loop = asyncio.new_event_loop()
    try:
        ours = {
            v: Ours(args.root, n, t, args.vocoder_chunk, DIT_VARIANTS[v], f"omnistep {v}")
            for v in variants
        }
        for o in ours.values():
            loop.run_until_complete(o.burst(2, quiet=True))  # warm-up
        cap_check = loop.run_until_complete(ours[variants[0]].request_cap_check(n))
        print(f"request-cap check: {cap_check}", flush=True)
        rounds = []
        for r in range(1, args.rounds + 1):
            print(f"round {r}/{args.rounds}", flush=True)
            rnd: dict[str, Any] = {"ours": {v: {} for v in variants}}
            for v, runs in loop.run_until_complete(run_ours(ours, levels, r, True)).items():
                rnd["ours"][v].update(runs)
            if ref is not None:
                rnd["ref_sequential"] = ref.sequential(levels[-1], f"round {r}")
            for v, runs in loop.run_until_complete(run_ours(ours, levels, r, False)).items():
                rnd["ours"][v].update(runs)
            rounds.append(rnd)
        info = {v: o.info() for v, o in ours.items()}
        loop.run_until_complete(Ours.close_all(list(ours.values())))
    finally:
        loop.close()
    return {
        "rounds": rounds,
        "omnistep": info,
        "transformers": None if ref is None else {"load_s": round(ref.load_s, 2)},
        "request_cap_check": cap_check,
    }


# ----------------------------------------------------------------------------- report


def ratio_line(name: str, value: float, op: str, target: float, paired: list[float]) -> dict:
    ok = {">=": value >= target, "<=": value <= target, "<": value < target}[op]
    pair = ", ".join(f"{p:.2f}" for p in paired)
    print(
        f"  {name:<58} {value:7.3f}  (target {op} {target:<4}) {'MET   ' if ok else 'MISSED'}"
        f"  paired: {pair}"
    )
    return {
        "name": name,
        "value": round(value, 4),
        "op": op,
        "target": target,
        "met": ok,
        "paired": [round(p, 4) for p in paired],
    }


def _row(side: str, c: int, runs: list[dict[str, Any]]) -> dict[str, Any]:
    def med(key: str) -> float:
        return median([r[key] for r in runs])

    keys = (
        "wall_s",
        "ttfa_p50_s",
        "ttfa_max_s",
        "total_p50_s",
        "thinker_tok_s",
        "talker_tok_s",
        "tok_s",
        "audio_s_per_s",
        "cpu_s",
        "underrun_s_p50",
        "underrun_s_max",
    )
    row: dict[str, Any] = {"side": side, "C": c, "runs": len(runs)}
    row.update({k: med(k) for k in keys})
    row["thinker_tokens"] = runs[0]["thinker_tokens"]
    row["talker_tokens"] = runs[0]["talker_tokens"]
    row["audio_s"] = runs[0]["audio_s"]
    row["cpu_s_per_audio_s"] = median([r["cpu_s"] / r["audio_s"] for r in runs])
    row["load1_max"] = max(r["loadavg"][0] for r in runs)
    return row


def report(levels: list[int], res: dict[str, Any]) -> dict[str, Any]:
    lo, hi = levels[0], levels[-1]
    rounds = res["rounds"]
    variants = list(rounds[0]["ours"])
    # the transformers comparisons use the card's default (chunked) when it ran
    main = "chunked" if "chunked" in variants else variants[0]
    runs = {v: {c: [r["ours"][v][str(c)] for r in rounds] for c in levels} for v in variants}
    ours = runs[main]
    has_ref = "ref_sequential" in rounds[0]
    ref = (
        {c: [Reference.level(r["ref_sequential"], c) for r in rounds] for c in levels}
        if has_ref
        else {}
    )
    rows = [_row(f"omnistep {v}", c, runs[v][c]) for v in variants for c in levels]
    rows += [_row("transformers", c, ref[c]) for c in levels if has_ref]

    print()
    head = (
        f"{'side':<16} {'C':>2} {'TTFA p50':>8} {'TTFA max':>8} {'total p50':>9} {'wall':>6} "
        f"{'think tok/s':>11} {'talk tok/s':>10} {'audio s/s':>9} {'think/talk tok':>14} "
        f"{'audio s':>7} {'cpu s':>6} {'cpu/aud':>7} {'stall p50':>9} {'stall max':>9} "
        f"{'load1':>5}"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        print(
            f"{r['side']:<16} {r['C']:>2} {fmt(r['ttfa_p50_s'], '8.2f')} "
            f"{fmt(r['ttfa_max_s'], '8.2f')} {fmt(r['total_p50_s'], '9.2f')} "
            f"{r['wall_s']:6.2f} {r['thinker_tok_s']:11.1f} {r['talker_tok_s']:10.1f} "
            f"{r['audio_s_per_s']:9.3f} {r['thinker_tokens']:>6}/{r['talker_tokens']:<7} "
            f"{r['audio_s']:7.2f} {r['cpu_s']:6.1f} {r['cpu_s_per_audio_s']:7.2f} "
            f"{fmt(r['underrun_s_p50'], '9.2f')} {fmt(r['underrun_s_max'], '9.2f')} "
            f"{r['load1_max']:>5}"
        )
    print(
        "(omnistep chunked: dit_chunking=DiTChunking() (the card's default), whole: "
        "dit_chunking=None; transformers: sequential, its TTFA = the first request's whole "
        "generate time. cpu/aud: process CPU seconds per audio second, less sensitive to other "
        "load. stall: seconds a real-time player of the stream waits after its first audio "
        "(omnistep.bench.client.simulate_playback), per request)"
    )

    def paired(fn: Any) -> list[float]:
        return [fn(i) for i in range(len(rounds))]

    def med(xs: list[dict[str, Any]], key: str) -> float:
        return median([x[key] for x in xs])

    print()
    print("targets (headline = medians over rounds; paired = same round):")
    targets = []

    def compare(label: str, num: dict, den: dict, level: int, key: str, op: str, bound: float):
        """A target on the ratio of two runs' ``key`` at ``level`` (medians; paired rounds)."""
        return ratio_line(
            label,
            med(num[level], key) / med(den[level], key),
            op,
            bound,
            paired(lambda i: num[level][i][key] / den[level][i][key]),
        )

    if has_ref:
        print(f"  omnistep = omnistep {main}")
        targets += [
            compare(f"(a) C={hi} audio-s/s: omnistep / transformers sequential", ours, ref, hi,
                    "audio_s_per_s", ">=", 4.0),
            compare(f"(a') C={hi} thinker+talker tok/s: omnistep / transformers", ours, ref, hi,
                    "tok_s", ">=", 4.0),
            compare(f"(b) C={lo} TTFA: omnistep / transformers first generate", ours, ref, lo,
                    "ttfa_p50_s", "<", 1.0),
        ]  # fmt: skip
    if {"chunked", "whole"} <= set(variants):
        chunked, whole = runs["chunked"], runs["whole"]
        targets += [
            compare(f"(c) C={lo} TTFA: DiT chunked / DiT whole", chunked, whole, lo,
                    "ttfa_p50_s", "<=", 0.5),
            compare(f"(d) C={hi} audio-s/s: DiT chunked / DiT whole", chunked, whole, hi,
                    "audio_s_per_s", ">=", 1.0),
        ]  # fmt: skip
    cpu_ratio = None
    if has_ref:
        cpu_ratio = median([x["cpu_s"] / x["audio_s"] for x in ref[hi]]) / median(
            [x["cpu_s"] / x["audio_s"] for x in ours[hi]]
        )
        print(
            f"  (info) C={hi} CPU seconds per audio second, transformers / omnistep: "
            f"{cpu_ratio:.3f}  ((a) if both sides got the same CPU time)"
        )
    # same greedy work on both sides? (thinker tokens must match; talker codes may differ)
    same = []
    for r in rounds if has_ref else []:
        seq = r["ref_sequential"]["requests"]
        burst = r["ours"][main][str(hi)]["requests"]
        for a, b in zip(burst, seq, strict=False):
            same.append(
                {
                    "prompt": a["prompt"],
                    "thinker_equal": a["think"] == b["think"],
                    "talker_equal": a["talk"] == b["talk"],
                    "talker_tokens": [a["talker_tokens"], b["talker_tokens"]],
                }
            )
    if same:
        n_think = sum(s["thinker_equal"] for s in same)
        n_talk = sum(s["talker_equal"] for s in same)
        print(
            f"  greedy work check at C={hi}: thinker tokens equal in {n_think}/{len(same)} "
            f"requests, talker codes equal in {n_talk}/{len(same)}"
        )
    variant_check = _variant_check(rounds, variants, hi)
    if variant_check is not None:
        print(
            f"  DiT variants at C={hi}: same thinker tokens and talker codes in "
            f"{variant_check['equal']}/{variant_check['requests']} requests, same audio "
            f"seconds in {variant_check['same_audio_s']}/{variant_check['requests']}"
        )
    busy = {v: _busy_summary(runs[v]) for v in variants}
    for v, by_level in busy.items():
        for c, b in by_level.items():
            shares = ", ".join(f"{k} {x:.2f}s" for k, x in b.items())
            print(f"  omnistep {v} C={c} component busy seconds (median): {shares}")
    phases = _phase_summary(rounds) if has_ref else {}
    if has_ref:
        print(f"  transformers per request (median s): {phases}")
    return {
        "table": rows,
        "targets": targets,
        "cpu_efficiency_ratio": cpu_ratio,
        "work_check": same,
        "dit_variant_check": variant_check,
        "omnistep_busy_s": busy,
        "transformers_phases_s": phases,
    }


def _variant_check(
    rounds: list[dict[str, Any]], variants: list[str], c: int
) -> dict[str, int] | None:
    """Do the DiT variants do the same greedy work at level ``c``? (The DiT does not feed
    back into the LMs, so thinker tokens and talker codes must be equal.) None with one
    variant."""
    if len(variants) < 2:
        return None
    equal = same_audio = total = 0
    for r in rounds:
        per = [r["ours"][v][str(c)]["requests"] for v in variants]
        for reqs in zip(*per, strict=True):
            total += 1
            first = reqs[0]
            equal += all(q["think"] == first["think"] and q["talk"] == first["talk"] for q in reqs)
            same_audio += all(abs(q["audio_s"] - reqs[0]["audio_s"]) < 1e-9 for q in reqs)
    return {"requests": total, "equal": equal, "same_audio_s": same_audio}


def _busy_summary(ours: dict[int, list[dict[str, Any]]]) -> dict[str, dict[str, float]]:
    out = {}
    for c, runs in ours.items():
        names = runs[0]["busy_s"].keys()
        out[str(c)] = {n: round(median([r["busy_s"][n] for r in runs]), 3) for n in names}
        out[str(c)]["wall"] = round(median([r["wall_s"] for r in runs]), 3)
    return out


def _phase_summary(rounds: list[dict[str, Any]]) -> dict[str, float]:
    reqs = [q for r in rounds for q in r["ref_sequential"]["requests"]]
    names = sorted({k for q in reqs for k in q["phases_s"]})
    out = {n: round(median([q["phases_s"].get(n, 0.0) for q in reqs]), 3) for n in names}
    out["generate"] = round(median([q["seconds"] for q in reqs]), 3)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--concurrency", default="1,8", help="omnistep burst sizes")
    ap.add_argument("--root", type=Path, default=DEFAULT_ROOT, help="checkpoint folder (cache)")
    ap.add_argument("--size", choices=sorted(SIZES), default="tiny", help="checkpoint sizes")
    ap.add_argument("--thinker-tokens", type=int, default=24, help="thinker cap N")
    ap.add_argument("--talker-tokens", type=int, default=128, help="talker cap T (codes)")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads, both sides")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of the paired comparisons")
    ap.add_argument(
        "--vocoder-chunk",
        type=int,
        default=None,
        help="omnistep BigVGAN chunk in mel frames after the first (default: the card's)",
    )
    ap.add_argument(
        "--dit",
        choices=("both", "chunked", "whole"),
        default="both",
        help="omnistep DiT: chunked (QwenOmniOptions(dit_chunking=DiTChunking()), the default "
        "card), whole (dit_chunking=None), or both in the same rounds",
    )
    ap.add_argument(
        "--dit-chunking",
        default=None,
        help="the chunked variant's first/chunk/left/ahead blocks, first may be auto "
        "(default: DiTChunking(), auto/auto/2/1)",
    )
    ap.add_argument(
        "--skip-transformers", action="store_true", help="omnistep only (no transformers side)"
    )
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = ap.parse_args()
    levels = sorted({int(x) for x in args.concurrency.split(",") if x.strip()})
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    torch.set_num_threads(args.threads)
    t_start = time.perf_counter()
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, load {load_avg()}")

    ckpt = ensure_checkpoint(args.root, args.size)
    ckpt["parameters"] = parameter_counts(args.root)
    print(f"checkpoint {args.root}: {ckpt}", flush=True)
    import transformers

    transformers.logging.set_verbosity_error()
    variants = ["chunked", "whole"] if args.dit == "both" else [args.dit]
    if args.dit_chunking:
        DIT_VARIANTS["chunked"] = parse_setting(args.dit_chunking)
    res = run_all(args, levels, variants)
    summary = report(levels, res)
    elapsed = time.perf_counter() - t_start
    print(f"load average now {load_avg()}; bench took {elapsed:.0f}s")
    result = {
        "machine": {
            "platform": platform.platform(),
            "python": sys.version.split()[0],
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "cpus": os.cpu_count(),
            "torch_threads": args.threads,
        },
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "checkpoint": {"root": str(args.root), **ckpt},
        **summary,
        "raw": res,
        "seconds": round(elapsed, 1),
        "loadavg_end": load_avg(),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(jsonable(result), indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
