"""The codebook delay pattern of a multi-codebook sampler (MusicGen-style; Higgs Audio v2).

With a delay pattern, codebook ``k`` of a frame lags ``k`` steps behind codebook 0, so the model
predicts the coarse codebooks of an audio frame before the fine ones. Step ``t`` of a delayed
stream (``t = 0`` the first sampled step) holds, for codebook ``k``:

- the stream BOS id while ``t <= k`` (forced: every other id is masked),
- then audio frame ``t - k - 1``'s id for codebook ``k``,
- and the stream EOS id once the end cascade reaches it: when the first EOS of any codebook
  was sampled at step ``s``, codebook ``k`` is forced to EOS at every step ``t > s + k``, so
  step ``s + num_codebooks`` is all EOS and ends the stream (that frame is not output).

These are the rules of transformers' ``HiggsAudioV2DelayPatternLogitsProcessor``
(models/higgs_audio_v2/generation_higgs_audio_v2.py: delay pattern ``[1..num_codebooks]``,
prompts ending in the audio-out BOS token, the EOS cascade driven by the delay token it appends
after a step with any EOS). Undoing the delay (``undelay``) follows
``HiggsAudioV2Processor.revert_delay_pattern`` / ``batch_decode``: the frames after step 0
(all BOS) up to the all-EOS step, column ``k`` shifted up by ``k``, ids clipped into the codec's
range (so the last frame's EOS ids become ``bos_id - 1``, as upstream decodes them);
``delay`` builds a reference clip's delayed rows as ``HiggsAudioV2Processor.build_delay_pattern``
with BOS and EOS around the codes.

The sampler applies ``constrain`` (``processed_logprobs``, when a ``SamplingRow`` carries a
``DelayPattern``): it needs the last ``num_codebooks`` frames of history (the loop's
``penalty_window`` must be at least ``num_codebooks``), because the cascade's start is always
within them.

Imports: torch only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class DelayPattern:
    """A delay pattern over ``num_codebooks`` codebooks with stream BOS/EOS ids.

    Attributes:
        num_codebooks: codebooks per frame (Higgs Audio v2: 8).
        bos_id: the stream BOS id, the same in every codebook (Higgs: ``audio_stream_bos_id``,
            1024); codec ids are ``[0, bos_id)``.
        eos_id: the stream EOS id (Higgs: ``audio_stream_eos_id``, 1025).
    """

    num_codebooks: int
    bos_id: int
    eos_id: int

    def __post_init__(self) -> None:
        if self.num_codebooks < 1:
            raise ValueError(f"num_codebooks must be >= 1, got {self.num_codebooks}")
        if self.bos_id < 1 or self.eos_id < 0 or self.bos_id == self.eos_id:
            raise ValueError(f"bad stream ids bos={self.bos_id} eos={self.eos_id}")

    def forced(self, num_generated: int, history: torch.Tensor) -> list[int | None]:
        """The id each codebook is forced to at step ``num_generated`` (None: free).

        Args:
            num_generated: frames sampled before this step.
            history: ``[num_codebooks, T]`` long, the last ``T`` of those frames; ``T`` must
                be at least ``min(num_generated, num_codebooks)``.

        Raises:
            ValueError: too short a history.
        """
        c = self.num_codebooks
        span = history.shape[1] if history.dim() == 2 else 0
        if span < min(num_generated, c):
            raise ValueError(
                f"the delay pattern needs the last {c} frames of history, got {span} "
                "(set the loop's penalty_window >= num_codebooks)"
            )
        out: list[int | None] = [self.bos_id if num_generated <= k else None for k in range(c)]
        if span == 0:
            return out
        recent = history[:, -min(span, c) :]  # [C, n]: steps num_generated - n ..
        hits = (recent == self.eos_id).any(dim=0).nonzero()
        if hits.numel():
            eos_step = num_generated - recent.shape[1] + int(hits[0, 0])
            for k in range(min(c, num_generated - eos_step)):
                out[k] = self.eos_id
        return out

    def is_end(self, frame: Sequence[int]) -> bool:
        """Whether a sampled frame is the all-EOS frame that ends the stream."""
        return all(int(t) == self.eos_id for t in frame)

    def num_ready(self, num_frames: int) -> int:
        """Audio frames ``undelay`` can give from the first ``num_frames`` delayed frames
        (step 0 included, the all-EOS frame not): ``num_frames - num_codebooks``, at least 0."""
        return max(0, num_frames - self.num_codebooks)

    def undelay(self, frames: Sequence[Sequence[int]], start: int = 0, stop: int | None = None):
        """Audio frames ``[start, stop)`` (default: all ready) from delayed frames.

        Audio frame ``f`` codebook ``k`` is delayed step ``f + k + 1``'s id, clipped into
        ``[0, bos_id)``.

        Returns:
            LongTensor ``[n, num_codebooks]``.
        """
        ready = self.num_ready(len(frames))
        stop = ready if stop is None else min(stop, ready)
        c = self.num_codebooks
        rows = [
            [min(max(int(frames[f + k + 1][k]), 0), self.bos_id - 1) for k in range(c)]
            for f in range(start, stop)
        ]
        return torch.tensor(rows, dtype=torch.long).reshape(-1, c)

    def in_frame_order(self, values: Sequence[Sequence[float]]) -> list[list[float]]:
        """Per-step, per-codebook values of a delayed stream (sampled ids, their log-probs)
        put in audio-frame order: ``out[f][k] = values[f + k + 1][k]``, one row per audio
        frame ``undelay`` gives (no clipping). What a trainer uses to see a rollout's actions
        and log-probs frame by frame."""
        c = self.num_codebooks
        return [
            [values[f + k + 1][k] for k in range(c)] for f in range(self.num_ready(len(values)))
        ]

    def forced_mask(self, frames: Sequence[Sequence[int]]) -> list[tuple[bool, ...]]:
        """Per sampled step and codebook, whether the id was free (a sampled action) rather
        than forced by the pattern (BOS before the delay, EOS in the end cascade)."""
        t = torch.tensor([tuple(f) for f in frames], dtype=torch.long).reshape(
            -1, self.num_codebooks
        )
        out = []
        for i in range(t.shape[0]):
            forced = self.forced(i, t[max(0, i - self.num_codebooks) : i].T)
            out.append(tuple(token is None for token in forced))
        return out

    def delay(self, codes: torch.Tensor) -> torch.Tensor:
        """Delayed rows of a clip's codes ``[T, num_codebooks]``: BOS, the codes, EOS, with
        codebook ``k`` shifted down ``k`` rows (BOS above, EOS below): ``[T + 1 + C, C]``."""
        t, c = codes.shape
        if c != self.num_codebooks:
            raise ValueError(f"codes have {c} codebooks, the pattern {self.num_codebooks}")
        out = torch.empty(t + 1 + c, c, dtype=torch.long)
        for k in range(c):
            out[: k + 1, k] = self.bos_id
            out[k + 1 : k + 1 + t, k] = codes[:, k]
            out[k + 1 + t :, k] = self.eos_id
        return out


def constrain(
    logits: torch.Tensor,
    patterns: Sequence[DelayPattern | None],
    history: Sequence[torch.Tensor],
    num_generated: Sequence[int],
) -> torch.Tensor:
    """Mask every id but the forced one in each forced (row, codebook) of ``logits``
    ``[B, C, V]`` (rows without a pattern unchanged): ``-inf`` elsewhere, the logit kept."""
    keep = torch.ones(logits.shape, dtype=torch.bool)
    changed = False
    for b, (pattern, hist, n) in enumerate(zip(patterns, history, num_generated, strict=True)):
        if pattern is None:
            continue
        for k, token in enumerate(pattern.forced(int(n), hist.cpu())):
            if token is not None:
                keep[b, k] = False
                keep[b, k, token] = True
                changed = True
    if not changed:
        return logits
    return logits.masked_fill(~keep.to(logits.device), float("-inf"))
