"""Base voice cloning (omnistep.models.qwen3_tts.clone): the speaker embedding and reference codes
of a clip against upstream ``qwen-tts`` 0.1.1 on the tiny Base fixture, the saved-voice text
form, and the typed errors for bad clips, transcripts and checkpoints."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from omnistep.core.errors import InvalidRequestError
from omnistep.models.qwen3_tts.clone import (
    MAX_CLIP_SECONDS,
    SPEC_PREFIX,
    VoiceCloneEncoder,
    VoiceClonePrompt,
    VoiceCloneUnsupportedError,
    compute_clone_prompt,
    resample,
)
from omnistep.models.qwen3_tts.encoder import SpeechTokenizerEncoder
from omnistep.models.qwen3_tts.loader import Qwen3TTSCheckpointError
from omnistep.models.qwen3_tts.speaker import mel_filter_bank
from tests.qwen3_tts_ref.assets import write_reference_qwen3_tts
from tests.qwen3_tts_ref.env import call_reference

REF = "tests.qwen3_tts_ref.upstream_clone"
TRANSCRIPT = "The quick brown fox jumps over the lazy dog."


def chirp(sample_rate: int, seconds: float, seed: int) -> np.ndarray:
    """A 100 Hz -> 1 kHz linear chirp (amplitude 0.5) plus N(0, 0.05^2) noise, float32."""
    n = int(round(seconds * sample_rate))
    t = np.arange(n) / sample_rate
    freq = 100.0 + 900.0 * t / t[-1]
    phase = 2 * np.pi * np.cumsum(freq) / sample_rate
    noise = np.random.default_rng(seed).standard_normal(n)
    return (0.5 * np.sin(phase) + 0.05 * noise).astype(np.float32)


def strengthen_encoder_transformer(root: Path, seed: int = 0) -> None:
    """Redraw the speech tokenizer's Mimi encoder-transformer matrices ``N(0, 1/fan_in)`` and
    set its layer scales to 1, in place. With upstream's init (``N(0, 0.02)``, layer scale
    0.01) the transformer moves the latents by ~1e-6 of their size, so no code depends on its
    attention (a windowed and a full attention give the same codes); after this they do."""
    path = root / "speech_tokenizer" / "model.safetensors"
    tensors = load_file(str(path))
    gen = torch.Generator().manual_seed(seed)
    for name, value in sorted(tensors.items()):
        if not name.startswith("encoder.encoder_transformer."):
            continue
        if name.endswith("layer_scale.scale"):
            tensors[name] = torch.ones_like(value)
        elif value.ndim == 2:
            tensors[name] = torch.randn(value.shape, generator=gen) * value.shape[1] ** -0.5
    save_file(tensors, str(path), metadata={"format": "pt"})


@pytest.fixture(scope="module")
def base_root(tmp_path_factory):
    root = write_reference_qwen3_tts(
        tmp_path_factory.mktemp("q3clone") / "base", "base", seed=3
    ).root
    strengthen_encoder_transformer(root)
    return root


@pytest.fixture(scope="module")
def encoder(base_root):
    return VoiceCloneEncoder.from_pretrained(base_root)


@pytest.fixture(scope="module")
def clip24():
    return chirp(24000, 3.3, seed=1)  # 79200 samples: not a multiple of 1920 (41.25 frames)


@pytest.fixture(scope="module")
def prompt24(encoder, clip24):
    return compute_clone_prompt(clip24, 24000, TRANSCRIPT, encoder)


@pytest.fixture(scope="module")
def upstream24(base_root, clip24):
    return call_reference(
        f"{REF}:clone_prompt", root=base_root, audio=clip24, sample_rate=24000, ref_text=TRANSCRIPT
    )


def test_mel_filters_and_mel_equal_upstream(base_root, encoder, clip24):
    ref = call_reference(f"{REF}:speaker_parts", root=base_root, audio_24k=clip24)
    filters = mel_filter_bank()
    assert filters.shape == ref["filters"].shape == (128, 513)
    assert np.abs(filters - ref["filters"]).max() <= 1e-8  # librosa's Slaney bank
    mel = encoder.speaker.mel(torch.from_numpy(clip24)[None])[0].numpy()
    assert mel.shape == ref["mel"].shape == (309, 128)
    assert np.abs(mel - ref["mel"]).max() <= 1e-5
    emb = encoder.speaker.embed(clip24).numpy()
    assert emb.shape == ref["embedding"].shape == (32,)
    assert np.abs(emb - ref["embedding"]).max() <= 1e-4
    assert np.abs(emb - ref["embedding"]).max() <= 1e-4 * np.abs(ref["embedding"]).max()


def test_clone_prompt_24k_equals_upstream(prompt24, upstream24):
    assert upstream24["icl_mode"] is True
    assert prompt24.ref_codes.dtype == np.int64
    assert prompt24.ref_codes.shape == upstream24["ref_code"].shape == (42, 16)  # ceil(41.25)
    np.testing.assert_array_equal(prompt24.ref_codes, upstream24["ref_code"])
    # the codes vary over the clip in every codebook (the comparison is not vacuous)
    assert all(len(set(prompt24.ref_codes[:, k])) > 3 for k in range(16))
    ref_emb = upstream24["ref_spk_embedding"]
    diff = np.abs(prompt24.speaker_embedding - ref_emb).max()
    assert diff <= 1e-4 and diff <= 1e-4 * np.abs(ref_emb).max()
    assert prompt24.ref_text == upstream24["ref_text"] == TRANSCRIPT


def test_clone_prompt_16k_equals_upstream_with_its_own_resampling(base_root, encoder):
    """Upstream resamples a 16 kHz clip itself (``librosa.resample``, soxr HQ) for both
    encoders; ours resamples with omnistep.audio's soxr stream: same codes, same embedding."""
    clip = chirp(16000, 2.7, seed=2)
    ours = compute_clone_prompt(clip, 16000, TRANSCRIPT, encoder)
    ref = call_reference(
        f"{REF}:clone_prompt", root=base_root, audio=clip, sample_rate=16000, ref_text=TRANSCRIPT
    )
    assert ours.ref_codes.shape == ref["ref_code"].shape == (34, 16)  # 64800 samples at 24 kHz
    np.testing.assert_array_equal(ours.ref_codes, ref["ref_code"])
    diff = np.abs(ours.speaker_embedding - ref["ref_spk_embedding"]).max()
    assert diff <= 1e-4 and diff <= 1e-4 * np.abs(ref["ref_spk_embedding"]).max()


