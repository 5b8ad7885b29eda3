"""Tiny S3Gen (flow + HiFT) checkpoints written by the reference's own classes, and its outputs.

Runs inside the reference subprocess (``tests.chatterbox_ref.env``). ``chatterbox.models`` and
``chatterbox.models.s3gen`` are registered as bare packages (``env.bare_package``): their
``__init__`` imports ``s3gen.py``, which imports torchaudio (no build for our torch) for its
resampler; the flow (``flow.py``, ``flow_matching.py``, ``decoder.py``, the conformer encoder)
and ``hifigan.py`` import without it. Their own imports (diffusers, conformer, omegaconf,
scipy) are real, from the overlay.

``write_s3gen`` builds ``CausalMaskedDiffWithXvec`` and ``HiFTGenerator`` with
``S3Token2Wav``'s arguments except the sizes (tiny: encoder FF 64, 1 + 4 layers; estimator 64
channels, 2 heads, 1 block per stage, 2 mid stages; HiFT 64 base channels, F0 predictor 32) and
writes their state dicts under ``flow.`` and ``mel2wav.`` of ``s3gen.safetensors`` (weight norm
kept as upstream's parametrization tensors, as the published file stores them).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from tests.chatterbox_ref.env import bare_package

HIFT_BASE = 64
F0_CHANNELS = 32
TINY_SIZES = {
    "linear_units": 64,
    "num_blocks": 1,
    "channels": 64,
    "n_blocks": 1,
    "num_mid_blocks": 2,
    "num_heads": 2,
    "base_channels": HIFT_BASE,
    "f0_channels": F0_CHANNELS,
}
"""The tiny sizes: encoder FF and blocks, estimator channels / blocks / mid blocks / heads,
HiFT base channels and F0 predictor width (upstream's published values: 2048, 6, 256, 4, 12,
8, 512, 512)."""


def _modules(sizes: dict | None = None):
    """Upstream's flow and HiFT with ``S3Token2Wav``'s arguments; ``sizes`` (keys of
    ``TINY_SIZES``) replaces the tiny sizes (``bench_ref`` passes the published ones)."""
    z = TINY_SIZES | (sizes or {})
    bare_package("chatterbox.models", "models")
    bare_package("chatterbox.models.s3gen", "models/s3gen")
    from chatterbox.models.s3gen.configs import CFM_PARAMS
    from chatterbox.models.s3gen.decoder import ConditionalDecoder
    from chatterbox.models.s3gen.f0_predictor import ConvRNNF0Predictor
    from chatterbox.models.s3gen.flow import CausalMaskedDiffWithXvec
    from chatterbox.models.s3gen.flow_matching import CausalConditionalCFM
    from chatterbox.models.s3gen.hifigan import HiFTGenerator
    from chatterbox.models.s3gen.transformer.upsample_encoder import UpsampleConformerEncoder

    encoder = UpsampleConformerEncoder(
        output_size=512,
        attention_heads=8,
        linear_units=z["linear_units"],
        num_blocks=z["num_blocks"],
        dropout_rate=0.1,
        positional_dropout_rate=0.1,
        attention_dropout_rate=0.1,
        normalize_before=True,
        input_layer="linear",
        pos_enc_layer_type="rel_pos_espnet",
        selfattention_layer_type="rel_selfattn",
        input_size=512,
        use_cnn_module=False,
        macaron_style=False,
    )
    estimator = ConditionalDecoder(
        in_channels=320,
        out_channels=80,
        causal=True,
        channels=[z["channels"]],
        dropout=0.0,
        attention_head_dim=64,
        n_blocks=z["n_blocks"],
        num_mid_blocks=z["num_mid_blocks"],
        num_heads=z["num_heads"],
        act_fn="gelu",
    )
    decoder = CausalConditionalCFM(spk_emb_dim=80, cfm_params=CFM_PARAMS, estimator=estimator)
    flow = CausalMaskedDiffWithXvec(encoder=encoder, decoder=decoder)
    hift = HiFTGenerator(
        sampling_rate=24000,
        base_channels=z["base_channels"],
        upsample_rates=[8, 5, 3],
        upsample_kernel_sizes=[16, 11, 7],
        source_resblock_kernel_sizes=[7, 7, 11],
        source_resblock_dilation_sizes=[[1, 3, 5], [1, 3, 5], [1, 3, 5]],
        f0_predictor=ConvRNNF0Predictor(cond_channels=z["f0_channels"]),
    )
    return flow.eval(), hift.eval()


def write_s3gen(root: str, seed: int = 0) -> None:
    """Write ``s3gen.safetensors`` (flow + HiFT, tiny, random) under ``root``."""
    from safetensors.torch import save_file

    torch.manual_seed(seed)
    flow, hift = _modules()
    with torch.no_grad():  # norms, biases and Snake alphas away from their neutral init
        for name, p in [*flow.named_parameters(), *hift.named_parameters()]:
            if "norm" in name or name.endswith("bias") or "alpha" in name or "pos_bias" in name:
                p.add_(0.1 * torch.randn_like(p))
    state = {f"flow.{k}": v for k, v in flow.state_dict().items()}
    state |= {f"mel2wav.{k}": v for k, v in hift.state_dict().items()}
    Path(root).mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in state.items()}, Path(root) / "s3gen.safetensors")


def _load(root: str, sizes: dict | None = None):
    from safetensors.torch import load_file

    flow, hift = _modules(sizes)
    state = load_file(Path(root) / "s3gen.safetensors")
    flow.load_state_dict({k[5:]: v for k, v in state.items() if k.startswith("flow.")})
    hift.load_state_dict({k[8:]: v for k, v in state.items() if k.startswith("mel2wav.")})
    return flow, hift


def flow_mel(
    root: str,
    tokens: list[int],
    prompt_tokens: list[int],
    prompt_mel: np.ndarray,
    embedding: np.ndarray,
    seed: int,
    n_timesteps: int = 10,
) -> np.ndarray:
    """Upstream ``CausalMaskedDiffWithXvec.inference`` (finalize, CFG rate 0.7) with the global
    generator seeded ``seed`` right before it (its only draw is the initial ``randn_like(mu)``
    ``[1, 80, T]``). Returns the mel ``[80, frames]`` float32."""
    flow, _ = _load(root)
    torch.manual_seed(seed)
    mel, _ = flow.inference(
        token=torch.tensor([tokens]),
        token_len=torch.tensor([len(tokens)]),
        prompt_token=torch.tensor([prompt_tokens]),
        prompt_token_len=torch.tensor([len(prompt_tokens)]),
        prompt_feat=torch.from_numpy(prompt_mel)[None],
        prompt_feat_len=None,
        embedding=torch.from_numpy(embedding)[None],
        finalize=True,
        n_timesteps=n_timesteps,
    )
    return mel[0].float().numpy()


def hift_wav(root: str, mel: np.ndarray, seed: int) -> dict:
    """Upstream ``HiFTGenerator.inference`` on ``mel`` ``[80, frames]`` with the global
    generator seeded ``seed`` right before it (its draws: the sine generator's phases, then its
    noise, then the source module's noise). Returns ``{"wav": [samples], "source": [samples]}``."""
    _, hift = _load(root)
    torch.manual_seed(seed)
    wav, source = hift.inference(speech_feat=torch.from_numpy(mel)[None])
    return {"wav": wav[0].float().numpy(), "source": source[0, 0].float().numpy()}


def case(root: str, flow_seed: int, hift_seed: int, **inputs) -> dict:
    """One subprocess for a test module: ``write_s3gen``, then ``flow_mel`` on ``inputs``
    (``tokens``, ``prompt_tokens``, ``prompt_mel``, ``embedding``) and ``hift_wav`` on that mel.
    Returns ``{"mel", "wav", "source"}``."""
    write_s3gen(root)
    mel = flow_mel(root, seed=flow_seed, **inputs)
    return {"mel": mel, **hift_wav(root, mel, hift_seed)}


def write_folder(root: str, seed: int = 0, prompt_tokens: int = 8) -> None:
    """The whole tiny published folder: ``upstream_t3.write_checkpoint`` (T3, tokenizer,
    ``conds.pt``), this module's ``s3gen.safetensors``, and ``conds.pt``'s S3Gen half completed
    as ``Conditionals.save`` stores it (``prompt_token`` ``[1, p]``, ``prompt_token_len``,
    ``prompt_feat`` ``[1, 2p, 80]``, ``prompt_feat_len`` None, ``embedding`` ``[1, 192]``)."""
    from tests.chatterbox_ref.upstream_t3 import write_checkpoint

    write_checkpoint(root, seed=seed)
    write_s3gen(root, seed=seed)
    path = Path(root) / "conds.pt"
    conds = torch.load(path, weights_only=True)
    g = torch.Generator().manual_seed(seed + 1)
    conds["gen"] = {
        "prompt_token": torch.randint(0, 6561, (1, prompt_tokens), generator=g),
        "prompt_token_len": torch.tensor([prompt_tokens]),
        "prompt_feat": torch.randn(1, 2 * prompt_tokens, 80, generator=g),
        "prompt_feat_len": None,
        "embedding": torch.randn(1, 192, generator=g),
    }
    torch.save(conds, path)


def token2wav(root: str, tokens: list[int], flow_seed: int, hift_seed: int) -> np.ndarray:
    """Upstream ``S3Token2Wav.inference`` on ``tokens`` with ``conds.pt``'s ``gen`` as its
    ``ref_dict``, composed from its parts (``S3Token2Wav`` itself imports torchaudio): the flow
    (10 steps) with the global generator seeded ``flow_seed`` before it, HiFT with it seeded
    ``hift_seed`` before it, then ``S3Token2Wav``'s ``trim_fade`` (its ``__init__``'s formula:
    20 ms of zeros, then ``(cos(linspace(pi, 0, n)) + 1) / 2`` over 20 ms). Returns
    ``[samples]`` float32."""
    flow, hift = _load(root)
    gen = torch.load(Path(root) / "conds.pt", weights_only=True)["gen"]
    with torch.inference_mode():  # as S3Token2Wav.inference runs
        return _token2wav(flow, hift, gen, tokens, flow_seed, hift_seed)


def _token2wav(flow, hift, gen, tokens, flow_seed, hift_seed) -> np.ndarray:
    torch.manual_seed(flow_seed)
    mel, _ = flow.inference(
        token=torch.tensor([tokens]),
        token_len=torch.tensor([len(tokens)]),
        finalize=True,
        n_timesteps=10,
        **gen,
    )
    torch.manual_seed(hift_seed)
    wav, _ = hift.inference(speech_feat=mel)
    n_trim = 24000 // 50
    trim_fade = torch.zeros(2 * n_trim)
    trim_fade[n_trim:] = (torch.cos(torch.linspace(torch.pi, 0, n_trim)) + 1) / 2
    wav[:, : len(trim_fade)] *= trim_fade
    return wav[0].float().numpy()
