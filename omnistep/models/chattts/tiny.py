"""Seeded random ChatTTS checkpoints in the official repository layout (chattts 0.2.5).

``write_tiny_chattts(root)`` writes::

    root/
      asset/gpt/config.json            LlamaConfig (transformers ``LlamaModel.from_pretrained``)
      asset/gpt/model.safetensors      LlamaModel state dict (``embed_tokens`` present, unused)
      asset/Embed.safetensors          emb_code.{i}, emb_text, weight-normed head_text/head_code.{i}
      asset/Decoder.safetensors        DVAE without encoder/VQ: hidden states -> 100-bin mel
      asset/DVAE.safetensors           DVAE with mel encoder + GFSQ (codes -> mel); loaded, not used
      asset/Vocos.safetensors          vocos.Vocos(MelSpectrogramFeatures, VocosBackbone, ISTFTHead)
      asset/tokenizer/{tokenizer.json, tokenizer_config.json, special_tokens_map.json}

and nothing else in ``root`` (the official file set: no ``asset/spk_stat.pt``, which the published
folder does not have either), plus, BESIDE the folder, ``<root>.omnistep_chattts.json``
(:func:`info_path`; not official): sizes, the upstream ``Config`` as a dict (incl. ``spk_stat``),
special-token ids, sha256 map.

These are exactly the files ``Chat.download_models(source="custom")`` checks (by sha256 against
``ChatTTS/res/sha256_map.json``) and ``Chat._load`` reads.  Upstream 0.2.5 reads no yaml: every
size, and the speaker statistics ``spk_stat``, live in the ``ChatTTS.config.Config`` dataclass,
so a checkpoint with other sizes needs a matching ``Config`` (and a sha256 map for the custom
check).  Both are stored in the info file; :mod:`tests.chattts_ref.reference` puts them on a
``Chat`` before ``Chat.load(source="custom", custom_path=root)``.

Speaker statistics: at the official hidden size (768) the info file records none, so upstream
keeps its own ``Config.spk_stat`` (the package's statistics, as for the published checkpoint)
and omnistep uses the same statistics, which it ships.  Any other hidden size gets seeded
random statistics for upstream's ``Config`` only; omnistep, like a user with that folder, sees
no statistics.  :func:`write_servable_tiny_chattts` is therefore tiny everywhere but the GPT
width (768, 12 heads of 64 like the official GPT), so that every voice form is served.

Tensor names and shapes (``H`` GPT hidden, ``L`` layers, ``I`` MLP size, ``V_t`` text vocab,
``V_a`` audio vocab, ``q`` num_vq, ``D*`` conv widths; official values in parentheses)::

  gpt/model.safetensors   embed_tokens.weight [llama_vocab(32000), H(768)]   (unused, deleted)
                          layers.{l}.self_attn.{q,k,v,o}_proj.weight [H, H] (no bias; kv: [kvH, H])
                          layers.{l}.mlp.{gate,up}_proj.weight [I(3072), H]; down_proj [H, I]
                          layers.{l}.{input,post_attention}_layernorm.weight [H]; norm.weight [H]
  Embed.safetensors       emb_text.weight [V_t(21178), H]; emb_code.{i}.weight [V_a(626), H]
                          head_text.parametrizations.weight.original0 [V_t, 1]   (g)
                          head_text.parametrizations.weight.original1 [V_t, H]   (v)
                          head_code.{i}.parametrizations.weight.original{0,1} [V_a, 1] / [V_a, H]
  Decoder.safetensors     coef [1, 100, 1]; out_conv.weight [100, H/2(384), 3]
                          decoder.conv_in.0.{weight [bn(128), H/2, 3], bias}
                          decoder.conv_in.2.{weight [Dd(512), bn, 3], bias}
                          decoder.decoder_block.{n}.{dwconv.weight [Dd,1,7], dwconv.bias,
                            norm.weight, norm.bias, pwconv1.weight [4Dd, Dd], pwconv1.bias,
                            pwconv2.weight [Dd, 4Dd], pwconv2.bias, weight [Dd] (layer scale)}
                          decoder.conv_out.weight [H/2, Dd, 1]                       (n < 12)
  DVAE.safetensors        coef; downsample_conv.{0 [E(512),100,3], 2 [E,E,4]}.{weight,bias};
                          preprocessor_mel.mel_spec.spectrogram.window [1024];
                          preprocessor_mel.mel_spec.mel_scale.fb [513, 100];
                          encoder.* (idim E, odim 2E(1024), hidden 256, 12 blocks);
                          decoder.* (idim E, odim E, hidden 256, 12 blocks); out_conv [100, E, 3];
                          vq_layer.quantizer.rvqs.{g}.project_{in [4, E], out [E, 4]}.{weight,bias}
  Vocos.safetensors       feature_extractor.mel_spec.{spectrogram.window, mel_scale.fb};
                          backbone.embed.{weight [Dv(512), 100, 7], bias}; backbone.norm.*;
                          backbone.convnext.{n}.{dwconv [Dv,1,7], norm, pwconv1 [Iv(1536), Dv],
                            pwconv2 [Dv, Iv], gamma [Dv]}; backbone.final_layer_norm.*;
                          head.out.{weight [n_fft+2(1026), Dv], bias}; head.istft.window [1024]

Weights are drawn per tensor from ``torch.Generator().manual_seed(crc32(f"{seed}/{file}/{key}"))``
so a file never depends on the others or on dict order, and equal seeds give byte-identical files.
Scales are "trained-like": matrices ``N(0, 1/fan_in)`` (residual outputs ``o_proj``/``down_proj``
further scaled by ``1/sqrt(2L)``), norm weights ``1 + 0.1 N``, biases ``0.02 N``, embeddings
``0.5 N``, weight-norm gains ``g ~ U(1.5, 3)`` (so code logits have std ~2), ConvNeXt layer scales
``0.1 (1 + 0.5 N)``, mel ``coef ~ U(0.5, 1.5)`` (identical in DVAE and Decoder), and the mel/ISTFT
buffers hold their real values (periodic Hann windows, HTK mel filterbank).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

INFO_FILE = "omnistep_chattts.json"
"""Suffix of the info file written beside a checkpoint folder (see :func:`info_path`)."""
INFO_FORMAT = 1
OFFICIAL_HIDDEN = 768
"""The official GPT hidden size: the size of chattts 0.2.5's speaker statistics."""

