"""Functions that run INSIDE the qwen-tts reference subprocess (``tests.qwen3_tts_ref.env``).

Every function here imports ``qwen_tts`` (0.1.1, transformers 4.57.3); call them only through
``call_reference("tests.qwen3_tts_ref.upstream:<name>", ...)``, never from the test process.

- ``write_weights``: builds the upstream modules from a folder's ``config.json`` and
  ``speech_tokenizer/config.json`` under a fixed seed (upstream ``_init_weights``), and writes
  ``model.safetensors`` (bf16, as published) and ``speech_tokenizer/model.safetensors`` (f32).
- ``tensor_shapes``: name -> shape of the upstream modules' state dicts for a folder's configs.
- ``generate``: ``Qwen3TTSModel.from_pretrained(root)`` + ``generate_custom_voice`` /
  ``generate_voice_design``; returns the codes and the waveform.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

CODEBOOK_USAGE_RANGE = (0.5, 2.0)
"""``cluster_usage`` of the random codebooks is drawn uniformly from this range."""
RESIDUAL_GAIN = 0.3
"""Factor on the last conv of each decoder residual unit (after the ``N(0, 1/fan_in)`` draw)."""
OUTPUT_GAIN = 0.15
"""Factor on the decoder's output conv (after the ``N(0, 1/fan_in)`` draw)."""


def _configs(root: Path) -> tuple[Any, Any]:
    from qwen_tts.core.models import Qwen3TTSConfig
    from qwen_tts.core.tokenizer_12hz.configuration_qwen3_tts_tokenizer_v2 import (
        Qwen3TTSTokenizerV2Config,
    )

    config = Qwen3TTSConfig.from_pretrained(str(root))
    codec = Qwen3TTSTokenizerV2Config.from_pretrained(str(Path(root) / "speech_tokenizer"))
    return config, codec


def _build(root: Path, seed: int) -> tuple[Any, Any]:
    """The upstream model (without its speech tokenizer) and the speech tokenizer model, both
    float32, initialised by upstream ``post_init`` under ``torch.manual_seed(seed)``.

    Upstream leaves every codebook at ``embedding_sum = 0`` / ``cluster_usage = 1`` (decoder)
    and ``embed_sum = 0`` (Mimi encoder), which makes the decoded audio independent of the
    codes; those are redrawn: ``cluster_usage ~ U(0.5, 2)``, ``embedding_sum = usage * N(0, 1)``
    (so the codebook vectors ``embedding_sum / cluster_usage`` are ``N(0, 1)``). The speech
    tokenizer decoder's linear and conv weights are redrawn ``N(0, 1/fan_in)`` (transposed
    convs: ``fan_in = c_in * k / stride``): with upstream's ``N(0, 0.02)`` at tiny widths the
    decoded waveform is ~1e-8, too small to exercise the SnakeBeta activations or the clamp;
    then the residual units' last convs are scaled by ``RESIDUAL_GAIN`` and the output conv by
    ``OUTPUT_GAIN`` (waveform std ~0.3, a few percent of samples clamped).
    """
    import torch
    from qwen_tts.core.models import Qwen3TTSForConditionalGeneration
    from qwen_tts.core.tokenizer_12hz.modeling_qwen3_tts_tokenizer_v2 import (
        Qwen3TTSTokenizerV2Model,
    )

    config, codec_config = _configs(root)
    torch.manual_seed(seed)
    model = Qwen3TTSForConditionalGeneration(config).eval()
    codec = Qwen3TTSTokenizerV2Model(codec_config).eval()
    make_audible(codec, seed)
    return model, codec


def make_audible(codec: Any, seed: int) -> None:
    """Redraw the speech tokenizer's codebooks and decoder weights in place as ``_build``
    describes, from ``torch.Generator().manual_seed(seed + 1)``."""
    import torch

    gen = torch.Generator().manual_seed(seed + 1)
    lo, hi = CODEBOOK_USAGE_RANGE
    with torch.no_grad():
        for _, module in sorted(codec.decoder.named_modules()):
            if isinstance(module, (torch.nn.Conv1d, torch.nn.ConvTranspose1d, torch.nn.Linear)):
                fan_in = module.weight[0].numel()
                if isinstance(module, torch.nn.ConvTranspose1d):
                    fan_in = module.weight.shape[0] * module.weight.shape[2] // module.stride[0]
                std = fan_in**-0.5
                module.weight.copy_(std * torch.randn(module.weight.shape, generator=gen))
        # Keep the amplitude bounded through the four upsampling blocks (each adds three
        # residual units) and put the output at ~0.3 std, mostly inside the final clamp.
        for name, module in codec.decoder.decoder.named_modules():
            if name.endswith(".conv2.conv"):
                module.weight.mul_(RESIDUAL_GAIN)
        codec.decoder.decoder[-1].conv.weight.mul_(OUTPUT_GAIN)
        state = codec.state_dict(keep_vars=True)
        for name, tensor in sorted(state.items()):
            if name.endswith(("_codebook.embedding_sum", "codebook.embed_sum")):
                usage_name = name.rsplit(".", 1)[0] + ".cluster_usage"
                usage = lo + (hi - lo) * torch.rand(tensor.shape[0], generator=gen)
                state[usage_name].copy_(usage)
                tensor.copy_(usage[:, None] * torch.randn(tensor.shape, generator=gen))


