"""Read the published Chatterbox folder (ResembleAI/chatterbox).

Files as upstream ``ChatterboxTTS.from_local`` / ``from_pretrained`` name them:
``ve.safetensors`` (voice encoder), ``t3_cfg.safetensors`` (T3), ``s3gen.safetensors``
(S3Gen + HiFT), ``tokenizer.json`` (``tokenizers`` vocabulary), and the optional ``conds.pt``
(the default voice: ``torch.save({"t3": T3Cond fields, "gen": S3Gen prompt})``). T3, S3Gen's
flow (``flow.*``) and HiFT (``mel2wav.*``) load from their files; for reference-clip cloning, the
voice encoder (``ve.safetensors``), S3Gen's speech tokenizer (``tokenizer.*``) and speaker
encoder (``speaker_encoder.*``, CAMPPlus) load too (``load_clone_encoders``).

Imports torch, safetensors and this family's modules.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from omnistep.core import ModelFilesError
from omnistep.kv import KVCacheConfig
from omnistep.models.chatterbox.campplus import CAMPPlus, CAMPPlusConfig
from omnistep.models.chatterbox.frontend import Voice
from omnistep.models.chatterbox.hift import HiFT, HiFTConfig
from omnistep.models.chatterbox.s3_tokenizer import S3Tokenizer, S3TokenizerConfig
from omnistep.models.chatterbox.s3gen import FlowConfig, S3GenFlow
from omnistep.models.chatterbox.t3 import ChatterboxT3, T3Config
from omnistep.models.chatterbox.voice_encoder import VoiceEncoder

REQUIRED_FILES = ("ve.safetensors", "t3_cfg.safetensors", "s3gen.safetensors", "tokenizer.json")
"""Files every published folder has (upstream ``from_pretrained``'s list, less ``conds.pt``)."""

DEFAULT_VOICE_FILE = "conds.pt"


class ChatterboxCheckpointError(ModelFilesError):
    """The folder lacks a published file (the message names it) or one is malformed."""


@dataclass(frozen=True)
class DefaultVoice:
    """The T3 part of ``conds.pt``.

    Attributes:
        speaker: ``[speaker_dim]`` float32 voice-encoder embedding (``t3.speaker_emb``).
        prompt_tokens: the voice's prompt speech tokens (``t3.cond_prompt_speech_tokens``).
        exaggeration: its stored emotion scalar (``t3.emotion_adv``).
    """

    speaker: torch.Tensor
    prompt_tokens: tuple[int, ...]
    exaggeration: float


def check_folder(root: str | Path) -> Path:
    """The folder as a Path, with every ``REQUIRED_FILES`` present.

    Raises:
        ChatterboxCheckpointError: the folder or a file is missing (the first one named).
    """
    root = Path(root)
    if not root.is_dir():
        raise ChatterboxCheckpointError(f"Chatterbox checkpoint folder {root} does not exist")
    for name in REQUIRED_FILES:
        if not (root / name).is_file():
            raise ChatterboxCheckpointError(f"Chatterbox checkpoint {root} has no {name}")
    return root


def load_t3(
    root: str | Path,
    kv: KVCacheConfig,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    batch_invariant: bool = False,
) -> ChatterboxT3:
    """The T3 component with ``t3_cfg.safetensors``' weights (sizes read from its tensors).

    Raises:
        ChatterboxCheckpointError: a missing file, or a tensor the layout needs (named).
    """
    root = check_folder(root)
    state = load_file(root / "t3_cfg.safetensors")
    try:
        config = T3Config.from_state_dict(state)
        t3 = ChatterboxT3(config, kv, device, dtype, batch_invariant)
        t3.load_weights(state)
    except KeyError as exc:
        raise ChatterboxCheckpointError(f"{root}: {exc.args[0]}") from exc
    return t3


def _load_module(module: torch.nn.Module, state: dict[str, torch.Tensor], prefix: str, path: Path):
    """Load ``module`` from the tensors under ``prefix`` (names as published), strictly.

    Raises:
        ChatterboxCheckpointError: a tensor is missing or unexpected (named) or misshapen.
    """
    own = {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}
    try:
        module.load_state_dict(own, strict=True)
    except RuntimeError as exc:
        raise ChatterboxCheckpointError(
            f"{path} does not fit {type(module).__name__}: {exc}"
        ) from exc


def load_s3gen(
    root: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32
) -> S3GenFlow:
    """S3Gen's token-to-mel flow with the ``flow.`` tensors of ``s3gen.safetensors`` (sizes
    read from them).

    Raises:
        ChatterboxCheckpointError: a missing file, or a tensor the layout needs (named).
    """
    path = check_folder(root) / "s3gen.safetensors"
    state = load_file(path)
    try:
        flow = S3GenFlow(FlowConfig.from_state_dict(state, "flow."))
    except (KeyError, ValueError) as exc:
        raise ChatterboxCheckpointError(f"{path}: {exc}") from exc
    _load_module(flow, state, "flow.", path)
    return flow.to(device=device, dtype=dtype).eval()


def load_hift(
    root: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32
) -> HiFT:
    """The HiFT vocoder with the ``mel2wav.`` tensors of ``s3gen.safetensors`` (sizes read from
    them; weight norm folded).

    Raises:
        ChatterboxCheckpointError: a missing file, or a tensor the layout needs (named).
        WeightNormError: a weight-norm ``original1`` with an output channel of norm 0 (named).
    """
    path = check_folder(root) / "s3gen.safetensors"
    state = load_file(path)
    try:
        hift = HiFT(HiFTConfig.from_state_dict(state, "mel2wav."))
    except KeyError as exc:
        raise ChatterboxCheckpointError(f"{path}: {exc}") from exc
    _load_module(hift, state, "mel2wav.", path)
    hift.fold_weight_norm()
    return hift.to(device=device, dtype=dtype).eval()


def load_voice_encoder(root: str | Path, device: str | torch.device = "cpu") -> VoiceEncoder:
    """The voice encoder with ``ve.safetensors``' tensors (GE2E's ``similarity_*`` scalars,
    used only in training, are not needed).

    Raises:
        ChatterboxCheckpointError: a missing file, or a tensor the layout needs (named).
    """
    path = check_folder(root) / "ve.safetensors"
    state = {k: v for k, v in load_file(path).items() if not k.startswith("similarity_")}
    try:
        hidden = state["proj.weight"].shape[1]
        encoder = VoiceEncoder(hidden, state["proj.weight"].shape[0])
    except KeyError as exc:
        raise ChatterboxCheckpointError(f"{path}: no tensor {exc}") from exc
    _load_module(encoder, state, "", path)
    return encoder.to(device).eval()


TOKENIZER_PREFIX, SPEAKER_ENCODER_PREFIX = "tokenizer.", "speaker_encoder."
"""``s3gen.safetensors``' prefixes of the S3 tokenizer and CAMPPlus."""


def has_clone_encoders(root: str | Path) -> bool:
    """Whether ``s3gen.safetensors`` holds the S3 tokenizer and CAMPPlus (the published file
    does; read from its header, no tensor loaded)."""
    from safetensors import safe_open

    with safe_open(Path(root) / "s3gen.safetensors", "pt") as f:
        names = list(f.keys())  # noqa: SIM118 (safe_open is not iterable)
    return all(
        any(n.startswith(p) for n in names) for p in (TOKENIZER_PREFIX, SPEAKER_ENCODER_PREFIX)
    )


def load_clone_encoders(
    root: str | Path, device: str | torch.device = "cpu"
) -> tuple[S3Tokenizer, CAMPPlus, VoiceEncoder]:
    """The S3 tokenizer (``tokenizer.*``) and CAMPPlus (``speaker_encoder.*``) of
    ``s3gen.safetensors`` and the voice encoder of ``ve.safetensors`` (sizes read from the
    tensors; the published file has no mel-filter or window buffers: they are computed).

    Raises:
        ChatterboxCheckpointError: a missing file, or a tensor the layout needs (named).
    """
    path = check_folder(root) / "s3gen.safetensors"
    state = load_file(path)
    try:
        tokenizer = S3Tokenizer(S3TokenizerConfig.from_state_dict(state, TOKENIZER_PREFIX))
        campplus = CAMPPlus(CAMPPlusConfig.from_state_dict(state, SPEAKER_ENCODER_PREFIX))
    except KeyError as exc:
        raise ChatterboxCheckpointError(f"{path}: {exc.args[0]}") from exc
    _load_module(tokenizer, state, TOKENIZER_PREFIX, path)
    _load_module(campplus, state, SPEAKER_ENCODER_PREFIX, path)
    encoder = load_voice_encoder(root, device)
    return tokenizer.to(device).eval(), campplus.to(device).eval(), encoder


def load_default_voice(root: str | Path) -> DefaultVoice | None:
    """The default voice of ``conds.pt``, or None when the folder has none.

    Raises:
        ChatterboxCheckpointError: ``conds.pt`` lacks its ``t3`` fields.
    """
    path = Path(root) / DEFAULT_VOICE_FILE
    if not path.is_file():
        return None
    conds = torch.load(path, map_location="cpu", weights_only=True)
    try:
        t3 = conds["t3"]
        speaker = t3["speaker_emb"].float().reshape(-1)
        tokens = t3["cond_prompt_speech_tokens"]
        emotion = t3.get("emotion_adv")
    except (KeyError, TypeError) as exc:
        raise ChatterboxCheckpointError(f"{path} has no T3 conditionals ({exc})") from exc
    prompt = () if tokens is None else tuple(int(t) for t in tokens.reshape(-1).tolist())
    exaggeration = 0.5 if emotion is None else float(torch.as_tensor(emotion).reshape(-1)[0])
    return DefaultVoice(speaker, prompt, exaggeration)


def load_voice(root: str | Path) -> Voice | None:
    """Both halves of ``conds.pt`` (T3's and S3Gen's: ``prompt_token``, ``prompt_feat``,
    ``embedding``), or None when the folder has no ``conds.pt``.

    Raises:
        ChatterboxCheckpointError: a half or one of its fields is missing (named).
    """
    t3 = load_default_voice(root)
    if t3 is None:
        return None
    path = Path(root) / DEFAULT_VOICE_FILE
    conds = torch.load(path, map_location="cpu", weights_only=True)
    gen = conds.get("gen") if isinstance(conds, dict) else None
    try:
        tokens = gen["prompt_token"].reshape(-1).long()
        mel = gen["prompt_feat"].float().reshape(-1, gen["prompt_feat"].shape[-1])
        embedding = gen["embedding"].float().reshape(-1)
    except (KeyError, TypeError) as exc:
        raise ChatterboxCheckpointError(f"{path} has no S3Gen prompt field {exc}") from exc
    return Voice(t3.speaker, t3.prompt_tokens, t3.exaggeration, tokens, mel, embedding)
