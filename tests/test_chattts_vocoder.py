"""ChatTTS vocoder (omnistep/models/chattts/vocoder.py): upstream parity, chunking, loading.

Upstream reference: chattts 0.2.5 ``Chat._decode_to_wavs`` (called as is, on a stand-in ``self``)
with ``ChatTTS.model.dvae.DVAE`` built as ``Chat._load`` builds the Decoder, and ``vocos.Vocos``
built from ``MelSpectrogramFeatures`` / ``VocosBackbone`` / ``ISTFTHead(padding="center")``. Both
get our randomly drawn weights through ``load_state_dict(strict=True)`` (same names).
``tests/chattts_ref/shims.py`` lets them import without torchaudio / encodec / scipy.
"""

from __future__ import annotations

import math
import types

import pytest
import torch

from omnistep.models.chattts.vocoder import (
    ChatTTSVocoder,
    DecoderConfig,
    VocosConfig,
    load_vocoder,
)

SMALL_STFT = VocosConfig(dim=32, intermediate_dim=48, num_layers=2, n_fft=64, hop_length=16)
CONFIGS = {
    "official-stft": (DecoderConfig.tiny(), VocosConfig.tiny()),
    "small-stft": (DecoderConfig.tiny(), SMALL_STFT),
}
# Official byte sizes of asset/Decoder.safetensors and asset/Vocos.safetensors (fp32). A
# safetensors file's size is fixed by its tensor names, shapes and dtypes, so equal sizes check
# the state-dict layout against the official files without having them.
OFFICIAL_DECODER_BYTES = 103_694_920
OFFICIAL_VOCOS_BYTES = 54_348_240