def _main_state(model: Any) -> dict[str, Any]:
    """The tensors of the published ``model.safetensors``: everything but the speech tokenizer
    (upstream attaches it after loading; it has its own folder)."""
    return {k: v for k, v in model.state_dict().items() if not k.startswith("speech_tokenizer.")}


def write_weights(root: str | Path, seed: int = 0) -> dict[str, list[int]]:
    """Write ``root/model.safetensors`` (bf16) and ``root/speech_tokenizer/model.safetensors``
    (f32) for the configs already in ``root``.

    Returns:
        name -> shape of every tensor written (both files; the speech tokenizer's names under
        ``speech_tokenizer/``).
    """
    import torch
    from safetensors.torch import save_file

    root = Path(root)
    model, codec = _build(root, seed)
    main = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in _main_state(model).items()}
    tok = {k: v.detach().float().contiguous() for k, v in codec.state_dict().items()}
    save_file(main, str(root / "model.safetensors"), metadata={"format": "pt"})
    save_file(tok, str(root / "speech_tokenizer" / "model.safetensors"), metadata={"format": "pt"})
    shapes = {k: list(v.shape) for k, v in main.items()}
    shapes.update({f"speech_tokenizer/{k}": list(v.shape) for k, v in tok.items()})
    return shapes


def write_weights_many(roots: list[str | Path], seed: int = 0) -> list[dict[str, list[int]]]:
    """``write_weights`` for several folders in one subprocess (one start-up instead of many)."""
    return [write_weights(root, seed) for root in roots]


def generate_many(requests: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``generate(**request)`` for each request, in one subprocess."""
    return [generate(**request) for request in requests]


def tensor_shapes(root: str | Path) -> dict[str, list[int]]:
    """name -> shape of the state dicts upstream builds from ``root``'s configs (same keys as
    ``write_weights`` returns), without writing anything."""
    model, codec = _build(Path(root), 0)
    shapes = {k: list(v.shape) for k, v in _main_state(model).items()}
    shapes.update({f"speech_tokenizer/{k}": list(v.shape) for k, v in codec.state_dict().items()})
    return shapes


def generate(
    root: str | Path,
    text: str,
    language: str = "Auto",
    speaker: str | None = None,
    instruct: str | None = None,
    greedy: bool = True,
    max_new_tokens: int = 8,
    dtype: str = "float32",
    seed: int = 0,
    non_streaming_mode: bool | None = None,
) -> dict[str, Any]:
    """Load ``root`` with upstream ``Qwen3TTSModel.from_pretrained`` and synthesize ``text``.

    ``speaker`` given -> ``generate_custom_voice`` (with ``instruct``, which upstream drops for
    ``tts_model_size == "0b6"``); else ``generate_voice_design`` (``instruct`` required).
    ``greedy`` sets ``do_sample=False`` and ``subtalker_dosample=False``. ``non_streaming_mode``
    None leaves it out (the public call's default: True for both).

    Returns:
        ``codes``: int64 ``[T, num_code_groups]`` (the talker's codes, EOS excluded);
        ``wav``: float32 ``[T * 1920]`` at ``sample_rate`` (24000);
        ``tts_model_type``, ``speakers`` / ``languages`` (upstream's supported lists).
    """
    import numpy as np
    import torch
    from qwen_tts import Qwen3TTSModel

    torch.manual_seed(seed)
    tts = Qwen3TTSModel.from_pretrained(str(root), dtype=getattr(torch, dtype))
    captured: list[Any] = []
    decode = tts.model.speech_tokenizer.decode

    def _capture(encoded: Any) -> Any:
        captured.extend(item["audio_codes"] for item in encoded)
        return decode(encoded)

    tts.model.speech_tokenizer.decode = _capture
    kwargs: dict[str, Any] = {"max_new_tokens": max_new_tokens}
    if non_streaming_mode is not None:
        kwargs["non_streaming_mode"] = non_streaming_mode
    if greedy:
        kwargs.update(do_sample=False, subtalker_dosample=False)
    if speaker is not None:
        wavs, sr = tts.generate_custom_voice(
            text=text,
            speaker=speaker,
            language=language,
            instruct=instruct,
            **kwargs,
        )
    else:
        wavs, sr = tts.generate_voice_design(
            text=text,
            instruct=instruct or "",
            language=language,
            **kwargs,
        )
    return {
        "codes": captured[0].detach().cpu().long().numpy(),
        "wav": np.asarray(wavs[0], dtype=np.float32),
        "sample_rate": int(sr),
        "tts_model_type": tts.model.tts_model_type,
        "speakers": tts.get_supported_speakers(),
        "languages": tts.get_supported_languages(),
    }


def tokenize(root: str | Path, texts: list[str]) -> list[list[int]]:
    """Token ids of each text by upstream's processor (``Qwen3TTSProcessor`` from ``root``,
    as ``Qwen3TTSModel.from_pretrained`` loads it)."""
    from qwen_tts.core.models import Qwen3TTSConfig, Qwen3TTSProcessor
    from transformers import AutoConfig, AutoProcessor

    AutoConfig.register("qwen3_tts", Qwen3TTSConfig)
    AutoProcessor.register(Qwen3TTSConfig, Qwen3TTSProcessor)
    processor = AutoProcessor.from_pretrained(str(root), fix_mistral_regex=True)
    return [processor(text=t)["input_ids"][0] for t in texts]
