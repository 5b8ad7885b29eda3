"""VoxCPM2's LocDiT solve inside the AR unit (``inner_solve="in_step"``) vs its Euler steps as
WorkUnits of their own (``"units"``), measured in the same run (issue 30, P4 item 2).

What it measures
----------------
One folder in the published layout at the PUBLISHED WIDTHS and REDUCED DEPTH (``--layers``
per stack, default 2; published 28 / 8 / 12 / 12): base and residual LM hidden 2048, MLP 6144,
16 heads, 2 KV heads of 128 (the published ``config.json``'s block, as
``tests/voxcpm_ref/bench_ref.py: PUBLISHED_LM``); LocEnc and LocDiT 1024 wide, FFN 4096, 16
heads of 128 (``VoxCPMEncoderConfig`` / ``VoxCPMDitConfig``); patch 4, ``feat_dim`` 64,
quantizer 512 / 9; the AudioVAE whole at ``AudioVAEConfig``'s defaults (decoder 2048 channels,
48 kHz). Seeded random weights written by omnistep's own modules (``tiny.write_folder`` with
these sizes), float32, the stop head zeroed so every request runs to its cap of ``--frames``
patches (default 12 = 1.92 s). The tiny tokenizer (text ids are only looked up).

Two ``voxcpm2`` cards on that folder, each in its own in-process ``AsyncEngine`` (default
``EngineConfig``), identical but for ``VoxCPMOptions.inner_solve``; warm-ups, then one
unmeasured round. Work per request: one of
the bench sentences, the zero-shot voice, ``cfg_value`` 2.0, 10 Euler steps per patch (9 run:
CFG-Zero* zeroes the first). Per round, for each form (the order alternates by round):

* C=1: one request; TTFA (``add_request`` -> its first audio chunk) and the per-patch latency
  ``(end - first audio) / (F - 1)`` (the steady AR step + solve + vocoder share per patch);
* C=8: eight requests at once; audio-s/s (audio seconds / the burst's wall time) and TTFA p99;
* for both: units executed per second of wall time, ``execute`` calls, and the engine's
  overhead per call: wall time when no component's ``execute`` runs (the union of their
  intervals taken out: the vocoder's calls may overlap the LM's) / calls.

* direct (no engine; ``--direct-steps`` S, default 6): the components called by hand on C
  sequences (C = 1 and 8; a 20-id prompt), one patch at a time, the two forms alternating
  patch by patch: in_step one ``lm`` AR_TOKEN call; units the ``lm`` call that stops at the
  solve's input, then the 9 ``dit`` DENOISE_STEP calls. The median seconds per patch: the
  split's own compute cost (packing, per-row times, 9 calls instead of one), no scheduling.

Reported: per form the median over rounds, and the ratios units / in_step of each round and
their median. Wall-clock figures depend on other load (the load average goes with each burst).

Run::

    PYTHONPATH=. .venv/bin/python bench/voxcpm_inner_solve.py          # 2 layers, 12 patches
    PYTHONPATH=. .venv/bin/python bench/voxcpm_inner_solve.py --quick  # tiny folder, 4 patches

Output: a printed table and ``bench/results/voxcpm_inner_solve.json`` (``--out``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    SENTENCES,
    ExecTimer,
    jsonable,
    load_avg,
    median,
    percentile,
    union_seconds,
)

from omnistep.core import (  # noqa: E402
    Modality,
    ModelInstance,
    Request,
    SamplingParams,
    WorkUnitKind,
)
from omnistep.engine import AsyncEngine  # noqa: E402
from omnistep.models.voxcpm.card import VoxCPMOptions, build_card  # noqa: E402
from omnistep.models.voxcpm.tiny import write_folder  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO / "bench" / "results" / "voxcpm_inner_solve.json"
FORMS = ("in_step", "units")
SAMPLE_RATE = 48000


def published_sizes(layers: int) -> dict[str, Any]:
    """Top-level ``config.json`` overrides at the published widths, ``layers`` per stack."""
    lm = {
        "bos_token_id": 1,
        "eos_token_id": 2,
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "max_position_embeddings": 32768,
        "num_attention_heads": 16,
        "num_hidden_layers": layers,
        "num_key_value_heads": 2,
        "kv_channels": 128,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000,
        "rope_scaling": {
            "type": "longrope",
            "long_factor": [1.0] * 64,
            "short_factor": [1.0] * 64,
            "original_max_position_embeddings": 32768,
        },
        "vocab_size": 256,
        "use_mup": False,
        "scale_emb": 12,
        "dim_model_base": 256,
        "scale_depth": 1.4,
    }
    local = {"hidden_dim": 1024, "ffn_dim": 4096, "num_heads": 16, "num_layers": layers}
    local["kv_channels"] = 128
    cfm = {"sigma_min": 1e-6, "solver": "euler", "t_scheduler": "log-norm"}
    vae = {
        "encoder_dim": 128,
        "encoder_rates": [2, 5, 8, 8],
        "latent_dim": 64,
        "decoder_dim": 2048,
        "decoder_rates": [8, 6, 5, 2, 2, 2],
        "depthwise": True,
        "sample_rate": 16000,
        "out_sample_rate": 48000,
        "use_noise_block": False,
        "sr_bin_boundaries": [20000, 30000, 40000],
        "cond_type": "scale_bias",
        "cond_dim": 128,
        "cond_out_layer": False,
    }
    return {
        "lm_config": lm,
        "patch_size": 4,
        "feat_dim": 64,
        "residual_lm_num_layers": layers,
        "residual_lm_no_rope": True,
        "scalar_quantization_latent_dim": 512,
        "scalar_quantization_scale": 9,
        "encoder_config": local,
        "dit_config": {
            **local,
            "dit_mean_mode": False,
            "cfm_config": {**cfm, "inference_cfg_rate": 2.0},
        },
        "audio_vae_config": vae,
    }


def write(root: Path, quick: bool, layers: int) -> Path:
    """The folder (``write_folder``), the stop head zeroed so requests run to their cap."""
    from safetensors.torch import load_file, save_file

    folder = write_folder(root, overrides=None if quick else published_sizes(layers))
    path = folder / "model.safetensors"
    state = load_file(str(path))
    state["stop_head.weight"] = torch.zeros_like(state["stop_head.weight"])
    save_file(state, str(path))
    return folder


class Form:
    """One card (one ``inner_solve``) in its own engine, its components' ``execute`` timed."""

    def __init__(self, folder: Path, form: str, frames: int):
        options = VoxCPMOptions(kv_cache_gb=0.25, inner_solve=form, max_len=frames)
        self.model = ModelInstance.load(build_card(str(folder), options))
        self.timers = [ExecTimer(c) for c in self.model.components.values()]
        self.engine = AsyncEngine([self.model])
        self.form, self.frames, self.seed = form, frames, 1000

    async def burst(self, c: int, frames: int | None = None) -> dict[str, Any]:
        """C requests at once, streamed to their ends."""
        frames = frames or self.frames
        for t in self.timers:
            t.log.clear()
        load = load_avg()
        seed0, self.seed = self.seed, self.seed + c
        sampling = SamplingParams(max_new_tokens=frames)
        reqs = [
            Request("voxcpm2", text=SENTENCES[i % 8], seed=seed0 + i, sampling=sampling)
            for i in range(c)
        ]
        start = time.perf_counter()
        submitted = []
        streams = []
        for r in reqs:
            submitted.append(time.perf_counter())
            streams.append(self.engine.add_request(r))

        async def consume(i: int) -> tuple[float, float, int]:
            first, samples = None, 0
            async for chunk in streams[i]:
                audio = chunk.audio if chunk.modality is Modality.AUDIO else None
                if audio is not None and audio.size:
                    first = first or time.perf_counter()
                    samples += audio.size
            return first - submitted[i], time.perf_counter() - submitted[i], samples

        per = await asyncio.gather(*(consume(i) for i in range(c)))
        wall = time.perf_counter() - start
        calls = [entry for t in self.timers for entry in t.log]
        in_exec = union_seconds([(s, e) for _, _, s, e in calls])
        units = sum(n for _, n, _, _ in calls)
        audio = sum(s for _, _, s in per) / SAMPLE_RATE
        ttfa = [t for t, _, _ in per]
        by_kind: dict[str, float] = {}
        for kind, _, s, e in calls:
            by_kind[kind] = by_kind.get(kind, 0.0) + e - s
        return {
            "concurrency": c,
            "wall_s": wall,
            "audio_s": audio,
            "audio_s_per_s": audio / wall,
            "ttfa_p50_s": percentile(ttfa, 50),
            "ttfa_p99_s": percentile(ttfa, 99),
            "per_patch_s": median([(total - t) / max(1, frames - 1) for t, total, _ in per]),
            "units": units,
            "calls": len(calls),
            "units_per_s": units / wall,
            "exec_s": in_exec,
            "exec_s_by_kind": by_kind,
            "overhead_per_call_s": (wall - in_exec) / max(1, len(calls)),
            "loadavg_before": load,
        }

    async def close(self) -> None:
        await self.engine.shutdown()


