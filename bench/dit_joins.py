"""Error at the chunk joins of Qwen2.5-Omni's streamed DiT against the whole-utterance decode.

What it measures
----------------
For each DiT configuration, one utterance (random codec tokens, one speaker, the noise of every
frame from ``frame_noise(seed)``, the default solver: 10 time points, 9 RK4 steps, guidance 0.5,
sway -1) is decoded

* whole: ``DiT.sample`` (the card with ``dit_chunking=None``), and
* chunked: ``DiT.sample_chunked`` (what the card streams) for every ``DiTChunking`` of a grid
  (``first_chunk_blocks = chunk_blocks`` in ``--chunks``, ``left_context_blocks`` in
  ``--lefts``, ``lookahead_blocks`` in ``--aheads``) plus ``DiTChunking.exact`` (the ODE's whole
  receptive field, chunk 3 blocks),

on the same weights, codes, speaker and noise. Both mels go through the same BigVGAN whole
(chunked BigVGAN equals whole BigVGAN, tests/test_qwen_token2wav.py), so the wave error is the
DiT's. Per setting:

* mel error (log-mel units, |chunked - whole| over all bins): max and mean over the frames
  within one DiT block of a join (``near``: frames ``j - block .. j + block - 1`` for each
  chunk start ``j > 0``) and over the other frames (``else``; none when every frame is near a
  join, e.g. chunks of one block), and the same divided by the whole mel's std (``rel``);
* wave error (24 kHz): max |chunked - whole| and SNR = 10 log10(sum whole^2 / sum (chunked -
  whole)^2) in dB, over the whole utterance and over the samples of the near-join frames;
* DiT cost relative to whole: sum of window frames / utterance frames (``cost``: the work, as
  the DiT's attention is block-local it is linear in frames) and the measured seconds of the
  chunked decode / the whole decode's (``time``: one run each, on a shared machine);
* time to first audio, in codes: the codes the talker must have produced before the first DiT
  window can run (``codes@dit``: (first chunk + look-ahead) blocks) and before the vocoder's
  first chunk can be decoded (``codes@audio``: the card's BigVGAN needs ``first_chunk`` (20) +
  ``vocoder_context`` (34) mel frames, ``QwenOmniOptions`` defaults, so the DiT windows up to
  the one whose output reaches frame 54), and the DiT frames those windows run (``frames@audio``);
  the whole decode needs every code first.

Configurations (``--configs``, default ``tiny,full``):

* ``tiny``: the test checkpoint's token2wav (``omnistep.models.qwen2_5_omni.tiny.TINY_SIZES``: DiT
  width 64, 4 layers, 4 heads of 16, block 8 frames, look-back layers (0, 3), look-ahead (2,);
  BigVGAN 128 channels, official kernels and rates) with realistic-scale random weights
  (``randomize`` of tests/test_qwen_token2wav.py, the recipe of the token2wav parity tests);
* ``tiny-ckpt``: the same modules with the checkpoint writer's own weights (what the card's
  tests and ``bench/omni.py`` run; written once into ``--root`` by ``bench/omni.py``'s
  ``ensure_checkpoint``);
* ``full``: a full-width DiT (official ``DiTConfig``: hidden 1024, 16 heads of 64, ff_mult 2,
  block 24, emb_dim 512, num_embeds 8193, mel 80, official speaker-encoder sizes) with 4 layers
  instead of 22: look-back layers (0, 3) and look-ahead (2,), so each forward reaches 2 blocks
  back and 1 ahead like the official model's (0, 20) / (10,); ``randomize`` weights; a narrow
  BigVGAN (``--full-bigvgan-channels``, 128; official kernels and rates) to keep the run short.
  Its grid is smaller (``--full-settings``, ``--full-exact``): its whole decode of 150 codes
  takes ~11 s on 2 idle cores.

The errors are deterministic; the ``time`` column is one run on a shared machine (compare the
whole decode's two timings printed above each table), ``cost`` is the work.

How to run
----------
::

    PYTHONPATH=. .venv/bin/python bench/dit_joins.py                  # tiny + full (~9 min)
    PYTHONPATH=. .venv/bin/python bench/dit_joins.py --configs tiny-ckpt --chunks 3 --out x.json
    PYTHONPATH=. .venv/bin/python bench/dit_joins.py --configs full --full-settings 3/3/2/1,3/3/0/0

Prints one table per configuration and writes ``bench/results/dit_joins.json`` (``--out``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from omnistep.models.qwen2_5_omni.bigvgan import BigVGAN, BigVGANConfig
from omnistep.models.qwen2_5_omni.card import QwenOmniOptions
from omnistep.models.qwen2_5_omni.dit import ChunkWindow, DiT, DiTChunking, DiTConfig
from omnistep.models.qwen2_5_omni.loader import QwenOmniFiles
from omnistep.models.qwen2_5_omni.token2wav import Token2WavConfig, load_token2wav_part
from omnistep.runners.flow_matching import SolverConfig, frame_noise

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import load_avg  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO / "bench" / "results" / "dit_joins.json"
DEFAULT_ROOT = Path("/tmp/omnistep-qwen-bench")
SAMPLE_RATE = 24000
# The full-width DiT's default settings (first/chunk/left/ahead blocks): the card's default,
# its neighbours in context and look-ahead, larger chunks (after a first of 3 blocks: the same
# wait for the first audio, less recomputed context) and a chunk of one block (it needs as many
# codes before the first audio as three at block 24, see ``first_audio``).
FULL_SETTINGS = "3/3/0/0,3/3/1/1,3/3/2/0,3/3/2/1,3/3/2/2,6/6/2/1,3/6/2/1,3/6/2/2,1/1/2/1"


# ----------------------------------------------------------------------------- pure helpers


def grid(chunks: list[int], lefts: list[int], aheads: list[int]) -> list[DiTChunking]:
    """Every ``DiTChunking(c, c, left, ahead)`` of the grid, chunk-major."""
    return [DiTChunking(c, c, left, ahead) for c in chunks for left in lefts for ahead in aheads]


def parse_setting(text: str) -> DiTChunking:
    """``"first/chunk/left/ahead"`` (blocks; first or chunk ``auto``: None, which the card
    sets to the fewest blocks holding BigVGAN's first chunk, or ``CHUNK_FRAMES``,
    ``DiTChunking.covering``) -> ``DiTChunking``; raises ValueError."""
    parts = [p.strip() for p in text.strip().split("/")]
    if len(parts) != 4:
        raise ValueError(f"a setting is first/chunk/left/ahead in blocks, got {text!r}")
    first, chunk = (None if p == "auto" else int(p) for p in parts[:2])
    return DiTChunking(first, chunk, *(int(p) for p in parts[2:]))


def label(chunking: DiTChunking) -> str:
    """``first/chunk/left/ahead`` in blocks (``auto`` for None)."""
    c = chunking
    first, chunk = ("auto" if v is None else v for v in (c.first_chunk_blocks, c.chunk_blocks))
    return f"{first}/{chunk}/{c.left_context_blocks}/{c.lookahead_blocks}"


def join_frames(windows: list[ChunkWindow]) -> list[int]:
    """Mel frames where a chunk starts after another (every ``out_start`` but the first)."""
    return [w.out_start for w in windows[1:]]


def near_join_mask(frames: int, joins: list[int], block_size: int) -> np.ndarray:
    """bool ``[frames]``: frame f lies within one block of a join j (``j - block <= f < j +
    block``)."""
    mask = np.zeros(frames, dtype=bool)
    for j in joins:
        mask[max(0, j - block_size) : j + block_size] = True
    return mask


def abs_stats(diff: np.ndarray, scale: float) -> dict[str, float | None]:
    """max and mean of ``|diff|`` and both divided by ``scale`` (None when ``diff`` is empty)."""
    if diff.size == 0:
        return {"max": None, "mean": None, "max_rel": None, "mean_rel": None}
    a = np.abs(diff)
    mx, mean = float(a.max()), float(a.mean())
    return {"max": mx, "mean": mean, "max_rel": mx / scale, "mean_rel": mean / scale}


def snr_db(reference: np.ndarray, other: np.ndarray) -> float | None:
    """10 log10(sum reference^2 / sum (other - reference)^2); inf when equal; None when empty."""
    if reference.size == 0:
        return None
    noise = float(np.sum((other.astype(np.float64) - reference) ** 2))
    signal = float(np.sum(reference.astype(np.float64) ** 2))
    return math.inf if noise == 0 else 10 * math.log10(signal / noise)


def first_audio(windows: list[ChunkWindow], repeats: int, vocoder_frames: int) -> dict[str, int]:
    """What the first audio waits for: the DiT windows run until the chunks' output reaches
    ``vocoder_frames`` mel frames (or the utterance ends); ``codes_dit``: codes before the
    first window can start, ``codes_audio``: before the last of those can, ``frames_audio``:
    frames the DiT runs on in those windows, ``windows_audio``: how many."""
    needed = []
    for w in windows:
        needed.append(w)
        if w.out_end >= vocoder_frames:
            break
    return {
        "codes_dit": math.ceil(windows[0].end / repeats),
        "codes_audio": math.ceil(max(w.end for w in needed) / repeats),
        "frames_audio": sum(w.frames for w in needed),
        "windows_audio": len(needed),
    }


def errors(
    whole_mel: np.ndarray,
    mel: np.ndarray,
    whole_wave: np.ndarray,
    wave: np.ndarray,
    near: np.ndarray,
    hop: int,
) -> dict[str, Any]:
    """Mel errors ``[mel_dim, frames]`` near joins / elsewhere (``near`` ``[frames]``), and the
    wave's (``[frames * hop]`` samples): max |diff|, SNR over all and over near-join samples."""
    std = float(whole_mel.std())
    diff = mel - whole_mel
    near_samples = np.repeat(near, hop)
    return {
        "mel_std": std,
        "mel_near": abs_stats(diff[:, near], std),
        "mel_else": abs_stats(diff[:, ~near], std),
        "wave_max": float(np.abs(wave - whole_wave).max()),
        "wave_snr_db": snr_db(whole_wave, wave),
        "wave_snr_near_db": snr_db(whole_wave[near_samples], wave[near_samples]),
        "wave_rms": float(np.sqrt(np.mean(whole_wave.astype(np.float64) ** 2))),
    }


