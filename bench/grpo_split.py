"""One GRPO iteration's split on omnistep (``bench/rollout.py --grpo``): rollout / score /
backward / optimizer step / update_weights, for ChatTTS and Qwen3-TTS, with ``score`` timed both
packed (``batch_size=16``: one teacher-forced forward for the batch's samples) and one sample
per forward (``batch_size=1``, the path before packed scoring).

An iteration, as ``examples/grpo_chattts.py`` runs it:

* **rollout**: ``OmniEngine.rollout`` of ``inputs`` texts x ``n`` samples (every sample
  decodes exactly ``tokens`` frames: ``min_new_tokens = max_new_tokens``), one fixed voice,
  ``logprobs="policy"``.
* **score**: the log-probs of every recorded action, recomputed with autograd on the
  trainer's own copy of the AR component's weights (``omni.trainer()``), policy mode.
* **backward**: the GRPO loss (``-sum(advantage * sum(log-probs)) / samples``; advantages
  group-relative, from a reward computable without a model: the share of first-codebook codes
  in the lower half) and ``loss.backward()``.
* **optimizer**: one Adam step over every trained tensor.
* **update**: ``update_weights(trainer)``: the engine serves the trainer's weights.

Score is timed twice per iteration on the same samples (packed and per sample, the order
alternating between iterations; only the packed result is backpropagated); CPU seconds (this
process) are recorded beside wall seconds, the steadier figure on a shared machine. Target
(issue 31, item 9): packed score <= 0.3 x per-sample score for 16 samples.

Checkpoints: ChatTTS at the official sizes with seeded random weights (``--size full``, written
once by ``bench/ar_decode.py``'s ``ensure_checkpoint``) or the servable tiny one; Qwen3-TTS
CustomVoice at the published 0.6B widths with ``bench/qwen3_tts.py``'s default depth (talker 8
of 28 layers) or the tiny test sizes.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from omnistep.core import SamplingParams
from omnistep.offline import OmniEngine, RolloutGroup

FAMILIES = ("chattts", "qwen3_tts")
TEXTS = (
    "hello world this is a test of the voice",
    "good morning the weather is nice today",
    "thank you for the help with my work",
    "the man came home after a long day",
)
VOICES = {"chattts": "alloy", "qwen3_tts": "ryan"}
LOOP = "decode"
"""The AR loop both families record (ChatTTS GPT, Qwen3-TTS talker + code predictor)."""


def reward(tokens: np.ndarray, codebook_size: int) -> float:
    """Share of frames (``tokens`` int64 ``[T, C]``) whose first code is in the lower half."""
    return float((tokens[:, 0] < codebook_size // 2).mean()) if len(tokens) else 0.0


def advantages(groups: list[RolloutGroup], codebook_size: int) -> list[float]:
    """GRPO advantages (Shao et al. 2024, arXiv 2402.03300): (r - group mean) / (std + 1e-6),
    flattened in sample order."""
    out: list[float] = []
    for group in groups:
        r = np.array([reward(s.loops[LOOP].tokens, codebook_size) for s in group.samples])
        out += list((r - r.mean()) / (r.std() + 1e-6))
    return out


def _checkpoint(family: str, size: str, root: Path | None) -> Path:
    """The folder of ``family`` at ``size`` (``full``/``tiny``), written once."""
    if family == "chattts":
        from ar_decode import SIZES, ensure_checkpoint

        folder = root or SIZES[size][1]
        ensure_checkpoint(folder, size)
        return folder
    from qwen3_tts import DEFAULT_ROOT, DEPTHS, bench_sizes, ensure_checkpoint

    folder = root or (DEFAULT_ROOT if size == "full" else Path("/tmp/omnistep-qwen3-tts-tiny"))
    ensure_checkpoint(folder, bench_sizes(size != "full", DEPTHS["bench"]))
    return folder


class _Clock:
    """Wall and process-CPU seconds of a block (``with clock("phase"):``), summed per phase."""

    def __init__(self, device: str):
        self.device = device
        self.wall: dict[str, float] = {}
        self.cpu: dict[str, float] = {}
        self._phase = ""

    def __call__(self, phase: str) -> _Clock:
        self._phase = phase
        return self

    def __enter__(self) -> None:
        self._sync()
        self._t = (time.perf_counter(), time.process_time())

    def __exit__(self, *exc: object) -> None:
        self._sync()
        wall, cpu = time.perf_counter() - self._t[0], time.process_time() - self._t[1]
        self.wall[self._phase] = self.wall.get(self._phase, 0.0) + wall
        self.cpu[self._phase] = self.cpu.get(self._phase, 0.0) + cpu

    def _sync(self) -> None:
        if self.device.startswith("cuda"):
            torch.cuda.synchronize()


def run_family(
    family: str,
    *,
    size: str = "full",
    root: Path | None = None,
    inputs: int = 2,
    n: int = 8,
    tokens: int = 32,
    iterations: int = 2,
    device: str = "cpu",
    lr: float = 1e-4,
) -> dict[str, Any]:
    """Time ``iterations`` GRPO iterations of ``family`` (after one untimed warm-up
    iteration); returns the median seconds per phase (wall and CPU) and the packed / per-sample
    score ratio.

    Raises:
        ValueError: an unknown family.
    """
    if family not in FAMILIES:
        raise ValueError(f"family must be one of {FAMILIES}, got {family!r}")
    folder = _checkpoint(family, size, root)
    sampling = SamplingParams(
        temperature=1.0, top_p=1.0, top_k=0, repetition_penalty=1.0,
        max_new_tokens=tokens + (family == "qwen3_tts"),  # Qwen3-TTS: N - 1 frames of N
        min_new_tokens=tokens,
    )  # fmt: skip
    texts = list((TEXTS * 4)[:inputs])
    rows: list[dict[str, Any]] = []
    with OmniEngine(f"{family}={folder}", device, kv_cache_gb=1.0) as omni:
        model = next(iter(omni.engine.models.values()))
        codebook_size = int(model.loops[LOOP].config.eos_token_ids[0])
        trainer = omni.trainer()
        weights = trainer.weights()
        optimizer = torch.optim.Adam(list(weights.values()), lr=lr)
        for it in range(iterations + 1):
            clock = _Clock(device)
            with clock("rollout"):
                groups = omni.rollout(
                    texts, n=n, seed=1000 * it, voice=VOICES[family], sampling=sampling,
                    logprobs="policy", progress=False,
                )  # fmt: skip
            samples = [s for g in groups for s in g.samples]
            # per sample (graphs built as the old path did, then dropped) and packed, in
            # alternating order so neither always runs on a warmer cache
            for packed in (False, True) if it % 2 else (True, False):
                with clock("score" if packed else "score_per_sample"):
                    got = omni.score(
                        samples, mode="policy", trainer=trainer, batch_size=16 if packed else 1
                    )
                if packed:
                    scores = got
                del got
            adv = advantages(groups, codebook_size)
            with clock("backward"):
                loss = -sum(a * s[LOOP].sum() for a, s in zip(adv, scores, strict=True))
                (loss / len(samples)).backward()
            with clock("optimizer"):
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            with clock("update"):
                omni.update_weights(trainer)
            frames = sum(len(s.loops[LOOP].tokens) for s in samples)
            if it == 0:
                continue  # warm-up: oneDNN packs, allocator, first autograd graph
            rows.append({"wall": clock.wall, "cpu": clock.cpu, "frames": frames})
            print(
                f"{family} iteration {it}: "
                + ", ".join(f"{k} {v:.2f}" for k, v in clock.cpu.items())
                + " (cpu s)",
                flush=True,
            )
    phases = list(rows[0]["wall"])
    out = {
        "family": family,
        "size": size,
        "samples": inputs * n,
        "frames_per_sample": tokens,
        "wall_s": {p: statistics.median(r["wall"][p] for r in rows) for p in phases},
        "cpu_s": {p: statistics.median(r["cpu"][p] for r in rows) for p in phases},
    }
    out["score_ratio_cpu"] = out["cpu_s"]["score"] / out["cpu_s"]["score_per_sample"]
    out["score_ratio_wall"] = out["wall_s"]["score"] / out["wall_s"]["score_per_sample"]
    return out
