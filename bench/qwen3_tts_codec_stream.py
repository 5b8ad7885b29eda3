"""Per-chunk cost of the Qwen3-TTS 12 Hz codec decoder: stateless windows vs kept stream state.

Decodes random codes with seeded random weights at the published decoder size
(``PUBLISHED_DECODER``) or the tests' tiny one, with one chunk schedule (default 2, 8, 16, 32,
64, 64, ...), and times each chunk three ways:

- ``window``: the stateless path (``CodecDecoder.decode_rows``): every chunk's window carries
  ``left_context_frames`` (580) frames of left context; the transformer reruns over all of
  them, the conv stack over ``conv_context_frames`` (10) before the chunk.
- ``state+recompute``: the transformer continues the stream's KV cache (``decode_stream``'s
  latents), the conv stack reruns over the stream's last ``conv_context_frames`` latents.
- ``state``: ``CodecDecoder.decode_stream``: KV cache and every conv's carried inputs; only the
  chunk's own frames are computed.

Each variant's concatenated chunks are compared with the whole-utterance decode (max abs
difference), so the timings are of exact decodes. One thread by default, timed as this
thread's CPU time (``time.thread_time``; with one torch thread the kernels run in it), which
other load on a shared machine disturbs far less than wall time; ``--clock wall`` for wall
time. ``--repeats``: the best of that many runs per chunk.

    .venv/bin/python bench/qwen3_tts_codec_stream.py                     # published, 300 frames
    .venv/bin/python bench/qwen3_tts_codec_stream.py --size tiny --frames 300
    .venv/bin/python bench/qwen3_tts_codec_stream.py --steady 600        # window at full context
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from omnistep.layers.codec_decoder import (
    PUBLISHED_DECODER,
    CodecDecoder,
    CodecDecoderConfig,
    DecodeRow,
    DecoderStream,
    _schedule,
)

CLOCK = {"cpu": time.thread_time, "wall": time.perf_counter}
_clock = [time.thread_time]


def now() -> float:
    """Seconds on the chosen clock (``--clock``)."""
    return _clock[0]()


TINY = {
    "codebook_size": 64, "codebook_dim": 16, "hidden_size": 32, "latent_dim": 24,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "sliding_window": 5,
    "intermediate_size": 48, "num_hidden_layers": 2, "num_quantizers": 16,
    "upsample_rates": [3, 2], "upsampling_ratios": [2, 2], "decoder_dim": 32,
}  # fmt: skip
"""The decoder config of tests/test_qwen3_tts_codec.py."""


def build(size: str) -> CodecDecoder:
    """A decoder with seeded weights at a realistic scale (matrices ~ N(0, 1/fan_in), codebook
    sums ~ N(0, 1), LayerScale 0.01 as upstream's init)."""
    config = CodecDecoderConfig.from_dict(PUBLISHED_DECODER if size == "published" else TINY)
    model = CodecDecoder(config)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("embedding_sum"):
                p.copy_(torch.randn(p.shape, generator=g))
            elif name.endswith((".alpha", ".beta")):
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
            elif p.dim() >= 2:
                p.copy_(0.5 * torch.randn(p.shape, generator=g) / p[0].numel() ** 0.5)
    return model.eval()


def window_chunks(model: CodecDecoder, codes: torch.Tensor, bounds) -> tuple[list, list]:
    left = model.left_context_frames
    times, pieces = [], []
    for start, end in bounds:
        first = max(0, start - left)
        row = DecodeRow(codes[0, first:end], start - first, end - start)
        t0 = now()
        with torch.inference_mode():
            pieces.append(model.decode_rows([row])[0])
        times.append(now() - t0)
    return times, pieces


def state_chunks(model: CodecDecoder, codes: torch.Tensor, bounds) -> tuple[list, list]:
    stream, times, pieces = DecoderStream(), [], []
    for start, end in bounds:
        t0 = now()
        (wave,), (stream,) = model.decode_stream([codes[0, start:end]], [stream])
        times.append(now() - t0)
        pieces.append(wave)
    return times, pieces


def recompute_chunks(model: CodecDecoder, codes: torch.Tensor, bounds) -> tuple[list, list]:
    """The transformer's state kept, the conv stack rerun over the last conv_context_frames
    latents (the alternative to carrying every conv's inputs)."""
    context, hop = model.config.conv_context_frames, model.hop_length
    stream, history = DecoderStream(), None
    times, pieces = [], []
    for start, end in bounds:
        t0 = now()
        with torch.inference_mode():
            chunk, frames = model._stack_chunks([codes[0, start:end]])
            latents, (state,) = model._stream_latents(chunk, frames, [stream])
            stream = DecoderStream(stream.frames + frames[0], state, None)
            conv_in = latents if history is None else torch.cat([history, latents], 1)
            wave = model.waveform(conv_in)[0, -frames[0] * hop :]
            history = conv_in[:, -context:]
        times.append(now() - t0)
        pieces.append(wave)
    return times, pieces


def steady_window(model: CodecDecoder, codes: torch.Tensor, sizes: list[int]) -> dict[int, float]:
    """Seconds of a stateless chunk of each size with the full left context."""
    left = model.left_context_frames
    out = {}
    for n in sizes:
        start = codes.shape[1] - n
        row = DecodeRow(codes[0, start - left :], left, n)
        t0 = now()
        with torch.inference_mode():
            model.decode_rows([row])
        out[n] = now() - t0
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=["published", "tiny"], default="published")
    parser.add_argument("--frames", type=int, default=300)
    parser.add_argument("--schedule", default="2,8,16,32,64")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--steady", type=int, default=0, help="frames for the full-context row")
    parser.add_argument("--repeats", type=int, default=1, help="best of this many runs")
    parser.add_argument("--clock", choices=sorted(CLOCK), default="cpu")
    args = parser.parse_args()
    _clock[0] = CLOCK[args.clock]
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = build(args.size)
    size = model.config.codebook_size
    frames = max(args.frames, args.steady)
    codes = torch.randint(0, size, (1, frames, model.config.num_quantizers))
    schedule = [int(s) for s in args.schedule.split(",")]
    bounds = _schedule(args.frames, schedule)
    with torch.inference_mode():
        whole = model.decode(codes[:, : args.frames])[0]
    report: dict = {
        "size": args.size,
        "frames": args.frames,
        "chunks": bounds,
        "clock": args.clock,
        "variants": {},
    }
    for name, fn in (
        ("window", window_chunks),
        ("state+recompute", recompute_chunks),
        ("state", state_chunks),
    ):
        best = None
        for _ in range(args.repeats):
            times, pieces = fn(model, codes, bounds)
            best = times if best is None else [min(a, b) for a, b in zip(best, times, strict=True)]
        error = float((torch.cat(pieces) - whole).abs().max())
        report["variants"][name] = {"seconds": best, "max_abs_error": error}
        print(f"{name:16s} err {error:.2e} total {sum(best):7.3f} s  per chunk:", end="")
        for (start, end), t in zip(bounds, best, strict=True):
            print(f" {end - start}f:{t * 1000:.1f}ms", end="")
        print()
    if args.steady:
        steady = steady_window(model, codes[:, : args.steady], sorted(set(schedule)))
        report["window_full_context"] = steady
        print("window at full left context:", {n: f"{t * 1000:.0f}ms" for n, t in steady.items()})
    print(json.dumps(report))


if __name__ == "__main__":
    main()