# ----------------------------------------------------------------------------- models


@dataclass
class Setup:
    """One configuration's models and utterance."""

    name: str
    description: str
    dit: DiT
    vocoder: BigVGAN
    codes: torch.Tensor  # [1, T] int64
    cond: torch.Tensor  # [1, enc_emb_dim]
    ref_mel: torch.Tensor  # [1, L, mel_dim]
    noise: torch.Tensor  # [1, 2T, mel_dim]


def _randomize():  # noqa: ANN202
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    from tests.test_qwen_token2wav import randomize

    return randomize


def _utterance(config: DiTConfig, codes: int, vocab: int, seed: int, ref_frames: int):  # noqa: ANN202
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randint(0, vocab, (1, codes), generator=g),
        torch.randn(1, config.enc_emb_dim, generator=g),
        -5.0 + 1.5 * torch.randn(1, ref_frames, config.mel_dim, generator=g),
        frame_noise(seed + 1, codes * config.repeats, config.mel_dim)[None],
    )


def tiny_setups(root: Path, codes: int, seed: int, which: set[str]) -> list[Setup]:
    """``tiny`` (randomize weights) and/or ``tiny-ckpt`` (the written checkpoint's weights)."""
    from omni import ensure_checkpoint  # bench/omni.py: the same cached tiny checkpoint

    ensure_checkpoint(root, "tiny")
    files = QwenOmniFiles.locate(root)
    config = Token2WavConfig.from_dict(files.config()["token2wav_config"])
    codec_codes = config.dit.num_embeds  # any id the DiT embeds
    out = []
    if "tiny" in which:
        randomize = _randomize()
        dit = randomize(DiT(config.dit), seed=0).eval()
        vocoder = randomize(BigVGAN(config.bigvgan), seed=3).eval()
        spk = _utterance(config.dit, codes, codec_codes, seed, 48)
        out.append(
            Setup(
                "tiny",
                f"test checkpoint sizes (TINY_SIZES), randomize weights, "
                f"{torch.get_num_threads()} torch thread(s): {_describe(config)}",
                dit,
                vocoder,
                *spk,
            )
        )
    if "tiny-ckpt" in which:
        dit = load_token2wav_part("dit", files.tensors("token2wav.code2wav_dit_model."), config)
        vocoder = load_token2wav_part(
            "bigvgan", files.tensors("token2wav.code2wav_bigvgan_model."), config
        )
        speaker = files.speakers()["Chelsie"]
        codes_t, _, _, noise = _utterance(config.dit, codes, codec_codes, seed, 48)
        out.append(
            Setup(
                "tiny-ckpt",
                f"the tiny checkpoint's own weights and speaker Chelsie, "
                f"{torch.get_num_threads()} torch thread(s): {_describe(config)}",
                dit,
                vocoder,
                codes_t,
                speaker["cond"].float(),
                speaker["ref_mel"].float(),
                noise,
            )
        )
    return out