# The 50 tokens ChatTTS appends to bert-base-chinese (official ids 21128..21177, in this order;
# "[spk_emb]" is the 16th -> 21143).
CHATTTS_SPECIAL_TOKENS: tuple[str, ...] = (
    "[Sasr]",
    "[Pasr]",
    "[Easr]",
    "[Stts]",
    "[Ptts]",
    "[Etts]",
    "[Sbreak]",
    "[Pbreak]",
    "[Ebreak]",
    "[uv_break]",
    "[v_break]",
    "[lbreak]",
    "[llbreak]",
    "[undefine]",
    "[laugh]",
    "[spk_emb]",
    "[empty_spk]",
    "[music]",
    "[pure]",
    *(f"[break_{i}]" for i in range(8)),
    *(f"[laugh_{i}]" for i in range(3)),
    *(f"[oral_{i}]" for i in range(10)),
    *(f"[speed_{i}]" for i in range(10)),
)

BERT_SPECIAL_TOKENS: tuple[str, ...] = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")

# A small WordPiece vocabulary: whole words, single characters and "##" continuations, so any
# lower-case ASCII text tokenizes without [UNK]; a few CJK characters (BERT splits CJK per char).
_WORDS_TEXT = (
    "the of and to a in is it you that he was for on are with as i his they be at one have "
    "this from or had by hot word but what some we can out other were all there when up use "
    "your how said an each she which do their time if will way about many then them write "
    "would like so these her long make thing see him two has look more day could go come did "
    "number sound no most people my over know water than call first who may down side been "
    "now find any new work part take get place made live where after back little only round "
    "man year came show every good me give our under name very through just form sentence "
    "great think say help low line differ turn cause much mean before move right boy old too "
    "same tell does set three want air well also play small end put home read hand port large "
    "spell add even land here must big high such follow act why ask men change went light kind "
    "off need house picture try us again animal point mother world near build self earth father "
    "hello speech voice model test audio chat text today weather nice thank thanks morning"
)
_CJK = "你好我是的了在有人这中大为上个国不以会们来到说时要就出也和"
_PUNCT = ".,!?;:'\"-()[]_"
_DIGITS = "0123456789"
_LETTERS = "abcdefghijklmnopqrstuvwxyz"


def _base_vocab(size: int | None) -> list[str]:
    toks: list[str] = list(BERT_SPECIAL_TOKENS)
    seen = set(toks)

    def add(t: str) -> None:
        if t not in seen:
            seen.add(t)
            toks.append(t)

    for t in (*_PUNCT, *_DIGITS, *_LETTERS, *_CJK):
        add(t)
    for t in (*_LETTERS, *_DIGITS):
        add("##" + t)
    for w in _WORDS_TEXT.split():
        add(w)
    for suffix in ("s", "ed", "ing", "er", "ly", "es", "'s"):
        add("##" + suffix)
    if size is not None:
        if size < len(toks):
            raise ValueError(f"text_base_vocab={size} < {len(toks)} built-in tokens")
        i = 0
        while len(toks) < size:
            add(f"[unused{i}]")
            i += 1
    return toks


