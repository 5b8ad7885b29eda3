"""Read a published Qwen3-TTS checkpoint folder (Qwen/Qwen3-TTS-12Hz-{0.6B,1.7B}-{CustomVoice,
VoiceDesign,Base}) into typed configs, tensors and the text tokenizer.

Layout (``LAYOUT``): ``config.json`` (model_type ``qwen3_tts``: ``talker_config`` with
``code_predictor_config``, ``spk_id``, ``spk_is_dialect``, ``codec_language_id``;
``speaker_encoder_config`` for Base only; ``tts_model_type``, ``tts_model_size``, text token
ids), ``generation_config.json`` (upstream opens it unconditionally), one ``model.safetensors``
(bf16: ``talker.*``, ``talker.code_predictor.*``, Base also ``speaker_encoder.*``), the slow
Qwen2 tokenizer files ``vocab.json`` + ``merges.txt`` + ``tokenizer_config.json``,
``preprocessor_config.json``, ``configuration.json``, and ``speech_tokenizer/`` (``config.json``
model_type ``qwen3_tts_tokenizer_12hz`` with ``encoder_config`` (Mimi) and ``decoder_config``;
``model.safetensors`` f32: ``encoder.*``, ``decoder.*``; ``preprocessor_config.json``;
``configuration.json``).

Field meanings and the modules they size are those of upstream ``qwen_tts`` 0.1.1
(``core/models/configuration_qwen3_tts.py``, ``core/tokenizer_12hz/
configuration_qwen3_tts_tokenizer_v2.py``); a key the published files always carry is required,
a key they may omit falls back to the upstream class default. Any problem (missing file or key,
wrong ``model_type``, a ``tts_model_type`` other than the one asked for, a missing tensor or one
of the wrong shape) raises ``Qwen3TTSCheckpointError`` naming the file (and key or tensor).
Nothing is downloaded.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omnistep.core import ModelFilesError
from omnistep.runners.locate import checkpoint_folder

if TYPE_CHECKING:
    import torch

TTS_MODEL_TYPES = ("custom_voice", "voice_design", "base")
TOKENIZER_TYPE = "qwen3_tts_tokenizer_12hz"

LAYOUT: tuple[str, ...] = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "vocab.json",
    "merges.txt",
    "tokenizer_config.json",
    "preprocessor_config.json",
    "configuration.json",
    "speech_tokenizer/config.json",
    "speech_tokenizer/model.safetensors",
    "speech_tokenizer/preprocessor_config.json",
    "speech_tokenizer/configuration.json",
)
"""Every file of a published folder, relative to it."""
_EXPECTED = f"expected: {', '.join(LAYOUT)}"


class Qwen3TTSCheckpointError(ModelFilesError, ValueError):
    """A Qwen3-TTS checkpoint folder is missing a file, a config key or a tensor, or one of them
    does not match (model_type, tts_model_type, tensor shape); the message names the file and
    the key or tensor."""


_MISSING = object()


class _Json:
    """A JSON object read from ``path`` (shown in errors as ``file``, with the key path)."""

    def __init__(self, data: Mapping[str, Any], file: str, where: str = "") -> None:
        self.data, self.file, self.where = data, file, where

    @classmethod
    def read(cls, root: Path, rel: str) -> _Json:
        path = root / rel
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise Qwen3TTSCheckpointError(
                f"Qwen3-TTS checkpoint {root} is missing {rel} ({_EXPECTED})"
            ) from None
        except (OSError, ValueError) as exc:
            raise Qwen3TTSCheckpointError(f"{path} is not valid JSON: {exc}") from None
        if not isinstance(data, dict):
            raise Qwen3TTSCheckpointError(f"{path} is not a JSON object")
        return cls(data, str(path))

    def _name(self, key: str) -> str:
        return f"{self.where}{key}"

    def error(self, key: str, problem: str) -> Qwen3TTSCheckpointError:
        return Qwen3TTSCheckpointError(f"{self.file}: {self._name(key)} {problem}")

    def get(self, key: str, default: Any = _MISSING) -> Any:
        value = self.data.get(key, default)
        if value is _MISSING:
            raise self.error(key, "is missing")
        return value

    def get_int(self, key: str, default: Any = _MISSING) -> int:
        value = self.get(key, default)
        if not isinstance(value, int) or isinstance(value, bool):
            raise self.error(key, f"must be an int, got {value!r}")
        return value

    def positive(self, key: str, default: Any = _MISSING) -> int:
        value = self.get_int(key, default)
        if value <= 0:
            raise self.error(key, f"must be positive, got {value}")
        return value

    def get_float(self, key: str, default: Any = _MISSING) -> float:
        value = self.get(key, default)
        if not isinstance(value, int | float) or isinstance(value, bool):
            raise self.error(key, f"must be a number, got {value!r}")
        return float(value)

    def get_bool(self, key: str, default: Any = _MISSING) -> bool:
        value = self.get(key, default)
        if not isinstance(value, bool):
            raise self.error(key, f"must be true or false, got {value!r}")
        return value

    def get_str(self, key: str, default: Any = _MISSING) -> str:
        value = self.get(key, default)
        if not isinstance(value, str):
            raise self.error(key, f"must be a string, got {value!r}")
        return value

    def positive_ints(self, key: str, default: Any = _MISSING) -> tuple[int, ...]:
        value = self.get(key, default)
        if not isinstance(value, list | tuple) or not all(
            isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value
        ):
            raise self.error(key, f"must be a list of positive ints, got {value!r}")
        return tuple(value)

    def sub(self, key: str) -> _Json:
        value = self.get(key)
        if not isinstance(value, dict):
            raise self.error(key, f"must be an object, got {value!r}")
        return _Json(value, self.file, f"{self.where}{key}.")

    def id_map(self, key: str) -> dict[str, int]:
        value = self.get(key)
        if not isinstance(value, dict) or not all(
            isinstance(v, int) and not isinstance(v, bool) for v in value.values()
        ):
            raise self.error(key, f"must map names to int ids, got {value!r}")
        return dict(value)


# ----------------------------------------------------------------------------- configs


@dataclass(frozen=True)
class TalkerCodePredictorConfig:
    """``talker_config.code_predictor_config``: the small Qwen3 decoder that predicts codebooks
    1..15 of a frame (upstream ``Qwen3TTSTalkerCodePredictorConfig``; 1D RoPE), as the file has
    it; ``layers.code_predictor.CodePredictorConfig.of`` reads the sizes the module needs."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int  # codebook size (2048)
    num_code_groups: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    hidden_act: str
    attention_bias: bool

    @classmethod
    def parse(cls, j: _Json) -> TalkerCodePredictorConfig:
        heads = j.positive("num_attention_heads")
        hidden = j.positive("hidden_size")
        return cls(
            hidden_size=hidden,
            intermediate_size=j.positive("intermediate_size"),
            num_hidden_layers=j.positive("num_hidden_layers"),
            num_attention_heads=heads,
            num_key_value_heads=j.positive("num_key_value_heads"),
            head_dim=j.positive("head_dim", hidden // heads),
            vocab_size=j.positive("vocab_size"),
            num_code_groups=j.positive("num_code_groups"),
            rms_norm_eps=j.get_float("rms_norm_eps", 1e-6),
            rope_theta=j.get_float("rope_theta", 10000.0),
            max_position_embeddings=j.positive("max_position_embeddings", 32768),
            hidden_act=j.get_str("hidden_act", "silu"),
            attention_bias=j.get_bool("attention_bias", False),
        )


@dataclass(frozen=True)
class TalkerConfig:
    """``talker_config``: the Qwen3 decoder over codec ids (codebook 0 and control/speaker/language
    ids, ``vocab_size`` 3072) with a text track (``text_vocab_size`` x ``text_hidden_size``
    embedding, projected to ``hidden_size``) and interleaved mRoPE (upstream
    ``Qwen3TTSTalkerConfig``)."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    text_vocab_size: int
    text_hidden_size: int
    num_code_groups: int
    rms_norm_eps: float
    rope_theta: float
    mrope_section: tuple[int, ...] | None  # sums to head_dim / 2; None: plain RoPE
    mrope_interleaved: bool
    max_position_embeddings: int
    position_id_per_seconds: int | None
    hidden_act: str
    attention_bias: bool
    code_predictor: TalkerCodePredictorConfig

    @classmethod
    def parse(cls, j: _Json) -> TalkerConfig:
        heads = j.positive("num_attention_heads")
        hidden = j.positive("hidden_size")
        head_dim = j.positive("head_dim", hidden // heads)
        rope = j.get("rope_scaling", None)
        section: tuple[int, ...] | None = None
        interleaved = False
        if rope is not None:
            rj = j.sub("rope_scaling")
            if "mrope_section" in rope:
                section = rj.positive_ints("mrope_section")
                if sum(section) != head_dim // 2:
                    raise rj.error(
                        "mrope_section", f"must sum to head_dim / 2 = {head_dim // 2}: {section}"
                    )
            interleaved = rj.get_bool("interleaved", False)
        pips = j.get("position_id_per_seconds", None)
        return cls(
            hidden_size=hidden,
            intermediate_size=j.positive("intermediate_size"),
            num_hidden_layers=j.positive("num_hidden_layers"),
            num_attention_heads=heads,
            num_key_value_heads=j.positive("num_key_value_heads"),
            head_dim=head_dim,
            vocab_size=j.positive("vocab_size"),
            text_vocab_size=j.positive("text_vocab_size"),
            text_hidden_size=j.positive("text_hidden_size"),
            num_code_groups=j.positive("num_code_groups"),
            rms_norm_eps=j.get_float("rms_norm_eps", 1e-6),
            rope_theta=j.get_float("rope_theta", 10000.0),
            mrope_section=section,
            mrope_interleaved=interleaved,
            max_position_embeddings=j.positive("max_position_embeddings", 32768),
            position_id_per_seconds=None if pips is None else j.positive("position_id_per_seconds"),
            hidden_act=j.get_str("hidden_act", "silu"),
            attention_bias=j.get_bool("attention_bias", False),
            code_predictor=TalkerCodePredictorConfig.parse(j.sub("code_predictor_config")),
        )


@dataclass(frozen=True)
class SpeakerEncoderConfig:
    """``speaker_encoder_config`` (Base only): the ECAPA-TDNN x-vector model on 24 kHz mels
    (upstream ``Qwen3TTSSpeakerEncoderConfig``; published folders carry only ``enc_dim`` and
    ``sample_rate``, the rest are the class defaults)."""

    enc_dim: int  # = talker hidden_size (the embedding sits in the codec embedding sequence)
    sample_rate: int
    mel_dim: int = 128
    enc_channels: tuple[int, ...] = (512, 512, 512, 512, 1536)
    enc_kernel_sizes: tuple[int, ...] = (5, 3, 3, 3, 1)
    enc_dilations: tuple[int, ...] = (1, 2, 3, 4, 1)
    enc_attention_channels: int = 128
    enc_res2net_scale: int = 8
    enc_se_channels: int = 128

    @classmethod
    def parse(cls, j: _Json) -> SpeakerEncoderConfig:
        d = cls.__dataclass_fields__
        out = cls(
            enc_dim=j.positive("enc_dim"),
            sample_rate=j.positive("sample_rate"),
            mel_dim=j.positive("mel_dim", d["mel_dim"].default),
            enc_channels=j.positive_ints("enc_channels", d["enc_channels"].default),
            enc_kernel_sizes=j.positive_ints("enc_kernel_sizes", d["enc_kernel_sizes"].default),
            enc_dilations=j.positive_ints("enc_dilations", d["enc_dilations"].default),
            enc_attention_channels=j.positive(
                "enc_attention_channels", d["enc_attention_channels"].default
            ),
            enc_res2net_scale=j.positive("enc_res2net_scale", d["enc_res2net_scale"].default),
            enc_se_channels=j.positive("enc_se_channels", d["enc_se_channels"].default),
        )
        if not len(out.enc_channels) == len(out.enc_kernel_sizes) == len(out.enc_dilations):
            raise j.error("enc_channels", "enc_kernel_sizes and enc_dilations differ in length")
        return out


@dataclass(frozen=True)
class SpeechDecoderConfig:
    """``speech_tokenizer/config.json`` ``decoder_config``: split RVQ (1 semantic + 15 acoustic
    codebooks) -> causal conv -> sliding-window transformer -> ConvNeXt upsampling -> SnakeBeta
    conv decoder (upstream ``Qwen3TTSTokenizerV2DecoderConfig``)."""

    codebook_size: int
    codebook_dim: int
    latent_dim: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    decoder_dim: int
    num_quantizers: int
    upsample_rates: tuple[int, ...]
    upsampling_ratios: tuple[int, ...]
    sliding_window: int
    rope_theta: float
    rms_norm_eps: float
    layer_scale_initial_scale: float
    max_position_embeddings: int
    hidden_act: str
    attention_bias: bool

    @property
    def total_upsample(self) -> int:
        """Output samples per code frame (the product of all upsampling factors; 1920)."""
        total = 1
        for f in self.upsample_rates + self.upsampling_ratios:
            total *= f
        return total

    @classmethod
    def parse(cls, j: _Json) -> SpeechDecoderConfig:
        heads = j.positive("num_attention_heads")
        hidden = j.positive("hidden_size")
        return cls(
            codebook_size=j.positive("codebook_size"),
            codebook_dim=j.positive("codebook_dim"),
            latent_dim=j.positive("latent_dim"),
            hidden_size=hidden,
            intermediate_size=j.positive("intermediate_size"),
            num_hidden_layers=j.positive("num_hidden_layers"),
            num_attention_heads=heads,
            num_key_value_heads=j.positive("num_key_value_heads"),
            head_dim=j.positive("head_dim", hidden // heads),
            decoder_dim=j.positive("decoder_dim"),
            num_quantizers=j.positive("num_quantizers"),
            upsample_rates=j.positive_ints("upsample_rates"),
            upsampling_ratios=j.positive_ints("upsampling_ratios"),
            sliding_window=j.positive("sliding_window", 72),
            rope_theta=j.get_float("rope_theta", 10000.0),
            rms_norm_eps=j.get_float("rms_norm_eps", 1e-5),
            layer_scale_initial_scale=j.get_float("layer_scale_initial_scale", 0.01),
            max_position_embeddings=j.positive("max_position_embeddings", 8000),
            hidden_act=j.get_str("hidden_act", "silu"),
            attention_bias=j.get_bool("attention_bias", False),
        )


@dataclass(frozen=True)
class SpeechEncoderConfig:
    """``speech_tokenizer/config.json`` ``encoder_config``: the Mimi encoder (transformers
    ``MimiConfig``) whose first ``encoder_valid_num_quantizers`` codebooks give the codes of a
    reference clip (Base voice clone). Sizes only; the rest are MimiConfig defaults."""

    hidden_size: int
    num_filters: int
    upsampling_ratios: tuple[int, ...]
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    codebook_size: int
    codebook_dim: int
    num_quantizers: int
    num_semantic_quantizers: int
    sampling_rate: int
    frame_rate: float

    @classmethod
    def parse(cls, j: _Json) -> SpeechEncoderConfig:
        heads = j.positive("num_attention_heads", 8)
        hidden = j.positive("hidden_size")
        return cls(
            hidden_size=hidden,
            num_filters=j.positive("num_filters", 64),
            upsampling_ratios=j.positive_ints("upsampling_ratios", (8, 6, 5, 4)),
            num_hidden_layers=j.positive("num_hidden_layers", 8),
            num_attention_heads=heads,
            num_key_value_heads=j.positive("num_key_value_heads", heads),
            head_dim=j.positive("head_dim", hidden // heads),
            intermediate_size=j.positive("intermediate_size", 2048),
            codebook_size=j.positive("codebook_size"),
            codebook_dim=j.positive("codebook_dim"),
            num_quantizers=j.positive("num_quantizers"),
            num_semantic_quantizers=j.positive("num_semantic_quantizers", 1),
            sampling_rate=j.positive("sampling_rate", 24000),
            frame_rate=j.get_float("_frame_rate", 12.5),
        )


@dataclass(frozen=True)
class SpeechTokenizerConfig:
    """``speech_tokenizer/config.json`` (upstream ``Qwen3TTSTokenizerV2Config``)."""

    decoder: SpeechDecoderConfig
    encoder: SpeechEncoderConfig
    encoder_valid_num_quantizers: int
    input_sample_rate: int
    output_sample_rate: int
    decode_upsample_rate: int  # samples per code frame (1920 at 24 kHz: 12.5 frames/s)
    encode_downsample_rate: int

    @classmethod
    def parse(cls, j: _Json) -> SpeechTokenizerConfig:
        model_type = j.get_str("model_type")
        if model_type != TOKENIZER_TYPE:
            raise j.error("model_type", f"must be {TOKENIZER_TYPE!r}, got {model_type!r}")
        out = cls(
            decoder=SpeechDecoderConfig.parse(j.sub("decoder_config")),
            encoder=SpeechEncoderConfig.parse(j.sub("encoder_config")),
            encoder_valid_num_quantizers=j.positive("encoder_valid_num_quantizers"),
            input_sample_rate=j.positive("input_sample_rate"),
            output_sample_rate=j.positive("output_sample_rate"),
            decode_upsample_rate=j.positive("decode_upsample_rate"),
            encode_downsample_rate=j.positive("encode_downsample_rate"),
        )
        if out.decoder.total_upsample != out.decode_upsample_rate:
            raise j.error(
                "decode_upsample_rate",
                f"is {out.decode_upsample_rate} but decoder_config's upsampling factors "
                f"multiply to {out.decoder.total_upsample}",
            )
        return out


@dataclass(frozen=True)
class TokenIds:
    """Text ids (``config.json`` top level) and codec ids (``talker_config``) the prompt uses."""

    im_start: int
    im_end: int
    assistant: int
    tts_pad: int
    tts_bos: int
    tts_eos: int
    codec_pad: int
    codec_bos: int
    codec_eos: int
    codec_think: int
    codec_nothink: int
    codec_think_bos: int
    codec_think_eos: int

    @classmethod
    def parse(cls, top: _Json, talker: _Json) -> TokenIds:
        return cls(
            im_start=top.get_int("im_start_token_id"),
            im_end=top.get_int("im_end_token_id"),
            assistant=top.get_int("assistant_token_id"),
            tts_pad=top.get_int("tts_pad_token_id"),
            tts_bos=top.get_int("tts_bos_token_id"),
            tts_eos=top.get_int("tts_eos_token_id"),
            codec_pad=talker.get_int("codec_pad_id"),
            codec_bos=talker.get_int("codec_bos_id"),
            codec_eos=talker.get_int("codec_eos_token_id"),
            codec_think=talker.get_int("codec_think_id"),
            codec_nothink=talker.get_int("codec_nothink_id"),
            codec_think_bos=talker.get_int("codec_think_bos_id"),
            codec_think_eos=talker.get_int("codec_think_eos_id"),
        )


@dataclass(frozen=True)
class GenerationDefaults:
    """``generation_config.json`` with upstream's hard defaults for absent keys
    (``Qwen3TTSModel._merge_generate_kwargs``)."""

    do_sample: bool = True
    top_k: int = 50
    top_p: float = 1.0
    temperature: float = 0.9
    repetition_penalty: float = 1.05
    subtalker_dosample: bool = True
    subtalker_top_k: int = 50
    subtalker_top_p: float = 1.0
    subtalker_temperature: float = 0.9
    max_new_tokens: int = 2048

    @classmethod
    def parse(cls, j: _Json) -> GenerationDefaults:
        d = cls()
        return cls(
            do_sample=j.get_bool("do_sample", d.do_sample),
            top_k=j.get_int("top_k", d.top_k),
            top_p=j.get_float("top_p", d.top_p),
            temperature=j.get_float("temperature", d.temperature),
            repetition_penalty=j.get_float("repetition_penalty", d.repetition_penalty),
            subtalker_dosample=j.get_bool("subtalker_dosample", d.subtalker_dosample),
            subtalker_top_k=j.get_int("subtalker_top_k", d.subtalker_top_k),
            subtalker_top_p=j.get_float("subtalker_top_p", d.subtalker_top_p),
            subtalker_temperature=j.get_float("subtalker_temperature", d.subtalker_temperature),
            max_new_tokens=j.positive("max_new_tokens", d.max_new_tokens),
        )


@dataclass(frozen=True)
class Qwen3TTSConfig:
    """Everything ``config.json``, ``speech_tokenizer/config.json`` and
    ``generation_config.json`` say."""

    tts_model_type: str  # custom_voice | voice_design | base
    tts_model_size: str  # "0b6" | "1b7" (upstream drops CustomVoice instructions for 0b6)
    talker: TalkerConfig
    speaker_encoder: SpeakerEncoderConfig | None  # Base only
    speech_tokenizer: SpeechTokenizerConfig
    ids: TokenIds
    spk_id: dict[str, int]  # lower-case speaker name -> codec id (CustomVoice)
    spk_is_dialect: dict[str, str | bool]  # speaker -> dialect name (a codec_language_id key)
    codec_language_id: dict[str, int]  # lower-case language (and dialect) -> codec id
    generation: GenerationDefaults

    @property
    def languages(self) -> list[str]:
        """What upstream accepts as ``language``: "auto" then the non-dialect languages."""
        return ["auto"] + [k for k in self.codec_language_id if "dialect" not in k]


def parse_config(root: str | Path, tts_model_type: str | None = None) -> Qwen3TTSConfig:
    """Read and check the three config files of a folder (no tensors).

    Args:
        tts_model_type: when given, the folder's ``tts_model_type`` must equal it.

    Raises:
        Qwen3TTSCheckpointError: a missing file or key, a wrong value (named with its file).
    """
    root = checkpoint_folder(root, "Qwen3-TTS", _EXPECTED, error=Qwen3TTSCheckpointError)
    top = _Json.read(root, "config.json")
    model_type = top.get_str("model_type")
    if model_type != "qwen3_tts":
        raise top.error("model_type", f"must be 'qwen3_tts', got {model_type!r}")
    kind = top.get_str("tts_model_type")
    if kind not in TTS_MODEL_TYPES:
        raise top.error("tts_model_type", f"must be one of {TTS_MODEL_TYPES}, got {kind!r}")
    if tts_model_type is not None and kind != tts_model_type:
        raise top.error("tts_model_type", f"is {kind!r}, but a {tts_model_type!r} model was asked")
    tokenizer_type = top.get_str("tokenizer_type")
    if tokenizer_type != TOKENIZER_TYPE:
        raise top.error("tokenizer_type", f"must be {TOKENIZER_TYPE!r}, got {tokenizer_type!r}")
    talker_j = top.sub("talker_config")
    spk_id = talker_j.id_map("spk_id")
    languages = talker_j.id_map("codec_language_id")
    dialects = talker_j.get("spk_is_dialect")
    if not isinstance(dialects, dict) or set(dialects) != set(spk_id):
        raise talker_j.error(
            "spk_is_dialect", f"must have one entry per spk_id speaker: {dialects}"
        )
    for name, dialect in dialects.items():
        if dialect is not False and dialect not in languages:
            raise talker_j.error(
                "spk_is_dialect", f"{name!r} -> {dialect!r} is not a codec_language_id key"
            )
    if kind == "custom_voice" and not spk_id:
        raise talker_j.error("spk_id", "is empty in a custom_voice checkpoint")
    speaker_encoder = None
    if kind == "base":
        speaker_encoder = SpeakerEncoderConfig.parse(top.sub("speaker_encoder_config"))
    talker = TalkerConfig.parse(talker_j)
    ids = TokenIds.parse(top, talker_j)
    for name, value in [*spk_id.items(), *languages.items()]:
        if not 0 <= value < talker.vocab_size:
            raise talker_j.error("spk_id", f"{name!r} -> {value} is outside the codec vocabulary")
    return Qwen3TTSConfig(
        tts_model_type=kind,
        tts_model_size=top.get_str("tts_model_size"),
        talker=talker,
        speaker_encoder=speaker_encoder,
        speech_tokenizer=SpeechTokenizerConfig.parse(
            _Json.read(root, "speech_tokenizer/config.json")
        ),
        ids=ids,
        spk_id=spk_id,
        spk_is_dialect=dict(dialects),
        codec_language_id=languages,
        generation=GenerationDefaults.parse(_Json.read(root, "generation_config.json")),
    )


# ----------------------------------------------------------------------------- tensors


def _decoder_layers(
    prefix: str, n: int, h: int, inter: int, heads: int, kv: int, hd: int, qk_norm: bool
) -> dict[str, tuple[int, ...]]:
    spec: dict[str, tuple[int, ...]] = {}
    for i in range(n):
        p = f"{prefix}.layers.{i}."
        spec[p + "self_attn.q_proj.weight"] = (heads * hd, h)
        spec[p + "self_attn.k_proj.weight"] = (kv * hd, h)
        spec[p + "self_attn.v_proj.weight"] = (kv * hd, h)
        spec[p + "self_attn.o_proj.weight"] = (h, heads * hd)
        if qk_norm:
            spec[p + "self_attn.q_norm.weight"] = (hd,)
            spec[p + "self_attn.k_norm.weight"] = (hd,)
        spec[p + "mlp.gate_proj.weight"] = (inter, h)
        spec[p + "mlp.up_proj.weight"] = (inter, h)
        spec[p + "mlp.down_proj.weight"] = (h, inter)
        spec[p + "input_layernorm.weight"] = (h,)
        spec[p + "post_attention_layernorm.weight"] = (h,)
    spec[f"{prefix}.norm.weight"] = (h,)
    return spec


def model_tensor_shapes(config: Qwen3TTSConfig) -> dict[str, tuple[int, ...]]:
    """Official name -> shape of every tensor of ``model.safetensors`` (talker, code predictor,
    Base's speaker encoder), from upstream ``modeling_qwen3_tts.py``."""
    t, cp = config.talker, config.talker.code_predictor
    h = t.hidden_size
    spec = _decoder_layers(
        "talker.model",
        t.num_hidden_layers,
        h,
        t.intermediate_size,
        t.num_attention_heads,
        t.num_key_value_heads,
        t.head_dim,
        qk_norm=True,
    )
    spec["talker.model.codec_embedding.weight"] = (t.vocab_size, h)
    spec["talker.model.text_embedding.weight"] = (t.text_vocab_size, t.text_hidden_size)
    spec["talker.text_projection.linear_fc1.weight"] = (t.text_hidden_size, t.text_hidden_size)
    spec["talker.text_projection.linear_fc1.bias"] = (t.text_hidden_size,)
    spec["talker.text_projection.linear_fc2.weight"] = (h, t.text_hidden_size)
    spec["talker.text_projection.linear_fc2.bias"] = (h,)
    spec["talker.codec_head.weight"] = (t.vocab_size, h)
    spec.update(
        _decoder_layers(
            "talker.code_predictor.model",
            cp.num_hidden_layers,
            cp.hidden_size,
            cp.intermediate_size,
            cp.num_attention_heads,
            cp.num_key_value_heads,
            cp.head_dim,
            qk_norm=True,
        )
    )
    for g in range(cp.num_code_groups - 1):
        spec[f"talker.code_predictor.model.codec_embedding.{g}.weight"] = (cp.vocab_size, h)
        spec[f"talker.code_predictor.lm_head.{g}.weight"] = (cp.vocab_size, cp.hidden_size)
    if cp.hidden_size != h:
        spec["talker.code_predictor.small_to_mtp_projection.weight"] = (cp.hidden_size, h)
        spec["talker.code_predictor.small_to_mtp_projection.bias"] = (cp.hidden_size,)
    if config.speaker_encoder is not None:
        spec.update(_speaker_encoder_shapes(config.speaker_encoder))
    return spec


def _speaker_encoder_shapes(s: SpeakerEncoderConfig) -> dict[str, tuple[int, ...]]:
    spec: dict[str, tuple[int, ...]] = {}

    def conv(name: str, c_out: int, c_in: int, k: int) -> None:
        spec[f"speaker_encoder.{name}.weight"] = (c_out, c_in, k)
        spec[f"speaker_encoder.{name}.bias"] = (c_out,)

    ch, ks = s.enc_channels, s.enc_kernel_sizes
    conv("blocks.0.conv", ch[0], s.mel_dim, ks[0])
    for i in range(1, len(ch) - 1):
        c, part = ch[i], ch[i] // s.enc_res2net_scale
        conv(f"blocks.{i}.tdnn1.conv", c, ch[i - 1], 1)
        for j in range(s.enc_res2net_scale - 1):
            conv(f"blocks.{i}.res2net_block.blocks.{j}.conv", part, part, ks[i])
        conv(f"blocks.{i}.tdnn2.conv", c, c, 1)
        conv(f"blocks.{i}.se_block.conv1", s.enc_se_channels, c, 1)
        conv(f"blocks.{i}.se_block.conv2", c, s.enc_se_channels, 1)
    conv("mfa.conv", ch[-1], ch[-1], ks[-1])
    conv("asp.tdnn.conv", s.enc_attention_channels, ch[-1] * 3, 1)
    conv("asp.conv", ch[-1], s.enc_attention_channels, 1)
    conv("fc", s.enc_dim, ch[-1] * 2, 1)
    return spec


def speech_decoder_tensor_shapes(d: SpeechDecoderConfig) -> dict[str, tuple[int, ...]]:
    """Official name -> shape of the ``decoder.*`` tensors of
    ``speech_tokenizer/model.safetensors``, from upstream ``modeling_qwen3_tts_tokenizer_v2.py``
    (the ``encoder.*`` Mimi tensors are not listed: nothing here shape-checks them)."""
    spec: dict[str, tuple[int, ...]] = {}
    half = d.codebook_dim // 2
    for part, n in (("rvq_first", 1), ("rvq_rest", d.num_quantizers - 1)):
        p = f"decoder.quantizer.{part}"
        spec[f"{p}.input_proj.weight"] = (half, d.codebook_dim, 1)
        spec[f"{p}.output_proj.weight"] = (d.codebook_dim, half, 1)
        for i in range(n):
            spec[f"{p}.vq.layers.{i}._codebook.cluster_usage"] = (d.codebook_size,)
            spec[f"{p}.vq.layers.{i}._codebook.embedding_sum"] = (d.codebook_size, half)
    spec["decoder.pre_conv.conv.weight"] = (d.latent_dim, d.codebook_dim, 3)
    spec["decoder.pre_conv.conv.bias"] = (d.latent_dim,)
    tr = "decoder.pre_transformer"
    h, hd = d.hidden_size, d.head_dim
    spec[f"{tr}.input_proj.weight"] = (h, d.latent_dim)
    spec[f"{tr}.input_proj.bias"] = (h,)
    spec[f"{tr}.output_proj.weight"] = (d.latent_dim, h)
    spec[f"{tr}.output_proj.bias"] = (d.latent_dim,)
    layers = _decoder_layers(
        tr,
        d.num_hidden_layers,
        h,
        d.intermediate_size,
        d.num_attention_heads,
        d.num_key_value_heads,
        hd,
        qk_norm=False,
    )
    spec.update(layers)
    for i in range(d.num_hidden_layers):
        spec[f"{tr}.layers.{i}.self_attn_layer_scale.scale"] = (h,)
        spec[f"{tr}.layers.{i}.mlp_layer_scale.scale"] = (h,)
    c = d.latent_dim
    for i, factor in enumerate(d.upsampling_ratios):
        p = f"decoder.upsample.{i}"
        spec[f"{p}.0.conv.weight"] = (c, c, factor)
        spec[f"{p}.0.conv.bias"] = (c,)
        spec[f"{p}.1.dwconv.conv.weight"] = (c, 1, 7)
        spec[f"{p}.1.dwconv.conv.bias"] = (c,)
        spec[f"{p}.1.norm.weight"] = (c,)
        spec[f"{p}.1.norm.bias"] = (c,)
        spec[f"{p}.1.pwconv1.weight"] = (4 * c, c)
        spec[f"{p}.1.pwconv1.bias"] = (4 * c,)
        spec[f"{p}.1.pwconv2.weight"] = (c, 4 * c)
        spec[f"{p}.1.pwconv2.bias"] = (c,)
        spec[f"{p}.1.gamma"] = (c,)
    spec["decoder.decoder.0.conv.weight"] = (d.decoder_dim, c, 7)
    spec["decoder.decoder.0.conv.bias"] = (d.decoder_dim,)
    for i, rate in enumerate(d.upsample_rates):
        c_in, c_out = d.decoder_dim // 2**i, d.decoder_dim // 2 ** (i + 1)
        p = f"decoder.decoder.{i + 1}.block"
        spec[f"{p}.0.alpha"] = (c_in,)
        spec[f"{p}.0.beta"] = (c_in,)
        spec[f"{p}.1.conv.weight"] = (c_in, c_out, 2 * rate)
        spec[f"{p}.1.conv.bias"] = (c_out,)
        for j in range(3):
            u = f"{p}.{j + 2}"
            for act in ("act1", "act2"):
                spec[f"{u}.{act}.alpha"] = (c_out,)
                spec[f"{u}.{act}.beta"] = (c_out,)
            spec[f"{u}.conv1.conv.weight"] = (c_out, c_out, 7)
            spec[f"{u}.conv1.conv.bias"] = (c_out,)
            spec[f"{u}.conv2.conv.weight"] = (c_out, c_out, 1)
            spec[f"{u}.conv2.conv.bias"] = (c_out,)
    out = d.decoder_dim // 2 ** len(d.upsample_rates)
    n = len(d.upsample_rates) + 1
    spec[f"decoder.decoder.{n}.alpha"] = (out,)
    spec[f"decoder.decoder.{n}.beta"] = (out,)
    spec[f"decoder.decoder.{n + 1}.conv.weight"] = (1, out, 7)
    spec[f"decoder.decoder.{n + 1}.conv.bias"] = (1,)
    return spec


def _load(
    path: Path,
    spec: Mapping[str, tuple[int, ...]],
    dtype: torch.dtype | None,
    device: str | torch.device,
    prefix: str = "",
) -> dict[str, torch.Tensor]:
    """Tensors of ``path`` whose name starts with ``prefix`` (all of them by default); every
    ``spec`` name must be there with its shape."""
    from safetensors import safe_open

    out: dict[str, torch.Tensor] = {}
    try:
        handle = safe_open(str(path), framework="pt", device="cpu")
    except FileNotFoundError:
        raise Qwen3TTSCheckpointError(f"Qwen3-TTS checkpoint is missing {path}") from None
    except Exception as exc:  # safetensors raises its own error type for a bad header
        raise Qwen3TTSCheckpointError(f"{path} is not a safetensors file: {exc}") from None
    with handle as f:
        names = set(f.keys())  # noqa: SIM118 - safe_open has no __iter__
        for name, shape in spec.items():
            if name not in names:
                raise Qwen3TTSCheckpointError(f"{path}: tensor {name} is missing")
            got = tuple(f.get_slice(name).get_shape())
            if got != tuple(shape):
                raise Qwen3TTSCheckpointError(
                    f"{path}: tensor {name} has shape {list(got)}, expected {list(shape)}"
                )
        for name in sorted(names):
            if name.startswith(prefix):
                tensor = f.get_tensor(name)
                if dtype is not None and tensor.is_floating_point():
                    tensor = tensor.to(dtype)
                out[name] = tensor.to(device)
    return out


# ----------------------------------------------------------------------------- folder


@dataclass(frozen=True)
class Qwen3TTSCheckpoint:
    """A checked published folder: its configs; tensors and the tokenizer on request."""

    root: Path
    config: Qwen3TTSConfig

    @classmethod
    def open(cls, root: str | Path, tts_model_type: str | None = None) -> Qwen3TTSCheckpoint:
        """Check that every file of ``LAYOUT`` exists and read the configs.

        Raises:
            Qwen3TTSCheckpointError: naming the first missing file, a missing or wrong config
                key, or a ``tts_model_type`` other than the one asked for.
        """
        config = parse_config(root, tts_model_type)
        path = checkpoint_folder(
            root, "Qwen3-TTS", _EXPECTED, LAYOUT, files_only=True, error=Qwen3TTSCheckpointError
        )
        return cls(path, config)

    def model_tensors(
        self,
        dtype: torch.dtype | None = None,
        device: str | torch.device = "cpu",
        prefix: str = "",
    ) -> dict[str, torch.Tensor]:
        """Tensors of ``model.safetensors`` by official name whose name starts with ``prefix``
        (all by default; e.g. ``"speaker_encoder."``), floating ones cast to ``dtype`` (None: as
        stored, bf16 in published folders), on ``device``.

        Raises:
            Qwen3TTSCheckpointError: a tensor of ``model_tensor_shapes`` missing or misshapen.
        """
        spec = model_tensor_shapes(self.config)
        return _load(self.root / "model.safetensors", spec, dtype, device, prefix)

    def speech_tokenizer_tensors(
        self,
        dtype: torch.dtype | None = None,
        device: str | torch.device = "cpu",
        prefix: str = "",
    ) -> dict[str, torch.Tensor]:
        """Tensors of ``speech_tokenizer/model.safetensors`` whose name starts with ``prefix``
        (e.g. ``"decoder."``), cast and placed like ``model_tensors`` (stored f32).

        Raises:
            Qwen3TTSCheckpointError: a ``decoder.*`` tensor missing or misshapen.
        """
        spec = speech_decoder_tensor_shapes(self.config.speech_tokenizer.decoder)
        path = self.root / "speech_tokenizer" / "model.safetensors"
        return _load(path, spec, dtype, device, prefix)

    def tokenizer(self) -> Any:
        """The text tokenizer: transformers' slow ``Qwen2Tokenizer`` from ``vocab.json``,
        ``merges.txt`` and ``tokenizer_config.json`` (its added tokens and special tokens).

        Raises:
            Qwen3TTSCheckpointError: the tokenizer does not map the config's text ids
                (``<|im_start|>``, ``<|im_end|>``, ``<tts_pad>``, ``<tts_text_bos>``,
                ``<tts_text_eod>``, ``assistant``) to those ids.
        """
        from transformers import Qwen2Tokenizer

        tok = Qwen2Tokenizer.from_pretrained(str(self.root), local_files_only=True)
        ids = self.config.ids
        for text, want in (
            ("<|im_start|>", ids.im_start),
            ("<|im_end|>", ids.im_end),
            ("<tts_pad>", ids.tts_pad),
            ("<tts_text_bos>", ids.tts_bos),
            ("<tts_text_eod>", ids.tts_eos),
            ("assistant", ids.assistant),
        ):
            got = tok.convert_tokens_to_ids(text)
            if got != want:
                raise Qwen3TTSCheckpointError(
                    f"{self.root / 'tokenizer_config.json'}: {text} is id {got} in the tokenizer "
                    f"but {want} in config.json"
                )
        return tok