FIGURES = (
    ("c1", "ttfa_p50_s", "C=1 TTFA s"),
    ("c1", "per_patch_s", "C=1 per patch s"),
    ("c8", "audio_s_per_s", "C=8 audio-s/s"),
    ("c8", "ttfa_p99_s", "C=8 TTFA p99 s"),
    ("c8", "units_per_s", "C=8 units/s"),
    ("c8", "calls", "C=8 execute calls"),
    ("c8", "overhead_per_call_s", "C=8 overhead/call s"),
)


def direct(forms: dict[str, Form], batch: int, steps: int) -> dict[str, float]:
    """Median seconds per patch of each form's components called by hand (module docstring)."""
    from omnistep.loops.ar_decode import ARPrefillInput, ARStepInput
    from omnistep.loops.denoise import DenoiseInput
    from omnistep.models.voxcpm.ar import VoxCPMPrompt, stop_sampling
    from omnistep.models.voxcpm.lm import build_prompt
    from omnistep.models.voxcpm.solve import SolveStart

    def solve(dit: Any, outs: list) -> list:
        if not isinstance(outs[0].hidden, SolveStart):
            return [o.hidden for o in outs]
        pending = [DenoiseInput(start=o.hidden) for o in outs]
        while True:
            res = dit.execute(WorkUnitKind.DENOISE_STEP, pending)
            if res[0].done:
                return [r.result for r in res]
            pending = [DenoiseInput(state=r.state) for r in res]

    row = stop_sampling(2)
    state: dict[str, Any] = {}
    times: dict[str, list[float]] = {f: [] for f in FORMS}
    for name, form in forms.items():
        lm = form.model.components["lm"]
        prompt = VoxCPMPrompt(build_prompt(list(range(110, 130)), lm.patch, lm.feat))
        gens = [torch.Generator().manual_seed(i) for i in range(batch)]
        units = [
            ARPrefillInput(f"direct{batch}/{i}", prompt, (), (), row, g) for i, g in enumerate(gens)
        ]
        outs = lm.execute(WorkUnitKind.PREFILL, units)
        state[name] = (gens, outs, solve(form.model.components.get("dit"), outs))
    for step in range(1, steps + 1):
        for name in FORMS if step % 2 else FORMS[::-1]:
            lm, dit = (forms[name].model.components.get(n) for n in ("lm", "dit"))
            gens, outs, patches = state[name]
            units = [
                ARStepInput(f"direct{batch}/{i}", o.tokens, step, (), row, gens[i], extra=p)
                for i, (o, p) in enumerate(zip(outs, patches, strict=True))
            ]
            start = time.perf_counter()
            outs = lm.execute(WorkUnitKind.AR_TOKEN, units)
            patches = solve(dit, outs)
            times[name].append(time.perf_counter() - start)
            state[name] = (gens, outs, patches)
    for form in forms.values():
        for i in range(batch):
            form.model.components["lm"].free_sequence(f"direct{batch}/{i}")
    return {f: median(v) for f, v in times.items()}


