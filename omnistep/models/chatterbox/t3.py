"""Chatterbox's T3 as a component: a Llama (Llama 3.1 rope) over speech tokens on the shared
paged-KV AR component, with classifier-free guidance.

Input rows of a request (upstream ``chatterbox/models/t3/t3.py``, ``prepare_input_embeds`` and
``inference``; ``modules/cond_enc.py``), each ``[dim]``:

    spkr_enc(speaker)                                   1 row, the voice-encoder embedding
    perceiver(speech_emb(p) + speech_pos_emb(0..P-1))    32 rows, the voice's prompt tokens
    emotion_adv_fc(exaggeration)                        1 row
    text_emb(t) + text_pos_emb(0..L-1)                  L rows, [START] text [STOP]
    speech_emb(BOS) + speech_pos_emb(0)                 2 rows (upstream feeds the start of
                                                        speech twice: once in its prompt
                                                        embeddings, once as the first input)

then each generated token ``i`` (0-based) is fed as ``speech_emb(id) + speech_pos_emb(i + 1)``.
The unconditional row of CFG has the same rows with ``text_emb`` zeroed (the text positions
kept), as upstream's ``text_emb[1].zero_()``; the sampler sees ``cond + w * (cond - uncond)``
(``PagedARModel``'s guidance). Logits: ``speech_head`` over 8194 ids; 6561 = start of speech,
6562 = end (EOS); ids >= 6561 are not speech.

Imports torch, ``omnistep.kv``, ``omnistep.layers``, ``omnistep.loops`` payload types and
``omnistep.runners.paged_ar``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from omnistep.kv import KVCacheConfig
from omnistep.layers.llama import LlamaConfigLite
from omnistep.layers.rope import Llama3RopeScaling
from omnistep.loops.ar_decode import ARPrefillInput, ARStepInput
from omnistep.models.chatterbox.perceiver import PerceiverResampler
from omnistep.runners.paged_ar import PagedARModel


@dataclass(frozen=True)
class T3Config:
    """T3's sizes and token ids. Published values (upstream ``T3Config`` and
    ``llama_configs.LLAMA_520M_CONFIG_DICT``); ``from_state_dict`` reads the sizes a checkpoint's
    tensors carry (the folder has no config file).

    Attributes:
        hidden_size, intermediate_size, num_hidden_layers: the Llama's sizes.
        head_dim: 64; heads = hidden_size / head_dim (16 published, no grouped KV).
        rms_norm_eps, rope_theta, rope_scaling: 1e-5, 500000, Llama 3.1 (8, 1, 4, 8192).
        max_position_embeddings: rope table length here (upstream's 131072 is never reached:
            a prompt plus speech is at most ~6200 rows).
        text_vocab, speech_vocab: 704 (English) and 8194 ids.
        start_text, stop_text, start_speech, stop_speech: 255, 0, 6561, 6562.
        speaker_dim: the voice-encoder embedding width (256).
    """

    hidden_size: int = 1024
    intermediate_size: int = 4096
    num_hidden_layers: int = 30
    head_dim: int = 64
    rms_norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    rope_scaling: Llama3RopeScaling = Llama3RopeScaling(8.0, 1.0, 4.0, 8192)
    max_position_embeddings: int = 8192
    text_vocab: int = 704
    speech_vocab: int = 8194
    start_text: int = 255
    stop_text: int = 0
    start_speech: int = 6561
    stop_speech: int = 6562
    speaker_dim: int = 256

    @classmethod
    def from_state_dict(cls, state: Mapping[str, torch.Tensor]) -> T3Config:
        """Sizes from ``t3_cfg.safetensors``' tensors.

        Raises:
            KeyError: a tensor the published layout has is missing (named).
        """
        for name in ("speech_emb.weight", "text_emb.weight", "cond_enc.spkr_enc.weight"):
            if name not in state:
                raise KeyError(f"t3_cfg.safetensors has no {name!r}")
        layers = {int(k.split(".")[2]) for k in state if k.startswith("tfmr.layers.")}
        return cls(
            hidden_size=state["speech_emb.weight"].shape[1],
            intermediate_size=state["tfmr.layers.0.mlp.gate_proj.weight"].shape[0],
            num_hidden_layers=len(layers),
            text_vocab=state["text_emb.weight"].shape[0],
            speech_vocab=state["speech_emb.weight"].shape[0],
            speaker_dim=state["cond_enc.spkr_enc.weight"].shape[1],
        )

    def llama(self) -> LlamaConfigLite:
        return LlamaConfigLite(
            hidden_size=self.hidden_size,
            num_attention_heads=self.hidden_size // self.head_dim,
            num_hidden_layers=self.num_hidden_layers,
            intermediate_size=self.intermediate_size,
            head_dim=self.head_dim,
            rms_norm_eps=self.rms_norm_eps,
            rope_theta=self.rope_theta,
            max_position_embeddings=self.max_position_embeddings,
            rope_scaling=self.rope_scaling,
        )


@dataclass(frozen=True)
class T3Prompt:
    """One request's T3 prompt.

    Attributes:
        text_ids: text token ids without the start/stop tokens (``EnTokenizer``'s ids).
        speaker: the voice's speaker embedding ``[speaker_dim]`` float32 (``conds.pt``
            ``t3.speaker_emb``, or the voice encoder of a reference clip).
        prompt_tokens: the voice's prompt speech tokens (``t3.cond_prompt_speech_tokens``).
        exaggeration: the emotion-exaggeration scalar (upstream default 0.5).
        cfg_weight: classifier-free guidance weight ``w`` (upstream default 0.5); 0 or None
            samples the conditional row alone.
    """

    text_ids: tuple[int, ...]
    speaker: torch.Tensor
    prompt_tokens: tuple[int, ...]
    exaggeration: float = 0.5
    cfg_weight: float | None = 0.5


class ChatterboxT3(PagedARModel):
    """The T3 component (see the module docstring).

    Args:
        config: sizes and ids.
        kv: KV pool size (blocks of ``block_size`` tokens; a guided request holds two
            sequences).
        device, dtype, batch_invariant: as ``PagedARModel``.
    """

    def __init__(
        self,
        config: T3Config,
        kv: KVCacheConfig,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        batch_invariant: bool = False,
    ):
        super().__init__(config.llama(), kv, device, dtype, batch_invariant, 1)
        self.config = config
        d = config.hidden_size
        f = {"device": self.device, "dtype": dtype}
        self.text_emb = nn.Embedding(config.text_vocab, d, **f)
        self.speech_emb = nn.Embedding(config.speech_vocab, d, **f)
        # learned positions: text 2048 + 2, speech 4096 + 4 (upstream T3.__init__)
        self.text_pos_emb = nn.Embedding(2048 + 2, d, **f)
        self.speech_pos_emb = nn.Embedding(4096 + 4, d, **f)
        self.speech_head = nn.Linear(d, config.speech_vocab, bias=False, **f)
        self.spkr_enc = nn.Linear(config.speaker_dim, d, **f)
        self.emotion_adv_fc = nn.Linear(1, d, bias=False, **f)
        self.perceiver = PerceiverResampler(d, **f)
        for module in self._modules():
            module.requires_grad_(False)  # serving weights (no weight updates in this slice)

    def _modules(self) -> list[nn.Module]:
        return [
            self.text_emb,
            self.speech_emb,
            self.text_pos_emb,
            self.speech_pos_emb,
            self.speech_head,
            self.spkr_enc,
            self.emotion_adv_fc,
            self.perceiver,
        ]

    # ---------------------------------------------------------------- weights
    def load_weights(self, state: Mapping[str, torch.Tensor]) -> None:
        """Load ``t3_cfg.safetensors`` (upstream ``T3.state_dict()`` names; ``text_head`` and
        the backbone's unused ``embed_tokens`` are not needed to speak).

        Raises:
            KeyError: a missing tensor. RuntimeError: a mis-shaped one (from torch).
        """
        self.llama.load_hf_state_dict(state, prefix="tfmr.")
        modules = {
            "text_emb.": self.text_emb,
            "speech_emb.": self.speech_emb,
            "text_pos_emb.emb.": self.text_pos_emb,
            "speech_pos_emb.emb.": self.speech_pos_emb,
            "speech_head.": self.speech_head,
            "cond_enc.spkr_enc.": self.spkr_enc,
            "cond_enc.emotion_adv_fc.": self.emotion_adv_fc,
            "cond_enc.perceiver.": self.perceiver,
        }
        for prefix, module in modules.items():
            names = [prefix + k for k in module.state_dict()]
            missing = [n for n in names if n not in state]
            if missing:
                raise KeyError(f"t3_cfg.safetensors has no {missing[0]!r}")
            module.load_state_dict({n[len(prefix) :]: state[n] for n in names})

    # ---------------------------------------------------------------- prompt rows
    def condition_rows(self, prompt: T3Prompt) -> torch.Tensor:
        """The voice's conditioning rows ``[1 + 32 + 1, dim]``: speaker, resampled prompt,
        emotion."""
        c = self.config
        f = {"device": self.device, "dtype": self.dtype}
        speaker = self.spkr_enc(prompt.speaker.to(**f).view(1, c.speaker_dim))  # [1, dim]
        tokens = torch.tensor(prompt.prompt_tokens, device=self.device, dtype=torch.long)
        if tokens.numel():
            positions = torch.arange(tokens.numel(), device=self.device)
            speech = self.speech_emb(tokens) + self.speech_pos_emb(positions)
            resampled = self.perceiver(speech[None])[0]  # [32, dim]
        else:
            resampled = speaker[:0]
        emotion = self.emotion_adv_fc(torch.tensor([[prompt.exaggeration]], **f))  # [1, dim]
        return torch.cat([speaker, resampled, emotion])

    def _input_rows(self, unit: ARPrefillInput, conditional: bool) -> torch.Tensor:
        c = self.config
        prompt: T3Prompt = unit.prompt
        for t in prompt.text_ids:
            if not 0 <= t < c.text_vocab:
                raise ValueError(f"text id {t} outside [0, {c.text_vocab})")
        text = torch.tensor(
            [c.start_text, *prompt.text_ids, c.stop_text], device=self.device, dtype=torch.long
        )
        text_rows = self.text_emb(text)
        if not conditional:
            text_rows = torch.zeros_like(text_rows)
        text_rows = text_rows + self.text_pos_emb(torch.arange(text.numel(), device=self.device))
        speech = [c.start_speech, c.start_speech] + [f[0] for f in unit.generated]
        ids = torch.tensor(speech, device=self.device, dtype=torch.long)
        positions = torch.tensor([0, 0, *range(1, len(unit.generated) + 1)], device=self.device)
        speech_rows = self.speech_emb(ids) + self.speech_pos_emb(positions)
        return torch.cat([self.condition_rows(prompt), text_rows, speech_rows])

    # ---------------------------------------------------------------- PagedARModel hooks
    def _prefill_inputs(self, unit: ARPrefillInput) -> torch.Tensor:
        return self._input_rows(unit, conditional=True)

    def _unconditional_inputs(self, unit: ARPrefillInput) -> torch.Tensor:
        return self._input_rows(unit, conditional=False)

    def _guidance(self, prompt: T3Prompt) -> float | None:
        return prompt.cfg_weight or None

    def _step_inputs(self, units: Sequence[ARStepInput]) -> torch.Tensor:
        ids = torch.tensor([u.last[0] for u in units], device=self.device)
        # the token generated i-th (0-based; num_generated = i + 1) sits at speech position i + 1
        positions = torch.tensor([u.num_generated for u in units], device=self.device)
        return self.speech_emb(ids) + self.speech_pos_emb(positions)  # [B, dim]

    def _head(self, hidden: torch.Tensor, seq_id: str) -> torch.Tensor:
        """Speech logits ``[B, 1, speech_vocab]``."""
        return self._linear_rows(hidden.to(self.dtype), self.speech_head.weight)[:, None]
