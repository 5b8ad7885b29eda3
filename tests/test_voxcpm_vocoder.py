"""VoxCPM2's AudioVAE decoder as the chunked vocoder component: stateless windows with the
decoder's left context and stateful streams both equal the whole decode within 1e-5 (a window
with too little context does not), streams in one batch do not disturb each other, a stream
that skips frames is refused, and ``free_sequence`` drops a stream. (The decoder itself is
compared with upstream's in tests/test_voxcpm_parity.py.)"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from omnistep.core import WorkUnitKind
from omnistep.loops import AudioChunkInput
from omnistep.models.voxcpm.audio_vae import AudioVAEDecoder
from omnistep.models.voxcpm.config import AUDIO_VAE_DEFAULTS
from omnistep.models.voxcpm.tiny import tiny_config
from omnistep.models.voxcpm.vocoder import AudioVAEComponent

FRAMES = 24


@pytest.fixture(scope="module")
def decoder() -> AudioVAEDecoder:
    config = dict(AUDIO_VAE_DEFAULTS)
    config.update(tiny_config()["audio_vae_config"])
    torch.manual_seed(0)
    vae = AudioVAEDecoder(config).eval()
    with torch.no_grad():  # Snake alphas and the rate scale/bias away from their init
        for name, p in vae.named_parameters():
            if name.endswith("alpha") or "scale_embed" in name:
                p.add_(0.1 * torch.randn_like(p))
    return vae


@pytest.fixture(scope="module")
def latents() -> torch.Tensor:
    return torch.randn(2, 16, FRAMES, generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def whole(decoder, latents) -> torch.Tensor:
    with torch.no_grad():
        return decoder.decode(latents)


def _frames(z: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return tuple(z[:, t] for t in range(z.shape[1]))


def test_left_context_of_the_published_rates(decoder):
    assert decoder.hop == 1920
    assert decoder.left_context_frames == 21


@pytest.mark.parametrize("chunk", [4, 7])
def test_stateless_windows_equal_the_whole_decode(decoder, latents, whole, chunk):
    left_context = decoder.left_context_frames
    component = AudioVAEComponent(decoder)
    frames = _frames(latents[0])
    pieces = []
    for start in range(0, FRAMES, chunk):
        lo = max(0, start - left_context)
        end = min(FRAMES, start + chunk)
        unit = AudioChunkInput(frames[lo:end], left=start - lo, chunk=end - start, start=lo)
        pieces.append(component.execute(WorkUnitKind.AUDIO_CHUNK, [unit])[0])
    got = np.concatenate(pieces)
    assert got.shape == (FRAMES * 1920,)
    assert np.abs(got - whole[0].numpy()).max() < 1e-5


def test_a_window_with_too_little_context_differs(decoder, latents, whole):
    frames = _frames(latents[0])
    unit = AudioChunkInput(frames[12:20], left=4, chunk=4, start=12)
    got = AudioVAEComponent(decoder).execute(WorkUnitKind.AUDIO_CHUNK, [unit])[0]
    assert np.abs(got - whole[0, 16 * 1920 : 20 * 1920].numpy()).max() > 1e-4


@pytest.mark.parametrize("batch_invariant", [False, True])
def test_streams_in_shared_batches_equal_their_whole_decodes(
    decoder, latents, whole, batch_invariant
):
    component = AudioVAEComponent(decoder, batch_invariant=batch_invariant)
    schedules = {"a": [4, 4, 1, 3, 12], "b": [4, 4, 5, 7, 4]}
    frames = {"a": _frames(latents[0]), "b": _frames(latents[1])}
    pos = {"a": 0, "b": 0}
    got: dict[str, list[np.ndarray]] = {"a": [], "b": []}
    for step in range(max(len(s) for s in schedules.values())):
        units = []
        for sid, schedule in schedules.items():
            if step < len(schedule):
                n, start = schedule[step], pos[sid]
                units.append(
                    AudioChunkInput(frames[sid][start : start + n], 0, n, seq_id=sid, start=start)
                )
                pos[sid] += n
        outs = component.execute(WorkUnitKind.AUDIO_CHUNK, units)
        for unit, out in zip(units, outs, strict=True):
            assert out.shape == (unit.chunk * 1920,)
            got[unit.seq_id].append(out)
    assert component.num_streams == 2
    for row, sid in enumerate(("a", "b")):
        assert np.abs(np.concatenate(got[sid]) - whole[row].numpy()).max() < 1e-5
    component.free_sequence("a")
    component.free_sequence("a")  # idempotent
    assert component.num_streams == 1


def test_a_stream_that_skips_frames_is_refused(decoder, latents):
    component = AudioVAEComponent(decoder)
    frames = _frames(latents[0])
    component.execute(WorkUnitKind.AUDIO_CHUNK, [AudioChunkInput(frames[:4], 0, 4, seq_id="s")])
    with pytest.raises(ValueError, match="frame 8.*frame 4"):
        component.execute(
            WorkUnitKind.AUDIO_CHUNK, [AudioChunkInput(frames[8:12], 0, 4, seq_id="s", start=8)]
        )
    with pytest.raises(ValueError, match="no state"):
        component.execute(
            WorkUnitKind.AUDIO_CHUNK, [AudioChunkInput(frames[4:8], 0, 4, seq_id="t", start=4)]
        )