async def run(args: argparse.Namespace) -> dict[str, Any]:
    root = Path(args.root or tempfile.mkdtemp()) / "voxcpm_inner_solve"
    folder = write(root, args.quick, args.layers)
    forms = {f: Form(folder, f, args.frames) for f in FORMS}
    try:
        for form in forms.values():  # warm-ups: one short request, then a burst of 2
            await form.burst(1, frames=2)
            await form.burst(2, frames=2)
        for name in FORMS:  # and one unmeasured round (the first form's first burst after
            # the other engine's warm-up ran up to 2x slow)
            await forms[name].burst(1)
            await forms[name].burst(8, frames=2)
        rounds = []
        for r in range(args.rounds):
            order = FORMS if r % 2 == 0 else FORMS[::-1]
            rnd: dict[str, Any] = {}
            for name in order:
                rnd[name] = {"c1": await forms[name].burst(1), "c8": await forms[name].burst(8)}
                c1, c8 = rnd[name]["c1"], rnd[name]["c8"]
                print(
                    f"round {r + 1} {name:<8} C=1 TTFA {c1['ttfa_p50_s']:.3f}s "
                    f"patch {c1['per_patch_s']:.3f}s | C=8 {c8['audio_s_per_s']:.3f} audio-s/s "
                    f"TTFA p99 {c8['ttfa_p99_s']:.3f}s {c8['units_per_s']:.1f} units/s "
                    f"overhead/call {c8['overhead_per_call_s'] * 1e3:.2f} ms "
                    f"load {c8['loadavg_before'][0]}",
                    flush=True,
                )
            rounds.append(rnd)
        direct_s = {}
        for c in (1, 8):
            direct_s[c] = direct(forms, c, args.direct_steps)
            one, split = direct_s[c]["in_step"], direct_s[c]["units"]
            print(
                f"direct C={c}: per patch in_step {one:.3f}s, units {split:.3f}s "
                f"({split / one:.3f})",
                flush=True,
            )
    finally:
        for form in forms.values():
            await form.close()
    return {**summarize(rounds, args), "direct_per_patch_s": direct_s}


