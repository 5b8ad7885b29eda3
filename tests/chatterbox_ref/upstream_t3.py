"""Tiny Chatterbox checkpoints written by the reference's own classes, and T3 reference outputs.

Runs inside the reference subprocess (``tests.chatterbox_ref.env``). ``write_checkpoint`` builds
upstream's ``T3`` on a tiny Llama (2 layers, MLP 256; the width stays 1024 because upstream's
``Perceiver`` hard-codes it, head_dim 64 and the Llama 3.1 rope as published) with random weights,
and writes the published folder: ``t3_cfg.safetensors`` (the T3 state dict), ``conds.pt`` (the
default voice: ``Conditionals.save``'s layout, ``{"t3": T3Cond fields, "gen": S3Gen prompt}``),
``tokenizer.json`` (a tiny ``tokenizers`` word-level vocabulary with upstream's special tokens),
and ``ve.safetensors`` / ``s3gen.safetensors`` (this slice leaves VoiceEncoder and S3Gen out: one
placeholder tensor each, so the loader's file checks see the published names).
``greedy`` runs upstream ``T3.inference`` (its CFG loop) with sampling replaced by argmax.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

TINY = "omnistep_tiny"
TINY_LAYERS = 2
TINY_MLP = 256


def _tiny_t3():
    from chatterbox.models.t3 import t3 as t3_module
    from chatterbox.models.t3.llama_configs import LLAMA_CONFIGS
    from chatterbox.models.t3.modules.t3_config import T3Config

    config = dict(LLAMA_CONFIGS["Llama_520M"])
    config.update(num_hidden_layers=TINY_LAYERS, intermediate_size=TINY_MLP, torch_dtype="float32")
    LLAMA_CONFIGS[TINY] = config
    hp = T3Config()
    hp.llama_config_name = TINY
    return t3_module.T3(hp), hp


def write_checkpoint(root: str, seed: int = 0, num_prompt_tokens: int = 12) -> dict:
    """Write the tiny published folder under ``root``; returns the T3 hyper-parameters used."""
    from safetensors.torch import save_file

    torch.manual_seed(seed)
    t3, hp = _tiny_t3()
    with torch.no_grad():  # norms and the emotion projection away from their neutral init
        for name, p in t3.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    out = Path(root)
    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.contiguous() for k, v in t3.float().state_dict().items()}
    save_file(state, out / "t3_cfg.safetensors")
    save_file({"placeholder": torch.zeros(1)}, out / "ve.safetensors")
    save_file({"placeholder": torch.zeros(1)}, out / "s3gen.safetensors")
    t3_cond = {
        "speaker_emb": torch.randn(1, hp.speaker_embed_size),
        "clap_emb": None,
        "cond_prompt_speech_tokens": torch.randint(0, 6561, (1, num_prompt_tokens)),
        "cond_prompt_speech_emb": None,
        "emotion_adv": 0.5 * torch.ones(1, 1, 1),
    }
    gen = {"prompt_token": torch.randint(0, 6561, (1, 8)), "embedding": torch.randn(1, 192)}
    torch.save({"t3": t3_cond, "gen": gen}, out / "conds.pt")
    _write_tokenizer(out / "tokenizer.json", hp.text_tokens_dict_size)
    return {"text_vocab": hp.text_tokens_dict_size, "speech_vocab": hp.speech_tokens_dict_size}


def _write_tokenizer(path: Path, vocab_size: int) -> None:
    """A word-level tokenizer over characters: upstream's special tokens first, then letters."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    special = ["[STOP]", "[UNK]", "[SPACE]", "[PAD]", "[SEP]", "[CLS]", "[MASK]"]
    letters = [chr(c) for c in range(ord("a"), ord("z") + 1)] + list(".,!?'")
    vocab = {tok: i for i, tok in enumerate(special + letters)}
    vocab["[START]"] = 255  # upstream's start_text_token
    assert len(vocab) < vocab_size
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.save(str(path))


def _load(root: str):
    from chatterbox.models.t3.modules.cond_enc import T3Cond
    from safetensors.torch import load_file

    t3, _ = _tiny_t3()
    t3.load_state_dict(load_file(Path(root) / "t3_cfg.safetensors"))
    t3.eval()
    conds = torch.load(Path(root) / "conds.pt", map_location="cpu", weights_only=True)
    return t3, T3Cond(**conds["t3"])


def greedy(
    root: str,
    text_ids: list[int],
    cfg_weight: float,
    exaggeration: float,
    max_new_tokens: int,
    speaker_emb: np.ndarray | None = None,
    prompt_tokens: list[int] | None = None,
    repetition_penalty: float = 1.0,
    temperature: float = 1.0,
    min_p: float = 0.0,
    top_p: float = 1.0,
) -> dict:
    """Upstream ``T3.inference`` (CFG on: a conditional and a text-free row) with argmax in
    place of ``torch.multinomial`` (so the path is deterministic) and the given processor
    settings (its own transformers processors). ``text_ids`` exclude the start/stop tokens
    (added as ``tts.py`` does).

    Returns ``{"tokens": [T] ids (the EOS included when drawn), "logits": [T, V] float32 guided
    logits of each step, "probs": [T, V] float32 the distribution each step would sample from,
    "prefix": [L, dim] float32 conditional prompt rows}``.
    """
    from chatterbox.models.t3 import t3 as t3_module
    from chatterbox.models.t3.modules.cond_enc import T3Cond

    t3, cond = _load(root)
    cond = T3Cond(
        speaker_emb=cond.speaker_emb if speaker_emb is None else torch.from_numpy(speaker_emb),
        cond_prompt_speech_tokens=(
            cond.cond_prompt_speech_tokens
            if prompt_tokens is None
            else torch.tensor([prompt_tokens])
        ),
        emotion_adv=exaggeration * torch.ones(1, 1, 1),
    )
    hp = t3.hp
    text = torch.tensor([[hp.start_text_token, *text_ids, hp.stop_text_token]] * 2)
    recorded, probs_seen = [], []
    penalty_class = t3_module.RepetitionPenaltyLogitsProcessor

    class Recorder(penalty_class):  # records the guided logits the penalty receives
        def __call__(self, ids, logits):
            recorded.append(logits[0].float().clone())
            return super().__call__(ids, logits)

    def argmax(probs, num_samples):
        probs_seen.append(probs[0].float().clone())
        return probs.argmax(dim=-1, keepdim=True)

    t3_module.RepetitionPenaltyLogitsProcessor = Recorder
    torch.multinomial = argmax
    with torch.inference_mode():
        tokens = t3.inference(
            t3_cond=cond,
            text_tokens=text,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            cfg_weight=cfg_weight,
            repetition_penalty=repetition_penalty,
            min_p=min_p,
            top_p=top_p,
        )
        embeds, _ = t3.prepare_input_embeds(
            t3_cond=cond, text_tokens=text, speech_tokens=text[:, :1] * 0 + hp.start_speech_token
        )
    return {
        "tokens": tokens[0].tolist(),
        "logits": torch.stack(recorded).numpy(),
        "probs": torch.stack(probs_seen).numpy(),
        "prefix": embeds[0].float().numpy(),
    }
