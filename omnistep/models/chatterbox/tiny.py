"""A tiny random Chatterbox folder in the published layout (``omnistep weights chatterbox DIR``).

Every file ``ChatterboxTTS.from_local`` reads, with this family's own modules at tiny sizes
(randomly initialised) writing their tensors under the published names: ``t3_cfg.safetensors``
(T3: 2 layers, MLP 256; width 1024, which the Perceiver fixes), ``s3gen.safetensors`` (``flow.*``:
encoder FF 64, 1 + 4 layers, estimator 64 channels, 2 heads, 1 block, 2 mid stages;
``mel2wav.*``: HiFT 64 base channels, weight norm as ``parametrizations`` tensors;
``tokenizer.*``: the S3 tokenizer at width 128, 2 heads, 2 layers; ``speaker_encoder.*``:
CAMPPlus with 32 channels, growth 8, bottleneck 16: the folder clones reference clips),
``ve.safetensors`` (the voice encoder at its published size), ``tokenizer.json`` (a
character-level ``tokenizers`` vocabulary with upstream's special tokens, ``[START]`` = 255,
``[STOP]`` = 0) and ``conds.pt`` (a random default voice: both halves). Not a voice anyone
would want to hear: for tests and smoke runs.

Imports torch, safetensors, tokenizers and this family's modules.
"""

from __future__ import annotations

from pathlib import Path

import torch

FOLDER_VARIANTS: tuple[str, ...] = ()
SPECIAL = ("[STOP]", "[UNK]", "[SPACE]", "[PAD]", "[SEP]", "[CLS]", "[MASK]")


def _tokenizer(path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    letters = [chr(c) for c in range(ord("a"), ord("z") + 1)]
    letters += [chr(c) for c in range(ord("A"), ord("Z") + 1)] + list(".,!?'-\"")
    vocab = {tok: i for i, tok in enumerate((*SPECIAL, *letters))}
    vocab["[START]"] = 255
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.save(str(path))


def _t3_state(config=None) -> dict[str, torch.Tensor]:
    from omnistep.kv import KVCacheConfig
    from omnistep.models.chatterbox.t3 import ChatterboxT3, T3Config

    t3 = ChatterboxT3(
        config or T3Config(num_hidden_layers=2, intermediate_size=256),
        KVCacheConfig(num_blocks=4, block_size=16),
    )
    state = {f"tfmr.{k}": v for k, v in t3.llama.state_dict().items()}
    modules = {
        "text_emb.": t3.text_emb,
        "speech_emb.": t3.speech_emb,
        "text_pos_emb.emb.": t3.text_pos_emb,
        "speech_pos_emb.emb.": t3.speech_pos_emb,
        "speech_head.": t3.speech_head,
        "cond_enc.spkr_enc.": t3.spkr_enc,
        "cond_enc.emotion_adv_fc.": t3.emotion_adv_fc,
        "cond_enc.perceiver.": t3.perceiver,
    }
    for prefix, module in modules.items():
        state |= {prefix + k: v for k, v in module.state_dict().items()}
    return state


def _s3gen_state(flow_config=None, hift_config=None) -> dict[str, torch.Tensor]:
    from omnistep.models.chatterbox.hift import HiFT, HiFTConfig
    from omnistep.models.chatterbox.s3gen import FlowConfig, S3GenFlow
    from omnistep.models.chatterbox.s3gen_encoder import EncoderConfig
    from omnistep.models.chatterbox.s3gen_estimator import EstimatorConfig

    flow = S3GenFlow(
        flow_config
        or FlowConfig(
            encoder=EncoderConfig(ffn_dim=64, num_blocks=1),
            estimator=EstimatorConfig(channels=64, num_heads=2, num_blocks=1, num_mid_blocks=2),
        )
    )
    hift = HiFT(hift_config or HiFTConfig(base_channels=64, f0_channels=32))
    with torch.no_grad():  # a voiced F0 (~150 Hz), so the harmonic source is exercised
        hift.f0_predictor.classifier.bias.fill_(150.0)
    from omnistep.models.chatterbox.campplus import CAMPPlus, CAMPPlusConfig
    from omnistep.models.chatterbox.s3_tokenizer import S3Tokenizer, S3TokenizerConfig

    tokenizer = S3Tokenizer(S3TokenizerConfig(width=128, num_heads=2, num_layers=2))
    campplus = CAMPPlus(CAMPPlusConfig(init_channels=32, growth=8, bottleneck=16))
    state = {f"flow.{k}": v for k, v in flow.state_dict().items()}
    state |= {f"tokenizer.{k}": v for k, v in tokenizer.state_dict().items()}
    state |= {f"speaker_encoder.{k}": v for k, v in campplus.state_dict().items()}
    return state | {f"mel2wav.{k}": v for k, v in hift.state_dict().items()}


def _ve_state() -> dict[str, torch.Tensor]:
    from omnistep.models.chatterbox.voice_encoder import VoiceEncoder

    state = dict(VoiceEncoder().state_dict())
    return state | {
        "similarity_weight": torch.tensor([10.0]),
        "similarity_bias": torch.tensor([-5.0]),
    }


def write_folder(
    folder: str | Path,
    variant: str | None = None,
    seed: int = 0,
    *,
    t3_config=None,
    flow_config=None,
    hift_config=None,
) -> Path:
    """Write the tiny folder under ``folder`` (created); returns it.

    ``t3_config`` (``t3.T3Config``), ``flow_config`` (``s3gen.FlowConfig``) and ``hift_config``
    (``hift.HiFTConfig``) replace the tiny sizes (``bench/families.py`` writes the published
    widths at reduced depth this way); the voice encoder is always at its published size.

    Raises:
        ValueError: a ``variant`` (this family has one kind).
    """
    from safetensors.torch import save_file

    if variant is not None:
        raise ValueError(f"chatterbox has no folder variants, got {variant!r}")
    root = Path(folder)
    root.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    for name, state in (
        ("t3_cfg.safetensors", _t3_state(t3_config)),
        ("s3gen.safetensors", _s3gen_state(flow_config, hift_config)),
        ("ve.safetensors", _ve_state()),
    ):
        save_file({k: v.detach().contiguous() for k, v in state.items()}, root / name)
    _tokenizer(root / "tokenizer.json")
    g = torch.Generator().manual_seed(seed + 1)
    t3 = {
        "speaker_emb": torch.randn(1, 256, generator=g),
        "clap_emb": None,
        "cond_prompt_speech_tokens": torch.randint(0, 6561, (1, 12), generator=g),
        "cond_prompt_speech_emb": None,
        "emotion_adv": 0.5 * torch.ones(1, 1, 1),
    }
    gen = {
        "prompt_token": torch.randint(0, 6561, (1, 8), generator=g),
        "prompt_token_len": torch.tensor([8]),
        "prompt_feat": torch.randn(1, 16, 80, generator=g),
        "prompt_feat_len": None,
        "embedding": torch.randn(1, 192, generator=g),
    }
    torch.save({"t3": t3, "gen": gen}, root / "conds.pt")
    return root