def full_setup(codes: int, seed: int, bigvgan_channels: int, threads: int) -> Setup:
    """The full-width 4-layer DiT (see the module docstring) with randomize weights."""
    config = Token2WavConfig(
        DiTConfig(num_hidden_layers=4, look_backward_layers=(0, 3), look_ahead_layers=(2,)),
        BigVGANConfig(upsample_initial_channel=bigvgan_channels),
    )
    randomize = _randomize()
    dit = randomize(DiT(config.dit), seed=0).eval()
    vocoder = randomize(BigVGAN(config.bigvgan), seed=3).eval()
    spk = _utterance(config.dit, codes, config.dit.num_embeds, seed, 300)
    return Setup(
        "full",
        "full-width DiT with 4 of 22 layers (look-back (0, 3), look-ahead (2,): 2 blocks back "
        f"and 1 ahead per forward, as the official (0, 20) / (10,)), randomize weights, "
        f"{threads} torch threads: {_describe(config)}",
        dit,
        vocoder,
        *spk,
    )


def _describe(config: Token2WavConfig) -> str:
    d = config.dit
    return (
        f"DiT hidden {d.hidden_size}, {d.num_hidden_layers} layers, {d.num_attention_heads} "
        f"heads of {d.head_dim}, ff_mult {d.ff_mult}, block {d.block_size} frames, emb_dim "
        f"{d.emb_dim}, look-back {d.look_backward_layers}, look-ahead {d.look_ahead_layers}; "
        f"BigVGAN {config.bigvgan.upsample_initial_channel} channels"
    )