def test_clip_longer_than_the_mimi_attention_window_equals_upstream(base_root, encoder):
    """12 s: past the config's 250-frame window (10 s at the transformer's 25 Hz), which
    upstream's default attention ignores (encoder.py's docstring); the windowed codes differ
    after 10 s, so the comparison tells the two apart."""
    clip = chirp(24000, 12.0, seed=7)
    ours = compute_clone_prompt(clip, 24000, TRANSCRIPT, encoder)
    ref = call_reference(f"{REF}:encode", root=base_root, audio=clip, sample_rate=24000)
    assert ours.ref_codes.shape == ref.shape == (150, 16)
    np.testing.assert_array_equal(ours.ref_codes, ref)
    config = json.loads((base_root / "speech_tokenizer" / "config.json").read_text())
    windowed = SpeechTokenizerEncoder.from_tensors(
        config["encoder_config"],
        load_file(str(base_root / "speech_tokenizer" / "model.safetensors")),
        num_quantizers=16,
        downsample_rate=1920,
        sample_rate=24000,
        sliding_window=config["encoder_config"]["sliding_window"],
    ).encode(clip)
    assert config["encoder_config"]["sliding_window"] == 250
    np.testing.assert_array_equal(windowed[:125].numpy(), ref[:125])  # the first 10 s agree
    assert (windowed[125:].numpy() != ref[125:]).sum() > 10


def test_resample_follows_librosa_length_rule():
    x = chirp(44100, 1.00001, seed=4)
    y = resample(x, 44100, 24000)
    assert y.dtype == np.float32 and y.shape == (math.ceil(x.shape[0] * 24000 / 44100),)
    assert resample(x, 24000, 24000) is x