@dataclass(frozen=True)
class ChatTTSSizes:
    """Every size the checkpoint depends on. Defaults are the tiny test sizes."""

    # GPT (LlamaModel) and Embed
    hidden: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 4
    intermediate: int = 128
    max_position_embeddings: int = 4096
    llama_vocab_size: int = 64  # rows of the unused ``embed_tokens``
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    num_vq: int = 4
    num_audio_tokens: int = 626  # prod(vq_levels) codes + EOS
    text_base_vocab: int | None = None  # None: the built-in list only; ChatTTS tokens follow
    spk_emb_dim: int = 192  # Config.gpt field, unused by 0.2.5
    # Decoder: hidden states -> mel (idim = odim = hidden / 2)
    decoder_hidden: int = 32
    decoder_layers: int = 2
    decoder_bn_dim: int = 16
    # DVAE (codes <-> mel); idim = odim = dvae_dim, VQ dim = 2 * dvae_dim
    dvae_dim: int = 32
    dvae_hidden: int = 32
    dvae_layers: int = 1
    dvae_bn_dim: int = 16
    vq_levels: tuple[int, ...] = (5, 5, 5, 5)
    vq_groups: int = 2
    vq_residual: int = 2
    # Vocos
    vocos_dim: int = 32
    vocos_intermediate: int = 64
    vocos_layers: int = 2
    n_fft: int = 1024
    hop_length: int = 256
    n_mels: int = 100  # hard-coded to 100 in upstream DVAE (coef, out_conv)
    sample_rate: int = 24000

    def validate(self) -> None:
        if self.hidden % 2:
            raise ValueError("hidden must be even (Decoder idim = hidden / 2)")
        if self.hidden % self.num_heads or self.num_heads % self.num_kv_heads:
            raise ValueError("hidden % num_heads and num_heads % num_kv_heads must be 0")
        if math.prod(self.vq_levels) + 1 != self.num_audio_tokens:
            raise ValueError("num_audio_tokens must be prod(vq_levels) + 1 (the EOS id)")
        if self.n_mels != 100:
            raise ValueError("upstream hard-codes 100 mel bins")
        if self.vq_groups * self.vq_residual != self.num_vq:
            raise ValueError("num_vq must be vq_groups * vq_residual (GFSQ index layout)")


TINY_SIZES = ChatTTSSizes()

SERVABLE_SIZES = ChatTTSSizes(hidden=OFFICIAL_HIDDEN, num_heads=12, num_kv_heads=12)
"""Tiny but for the GPT width (768, 12 heads of 64, as the official GPT): see
:func:`write_servable_tiny_chattts`."""

FULL_SIZES = ChatTTSSizes(
    hidden=768,
    num_layers=20,
    num_heads=12,
    num_kv_heads=12,
    intermediate=3072,
    llama_vocab_size=32000,
    text_base_vocab=21128,  # bert-base-chinese; specials then sit at 21128..21177 like upstream
    decoder_hidden=512,
    decoder_layers=12,
    decoder_bn_dim=128,
    dvae_dim=512,
    dvae_hidden=256,
    dvae_layers=12,
    dvae_bn_dim=128,
    vocos_dim=512,
    vocos_intermediate=1536,
    vocos_layers=8,
)


@dataclass(frozen=True)
class TinyChatTTSInfo:
    """What other tests need to know about a written checkpoint (see :func:`read_info`)."""

    root: Path
    seed: int
    sizes: ChatTTSSizes
    num_text_tokens: int
    token_ids: dict[str, int]  # every BERT and ChatTTS special token -> id
    # b14 string of fp16 [std(H), mean(H)] put in upstream's Config.spk_stat; None at the
    # official hidden size: upstream's own Config.spk_stat (the package's statistics) applies
    spk_stat: str | None
    upstream_config: dict[str, Any]  # dataclasses.asdict() of the matching ChatTTS Config
    sha256_map: dict[str, str]  # same keys as ChatTTS/res/sha256_map.json
    files: dict[str, int] = field(default_factory=dict)  # relative path -> size in bytes

    @property
    def hidden(self) -> int:
        return self.sizes.hidden

    @property
    def num_vq(self) -> int:
        return self.sizes.num_vq

    @property
    def num_audio_tokens(self) -> int:
        return self.sizes.num_audio_tokens

    @property
    def eos_token(self) -> int:
        """Audio EOS id (``num_audio_tokens - 1``)."""
        return self.sizes.num_audio_tokens - 1

    @property
    def spk_emb_id(self) -> int:
        return self.token_ids["[spk_emb]"]

    @property
    def samples_per_token(self) -> int:
        """2 mel frames per GPT step times the ISTFT hop."""
        return 2 * self.sizes.hop_length


# ----------------------------------------------------------------------------- tensors


def _spec_gpt(s: ChatTTSSizes) -> dict[str, tuple[int, ...]]:
    h, kv = s.hidden, s.hidden // s.num_heads * s.num_kv_heads
    spec: dict[str, tuple[int, ...]] = {"embed_tokens.weight": (s.llama_vocab_size, h)}
    for i in range(s.num_layers):
        p = f"layers.{i}."
        spec[p + "self_attn.q_proj.weight"] = (h, h)
        spec[p + "self_attn.k_proj.weight"] = (kv, h)
        spec[p + "self_attn.v_proj.weight"] = (kv, h)
        spec[p + "self_attn.o_proj.weight"] = (h, h)
        spec[p + "mlp.gate_proj.weight"] = (s.intermediate, h)
        spec[p + "mlp.up_proj.weight"] = (s.intermediate, h)
        spec[p + "mlp.down_proj.weight"] = (h, s.intermediate)
        spec[p + "input_layernorm.weight"] = (h,)
        spec[p + "post_attention_layernorm.weight"] = (h,)
    spec["norm.weight"] = (h,)
    return spec