# ----------------------------------------------------------------------------- measurement


@torch.inference_mode()
def measure(
    setup: Setup, settings: list[DiTChunking], solver: SolverConfig, repeats: int = 1
) -> dict[str, Any]:
    """The whole decode (its time: the best of ``repeats`` after one untimed run when
    ``repeats > 1``), then every setting's chunked decode (one timed run) and its errors, then
    the whole decode timed once more (``time`` = chunked seconds / the mean of the two whole
    times, so a drift of the machine's load shows as a gap between them)."""
    dit, cfg = setup.dit, setup.dit.config
    frames = setup.codes.shape[1] * cfg.repeats
    args = (setup.codes, setup.cond, setup.ref_mel)
    whole_s = math.inf
    for _ in range(repeats + (repeats > 1)):
        start = time.perf_counter()
        whole = dit.sample(*args, noise=setup.noise, solver=solver)
        whole_s = min(whole_s, time.perf_counter() - start)
    whole_wave = setup.vocoder(whole)[0].numpy()
    whole_mel = whole[0].numpy()
    opts = QwenOmniOptions()
    vocoder_frames = opts.first_chunk + opts.vocoder_context
    hop = setup.vocoder.hop_length
    print(
        f"[{setup.name}] {setup.codes.shape[1]} codes = {frames} frames = "
        f"{frames / cfg.block_size:.1f} blocks; whole decode {whole_s:.2f}s; mel mean "
        f"{whole_mel.mean():.2f} std {whole_mel.std():.2f}; wave rms "
        f"{np.sqrt(np.mean(whole_wave**2)):.3f}",
        flush=True,
    )
    rows = []
    for chunking in settings:
        windows = chunking.windows(frames, cfg.block_size)
        exact = chunking == DiTChunking.exact(cfg, solver, chunking.chunk_size(cfg.block_size))
        start = time.perf_counter()
        mel = dit.sample_chunked(*args, setup.noise, chunking, solver)
        seconds = time.perf_counter() - start
        wave = setup.vocoder(mel)[0].numpy()
        joins = join_frames(windows)
        near = near_join_mask(frames, joins, cfg.block_size)
        row = {
            "setting": "exact" if exact else label(chunking),
            "chunking": dataclasses.asdict(chunking),
            "exact": exact,
            "windows": len(windows),
            "joins": len(joins),
            "near_frames": int(near.sum()),
            "cost_frames": sum(w.frames for w in windows) / frames,
            "seconds": seconds,
            "cost_time": seconds / whole_s,
            **first_audio(windows, cfg.repeats, vocoder_frames),
            **errors(whole_mel, mel[0].numpy(), whole_wave, wave, near, hop),
        }
        rows.append(row)
        print_row(row, flush=True)
    start = time.perf_counter()
    dit.sample(*args, noise=setup.noise, solver=solver)
    whole_after_s = time.perf_counter() - start
    for row in rows:
        row["cost_time"] = row["seconds"] / ((whole_s + whole_after_s) / 2)
    return {
        "name": setup.name,
        "description": setup.description,
        "codes": int(setup.codes.shape[1]),
        "frames": frames,
        "block_size": cfg.block_size,
        "whole_s": whole_s,
        "whole_after_s": whole_after_s,
        "vocoder_first_frames": vocoder_frames,
        "mel_mean": float(whole_mel.mean()),
        "mel_std": float(whole_mel.std()),
        "rows": rows,
    }


