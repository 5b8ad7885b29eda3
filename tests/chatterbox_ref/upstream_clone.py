"""The reference's reference-clip front ends (S3 tokenizer, CAMPPlus, S3Gen's prompt mel, the
voice encoder) and its cloned conditionals. Runs inside the reference subprocess
(``tests.chatterbox_ref.env``).

The overlay holds, ``--no-deps``, ``s3tokenizer`` 0.3.0 (``S3TokenizerV2``, which Chatterbox's
``S3Tokenizer`` subclasses; its ``utils`` imports onnx, from the venv) and torchaudio 2.11.0
with its compiled libraries removed (``make install-test``): torchaudio then imports without
its C++ extension, and the parts upstream calls here, ``compliance.kaldi.fbank`` and
``transforms.Resample``, are plain torch code, run as shipped. Nothing is stubbed.

Upstream's ``S3Tokenizer.__init__`` builds ``S3TokenizerV2`` at its published size whatever
config it is given; ``_tiny_tokenizer`` builds the same class with a tiny ``ModelConfig`` and
registers the buffers ``S3Tokenizer.__init__`` would (librosa's mel filters, the Hann window),
so its own ``forward`` / ``log_mel_spectrogram`` / ``quantize`` run. ``S3Token2Mel.embed_ref``
runs unbound on an object holding exactly what it reads (the tokenizer, CAMPPlus, the mel
function, device and dtype): the full ``S3Token2Mel`` would build the published flow.
``ChatterboxTTS.prepare_conditionals`` (``tts.py`` imports the watermarker, resemble-perth,
whose own imports fail here) is composed from its parts in its order: ``clone_conds``.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

from tests.chatterbox_ref.env import bare_package

TOKENIZER_SIZES = {"n_audio_state": 128, "n_audio_head": 2, "n_audio_layer": 2}
"""The tiny S3 tokenizer (published: width 1280, 20 heads, 6 layers)."""
CAMPPLUS_SIZES = {"growth_rate": 8, "bn_size": 2, "init_channels": 32}
"""The tiny CAMPPlus (published: growth 32, bottleneck 4 x 32, 128 channels)."""
PROMPT_LEN = 150
"""``T3Config.speech_cond_prompt_len`` (upstream's default)."""


def _packages() -> None:
    bare_package("chatterbox.models", "models")
    bare_package("chatterbox.models.s3gen", "models/s3gen")


def _tiny_tokenizer():
    import librosa

    _packages()
    from chatterbox.models.s3tokenizer.s3tokenizer import S3Tokenizer
    from s3tokenizer.model_v2 import ModelConfig, S3TokenizerV2

    tok = S3Tokenizer.__new__(S3Tokenizer)
    S3TokenizerV2.__init__(tok, "speech_tokenizer_v2_25hz", ModelConfig(**TOKENIZER_SIZES))
    tok.n_fft = 400
    filters = librosa.filters.mel(sr=16000, n_fft=400, n_mels=128)
    tok.register_buffer("_mel_filters", torch.FloatTensor(filters))
    tok.register_buffer("window", torch.hann_window(400))
    return tok.eval()


def _campplus():
    _packages()
    from chatterbox.models.s3gen.xvector import CAMPPlus

    return CAMPPlus(memory_efficient=False, **CAMPPLUS_SIZES).eval()


def _randomize(module: torch.nn.Module) -> None:
    """Biases, norms and batch-norm statistics away from their neutral init."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("bias") or "ln" in name or "bn" in name or "batchnorm" in name:
                p.add_(0.1 * torch.randn_like(p))
        for m in module.modules():
            if isinstance(m, torch.nn.modules.batchnorm._BatchNorm):
                m.running_mean.normal_(0.0, 0.1)
                m.running_var.uniform_(0.5, 1.5)


def write_encoders(root: str, seed: int = 0) -> None:
    """Add the tiny S3 tokenizer (``tokenizer.*``, without the mel-filter and window buffers,
    as the published file) and CAMPPlus (``speaker_encoder.*``) to ``root``'s
    ``s3gen.safetensors``, and write ``ve.safetensors`` (upstream ``VoiceEncoder`` at its
    published size), all random, seeded ``seed``."""
    from chatterbox.models.voice_encoder import VoiceEncoder
    from safetensors.torch import load_file, save_file

    torch.manual_seed(seed)
    tok, campplus = _tiny_tokenizer(), _campplus()
    _randomize(tok)
    _randomize(campplus)
    path = Path(root) / "s3gen.safetensors"
    state = load_file(path) if path.exists() else {}
    state = {k: v for k, v in state.items() if k != "placeholder"}
    state |= {
        f"tokenizer.{k}": v
        for k, v in tok.state_dict().items()
        if k not in ("_mel_filters", "window")
    }
    state |= {f"speaker_encoder.{k}": v for k, v in campplus.state_dict().items()}
    save_file({k: v.contiguous() for k, v in state.items()}, path)
    ve = VoiceEncoder().eval()
    save_file(
        {k: v.contiguous() for k, v in ve.state_dict().items()}, Path(root) / "ve.safetensors"
    )


def _load(root: str):
    from safetensors.torch import load_file

    state = load_file(Path(root) / "s3gen.safetensors")
    tok, campplus = _tiny_tokenizer(), _campplus()
    tok.load_state_dict(
        {k[10:]: v for k, v in state.items() if k.startswith("tokenizer.")}, strict=False
    )
    campplus.load_state_dict(
        {k[16:]: v for k, v in state.items() if k.startswith("speaker_encoder.")}
    )
    return tok, campplus


def features(wav16: np.ndarray, wav24: np.ndarray) -> dict:
    """Upstream's features: ``fbank`` (``torchaudio.compliance.kaldi.fbank(num_mel_bins=80)``
    of the 16 kHz clip, as ``xvector.extract_feature`` calls it, before its mean removal),
    ``log_mel`` (``S3Tokenizer.log_mel_spectrogram`` of it, ``[128, T]``), ``mel24``
    (``s3gen.utils.mel.mel_spectrogram`` of the 24 kHz clip, ``[T, 80]``) and ``resampled``
    (``s3gen.get_resampler(24000, 16000)`` of the 24 kHz clip, torchaudio's ``Resample``)."""
    import torchaudio.compliance.kaldi as kaldi

    _packages()
    from chatterbox.models.s3gen.s3gen import get_resampler
    from chatterbox.models.s3gen.utils.mel import mel_spectrogram

    tok = _tiny_tokenizer()
    x16, x24 = torch.from_numpy(wav16), torch.from_numpy(wav24)
    return {
        "fbank": kaldi.fbank(x16[None], num_mel_bins=80).numpy(),
        "log_mel": tok.log_mel_spectrogram(x16[None])[0].numpy(),
        "mel24": mel_spectrogram(x24[None])[0].T.numpy(),
        "resampled": get_resampler(24000, 16000, "cpu")(x24[None])[0].numpy(),
    }


def encoders(root: str, log_mel: np.ndarray, fbank: np.ndarray) -> dict:
    """Upstream's models on given features: ``tokens`` (``S3TokenizerV2.quantize`` of the log
    mel ``[128, T]``) and ``xvector`` (``CAMPPlus.forward`` of the fbank ``[T, 80]`` minus its
    mean over time, as ``extract_feature`` hands it over)."""
    tok, campplus = _load(root)
    mel = torch.from_numpy(log_mel)[None]
    with torch.inference_mode():
        tokens, _ = tok.quantize(mel, torch.tensor([mel.shape[-1]]))
        feats = torch.from_numpy(fbank)
        xvector = campplus(feats[None] - feats.mean(dim=0, keepdim=True))
    return {"tokens": tokens[0].tolist(), "xvector": xvector[0].numpy()}


def clone_conds(root: str, wav_path: str, exaggeration: float = 0.5) -> dict:
    """``ChatterboxTTS.prepare_conditionals(wav_path, exaggeration)`` composed from its parts:
    ``librosa.load(sr=24000)``, ``librosa.resample`` to 16 kHz, ``S3Token2Mel.embed_ref`` of
    the first 10 s at 24 kHz, the S3 tokenizer's ``forward`` on the first 6 s at 16 kHz with
    ``max_len=150``, the voice encoder's ``embeds_from_wavs`` mean. Returns the T3 half
    (``speaker_emb`` ``[256]``, ``prompt_tokens``, ``exaggeration``) and the S3Gen
    ``ref_dict`` (``prompt_token``, ``prompt_feat`` ``[2p, 80]``, ``embedding`` ``[192]``)."""
    import librosa

    _packages()
    from chatterbox.models.s3gen.s3gen import S3Token2Mel
    from chatterbox.models.s3gen.utils.mel import mel_spectrogram
    from chatterbox.models.voice_encoder import VoiceEncoder
    from safetensors.torch import load_file

    tok, campplus = _load(root)
    ve = VoiceEncoder()
    ve.load_state_dict(load_file(Path(root) / "ve.safetensors"))
    ve.eval()
    holder = SimpleNamespace(
        device=torch.device("cpu"),
        dtype=torch.float32,
        mel_extractor=mel_spectrogram,
        speaker_encoder=campplus,
        tokenizer=tok,
    )
    wav24, _ = librosa.load(wav_path, sr=24000)
    wav16 = librosa.resample(wav24, orig_sr=24000, target_sr=16000)
    with torch.inference_mode():
        ref = S3Token2Mel.embed_ref(holder, wav24[: 10 * 24000], 24000, device="cpu")
        prompt, _ = tok.forward([wav16[: 6 * 16000]], max_len=PROMPT_LEN)
    speaker = ve.embeds_from_wavs([wav16], sample_rate=16000).mean(axis=0)
    return {
        "speaker_emb": np.asarray(speaker, dtype=np.float32),
        "prompt_tokens": prompt[0].tolist(),
        "exaggeration": exaggeration,
        "gen": {
            "prompt_token": ref["prompt_token"][0].tolist(),
            "prompt_feat": ref["prompt_feat"][0].float().numpy(),
            "embedding": ref["embedding"][0].float().numpy(),
        },
    }


def clone_case(
    root: str,
    wav_path: str,
    text_ids: list[int],
    max_new_tokens: int,
    flow_seed: int,
    hift_seed: int,
) -> dict:
    """One subprocess for the end-to-end check: ``clone_conds``, then upstream ``T3.inference``
    greedy (``upstream_t3.greedy``: CFG 0.5, no repetition penalty) with those conditionals,
    then ``S3Token2Wav``'s flow + HiFT + ``trim_fade`` (``upstream_s3gen._token2wav``) on its
    speech tokens with the cloned ``ref_dict``. Returns ``{"conds", "tokens", "wav"}``."""
    from tests.chatterbox_ref import upstream_s3gen, upstream_t3

    conds = clone_conds(root, wav_path)
    t3 = upstream_t3.greedy(
        root,
        text_ids,
        cfg_weight=0.5,
        exaggeration=conds["exaggeration"],
        max_new_tokens=max_new_tokens,
        speaker_emb=conds["speaker_emb"][None],
        prompt_tokens=conds["prompt_tokens"],
    )
    speech = [t for t in t3["tokens"] if t < 6561]
    flow, hift = upstream_s3gen._load(root)
    g = conds["gen"]
    gen = {
        "prompt_token": torch.tensor([g["prompt_token"]]),
        "prompt_token_len": torch.tensor([len(g["prompt_token"])]),
        "prompt_feat": torch.from_numpy(g["prompt_feat"])[None],
        "prompt_feat_len": None,
        "embedding": torch.from_numpy(g["embedding"])[None],
    }
    with torch.inference_mode():
        wav = upstream_s3gen._token2wav(flow, hift, gen, speech, flow_seed, hift_seed)
    return {"conds": conds, "tokens": t3["tokens"], "wav": wav}


def case(
    root: str,
    wav_path: str,
    wav16: np.ndarray,
    wav24: np.ndarray,
    text: str,
    max_new_tokens: int,
    flow_seed: int,
    hift_seed: int,
) -> dict:
    """One subprocess for a test module: the tiny folder (``upstream_s3gen.write_folder``, then
    ``write_encoders``), ``features`` of ``wav16`` / ``wav24``, ``encoders`` on those
    features, and ``clone_case`` of the clip at ``wav_path`` speaking ``text`` (already
    ``punc_norm``-ed; encoded as ``EnTokenizer.encode`` does: spaces as ``[SPACE]``, then
    ``tokenizer.json``). Returns ``{"features", "encoders", "clone"}``."""
    from tokenizers import Tokenizer

    from tests.chatterbox_ref.upstream_s3gen import write_folder

    write_folder(root)
    write_encoders(root)
    feats = features(wav16, wav24)
    models = encoders(root, feats["log_mel"], feats["fbank"])
    ids = (
        Tokenizer.from_file(str(Path(root) / "tokenizer.json"))
        .encode(text.replace(" ", "[SPACE]"))
        .ids
    )
    clone = clone_case(root, wav_path, ids, max_new_tokens, flow_seed, hift_seed)
    return {"features": feats, "encoders": models, "clone": clone}