def _spec_embed(s: ChatTTSSizes, num_text_tokens: int) -> dict[str, tuple[int, ...]]:
    h, va = s.hidden, s.num_audio_tokens
    spec: dict[str, tuple[int, ...]] = {}
    for i in range(s.num_vq):
        spec[f"emb_code.{i}.weight"] = (va, h)
    spec["emb_text.weight"] = (num_text_tokens, h)
    spec["head_text.parametrizations.weight.original0"] = (num_text_tokens, 1)
    spec["head_text.parametrizations.weight.original1"] = (num_text_tokens, h)
    for i in range(s.num_vq):
        spec[f"head_code.{i}.parametrizations.weight.original0"] = (va, 1)
        spec[f"head_code.{i}.parametrizations.weight.original1"] = (va, h)
    return spec


def _spec_dvae_decoder(
    prefix: str, idim: int, odim: int, hidden: int, n_layer: int, bn_dim: int
) -> dict[str, tuple[int, ...]]:
    """``ChatTTS.model.dvae.DVAEDecoder`` (kernel 7, dilation 2, intermediate 4 * hidden)."""
    spec: dict[str, tuple[int, ...]] = {
        f"{prefix}conv_in.0.weight": (bn_dim, idim, 3),
        f"{prefix}conv_in.0.bias": (bn_dim,),
        f"{prefix}conv_in.2.weight": (hidden, bn_dim, 3),
        f"{prefix}conv_in.2.bias": (hidden,),
    }
    for i in range(n_layer):
        p = f"{prefix}decoder_block.{i}."
        spec[p + "weight"] = (hidden,)
        spec[p + "dwconv.weight"] = (hidden, 1, 7)
        spec[p + "dwconv.bias"] = (hidden,)
        spec[p + "norm.weight"] = (hidden,)
        spec[p + "norm.bias"] = (hidden,)
        spec[p + "pwconv1.weight"] = (4 * hidden, hidden)
        spec[p + "pwconv1.bias"] = (4 * hidden,)
        spec[p + "pwconv2.weight"] = (hidden, 4 * hidden)
        spec[p + "pwconv2.bias"] = (hidden,)
    spec[f"{prefix}conv_out.weight"] = (odim, hidden, 1)
    return spec


def _spec_decoder(s: ChatTTSSizes) -> dict[str, tuple[int, ...]]:
    d = s.hidden // 2
    spec: dict[str, tuple[int, ...]] = {"coef": (1, s.n_mels, 1)}
    spec.update(
        _spec_dvae_decoder("decoder.", d, d, s.decoder_hidden, s.decoder_layers, s.decoder_bn_dim)
    )
    spec["out_conv.weight"] = (s.n_mels, d, 3)
    return spec