def randomize(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Draw weights with a realistic scale so the wave is far from zero and from clipping.

    Matrices ~ N(0, 1/fan_in); layer scales U[0.1, 0.3] (upstream inits them at 1e-6 / 1/8,
    which would make every block near-identity); norm weights ~ 1; ISTFT head std 0.1 with a
    log-magnitude bias near -1; ``coef`` U[0.5, 1.5].
    """
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                std = 0.1 if name.endswith("head.out.weight") else 1.0 / math.sqrt(p[0].numel())
                p.copy_(torch.randn(p.shape, generator=g) * std)
            elif name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            elif name.endswith((".weight", ".gamma")):  # ConvNeXt layer scales
                p.copy_(0.1 + 0.2 * torch.rand(p.shape, generator=g))
            elif name.endswith("head.out.bias"):
                n = p.shape[0] // 2
                p[:n] = -1.0 + 0.5 * torch.randn(n, generator=g)  # log-magnitude
                p[n:] = torch.randn(n, generator=g)  # phase
            else:
                p.copy_(0.05 * torch.randn(p.shape, generator=g))
        for name, buf in model.named_buffers():
            if name.endswith("coef"):
                buf.copy_(0.5 + torch.rand(buf.shape, generator=g))
    return model


def tiny_vocoder(config: str = "official-stft", seed: int = 0) -> ChatTTSVocoder:
    return randomize(ChatTTSVocoder(*CONFIGS[config]), seed).eval()


def hidden_states(batch: int, tokens: int, size: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(batch, tokens, size, generator=torch.Generator().manual_seed(seed))


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny models: one intra-op thread (two threads on a loaded 2-core box spin ~50x slower)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def upstream():
    """Upstream classes, imported through the shared test shims."""
    from tests.chattts_ref import shims

    shims.install_shims()
    from ChatTTS.core import Chat
    from ChatTTS.model.dvae import DVAE
    from vocos import Vocos
    from vocos.feature_extractors import MelSpectrogramFeatures
    from vocos.heads import ISTFTHead
    from vocos.models import VocosBackbone

    return types.SimpleNamespace(
        Chat=Chat,
        DVAE=DVAE,
        Vocos=Vocos,
        MelSpectrogramFeatures=MelSpectrogramFeatures,
        ISTFTHead=ISTFTHead,
        VocosBackbone=VocosBackbone,
    )


def build_upstream(up, dc: DecoderConfig, vc: VocosConfig):
    """Upstream Decoder and Vocos as ``Chat._load`` builds them, for the given sizes."""
    decoder_config = {
        "idim": dc.frame_dim,
        "odim": dc.out_dim,
        "hidden": dc.hidden_dim,
        "n_layer": dc.num_layers,
        "bn_dim": dc.bottleneck_dim,
    }
    decoder = up.DVAE(decoder_config=decoder_config, dim=dc.frame_dim)
    vocos = up.Vocos(
        feature_extractor=up.MelSpectrogramFeatures(
            sample_rate=vc.sample_rate,
            n_fft=vc.n_fft,
            hop_length=vc.hop_length,
            n_mels=vc.num_mels,
            padding="center",
        ),
        backbone=up.VocosBackbone(
            input_channels=vc.num_mels,
            dim=vc.dim,
            intermediate_dim=vc.intermediate_dim,
            num_layers=vc.num_layers,
        ),
        head=up.ISTFTHead(dim=vc.dim, n_fft=vc.n_fft, hop_length=vc.hop_length, padding="center"),
    )
    return decoder.eval(), vocos.eval()


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_parity_with_upstream_decode_to_wavs(upstream, config: str) -> None:
    ours = tiny_vocoder(config)
    decoder, vocos = build_upstream(upstream, *CONFIGS[config])
    decoder.load_state_dict(ours.decoder.state_dict(), strict=True)
    vocos.load_state_dict(ours.vocos.state_dict(), strict=True)
    hidden = hidden_states(2, 37, ours.hidden_size)

    # Chat._decode_to_wavs itself, on a stand-in `self` holding the upstream modules.
    chat = types.SimpleNamespace(decoder=decoder, vocos=vocos, device=torch.device("cpu"))
    chat._vocos_decode = lambda spec: upstream.Chat._vocos_decode(chat, spec)
    rows = [hidden[i].clone() for i in range(hidden.shape[0])]  # result.hiddens: [T, hidden]
    reference = torch.from_numpy(upstream.Chat._decode_to_wavs(chat, rows, use_decoder=True))

    wave = ours.decode(hidden)
    hop = CONFIGS[config][1].hop_length
    assert wave.dtype == torch.float32
    assert wave.shape == (2, 37 * ours.samples_per_token)
    # torch.istft without `length` stops at the centre of the last frame: one hop shorter.
    assert reference.shape == (2, 37 * ours.samples_per_token - hop)
    assert reference.std() > 1e-3  # weights drawn with a realistic scale, not ~0
    diff = (wave[:, : reference.shape[1]] - reference).abs().max().item()
    assert diff <= 1e-4, diff


def test_state_dict_layout_matches_upstream_and_official_file_sizes(upstream) -> None:
    from safetensors.torch import save

    with torch.device("meta"):
        ours = ChatTTSVocoder(DecoderConfig(), VocosConfig())
        decoder, vocos = build_upstream(upstream, DecoderConfig(), VocosConfig())
    for mine, theirs, size in (
        (ours.decoder, decoder, OFFICIAL_DECODER_BYTES),
        (ours.vocos, vocos, OFFICIAL_VOCOS_BYTES),
    ):
        shapes = {k: tuple(v.shape) for k, v in mine.state_dict().items()}
        assert shapes == {k: tuple(v.shape) for k, v in theirs.state_dict().items()}
        tensors = {k: torch.empty(s, dtype=torch.float32) for k, s in shapes.items()}
        assert len(save(tensors)) == size


def test_receptive_field_by_perturbation() -> None:
    """Perturbing token u changes exactly the samples of tokens u - left .. u + right."""
    with torch.device("meta"):
        official = ChatTTSVocoder(DecoderConfig(), VocosConfig())
    assert official.receptive_field_frames == 102
    assert (official.left_context_tokens, official.lookahead_tokens) == (52, 52)

    for config in CONFIGS:
        # float64: the influence at the field's edge (~1e-8 here) is below float32 rounding.
        model = tiny_vocoder(config).double()
        hidden = hidden_states(1, 60, model.hidden_size).double()
        u = 30
        base = model.decode(hidden)[0]
        bumped = hidden.clone()
        bumped[0, u] += 1.0
        changed = torch.nonzero(model.decode(bumped)[0] != base).flatten()
        spt = model.samples_per_token
        first, last = changed.min().item() // spt, changed.max().item() // spt
        assert (first, last) == (u - model.left_context_tokens, u + model.lookahead_tokens)


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_chunked_decode_equals_whole(config: str) -> None:
    model = tiny_vocoder(config)
    num_tokens = 90
    hidden = hidden_states(1, num_tokens, model.hidden_size, seed=4)
    whole = model.decode(hidden)
    left, right = model.left_context_tokens, model.lookahead_tokens
    bounds = [0, 3, 11, 27, 43, 59, 75, 89, 90]  # a small first chunk, then uneven ones
    parts = []
    for a, b in zip(bounds[:-1], bounds[1:], strict=True):
        lo, hi = max(0, a - left), min(num_tokens, b + right)
        parts.append(model.decode_chunk(hidden[:, lo:hi], a - lo, b - a))
        assert parts[-1].shape == (1, (b - a) * model.samples_per_token)
    diff = (torch.cat(parts, dim=1) - whole).abs().max().item()
    assert diff <= 1e-5, diff


def test_batched_chunks_match_single_rows() -> None:
    model = tiny_vocoder()
    windows = hidden_states(3, 16 + 8 + 16, model.hidden_size, seed=5)
    batched = model.decode_chunk(windows, 16, 8)
    for i in range(3):
        alone = model.decode_chunk(windows[i : i + 1], 16, 8)
        assert (batched[i : i + 1] - alone).abs().max().item() <= 1e-6


def test_loader_roundtrip_and_missing_files(tmp_path) -> None:
    from safetensors.torch import save_file

    model = tiny_vocoder()
    dc, vc = CONFIGS["official-stft"]
    with pytest.raises(FileNotFoundError, match="Decoder.safetensors.*Vocos.safetensors"):
        load_vocoder(tmp_path, "cpu", torch.float32, dc, vc)
    save_file(
        {k: v.contiguous() for k, v in model.decoder.state_dict().items()},
        tmp_path / "Decoder.safetensors",
    )
    with pytest.raises(FileNotFoundError, match="Vocos.safetensors") as info:
        load_vocoder(tmp_path, "cpu", torch.float32, dc, vc)
    assert "Decoder.safetensors" not in str(info.value)
    save_file(
        {k: v.contiguous() for k, v in model.vocos.state_dict().items()},
        tmp_path / "Vocos.safetensors",
    )

    loaded = load_vocoder(tmp_path, "cpu", torch.float32, dc, vc)
    hidden = hidden_states(1, 9, model.hidden_size)
    assert torch.equal(loaded.decode(hidden), model.decode(hidden))
    with pytest.raises(RuntimeError):  # strict: a file for another size does not load
        load_vocoder(tmp_path, "cpu", torch.float32, DecoderConfig(), VocosConfig())


def test_validation() -> None:
    model = tiny_vocoder()
    assert model.decode(torch.zeros(2, 0, model.hidden_size)).shape == (2, 0)
    with pytest.raises(ValueError, match="hidden must be"):
        model.decode(torch.zeros(1, 4, model.hidden_size + 1))
    with pytest.raises(ValueError, match="left"):
        model.decode_chunk(torch.zeros(1, 4, model.hidden_size), 3, 2)
    with pytest.raises(ValueError, match="num_layers"):
        DecoderConfig(num_layers=0)
    with pytest.raises(ValueError, match="hop_length"):
        VocosConfig(n_fft=64, hop_length=48)
    with pytest.raises(ValueError, match="num_mels"):
        ChatTTSVocoder(DecoderConfig.tiny(), VocosConfig(num_mels=80, dim=32))


def test_receptive_field_full_size_by_perturbation() -> None:
    """The official sizes: 52 tokens of influence on each side, measured (float64)."""
    model = randomize(ChatTTSVocoder(DecoderConfig(), VocosConfig())).double().eval()
    u, num_tokens = 54, 110  # tokens 0, 1 and 107..109 must stay untouched
    hidden = hidden_states(1, num_tokens, model.hidden_size).double()
    base = model.decode(hidden)[0]
    bumped = hidden.clone()
    bumped[0, u] += 1.0
    changed = torch.nonzero(model.decode(bumped)[0] != base).flatten()
    spt = model.samples_per_token
    assert (changed.min().item() // spt, changed.max().item() // spt) == (u - 52, u + 52)
