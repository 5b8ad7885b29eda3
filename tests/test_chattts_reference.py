"""The ChatTTS reference-parity infrastructure (tests/chattts_ref) against upstream chattts 0.2.5.

Needs torch and the upstream ``chattts``/``vocos`` packages (``make test`` installs them).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch

from omnistep.models.chattts import tiny as assets
from tests.chattts_ref import reference, shims

TEXT = "hello world, nice weather today"
STEPS = 24
# Speaker seeds for which the tiny seed-0 model samples EOS (greedy) within 48 steps.
EOS_SPEAKERS = (12, 23)

pytestmark = pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning")


@pytest.fixture(scope="module")
def tiny_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return assets.write_tiny_chattts(tmp_path_factory.mktemp("chattts_tiny") / "ckpt", seed=0)


@pytest.fixture(scope="module")
def info(tiny_root: Path) -> assets.TinyChatTTSInfo:
    return assets.read_info(tiny_root)


@pytest.fixture(scope="module")
def chat(tiny_root: Path):
    return reference.load_upstream_chat(tiny_root)


@pytest.fixture(scope="module")
def greedy(tiny_root: Path) -> reference.GreedyResult:
    return reference.upstream_greedy_codes(tiny_root, TEXT, spk=0, steps=STEPS)


def test_shims_stand_in_without_leaking(chat) -> None:
    stubbed = shims.install_shims()  # idempotent: what the first call stood in for
    # The stand-ins were only registered while ChatTTS/vocos imported.
    for name in stubbed:
        assert importlib.util.find_spec(name) is None, name
    if "torchaudio" in stubbed:
        # The DVAE's mel encoder exists (its buffers load) but is no parity path: it raises.
        with pytest.raises(shims.ShimNotImplementedError):
            chat.dvae.preprocessor_mel(torch.zeros(1, 4096))


def test_tiny_folder_loads_in_upstream(tiny_root: Path, info, chat) -> None:
    for rel in assets.CHECKED_FILES:
        assert (tiny_root / rel).is_file(), rel
    assert chat.has_loaded(use_decoder=True)
    cfg = chat.gpt.gpt.config
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads) == (64, 2, 4)
    assert chat.tokenizer.spk_emb_ids == info.spk_emb_id
    assert chat.tokenizer.eos_token == info.token_ids["[Ebreak]"]
    assert chat.tokenizer.len == info.num_text_tokens
    # Official token order, shifted: [spk_emb] is the 16th ChatTTS token (21143 - 21128 = 15).
    first = info.token_ids[assets.CHATTTS_SPECIAL_TOKENS[0]]
    assert info.spk_emb_id - first == 15
    assert info.token_ids["[speed_9]"] == info.num_text_tokens - 1


def test_files_match_upstream_state_dicts(tiny_root: Path, info, chat) -> None:
    specs = assets.tensor_specs(info.sizes, info.num_text_tokens)
    gpt_spec = dict(specs["asset/gpt/model.safetensors"])
    gpt_spec.pop("embed_tokens.weight")  # upstream deletes it after loading
    modules = {
        "asset/gpt/model.safetensors": (chat.gpt.gpt, gpt_spec),
        "asset/Embed.safetensors": (chat.embed, specs["asset/Embed.safetensors"]),
        "asset/Decoder.safetensors": (chat.decoder, specs["asset/Decoder.safetensors"]),
        "asset/DVAE.safetensors": (chat.dvae, specs["asset/DVAE.safetensors"]),
        "asset/Vocos.safetensors": (chat.vocos, specs["asset/Vocos.safetensors"]),
    }
    for rel, (module, spec) in modules.items():
        got = {k: tuple(v.shape) for k, v in module.state_dict().items()}
        assert got == spec, rel


def test_prompt_layout_and_speaker(tiny_root: Path, info) -> None:
    spk = reference.upstream_random_speaker(tiny_root, 0)
    assert spk == reference.upstream_random_speaker(tiny_root, 0)
    p = reference.upstream_prompt_inputs(tiny_root, TEXT, spk)
    assert p.texts == [f"[Stts][spk_emb][speed_5]{TEXT}[Ptts]"]
    ids = p.input_ids[0]
    assert ids.shape[1] == info.num_vq and bool((ids == ids[:, :1]).all())  # text ids repeated
    tid = info.token_ids
    assert ids[:3, 0].tolist() == [tid["[Stts]"], tid["[spk_emb]"], tid["[speed_5]"]]
    assert ids[-1, 0].item() == tid["[Ptts]"]
    vec = torch.from_numpy(reference.decode_speaker(spk))
    assert vec.dtype == torch.float16 and vec.shape == (info.hidden,)
    expected = torch.nn.functional.normalize(vec, dim=0).float()
    torch.testing.assert_close(p.emb[0, 1], expected)
    assert abs(p.emb[0, 1].norm().item() - 1.0) < 1e-3


def test_greedy_codes_deterministic_and_non_degenerate(tiny_root: Path, info, greedy) -> None:
    again = reference.upstream_greedy_codes(tiny_root, TEXT, spk=0, steps=STEPS)
    assert torch.equal(greedy.codes, again.codes)
    assert torch.equal(greedy.hiddens, again.hiddens)
    assert torch.equal(greedy.logits, again.logits)
    n = greedy.codes.shape[0]
    assert greedy.codes.shape == (n, info.num_vq) and greedy.hiddens.shape == (n, info.hidden)
    assert n >= 8, "stopped on EOS almost at once"
    assert greedy.logits.shape[1:] == (info.num_vq, info.num_audio_tokens)
    assert torch.isfinite(greedy.logits).all() and torch.isfinite(greedy.hiddens).all()
    assert (greedy.logits.std(dim=-1) > 0.1).all()
    # Greedy: every emitted code is the argmax of its step's raw logits.
    assert torch.equal(greedy.logits[:n].argmax(dim=-1), greedy.codes)
    assert len({tuple(c) for c in greedy.codes.tolist()}) > n // 2


def test_prefill_logits_are_the_first_step(tiny_root: Path, info, greedy) -> None:
    logits = reference.upstream_prefill_logits(tiny_root, TEXT, spk=0)
    assert logits.shape == (info.num_vq, info.num_audio_tokens)
    torch.testing.assert_close(logits, greedy.logits[0], rtol=0, atol=1e-5)


def test_eos_rule(tiny_root: Path, info) -> None:
    for spk in EOS_SPEAKERS:
        res = reference.upstream_greedy_codes(tiny_root, TEXT, spk=spk, steps=48)
        if res.eos:
            break
    else:
        pytest.fail(f"no greedy EOS for speakers {EOS_SPEAKERS}")
    n = res.codes.shape[0]
    assert 0 < n < 48 and res.hiddens.shape[0] == n and res.logits.shape[0] == n + 1
    picks = res.logits.argmax(dim=-1)  # [n + 1, q]
    assert (picks[:n] != info.eos_token).all()  # no codebook chose EOS before ...
    assert (picks[n] == info.eos_token).any()  # ... the dropped frame, where ANY codebook did
    longer = reference.upstream_greedy_codes(
        tiny_root, TEXT, spk=spk, steps=n + 4, min_new_token=n + 4
    )
    assert longer.codes.shape[0] == n + 4 and not longer.eos
    assert torch.equal(longer.codes[:n], res.codes)
    assert (longer.codes != info.eos_token).all()


def test_left_padded_batch_matches_single(tiny_root: Path, greedy) -> None:
    batch = reference.upstream_greedy_codes(tiny_root, ["hi", TEXT], spk=0, steps=STEPS)
    assert batch[1].prompt == greedy.prompt
    assert torch.equal(batch[1].codes, greedy.codes)
    torch.testing.assert_close(batch[1].logits, greedy.logits, rtol=1e-4, atol=1e-4)


def test_decoded_wav(tiny_root: Path, info, greedy) -> None:
    n = greedy.codes.shape[0]
    wav = reference.upstream_decode_wav(tiny_root, greedy.hiddens)
    assert wav.dtype == np.float32 and wav.ndim == 1
    # 2 mel frames per token, hop 256, torch.istft(center=True) without length: 256 * (2n - 1).
    assert wav.shape[0] == info.samples_per_token * n - info.sizes.hop_length
    assert np.isfinite(wav).all()
    assert 1e-3 < float(np.sqrt(np.mean(wav**2))) < 1.0
    mel = reference.upstream_decode_mel(tiny_root, greedy.hiddens)
    assert mel.shape == (info.sizes.n_mels, 2 * n)
    np.testing.assert_allclose(reference.upstream_vocos_wav(tiny_root, mel), wav, atol=1e-6)
    from_codes = reference.upstream_decode_codes_wav(tiny_root, greedy.codes)
    assert from_codes.shape == wav.shape and np.isfinite(from_codes).all()


def test_writing_twice_gives_identical_files(tmp_path: Path, tiny_root: Path) -> None:
    again = assets.write_tiny_chattts(tmp_path / "again", seed=0)
    other = assets.write_tiny_chattts(tmp_path / "other", seed=1)
    files = sorted(p.relative_to(tiny_root) for p in tiny_root.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(again) for p in again.rglob("*") if p.is_file())
    for rel in files:
        assert (tiny_root / rel).read_bytes() == (again / rel).read_bytes(), rel
    assert (other / "asset/Embed.safetensors").read_bytes() != (
        tiny_root / "asset/Embed.safetensors"
    ).read_bytes()
    assert assets.read_info(again).sha256_map == assets.read_info(tiny_root).sha256_map