HEADER = (
    f"{'f/c/l/a':>9} {'near max':>9} {'(rel)':>7} {'near mean':>9} {'else max':>9} {'(rel)':>7} "
    f"{'else mean':>9} {'wave max':>8} {'SNR dB':>6} {'SNR near':>8} {'cost':>5} {'time':>5} "
    f"{'codes@dit':>9} {'codes@audio':>11} {'frames@audio':>12}"
)


def _e(x: float | None, spec: str = "9.2e") -> str:
    width = int(spec.split(".")[0])
    return "-".rjust(width) if x is None else format(x, spec)


def _db(x: float | None) -> str:
    return "-" if x is None else ("inf" if math.isinf(x) else f"{x:.1f}")


def print_row(r: dict[str, Any], flush: bool = False) -> None:
    """One table row (see ``HEADER``)."""
    print(
        f"{r['setting']:>9} {_e(r['mel_near']['max'])} {_e(r['mel_near']['max_rel'], '7.1e')} "
        f"{_e(r['mel_near']['mean'])} {_e(r['mel_else']['max'])} "
        f"{_e(r['mel_else']['max_rel'], '7.1e')} {_e(r['mel_else']['mean'])} "
        f"{r['wave_max']:8.1e} {_db(r['wave_snr_db']):>6} {_db(r['wave_snr_near_db']):>8} "
        f"{r['cost_frames']:5.2f} {r['cost_time']:5.2f} {r['codes_dit']:>9} "
        f"{r['codes_audio']:>11} {r['frames_audio']:>12}",
        flush=flush,
    )