def summarize(rounds: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    """Per form the median of each figure over rounds; per figure the median ratio units /
    in_step of the rounds."""
    figures: dict[str, Any] = {}
    for level, key, label in FIGURES:
        values = {f: [r[f][level][key] for r in rounds] for f in FORMS}
        ratios = [u / i for u, i in zip(values["units"], values["in_step"], strict=True) if i]
        figures[label] = {
            **{f: median(v) for f, v in values.items()},
            "ratio_units_over_in_step": median(ratios),
            "ratios": ratios,
        }
    return {
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "threads": torch.get_num_threads(),
        "figures": figures,
        "rounds": rounds,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=2, help="layers per stack (published widths)")
    ap.add_argument("--frames", type=int, default=12, help="patches per request")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--direct-steps", type=int, default=6, help="patches of the direct timing")
    ap.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    ap.add_argument("--quick", action="store_true", help="tiny folder, 4 patches")
    ap.add_argument("--root", type=str, default=None, help="folder to write the weights under")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = ap.parse_args(argv)
    if args.quick:
        args.frames, args.direct_steps = 4, 2
    torch.set_num_threads(args.threads)
    result = asyncio.run(run(args))
    print(f"\n{'figure':<22} {'in_step':>10} {'units':>10} {'units/in_step':>14}")
    for label, row in result["figures"].items():
        print(
            f"{label:<22} {row['in_step']:>10.4g} {row['units']:>10.4g} "
            f"{row['ratio_units_over_in_step']:>14.3f}"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(jsonable(result), indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
