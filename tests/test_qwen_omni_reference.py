"""The Qwen2.5-Omni reference-parity infrastructure (tests/qwen_omni_ref) against transformers.

Needs torch, safetensors, tokenizers and transformers' ``qwen2_5_omni`` (``make test``
installs them).
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch

from omnistep.models.qwen2_5_omni import tiny as assets
from tests.qwen_omni_ref import reference

# The tiny seed-0 talker runs all TALKER_STEPS greedy codes on MESSAGES (the reply track is
# exhausted, so the pad row repeats) and greedily emits the codec EOS at its 5th code on
# EOS_MESSAGES.
MESSAGES = [{"role": "user", "content": "Please say something about the weather."}]
EOS_MESSAGES = [{"role": "user", "content": "Hello, how are you today?"}]
SPEECH_MESSAGES = [
    {"role": "system", "content": assets.QWEN_SPEECH_SYSTEM_PROMPT},
    {"role": "user", "content": "Please say something about the weather."},
]
THINKER_STEPS = 8
TALKER_STEPS = 24


@pytest.fixture(scope="module")
def tiny_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return assets.write_tiny_qwen_omni(tmp_path_factory.mktemp("qwen_omni") / "ckpt", seed=0)


@pytest.fixture(scope="module")
def info(tiny_root: Path) -> assets.QwenOmniInfo:
    return assets.read_info(tiny_root)


@pytest.fixture(scope="module")
def model(tiny_root: Path):
    return reference.load_reference(tiny_root)[0]


@pytest.fixture(scope="module")
def thinker(tiny_root: Path) -> reference.ThinkerGreedy:
    return reference.thinker_greedy(tiny_root, MESSAGES, THINKER_STEPS)


@pytest.fixture(scope="module")
def talker(tiny_root: Path, thinker) -> reference.TalkerGreedy:
    return reference.talker_greedy(tiny_root, thinker, "Chelsie", TALKER_STEPS)


def _official_to_state_dict(name: str) -> str:
    """transformers 5.x renames of the official thinker names (see assets' docstring)."""
    for old, new in (
        ("thinker.model.", "thinker.model.language_model."),
        ("thinker.audio_tower.", "thinker.model.audio_tower."),
        ("thinker.visual.", "thinker.model.visual."),
    ):
        if name.startswith(old):
            return new + name[len(old) :]
    return name


def test_folder_has_official_layout(tiny_root: Path, info) -> None:
    for rel in (
        "config.json",
        "generation_config.json",
        "model.safetensors.index.json",
        "spk_dict.pt",
        "tokenizer.json",
        "tokenizer_config.json",
        "vocab.json",
        "merges.txt",
        "chat_template.json",
    ):
        assert (tiny_root / rel).is_file(), rel
    shards = sorted(p.name for p in tiny_root.glob("model-*.safetensors"))
    assert shards == [f"model-{i:05d}-of-00003.safetensors" for i in (1, 2, 3)]
    assert sorted(set(info.weight_map.values())) == shards
    prefixes = {name.split(".")[0] for name in info.weight_map}
    assert prefixes == {"thinker", "talker", "token2wav"}
    for part in ("thinker.audio_tower.", "thinker.visual.", "thinker.model.layers."):
        assert any(n.startswith(part) for n in info.weight_map), part
    for part in ("token2wav.code2wav_dit_model.", "token2wav.code2wav_bigvgan_model."):
        assert any(n.startswith(part) for n in info.weight_map), part
    sizes = assets.TINY_SIZES
    assert set(info.weight_map) == set(assets.tensor_specs(sizes, info.ids))

    cfg = info.config
    th, tk = cfg["thinker_config"], cfg["talker_config"]
    dit = cfg["token2wav_config"]["dit_config"]
    hidden = th["text_config"]["hidden_size"]
    assert cfg["model_type"] == "qwen2_5_omni"
    assert tk["embedding_size"] == th["audio_config"]["output_dim"] == hidden
    assert th["vision_config"]["out_hidden_size"] == hidden
    head_dim = hidden // th["text_config"]["num_attention_heads"]
    assert 2 * sum(th["text_config"]["rope_scaling"]["mrope_section"]) == head_dim
    assert 2 * sum(tk["rope_scaling"]["mrope_section"]) == tk["head_dim"]
    assert dit["num_embeds"] >= tk["vocab_size"] and "head_dim" in dit
    # Official offsets from <|endoftext|> / from the number of real codes.
    assert info.ids.tts_text_pad - info.ids.endoftext == 151859 - 151643
    assert info.ids.text_vocab - info.ids.endoftext == 152064 - 151643
    assert info.ids.image - info.ids.endoftext == 151655 - 151643
    assert info.talker_eos_token_ids == [sizes.codec_codes + 100, sizes.codec_codes + 102]
    assert info.samples_per_code == 480


def test_loads_with_no_missing_or_unexpected_keys(tiny_root: Path, info, model) -> None:
    report = reference.load_state_dict_info(tiny_root)
    assert report["missing_keys"] == [] and report["unexpected_keys"] == []
    assert report["mismatched_keys"] == [] and report["error_msgs"] == []
    # Every file tensor landed where the documented rename says, bit for bit.
    from safetensors import safe_open

    state = model.state_dict()
    loaded = 0
    for shard in sorted(set(info.weight_map.values())):
        with safe_open(tiny_root / shard, "pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                assert torch.equal(state[_official_to_state_dict(name)], f.get_tensor(name)), name
                loaded += 1
    assert loaded == len(info.weight_map)
    persistent = {k for k in state if not k.endswith(("inv_freq", "filter"))}
    assert len(persistent) == loaded
    # Speakers as ``load_speakers`` reads them.
    assert set(model.speaker_map) == {"Chelsie", "Ethan"}
    for name, spk in model.speaker_map.items():
        assert set(spk) == {"cond", "ref_mel", "bos_token"}
        assert spk["cond"].shape == (1, assets.TINY_SIZES.enc_emb_dim)
        assert spk["ref_mel"].shape == (1, assets.TINY_SIZES.ref_mel_frames, 80)
        assert spk["bos_token"] == info.ids.speaker_bos[name] < info.ids.text_vocab
    assert model.thinker.generation_config.eos_token_id == info.ids.im_end


def test_same_seed_writes_identical_files(tmp_path: Path, tiny_root: Path) -> None:
    again = assets.write_tiny_qwen_omni(tmp_path / "again", seed=0)
    names = sorted(p.name for p in tiny_root.iterdir())
    assert names == sorted(p.name for p in again.iterdir())
    for name in names:
        assert (tiny_root / name).read_bytes() == (again / name).read_bytes(), name
    other = assets.write_tiny_qwen_omni(tmp_path / "other", seed=1)
    for name in names:
        same = (tiny_root / name).read_bytes() == (other / name).read_bytes()
        assert same == (not name.endswith((".safetensors", ".pt"))), name


def test_tokenizer_and_chat_template(tiny_root: Path, info) -> None:
    _, tok = reference.load_reference(tiny_root)
    text = tok.apply_chat_template(EOS_MESSAGES, add_generation_prompt=True, tokenize=False)
    assert text == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nHello, how are you today?<|im_end|>\n<|im_start|>assistant\n"
    )
    ids = reference.prompt_ids(tiny_root, EOS_MESSAGES)
    assert ids[0] == info.ids.im_start and ids[-3] == info.ids.im_start
    assert int((ids == info.ids.im_end).sum()) == 2
    assert tok.decode(ids) == text
    assert tok.convert_tokens_to_ids(["<|AUDIO|>", "<|IMAGE|>", "<|VIDEO|>"]) == [
        info.ids.audio,
        info.ids.image,
        info.ids.video,
    ]
    assert tok.convert_tokens_to_ids("<|vision_bos|>") == info.ids.vision_bos
    parts = [{"role": "user", "content": [{"type": "audio"}, {"type": "text", "text": "hi"}]}]
    text = tok.apply_chat_template(parts, add_generation_prompt=True, tokenize=False)
    assert "<|im_start|>user\n<|audio_bos|><|AUDIO|><|audio_eos|>hi<|im_end|>\n" in text


def test_thinker_greedy_is_deterministic(tiny_root: Path, info, thinker) -> None:
    again = reference.thinker_greedy(tiny_root, MESSAGES, THINKER_STEPS)
    assert torch.equal(again.token_ids, thinker.token_ids)
    assert torch.equal(again.logits, thinker.logits)
    n, p = len(thinker.token_ids), len(thinker.prompt_ids)
    assert 2 <= n <= THINKER_STEPS
    assert thinker.logits.shape == (n, info.ids.text_vocab)
    assert torch.equal(thinker.logits.argmax(-1), thinker.token_ids)
    assert torch.isfinite(thinker.logits).all() and float(thinker.logits.std(-1).min()) > 0.1
    prefill = reference.thinker_prefill_logits(tiny_root, MESSAGES)
    torch.testing.assert_close(prefill, thinker.logits[0], rtol=0, atol=1e-5)
    assert thinker.prompt_hidden.shape == thinker.prompt_embeds.shape == (p, 64)
    assert thinker.token_hidden.shape == thinker.token_embeds.shape == (n - 1, 64)


def test_talker_handoff_matches_generate(tiny_root: Path, thinker) -> None:
    captured = reference.capture_generate_handoff(tiny_root, MESSAGES, "Chelsie", THINKER_STEPS)
    ours = reference.talker_inputs(tiny_root, thinker, "Chelsie")
    for key in ("input_ids", "input_text_ids", "inputs_embeds", "thinker_reply_part"):
        assert torch.equal(getattr(ours, key), captured[key]), key
    assert captured["suppress_tokens"] == ours.suppress_tokens
    assert captured["eos_token_id"] == reference.talker_eos_token_ids(tiny_root)
    # generate's talker sampling defaults (documented in reference's docstring)
    assert (captured["do_sample"], captured["top_k"], captured["top_p"]) == (True, 40, 0.8)
    assert (captured["temperature"], captured["repetition_penalty"]) == (0.9, 1.05)


def test_talker_logits_and_inputs(tiny_root: Path, info, model, thinker, talker) -> None:
    n = len(talker.codes)
    assert n == TALKER_STEPS and not talker.eos_reached  # see MESSAGES
    assert torch.equal(talker.audio_codes, talker.codes)
    assert talker.logits.shape == (n, info.ids.codec_vocab)
    assert torch.isfinite(talker.logits).all() and float(talker.logits.std(-1).min()) > 0.1
    masked = talker.logits.clone()
    masked[:, info.ids.codec_bos] = -math.inf
    assert torch.equal(masked.argmax(-1), talker.codes)
    inp = talker.inputs
    # Prefill rows: h + e of the prompt, E(speaker bos), h + e of y_0; codec pad/bos added last.
    expected = inp.inputs_embeds[0].clone()
    expected[-2:] += inp.codec_prompt_embeds
    torch.testing.assert_close(talker.prefill_inputs, expected, rtol=0, atol=0)
    bos = model.thinker.get_input_embeddings()(torch.tensor(info.ids.speaker_bos["Chelsie"]))
    torch.testing.assert_close(inp.inputs_embeds[0, -2], bos.detach(), rtol=0, atol=0)
    # Decode step j: codec_embed(code_{j-1}) + r_{j-1}, then the pad row forever.
    codec = model.talker.get_input_embeddings()
    reply = inp.thinker_reply_part[0]
    for j in range(1, n):
        r = reply[min(j - 1, len(reply) - 1)]
        want = codec(talker.codes[j - 1]).detach() + r
        torch.testing.assert_close(talker.step_inputs[j - 1], want, rtol=0, atol=1e-6)
    plain = reference.talker_greedy(
        tiny_root, thinker, "Chelsie", TALKER_STEPS, codec_prompt_embeds=False
    )
    torch.testing.assert_close(plain.prefill_inputs, inp.inputs_embeds[0], rtol=0, atol=0)


def test_generate_equals_greedy_handoff(tiny_root: Path) -> None:
    """transformers 5.24 ``model.generate`` (unpadded) = the hand-off WITHOUT codec embeds."""
    thinker = reference.thinker_greedy(tiny_root, EOS_MESSAGES, THINKER_STEPS)
    text_ids, wav, codes = reference.generate_audio(
        tiny_root,
        EOS_MESSAGES,
        "Chelsie",
        seed=0,
        thinker_max_new_tokens=THINKER_STEPS,
        talker_max_new_tokens=TALKER_STEPS,
        return_codes=True,
        talker_do_sample=False,
        talker_repetition_penalty=1.0,
    )
    assert torch.equal(text_ids[len(thinker.prompt_ids) :], thinker.token_ids)
    plain = reference.talker_greedy(
        tiny_root, thinker, "Chelsie", TALKER_STEPS, codec_prompt_embeds=False
    )
    assert torch.equal(codes, plain.codes)
    assert plain.eos_reached and len(plain.audio_codes) == len(plain.codes) - 1  # see EOS_MESSAGES
    assert wav.shape == (len(plain.audio_codes) * 480,)


def test_token2wav_waveform(tiny_root: Path, info) -> None:
    g = torch.Generator().manual_seed(7)
    codes = torch.randint(0, assets.TINY_SIZES.codec_codes, (20,), generator=g)
    wav = reference.token2wav(tiny_root, codes, "Ethan", seed=3)
    assert wav.shape == (len(codes) * 2 * 240,) == (len(codes) * info.samples_per_code,)
    assert reference.samples_per_code(tiny_root) == 480
    assert torch.isfinite(wav).all()
    rms = float(wav.pow(2).mean().sqrt())
    assert 1e-3 < rms < 0.7, rms
    assert float((wav.abs() >= 1.0).float().mean()) < 0.01  # not clamped flat
    assert torch.equal(reference.token2wav(tiny_root, codes, "Ethan", seed=3), wav)
    assert not torch.equal(reference.token2wav(tiny_root, codes, "Ethan", seed=4), wav)

    mel, traj = reference.token2wav_mel(tiny_root, codes, "Ethan", seed=3, return_trajectory=True)
    assert mel.shape == (80, 2 * len(codes)) and traj.shape == (10, 2 * len(codes), 80)
    torch.testing.assert_close(reference.bigvgan(tiny_root, mel), wav, rtol=0, atol=0)
    torch.testing.assert_close(traj[-1], mel.T, rtol=0, atol=0)
    # The initial state is the first global randn after manual_seed(seed).
    noise = reference.dit_initial_noise(len(codes), seed=3)
    torch.testing.assert_close(traj[0], noise[0], rtol=0, atol=0)
    fed = reference.token2wav_mel(tiny_root, codes, "Ethan", noise=noise)
    torch.testing.assert_close(fed, mel, rtol=0, atol=0)
    # Time grid and one RK4 (3/8) step from the guided velocity reproduce the solver.
    t = reference.dit_time_grid()
    lin = torch.linspace(0, 1, 10)
    torch.testing.assert_close(t, 1 - torch.cos(torch.pi / 2 * lin), rtol=0, atol=1e-6)

    def f(tt: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return reference.dit_velocity(tiny_root, x, tt, codes, "Ethan")

    x1 = reference.rk4_step(f, t[0], t[1], noise)
    torch.testing.assert_close(x1[0], traj[1], rtol=0, atol=1e-6)


def test_generate_audio_same_seed_same_output(tiny_root: Path) -> None:
    kwargs = {"thinker_max_new_tokens": 6, "talker_max_new_tokens": 16, "return_codes": True}
    a = reference.generate_audio(tiny_root, SPEECH_MESSAGES, "Ethan", seed=5, **kwargs)
    b = reference.generate_audio(tiny_root, SPEECH_MESSAGES, "Ethan", seed=5, **kwargs)
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x, y)
    text_ids, wav, codes = a
    eos = torch.isin(codes, torch.tensor(reference.talker_eos_token_ids(tiny_root)))
    m = int(torch.nonzero(eos)[0, 0]) if bool(eos.any()) else len(codes)
    assert wav.shape == (m * 480,) and torch.isfinite(wav).all()


def test_config_json_is_plain_json(tiny_root: Path) -> None:
    cfg = json.loads((tiny_root / "config.json").read_text())
    assert re.fullmatch(r"Qwen2_5Omni\w+", cfg["architectures"][0])
    assert cfg["token2wav_config"]["dit_config"]["head_dim"] == 16