def print_table(result: dict[str, Any]) -> None:
    """The configuration's rows under a header."""
    print(
        f"\n== {result['name']}: {result['description']}\n   {result['codes']} codes, "
        f"{result['frames']} mel frames, block {result['block_size']}; whole decode "
        f"{result['whole_s']:.2f}s (at the end {result['whole_after_s']:.2f}s), needs all "
        f"{result['codes']} codes before the first audio; mel std {result['mel_std']:.2f} "
        "(log-mel units)"
    )
    print(HEADER)
    print("-" * len(HEADER))
    for r in result["rows"]:
        print_row(r)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--configs", default="tiny,full", help="of tiny, tiny-ckpt, full")
    ap.add_argument("--chunks", default="1,3,6", help="chunk blocks (first = chunk), tiny grid")
    ap.add_argument("--lefts", default="0,1,2,4,8", help="left context blocks, tiny grid")
    ap.add_argument("--aheads", default="0,1,2,4", help="look-ahead blocks, tiny grid")
    ap.add_argument("--codes", type=int, default=200, help="utterance codes, tiny configs")
    ap.add_argument("--full-codes", type=int, default=150, help="utterance codes, full config")
    ap.add_argument(
        "--full-settings", default=FULL_SETTINGS, help="first/chunk/left/ahead list, full config"
    )
    ap.add_argument("--full-exact", action="store_true", help="also `exact` on full (~5x whole)")
    ap.add_argument("--full-bigvgan-channels", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2, help="torch threads, full config")
    ap.add_argument(
        "--tiny-threads",
        type=int,
        default=1,
        help="torch threads, tiny configs (a second thread only spin-waits on their small ops)",
    )
    ap.add_argument("--root", type=Path, default=DEFAULT_ROOT, help="tiny checkpoint (cache)")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = ap.parse_args()
    configs = {c.strip() for c in args.configs.split(",") if c.strip()}
    unknown = configs - {"tiny", "tiny-ckpt", "full"}
    if unknown:
        ap.error(f"unknown --configs {sorted(unknown)}")
    solver = SolverConfig()
    t0 = time.perf_counter()
    print(f"torch {torch.__version__}, load {load_avg()}")
    results = []
    tiny_grid = grid(_ints(args.chunks), _ints(args.lefts), _ints(args.aheads))
    if configs & {"tiny", "tiny-ckpt"}:
        torch.set_num_threads(args.tiny_threads)
        for setup in tiny_setups(args.root, args.codes, args.seed, configs):
            exact = DiTChunking.exact(setup.dit.config, solver)
            results.append(measure(setup, [*tiny_grid, exact], solver, repeats=3))
    if "full" in configs:
        torch.set_num_threads(args.threads)
        setup = full_setup(args.full_codes, args.seed, args.full_bigvgan_channels, args.threads)
        settings = [parse_setting(s) for s in args.full_settings.split(",") if s.strip()]
        if args.full_exact:
            settings.append(DiTChunking.exact(setup.dit.config, solver))
        results.append(measure(setup, settings, solver))
    for result in results:
        print_table(result)
    print(
        "\ncolumns: f/c/l/a = first/chunk/left/look-ahead blocks; near = frames within one "
        "block of a join, else = the others (log-mel units; rel = / whole mel std); wave: 24 "
        "kHz after the same BigVGAN; cost = window frames / frames, time = seconds / whole's; "
        "codes@dit / codes@audio = codes before the first DiT window / the first vocoder chunk "
        "can run"
    )
    elapsed = time.perf_counter() - t0
    print(f"load average now {load_avg()}; took {elapsed:.0f}s")
    out = {
        "machine": {
            "platform": platform.platform(),
            "torch": torch.__version__,
            "cpus": os.cpu_count(),
            "threads": {"tiny": args.tiny_threads, "full": args.threads},
        },
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "solver": dataclasses.asdict(solver),
        "configs": results,
        "seconds": round(elapsed, 1),
        "loadavg_end": load_avg(),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(_finite(out), indent=1))
    print(f"wrote {args.out}")


def _finite(x: Any) -> Any:
    """``x`` with infinite floats (an SNR of equal signals) as the string "inf" (strict JSON)."""
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_finite(v) for v in x]
    return "inf" if isinstance(x, float) and math.isinf(x) else x


if __name__ == "__main__":
    main()