def _spec_mel(prefix: str, s: ChatTTSSizes) -> dict[str, tuple[int, ...]]:
    return {
        f"{prefix}spectrogram.window": (s.n_fft,),
        f"{prefix}mel_scale.fb": (s.n_fft // 2 + 1, s.n_mels),
    }


def _spec_dvae(s: ChatTTSSizes) -> dict[str, tuple[int, ...]]:
    e = s.dvae_dim
    spec: dict[str, tuple[int, ...]] = {
        "coef": (1, s.n_mels, 1),
        "downsample_conv.0.weight": (e, s.n_mels, 3),
        "downsample_conv.0.bias": (e,),
        "downsample_conv.2.weight": (e, e, 4),
        "downsample_conv.2.bias": (e,),
    }
    spec.update(_spec_mel("preprocessor_mel.mel_spec.", s))
    spec.update(
        _spec_dvae_decoder("encoder.", e, 2 * e, s.dvae_hidden, s.dvae_layers, s.dvae_bn_dim)
    )
    spec.update(_spec_dvae_decoder("decoder.", e, e, s.dvae_hidden, s.dvae_layers, s.dvae_bn_dim))
    spec["out_conv.weight"] = (s.n_mels, e, 3)
    group_dim, codebook_dim = 2 * e // s.vq_groups, len(s.vq_levels)
    for g in range(s.vq_groups):
        p = f"vq_layer.quantizer.rvqs.{g}."
        spec[p + "project_in.weight"] = (codebook_dim, group_dim)
        spec[p + "project_in.bias"] = (codebook_dim,)
        spec[p + "project_out.weight"] = (group_dim, codebook_dim)
        spec[p + "project_out.bias"] = (group_dim,)
    return spec


def _spec_vocos(s: ChatTTSSizes) -> dict[str, tuple[int, ...]]:
    d, iv = s.vocos_dim, s.vocos_intermediate
    spec: dict[str, tuple[int, ...]] = dict(_spec_mel("feature_extractor.mel_spec.", s))
    spec["backbone.embed.weight"] = (d, s.n_mels, 7)
    spec["backbone.embed.bias"] = (d,)
    spec["backbone.norm.weight"] = (d,)
    spec["backbone.norm.bias"] = (d,)
    for i in range(s.vocos_layers):
        p = f"backbone.convnext.{i}."
        spec[p + "gamma"] = (d,)
        spec[p + "dwconv.weight"] = (d, 1, 7)
        spec[p + "dwconv.bias"] = (d,)
        spec[p + "norm.weight"] = (d,)
        spec[p + "norm.bias"] = (d,)
        spec[p + "pwconv1.weight"] = (iv, d)
        spec[p + "pwconv1.bias"] = (iv,)
        spec[p + "pwconv2.weight"] = (d, iv)
        spec[p + "pwconv2.bias"] = (d,)
    spec["backbone.final_layer_norm.weight"] = (d,)
    spec["backbone.final_layer_norm.bias"] = (d,)
    spec["head.out.weight"] = (s.n_fft + 2, d)
    spec["head.out.bias"] = (s.n_fft + 2,)
    spec["head.istft.window"] = (s.n_fft,)
    return spec


def tensor_specs(sizes: ChatTTSSizes, num_text_tokens: int) -> dict[str, dict[str, tuple]]:
    """Relative file path -> {tensor name -> shape} for every safetensors file."""
    return {
        "asset/gpt/model.safetensors": _spec_gpt(sizes),
        "asset/Embed.safetensors": _spec_embed(sizes, num_text_tokens),
        "asset/Decoder.safetensors": _spec_decoder(sizes),
        "asset/DVAE.safetensors": _spec_dvae(sizes),
        "asset/Vocos.safetensors": _spec_vocos(sizes),
    }


def hz_to_mel_htk(freq: float) -> float:
    """torchaudio ``_hz_to_mel(freq, mel_scale="htk")``."""
    return 2595.0 * math.log10(1.0 + freq / 700.0)


def mel_to_hz_htk(mels):  # noqa: ANN001, ANN201 - tensor in, tensor out (like torchaudio)
    """torchaudio ``_mel_to_hz(mels, mel_scale="htk")``."""
    return 700.0 * (10.0 ** (mels / 2595.0) - 1.0)


def mel_filterbank_htk(n_freqs: int, n_mels: int, sample_rate: int):  # noqa: ANN201
    """``torchaudio.functional.melscale_fbanks(n_freqs, 0, sr // 2, n_mels, sr, None, "htk")``.

    Returns a float32 tensor ``[n_freqs, n_mels]`` (the ``mel_scale.fb`` buffer).
    """
    import torch

    f_max = float(sample_rate // 2)
    all_freqs = torch.linspace(0, sample_rate // 2, n_freqs)
    m_pts = torch.linspace(hz_to_mel_htk(0.0), hz_to_mel_htk(f_max), n_mels + 2)
    f_pts = mel_to_hz_htk(m_pts)
    f_diff = f_pts[1:] - f_pts[:-1]
    slopes = f_pts.unsqueeze(0) - all_freqs.unsqueeze(1)
    down = (-1.0 * slopes[:, :-2]) / f_diff[:-1]
    up = slopes[:, 2:] / f_diff[1:]
    return torch.clamp(torch.min(down, up), min=0.0).to(torch.float32)


def _draw(seed: int, file: str, key: str, shape: tuple[int, ...], s: ChatTTSSizes, coef):  # noqa: ANN001, ANN202
    import torch

    g = torch.Generator().manual_seed(zlib.crc32(f"{seed}/{file}/{key}".encode()))

    def randn() -> torch.Tensor:
        return torch.randn(shape, generator=g, dtype=torch.float32)

    def rand() -> torch.Tensor:
        return torch.rand(shape, generator=g, dtype=torch.float32)

    leaf = key.rsplit(".", 1)[-1]
    if key == "coef":
        return coef.clone()
    if key.endswith("window"):
        return torch.hann_window(shape[0])
    if key.endswith("mel_scale.fb"):
        return mel_filterbank_htk(shape[0], shape[1], s.sample_rate)
    if key.endswith("original0"):  # weight-norm gain g
        return 1.5 + 1.5 * rand()
    if key.startswith(("emb_", "embed_tokens")):
        return 0.5 * randn() if not key.startswith("embed_tokens") else 0.02 * randn()
    if "norm" in key and leaf == "weight":
        return 1.0 + 0.1 * randn()
    if leaf == "gamma" or (len(shape) == 1 and leaf == "weight"):  # ConvNeXt layer scale
        return 0.1 * (1.0 + 0.5 * randn())
    if leaf == "bias":
        return 0.02 * randn()
    fan_in = math.prod(shape[1:])
    std = 1.0 / math.sqrt(fan_in)
    if key.endswith(("o_proj.weight", "down_proj.weight")):
        std /= math.sqrt(2 * s.num_layers)
    return std * randn()


def _write_safetensors(path: Path, tensors: dict, metadata: dict[str, str] | None) -> None:
    from safetensors.torch import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path), metadata=metadata)
    path.chmod(0o644)


# ----------------------------------------------------------------------------- tokenizer


def _tokenizer_files(sizes: ChatTTSSizes) -> tuple[dict[str, str], dict[str, int], int]:
    """(file name -> text, token -> id, vocabulary size) of the tokenizer folder."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers
    from tokenizers import processors as tk_processors

    base = _base_vocab(sizes.text_base_vocab)
    vocab = {t: i for i, t in enumerate(base)}
    tok = Tokenizer(models.WordPiece(vocab=vocab, unk_token="[UNK]", max_input_chars_per_word=100))
    tok.normalizer = normalizers.BertNormalizer(
        clean_text=True, handle_chinese_chars=True, strip_accents=None, lowercase=True
    )
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.post_processor = tk_processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", vocab["[CLS]"]), ("[SEP]", vocab["[SEP]"])],
    )
    tok.decoder = decoders.WordPiece(prefix="##")
    tok.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in BERT_SPECIAL_TOKENS]
    )
    # ChatTTS tokens: plain added tokens, matched before normalisation (so "[Stts]" survives
    # lower-casing), appended after the base vocabulary in the official order.
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in CHATTTS_SPECIAL_TOKENS])
    ids = {t: tok.token_to_id(t) for t in (*BERT_SPECIAL_TOKENS, *CHATTTS_SPECIAL_TOKENS)}
    n = tok.get_vocab_size(with_added_tokens=True)
    assert ids["[speed_9]"] == n - 1 == len(base) + len(CHATTTS_SPECIAL_TOKENS) - 1

    def added(t: str, special: bool) -> dict[str, Any]:
        return {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": special,
        }

    decoder = {str(ids[t]): added(t, True) for t in BERT_SPECIAL_TOKENS}
    decoder.update({str(ids[t]): added(t, False) for t in CHATTTS_SPECIAL_TOKENS})
    config = {
        "added_tokens_decoder": decoder,
        "clean_up_tokenization_spaces": True,
        "cls_token": "[CLS]",
        "do_basic_tokenize": True,
        "do_lower_case": True,
        "mask_token": "[MASK]",
        "model_max_length": 1000000000000000019884624838656,
        "never_split": None,
        "pad_token": "[PAD]",
        "sep_token": "[SEP]",
        "strip_accents": None,
        "tokenize_chinese_chars": True,
        "tokenizer_class": "BertTokenizer",
        "unk_token": "[UNK]",
    }
    special_map = {
        "cls_token": "[CLS]",
        "mask_token": "[MASK]",
        "pad_token": "[PAD]",
        "sep_token": "[SEP]",
        "unk_token": "[UNK]",
    }
    files = {
        "tokenizer.json": tok.to_str(pretty=True) + "\n",
        "tokenizer_config.json": _dumps(config),
        "special_tokens_map.json": _dumps(special_map),
    }
    return files, ids, n


# ----------------------------------------------------------------------------- config


def _speaker_stat(seed: int, hidden: int) -> str | None:
    """None at the official hidden size (upstream's own statistics apply, and omnistep ships the
    same); else b14(fp16 [std(H), mean(H)]) drawn like the official stats (std 1.6..16, mean
    ~ N(0, 1.7)), for upstream's ``Config`` only (no file in the folder holds them)."""
    if hidden == OFFICIAL_HIDDEN:
        return None
    import numpy as np
    import pybase16384 as b14
    import torch

    g = torch.Generator().manual_seed(zlib.crc32(f"{seed}/spk_stat".encode()))
    std = 1.5 + 4.5 * torch.rand(hidden, generator=g)
    mean = 1.7 * torch.randn(hidden, generator=g)
    arr = torch.cat([std, mean]).to(torch.float16).numpy().astype(np.float16)
    return b14.encode_to_string(arr.tobytes())


def upstream_config_dict(
    s: ChatTTSSizes, num_text_tokens: int, spk_stat: str | None
) -> dict[str, Any]:
    """``dataclasses.asdict(ChatTTS.config.Config(...))`` for these sizes (same nesting);
    ``spk_stat`` None stands for the package's default."""
    half = s.hidden // 2

    def conv_cfg(idim: int, odim: int, hidden: int, n_layer: int, bn_dim: int) -> dict:
        return {"idim": idim, "odim": odim, "hidden": hidden, "n_layer": n_layer, "bn_dim": bn_dim}

    e = s.dvae_dim
    return {
        "path": {
            "vocos_ckpt_path": "asset/Vocos.safetensors",
            "dvae_ckpt_path": "asset/DVAE.safetensors",
            "gpt_ckpt_path": "asset/gpt",
            "decoder_ckpt_path": "asset/Decoder.safetensors",
            "tokenizer_path": "asset/tokenizer",
            "embed_path": "asset/Embed.safetensors",
        },
        "decoder": conv_cfg(half, half, s.decoder_hidden, s.decoder_layers, s.decoder_bn_dim),
        "dvae": {
            "encoder": conv_cfg(e, 2 * e, s.dvae_hidden, s.dvae_layers, s.dvae_bn_dim),
            "decoder": conv_cfg(e, e, s.dvae_hidden, s.dvae_layers, s.dvae_bn_dim),
            "vq": {
                "dim": 2 * e,
                "levels": list(s.vq_levels),
                "G": s.vq_groups,
                "R": s.vq_residual,
            },
        },
        "gpt": {
            "hidden_size": s.hidden,
            "intermediate_size": s.intermediate,
            "num_attention_heads": s.num_heads,
            "num_hidden_layers": s.num_layers,
            "use_cache": False,
            "max_position_embeddings": s.max_position_embeddings,
            "spk_emb_dim": s.spk_emb_dim,
            "spk_KL": False,
            "num_audio_tokens": s.num_audio_tokens,
            "num_text_tokens": num_text_tokens,
            "num_vq": s.num_vq,
        },
        "embed": {
            "hidden_size": s.hidden,
            "num_audio_tokens": s.num_audio_tokens,
            "num_text_tokens": num_text_tokens,
            "num_vq": s.num_vq,
        },
        "vocos": {
            "feature_extractor": {
                "class_path": "vocos.feature_extractors.MelSpectrogramFeatures",
                "init_args": {
                    "sample_rate": s.sample_rate,
                    "n_fft": s.n_fft,
                    "hop_length": s.hop_length,
                    "n_mels": s.n_mels,
                    "padding": "center",
                },
            },
            "backbone": {
                "class_path": "vocos.models.VocosBackbone",
                "init_args": {
                    "input_channels": s.n_mels,
                    "dim": s.vocos_dim,
                    "intermediate_dim": s.vocos_intermediate,
                    "num_layers": s.vocos_layers,
                },
            },
            "head": {
                "class_path": "vocos.heads.ISTFTHead",
                "init_args": {
                    "dim": s.vocos_dim,
                    "n_fft": s.n_fft,
                    "hop_length": s.hop_length,
                    "padding": "center",
                },
            },
        },
        "spk_stat": spk_stat,
    }


def _llama_config(s: ChatTTSSizes) -> dict[str, Any]:
    """``asset/gpt/config.json``: the keys of the official file (a transformers 4.x dump)."""
    return {
        "architectures": ["LlamaModel"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "hidden_act": "silu",
        "hidden_size": s.hidden,
        "initializer_range": 0.02,
        "intermediate_size": s.intermediate,
        "max_position_embeddings": s.max_position_embeddings,
        "mlp_bias": False,
        "model_type": "llama",
        "num_attention_heads": s.num_heads,
        "num_hidden_layers": s.num_layers,
        "num_key_value_heads": s.num_kv_heads,
        "pretraining_tp": 1,
        "rms_norm_eps": s.rms_norm_eps,
        "rope_scaling": None,
        "rope_theta": s.rope_theta,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "use_cache": False,
        "vocab_size": s.llama_vocab_size,
    }


def _dumps(obj: Any) -> str:
    return json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


# Files upstream's custom-path check hashes (ChatTTS/utils/dl.py:check_all_assets).
CHECKED_FILES: tuple[str, ...] = (
    "asset/Decoder.safetensors",
    "asset/DVAE.safetensors",
    "asset/Embed.safetensors",
    "asset/Vocos.safetensors",
    "asset/gpt/config.json",
    "asset/gpt/model.safetensors",
    "asset/tokenizer/special_tokens_map.json",
    "asset/tokenizer/tokenizer_config.json",
    "asset/tokenizer/tokenizer.json",
)


def sha256_key(rel: str) -> str:
    """``asset/gpt/config.json`` -> ``sha256_asset_gpt_config_json`` (upstream's key format)."""
    return "sha256_" + rel.replace("/", "_").replace(".", "_")


# ----------------------------------------------------------------------------- writers


def write_chattts(
    root: Path, sizes: ChatTTSSizes, seed: int = 0, write_info: bool = True
) -> TinyChatTTSInfo:
    """Write a full checkpoint folder for ``sizes``; returns its :class:`TinyChatTTSInfo`.

    ``write_info``: also write the info file beside the folder (:func:`info_path`), which the
    upstream reference reads; ``omnistep weights`` writes the folder only."""
    import torch

    sizes.validate()
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)

    tok_files, token_ids, num_text_tokens = _tokenizer_files(sizes)
    tok_dir = root / "asset" / "tokenizer"
    tok_dir.mkdir(parents=True, exist_ok=True)
    for name, text in tok_files.items():
        (tok_dir / name).write_text(text, encoding="utf-8")

    gpt_dir = root / "asset" / "gpt"
    gpt_dir.mkdir(parents=True, exist_ok=True)
    (gpt_dir / "config.json").write_text(_dumps(_llama_config(sizes)), encoding="utf-8")

    g = torch.Generator().manual_seed(zlib.crc32(f"{seed}/coef".encode()))
    coef = (0.5 + torch.rand(sizes.n_mels, generator=g)).view(1, sizes.n_mels, 1)
    for rel, spec in tensor_specs(sizes, num_text_tokens).items():
        tensors = {k: _draw(seed, rel, k, shape, sizes, coef) for k, shape in spec.items()}
        for k, shape in spec.items():
            assert tuple(tensors[k].shape) == shape, (rel, k)
        # transformers' save_pretrained writes {"format": "pt"}; the other official files carry no
        # metadata.  With that, full-size files have the official byte sizes exactly.
        meta = {"format": "pt"} if rel == "asset/gpt/model.safetensors" else None
        _write_safetensors(root / rel, tensors, meta)
        del tensors

    spk_stat = _speaker_stat(seed, sizes.hidden)
    sha = {sha256_key(rel): _sha256(root / rel) for rel in CHECKED_FILES}
    files = {rel: (root / rel).stat().st_size for rel in CHECKED_FILES}
    info = {
        "format": INFO_FORMAT,
        "seed": seed,
        "sizes": dataclasses.asdict(sizes),
        "num_text_tokens": num_text_tokens,
        "token_ids": token_ids,
        "spk_stat": spk_stat,
        "upstream_config": upstream_config_dict(sizes, num_text_tokens, spk_stat),
        "sha256_map": sha,
        "files": files,
    }
    if write_info:
        info_path(root).write_text(_dumps(info), encoding="utf-8")
    return _info_from_dict(root, json.loads(_dumps(info)))


def info_path(root: Path) -> Path:
    """The info file of the checkpoint folder ``root``: ``<root>.omnistep_chattts.json`` beside
    it, so that the folder itself holds the official files only."""
    root = Path(root)
    return root.with_name(f"{root.name}.{INFO_FILE}")


def write_tiny_chattts(root: Path, seed: int = 0, **overrides: Any) -> Path:
    """Tiny checkpoint (GPT hidden 64, 2 layers, 4 heads; see :class:`ChatTTSSizes`) at ``root``.

    ``overrides`` are :class:`ChatTTSSizes` fields (e.g. ``num_layers=3``).  Returns ``root``.
    """
    write_chattts(Path(root), dataclasses.replace(TINY_SIZES, **overrides), seed)
    return Path(root)


def write_servable_tiny_chattts(root: Path, seed: int = 0, **overrides: Any) -> Path:
    """A checkpoint in the official file set, exactly (:data:`SERVABLE_SIZES`: tiny but for the
    GPT width, 768 as the official one, so the speaker statistics omnistep ships, which are
    chattts 0.2.5's, fit it and every voice form is served, as on the published folder).

    ``overrides`` are :class:`ChatTTSSizes` fields.  Returns ``root``.
    """
    write_chattts(Path(root), dataclasses.replace(SERVABLE_SIZES, **overrides), seed)
    return Path(root)


FOLDER_VARIANTS: tuple[str, ...] = ()
"""``omnistep weights chattts`` writes one kind of folder (``write_folder``)."""


def write_folder(folder: Path, variant: str | None = None, seed: int = 0) -> Path:
    """``omnistep weights chattts DIR``: :func:`write_servable_tiny_chattts` without the info
    file (``variant`` is unused: one kind). Returns ``folder``."""
    write_chattts(Path(folder), SERVABLE_SIZES, seed, write_info=False)
    return Path(folder)


def write_full_size_chattts(root: Path, seed: int = 0, **overrides: Any) -> Path:
    """Official sizes (REFERENCE.md), random weights: ~1.2 GB, for benchmarks only."""
    write_chattts(Path(root), dataclasses.replace(FULL_SIZES, **overrides), seed)
    return Path(root)


def read_info(root: Path) -> TinyChatTTSInfo:
    """Parse the info file (:func:`info_path`) written by :func:`write_chattts`."""
    root = Path(root)
    return _info_from_dict(root, json.loads(info_path(root).read_text(encoding="utf-8")))


def _info_from_dict(root: Path, raw: dict[str, Any]) -> TinyChatTTSInfo:
    if raw.get("format") != INFO_FORMAT:
        raise ValueError(f"{info_path(root)}: unknown format {raw.get('format')}")
    sizes_raw = dict(raw["sizes"])
    sizes_raw["vq_levels"] = tuple(sizes_raw["vq_levels"])
    return TinyChatTTSInfo(
        root=root,
        seed=int(raw["seed"]),
        sizes=ChatTTSSizes(**sizes_raw),
        num_text_tokens=int(raw["num_text_tokens"]),
        token_ids={k: int(v) for k, v in raw["token_ids"].items()},
        spk_stat=raw["spk_stat"],
        upstream_config=raw["upstream_config"],
        sha256_map=dict(raw["sha256_map"]),
        files={k: int(v) for k, v in raw["files"].items()},
    )