def test_stereo_clip_is_the_mean_of_its_channels(encoder, clip24, prompt24):
    stereo = np.stack([clip24 * 1.5, clip24 * 0.5], axis=1)  # mean == clip24 exactly
    assert compute_clone_prompt(stereo, 24000, TRANSCRIPT, encoder).same_as(prompt24)


def test_spec_round_trip_is_exact(prompt24):
    spec = prompt24.to_spec()
    assert spec.startswith(SPEC_PREFIX) and spec.isascii()
    back = VoiceClonePrompt.from_spec(spec)
    assert back.same_as(prompt24)
    assert back.speaker_embedding.dtype == np.float32 and back.ref_codes.dtype == np.int64
    odd = VoiceClonePrompt(
        speaker_embedding=np.array([np.nan, -0.0, 1e-38, 3.4e38], dtype=np.float32),
        ref_codes=np.array([[0, 2047], [1, 1024]], dtype=np.int64),
        ref_text="héllo 你好 🙂",
    )
    odd_back = VoiceClonePrompt.from_spec(odd.to_spec())
    assert odd_back.same_as(odd) and odd_back.ref_text == "héllo 你好 🙂"
    empty = VoiceClonePrompt(np.zeros(3, np.float32), np.zeros((0, 16), np.int64), "x")
    assert VoiceClonePrompt.from_spec(empty.to_spec()).same_as(empty)


def test_spec_size_at_published_sizes():
    """A 10 s clip (125 frames of 16 codes < 2048) with a 100-byte transcript: the figures
    quoted in ``to_spec``'s docstring."""
    rng = np.random.default_rng(0)
    codes = rng.integers(0, 2048, size=(125, 16), dtype=np.int64)
    codes[0, 0] = 2047  # 11 bits per code
    sizes = {}
    for enc_dim in (2048, 1024):
        emb = rng.standard_normal(enc_dim).astype(np.float32)
        spec = VoiceClonePrompt(emb, codes, "a" * 100).to_spec()
        payload = 16 + 100 + 4 * enc_dim + math.ceil(125 * 16 * 11 / 8)
        assert len(spec) == len(SPEC_PREFIX) + 4 * math.ceil(payload / 3)
        sizes[enc_dim] = len(spec)
    assert sizes == {2048: 14762, 1024: 9302}


@pytest.mark.parametrize(
    "spec",
    [
        "seed:3",
        SPEC_PREFIX + "not base64!",
        SPEC_PREFIX + "AAAA",
        SPEC_PREFIX[:-2],
    ],
)
def test_from_spec_rejects_other_or_damaged_text(spec, prompt24):
    with pytest.raises(InvalidRequestError) as err:
        VoiceClonePrompt.from_spec(spec)
    assert err.value.param == "voice"


def test_from_spec_rejects_a_truncated_spec(prompt24):
    spec = prompt24.to_spec()
    with pytest.raises(InvalidRequestError) as err:
        VoiceClonePrompt.from_spec(spec[: len(spec) - 8])
    assert err.value.param == "voice"


def test_check_fits(prompt24):
    prompt24.check_fits(enc_dim=32, num_code_groups=16, codebook_size=2048)
    for kwargs in (
        {"enc_dim": 2048, "num_code_groups": 16, "codebook_size": 2048},
        {"enc_dim": 32, "num_code_groups": 8, "codebook_size": 2048},
        {"enc_dim": 32, "num_code_groups": 16, "codebook_size": 16},
    ):
        with pytest.raises(InvalidRequestError) as err:
            prompt24.check_fits(**kwargs)
        assert err.value.param == "voice"


