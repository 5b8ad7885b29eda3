"""VoxCPM2's models against the reference (``voxcpm`` 2.0.3 in the ``.ref/voxcpm`` overlay) on a
tiny folder whose weights upstream's own ``VoxCPM2Model`` wrote: the base and residual LMs'
hidden states over the prompt and every step (teacher-forced on upstream's patches), the
LocDiT conditioning and stop logits, the LocDiT's Euler/CFG-Zero* solve from the same noise,
the AudioVAE decoder's waveform, and the paged AR component's patches and stop decisions (two
requests batched, a replay after a preemption), all within 1e-4; the chunked (streaming)
decode equals the whole decode within 1e-5 and upstream's own streaming decode; the loader's
file checks."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from omnistep.core import WorkUnitKind
from omnistep.kv import KVCacheConfig
from omnistep.loops.ar_decode import ARPrefillInput, ARStepInput
from omnistep.models.voxcpm.ar import VoxCPMAR, VoxCPMPrompt, stop_sampling
from omnistep.models.voxcpm.lm import Prompt, build_prompt, encode_reference
from omnistep.models.voxcpm.loader import VoxCPMCheckpointError, load_voxcpm
from omnistep.models.voxcpm.tiny import AUDIO_START, write_tiny_voxcpm
from tests.voxcpm_ref.env import call_reference

TEXT = "the cat 你好"
STEPS = 4
TIMESTEPS = 10
CFG = 2.0
FEAT, PATCH = 16, 4


def _noises(n: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((FEAT, PATCH)).astype(np.float32) for _ in range(n)]


SCHEDULES = [[1] * 16, [4] * 4, [3, 5, 7, 1]]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return write_tiny_voxcpm(tmp_path_factory.mktemp("voxcpm"))


CLIP_SAMPLES = 16000 + 1234  # 1.08 s at 16 kHz: not a whole number of patches (2560 samples)


def _clip() -> np.ndarray:
    """A 16 kHz reference clip: two tones and some noise."""
    t = np.arange(CLIP_SAMPLES) / 16000
    rng = np.random.default_rng(3)
    wave = 0.3 * np.sin(2 * np.pi * 220 * t) + 0.2 * np.sin(2 * np.pi * 1330 * t)
    return (wave + 0.05 * rng.standard_normal(CLIP_SAMPLES)).astype(np.float32)


@pytest.fixture(scope="module")
def reference(checkpoint) -> dict:
    """Upstream writes the weights, generates (streamed) and decodes the patches whole and in
    each of ``SCHEDULES``, then generates with a reference clip, in one subprocess."""
    import soundfile as sf

    clip_path = checkpoint / "clip.wav"
    sf.write(clip_path, _clip(), 16000, subtype="FLOAT")
    return call_reference(
        "tests.voxcpm_ref.upstream:write_and_generate",
        root=str(checkpoint),
        schedules=SCHEDULES,
        clone={
            "text": "a cat",
            "noises": _noises(STEPS, seed=1),
            "max_len": STEPS,
            "inference_timesteps": TIMESTEPS,
            "cfg_value": CFG,
            "reference_wav": str(clip_path),
        },
        text=TEXT,
        noises=_noises(STEPS),
        max_len=STEPS,
        inference_timesteps=TIMESTEPS,
        cfg_value=CFG,
        streaming=True,
    )


@pytest.fixture(scope="module")
def model(checkpoint, reference):  # the reference wrote the weights
    return load_voxcpm(checkpoint)


def _zero_shot_prompt(text_ids: list[int]) -> Prompt:
    prompt = build_prompt(text_ids, PATCH, FEAT)
    assert prompt.text_ids[-1] == AUDIO_START and bool(prompt.text_mask.all())
    return prompt


def _diff(ours: torch.Tensor, theirs: np.ndarray) -> float:
    return float(np.abs(ours.detach().float().numpy() - theirs).max())


def test_reference_ran_the_steps(reference):
    assert reference["patches"].shape == (STEPS, FEAT, PATCH)
    assert reference["chunks"] == [PATCH * 1920] * STEPS  # one streamed chunk per patch
    # "▁the ▁ c a t ▁ 你 好": upstream's tokenizer wrapper split the merged CJK token "你好"
    # (the vocabulary's last id) into its two characters
    assert len(reference["text_ids"]) == 8
    assert 183 not in reference["text_ids"]


def test_lm_hidden_states_and_heads_match(model, reference):
    _, backbone, _ = model
    patches = torch.from_numpy(reference["patches"]).transpose(1, 2)  # [T, P, C]
    with torch.no_grad():
        out = backbone.teacher_forced(_zero_shot_prompt(reference["text_ids"]), patches)
    assert _diff(out["prefill_lm"], reference["prefill_lm"]) < 1e-4
    assert _diff(out["prefill_residual"], reference["prefill_residual"]) < 1e-4
    assert _diff(out["mu"], reference["mu"]) < 1e-4
    assert _diff(out["stop_logits"], reference["stop_logits"]) < 1e-4
    # the decode steps' base-LM rows (before the quantizer): upstream's forward_step outputs
    length = len(reference["text_ids"]) + 1
    with torch.no_grad():
        prompt = _zero_shot_prompt(reference["text_ids"])
        combined, _ = backbone.prompt_rows(prompt)
        rows = torch.cat([combined, backbone.embed_patches(patches[:-1])])
        base = backbone.base_lm.forward_dense(rows, prefill_len=length)[length:]
    assert _diff(base, reference["lm_steps"][: STEPS - 1]) < 1e-4


def test_locdit_solve_matches_with_the_same_noise(model, reference):
    _, backbone, _ = model
    mu, cond = torch.from_numpy(reference["mu"]), torch.from_numpy(reference["cond"])
    noise = torch.from_numpy(np.stack(_noises(STEPS)))
    with torch.no_grad():
        batched = backbone.estimator.solve(mu, cond, noise, TIMESTEPS, CFG)
        alone = torch.cat(
            [
                backbone.estimator.solve(
                    mu[i : i + 1], cond[i : i + 1], noise[i : i + 1], TIMESTEPS, CFG
                )
                for i in (0, STEPS - 1)
            ]
        )
        unguided = backbone.estimator.solve(mu, cond, noise, TIMESTEPS, 1.0)
    assert _diff(batched, reference["patches"]) < 1e-4
    assert _diff(alone, reference["patches"][[0, STEPS - 1]]) < 1e-4
    assert _diff(unguided, reference["patches"]) > 1e-3  # the guidance scale matters
    # per-row guidance scales: row 0 unguided, the rest at CFG
    scales = torch.full((STEPS,), CFG)
    scales[0] = 1.0
    with torch.no_grad():
        mixed = backbone.estimator.solve(mu, cond, noise, TIMESTEPS, scales)
    assert _diff(mixed[1:], reference["patches"][1:]) < 1e-4
    assert _diff(mixed[:1], unguided[:1].numpy()) < 1e-6


def _latents(patches: np.ndarray) -> torch.Tensor:
    """``[T, C, P]`` patches -> ``[1, C, T * P]`` latents (upstream's rearrange)."""
    t = torch.from_numpy(patches)
    return t.permute(1, 0, 2).reshape(FEAT, -1)[None]


def test_waveform_matches(model, reference):
    *_, vae = model
    with torch.no_grad():
        wave = vae.decode(_latents(reference["patches"]))[0]
    assert wave.shape == (STEPS * PATCH * 1920,)
    assert _diff(wave, reference["waveform"]) < 1e-4
    assert float(wave.abs().max()) > 1e-3


def test_chunked_decode_equals_whole_and_upstream_streaming(model, reference):
    *_, vae = model
    z = _latents(reference["patches"])
    ref = reference["vae"]
    with torch.no_grad():
        whole = vae.decode(z)[0]
    for schedule, theirs in zip(SCHEDULES, ref["streams"], strict=True):
        state: dict = {}
        pieces, start = [], 0
        with torch.no_grad():
            for n in schedule:
                pieces.append(vae.decode(z[..., start : start + n], state)[0])
                start += n
        streamed = torch.cat(pieces)
        assert streamed.shape == whole.shape
        assert float((streamed - whole).abs().max()) < 1e-5, schedule
        for ours, chunk in zip(pieces, theirs, strict=True):
            assert _diff(ours, chunk) < 1e-4
    # upstream's streamed generate (one chunk per patch) is the same waveform
    assert _diff(whole, reference["waveform"]) < 1e-4


def test_reference_clip_prompt_matches(model, reference):
    """Voice cloning by a reference clip (upstream's reference-only mode): the clip's latent
    patches, the prompt's hidden states, the LocDiT conditioning and the solved patches."""
    weights = model
    clone = reference["clone"]
    feat = encode_reference(weights.encoder, torch.from_numpy(_clip()), PATCH)
    # 17234 samples, right-padded to whole patches of 4 latents x 640 samples: 7 patches
    assert feat.shape == clone["ref_feat"].shape == (7, PATCH, FEAT)
    assert _diff(feat, clone["ref_feat"]) < 1e-4
    prompt = build_prompt(clone["text_ids"], PATCH, FEAT, feat)
    patches = torch.from_numpy(clone["patches"]).transpose(1, 2)
    with torch.no_grad():
        out = weights.backbone.teacher_forced(prompt, patches)
        solved = weights.backbone.estimator.solve(
            out["mu"],
            torch.from_numpy(clone["cond"]),
            torch.from_numpy(np.stack(_noises(STEPS, seed=1))),
            TIMESTEPS,
            CFG,
        )
    assert _diff(out["prefill_lm"], clone["prefill_lm"]) < 1e-4
    assert _diff(out["prefill_residual"], clone["prefill_residual"]) < 1e-4
    assert _diff(out["mu"], clone["mu"]) < 1e-4
    assert _diff(solved, clone["patches"]) < 1e-4
    # the clip changes the prompt: the zero-shot prompt of the same text gives other rows
    with torch.no_grad():
        plain = weights.backbone.teacher_forced(
            build_prompt(clone["text_ids"], PATCH, FEAT), patches
        )
    assert _diff(plain["mu"], clone["mu"]) > 1e-3


def test_loader_names_the_missing_file(model, checkpoint, tmp_path):
    import shutil

    for name in ("model.safetensors", "audiovae.pth", "config.json"):
        copy = tmp_path / name.replace(".", "_")
        shutil.copytree(checkpoint, copy)
        (copy / name).unlink()
        with pytest.raises(VoxCPMCheckpointError, match=name.split(".")[0]):
            load_voxcpm(copy)


def test_loader_names_a_misshapen_tensor(model, checkpoint, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    copy = tmp_path / "bad"
    shutil.copytree(checkpoint, copy)
    state = load_file(str(copy / "model.safetensors"))
    state["stop_head.weight"] = torch.zeros(3, 64)
    save_file(state, str(copy / "model.safetensors"))
    with pytest.raises(VoxCPMCheckpointError, match="stop_head.weight"):
        load_voxcpm(copy)


class _GivenNoise(VoxCPMAR):
    """The AR component with each sequence's LocDiT noise taken from a list (upstream's)."""

    def __init__(self, *args, noises: dict[str, list[np.ndarray]], **kwargs):
        self.noises = {k: list(v) for k, v in noises.items()}
        super().__init__(*args, **kwargs)

    def _noise(self, unit) -> torch.Tensor:
        return torch.from_numpy(self.noises[unit.seq_id].pop(0))


def _prefill(seq_id: str, prompt: VoxCPMPrompt, generated: tuple = ()) -> ARPrefillInput:
    return ARPrefillInput(seq_id, prompt, generated, (), stop_sampling(2), None)


def test_paged_ar_component_reproduces_upstream(model, reference):
    """Both requests (zero-shot and cloned) batched on the paged component: every step's patch
    and stop decision equal upstream's; a replayed prefill after a preemption continues with
    the same patch."""
    weights, clone = model, reference["clone"]
    feat = encode_reference(weights.encoder, torch.from_numpy(_clip()), PATCH)
    prompts = {
        "plain": VoxCPMPrompt(build_prompt(reference["text_ids"], PATCH, FEAT), CFG, TIMESTEPS),
        "clone": VoxCPMPrompt(build_prompt(clone["text_ids"], PATCH, FEAT, feat), CFG, TIMESTEPS),
    }
    refs = {"plain": reference, "clone": clone}
    noises = {"plain": _noises(STEPS), "clone": _noises(STEPS, seed=1)}
    ar = _GivenNoise(weights.backbone, KVCacheConfig(num_blocks=32, block_size=4), noises=noises)
    outs = ar.execute(WorkUnitKind.PREFILL, [_prefill(s, p) for s, p in prompts.items()])
    got = {s: [o] for s, o in zip(prompts, outs, strict=True)}
    for step in range(1, STEPS):
        units = [
            ARStepInput(
                s, got[s][-1].tokens, step, (), stop_sampling(2), None, extra=got[s][-1].hidden
            )
            for s in prompts
        ]
        for s, out in zip(prompts, ar.execute(WorkUnitKind.AR_TOKEN, units), strict=True):
            got[s].append(out)
    for s, ref in refs.items():
        patches = torch.stack([o.hidden for o in got[s]]).transpose(1, 2)  # [T, C, P]
        assert _diff(patches, ref["patches"]) < 1e-4, s
        stops = [int(np.argmax(row)) if i > 2 else 0 for i, row in enumerate(ref["stop_logits"])]
        assert [o.tokens[0] for o in got[s]] == stops, s
    # preempted after two patches: the replay prefill (prompt + both patches) gives the third
    ar.free_sequence("clone")
    replay = VoxCPMPrompt(
        prompts["clone"].rows, CFG, TIMESTEPS, (got["clone"][0].hidden, got["clone"][1].hidden)
    )
    ar.noises["clone"] = _noises(STEPS, seed=1)[2:]
    frames = tuple(o.tokens for o in got["clone"][:2])
    (out,) = ar.execute(WorkUnitKind.PREFILL, [_prefill("clone", replay, frames)])
    assert _diff(out.hidden.T, clone["patches"][2]) < 1e-4