def _bad_inputs():
    ok = chirp(16000, 1.5, seed=5)
    nan = ok.copy()
    nan[100] = np.nan
    inf = ok.copy()
    inf[-1] = np.inf
    return [
        ("empty", np.zeros(0, np.float32), 16000, TRANSCRIPT, "audio", None),
        ("empty stereo", np.zeros((0, 2), np.float32), 16000, TRANSCRIPT, "audio", None),
        ("too short", ok[:15999], 16000, TRANSCRIPT, "audio", "audio_too_short"),
        (
            "too long",
            np.zeros(int(MAX_CLIP_SECONDS * 8000) + 1, np.float32),
            8000,
            TRANSCRIPT,
            "audio",
            "audio_too_long",
        ),
        ("nan", nan, 16000, TRANSCRIPT, "audio", "invalid_audio"),
        ("inf", inf, 16000, TRANSCRIPT, "audio", "invalid_audio"),
        ("int16 pcm", (ok * 32767).astype(np.int16), 16000, TRANSCRIPT, "audio", None),
        ("3-d", ok.reshape(1, -1, 1), 16000, TRANSCRIPT, "audio", None),
        ("not audio", "clip.wav", 16000, TRANSCRIPT, "audio", None),
        ("zero rate", ok, 0, TRANSCRIPT, "sample_rate", None),
        ("float rate", ok, 16000.0, TRANSCRIPT, "sample_rate", None),
        ("empty transcript", ok, 16000, "", "transcript", None),
        ("blank transcript", ok, 16000, " \n\t", "transcript", None),
        ("no transcript", ok, 16000, None, "transcript", None),
    ]


@pytest.mark.parametrize(
    ("audio", "rate", "text", "param", "code"),
    [case[1:] for case in _bad_inputs()],
    ids=[case[0] for case in _bad_inputs()],
)
def test_bad_input_raises_typed_error(encoder, audio, rate, text, param, code):
    with pytest.raises(InvalidRequestError) as err:
        compute_clone_prompt(audio, rate, text, encoder)
    assert isinstance(err.value, ValueError)
    assert err.value.param == param
    if code is not None:
        assert err.value.code == code


def test_exactly_one_second_is_accepted(encoder):
    prompt = compute_clone_prompt(chirp(16000, 1.0, seed=6), 16000, "one", encoder)
    assert prompt.ref_codes.shape == (13, 16)  # 24000 samples -> ceil(12.5)


@pytest.mark.parametrize("variant", ["custom_voice", "voice_design"])
def test_checkpoint_without_speaker_encoder_is_refused(base_root, tmp_path, variant):
    """A CustomVoice / VoiceDesign folder (no speaker_encoder_config, as published) cannot clone:
    the Base folder with its config turned into the other variant's."""
    root = tmp_path / variant
    shutil.copytree(base_root, root)
    config = json.loads((root / "config.json").read_text())
    config["tts_model_type"] = variant
    del config["speaker_encoder_config"]
    if variant == "custom_voice":  # the loader wants CustomVoice's speaker table
        config["talker_config"]["spk_id"] = {"ryan": 3061}
        config["talker_config"]["spk_is_dialect"] = {"ryan": False}
    (root / "config.json").write_text(json.dumps(config))
    with pytest.raises(VoiceCloneUnsupportedError) as err:
        VoiceCloneEncoder.from_pretrained(root)
    assert isinstance(err.value, InvalidRequestError) and isinstance(err.value, ValueError)
    assert err.value.param == "model" and err.value.code == "voice_clone_unsupported"
    assert "Base" in str(err.value) and variant in str(err.value)


def test_missing_or_misshapen_encoder_tensor_is_named(base_root, tmp_path):
    for name, change in (
        ("speaker_encoder.fc.weight", "drop"),
        ("encoder.quantizer.semantic_residual_vector_quantizer.input_proj.weight", "drop"),
        ("encoder.downsample.conv.weight", "reshape"),
    ):
        root = tmp_path / change / name
        shutil.copytree(base_root, root)
        rel = (
            "model.safetensors"
            if name.startswith("speaker")
            else "speech_tokenizer/model.safetensors"
        )
        tensors = load_file(str(root / rel))
        if change == "drop":
            del tensors[name]
        else:
            tensors[name] = tensors[name][:, :, :-1].contiguous()
        save_file(tensors, str(root / rel), metadata={"format": "pt"})
        with pytest.raises(Qwen3TTSCheckpointError) as err:
            VoiceCloneEncoder.from_pretrained(root)
        assert str(root / rel) in str(err.value) and name in str(err.value)
