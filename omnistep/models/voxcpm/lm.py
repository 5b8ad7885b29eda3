"""VoxCPM2's text-semantic LM, residual acoustic LM and the heads between them.

Upstream ``voxcpm/model/voxcpm2.py: VoxCPM2Model`` (``_inference``): a prompt row is a text
token's embedding (times ``scale_emb`` under muP) or a latent patch's LocEnc embedding
(``enc_to_lm_proj``), chosen by the text/audio masks. The base LM (MiniCPM-4) runs over the
rows; its output on audio rows (prompt audio and every generated patch) goes through the
scalar quantizer (``fsq_layer``: ``out_proj(round(tanh(in_proj(h)) * s) / s)``). The residual LM
runs over ``fusion_concat_proj([lm_out, audio_mask * patch_embedding])``. Each AR step reads
the last row of both: ``mu = [lm_to_dit_proj(lm), res_to_dit_proj(res)]`` conditions the LocDiT
solve of the next patch, and ``stop_head(silu(stop_proj(lm)))`` gives the stop logits
(``[continue, stop]``). The new patch's embedding is the next row of both LMs.

``teacher_forced`` computes a whole utterance's steps from its prompt and patches at once
(the parity tests' and a trainer's view); the paged serving path is ``ar.VoxCPMAR``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from omnistep.layers.llama import LlamaModel
from omnistep.models.voxcpm.audio_vae import AudioVAEEncoder
from omnistep.models.voxcpm.config import VoxCPMConfig
from omnistep.models.voxcpm.locdit import LocDiT
from omnistep.models.voxcpm.locenc import LocEnc

AUDIO_START, AUDIO_END, REF_AUDIO_START, REF_AUDIO_END = 101, 102, 103, 104
"""Upstream's control token ids (hard-coded in ``VoxCPM2Model.__init__``)."""


class _RoundStraightThrough(torch.autograd.Function):
    """``round(x)`` forward, identity backward (a straight-through estimator): the value is
    inference's ``torch.round`` to the bit, the gradient upstream training's
    ``h + (round(h) - h).detach()``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
        return torch.round(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
        return grad


class ScalarQuantizer(nn.Module):
    """``out_proj(round(tanh(in_proj(h)) * scale) / scale)`` (upstream
    ``ScalarQuantizationLayer``; names ``in_proj``, ``out_proj``). The rounding passes
    gradients straight through, as upstream's training mode does (so a trainer's loss reaches
    the base LM through audio rows); its value is inference's."""

    def __init__(self, width: int, latent: int, scale: int):
        super().__init__()
        self.in_proj = nn.Linear(width, latent)
        self.out_proj = nn.Linear(latent, width)
        self.scale = scale

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        q = _RoundStraightThrough.apply(torch.tanh(self.in_proj(h)) * self.scale) / self.scale
        return self.out_proj(q)


@dataclass
class Prompt:
    """One request's prompt rows (upstream ``_generate``'s tensors, batch dim dropped).

    Attributes:
        text_ids: LongTensor ``[L]`` (0 on audio rows).
        text_mask, audio_mask: float ``[L]`` (1 where the row is text / a latent patch).
        feats: ``[L, P, C]`` latent patches (zeros on text rows).
    """

    text_ids: torch.Tensor
    text_mask: torch.Tensor
    audio_mask: torch.Tensor
    feats: torch.Tensor


def build_prompt(
    text_ids: list[int], patch_size: int, feat_dim: int, ref_feat: torch.Tensor | None = None
) -> Prompt:
    """The prompt rows of upstream ``_generate``'s zero-shot and reference-only modes:
    ``[ref_audio_start, ref patches..., ref_audio_end]`` when ``ref_feat`` ``[R, P, C]`` is
    given (the clip's patches on audio rows, zeros elsewhere), then the text tokens and
    ``audio_start``. (Upstream's continuation modes, a prompt clip with its transcript, are not
    built yet.)"""
    zeros = torch.zeros(1, patch_size, feat_dim)
    ids = [*text_ids, AUDIO_START]
    n = len(ids)
    parts = [(torch.tensor(ids), torch.ones(n), torch.zeros(n), zeros.expand(n, -1, -1))]
    if ref_feat is not None:
        r = ref_feat.shape[0]
        ref_ids = torch.tensor([REF_AUDIO_START] + [0] * r + [REF_AUDIO_END])
        text = torch.cat([torch.ones(1), torch.zeros(r), torch.ones(1)])
        parts.insert(0, (ref_ids, text, 1 - text, torch.cat([zeros, ref_feat.float(), zeros])))
    cols = list(zip(*parts, strict=True))
    return Prompt(*(torch.cat(col) for col in cols))


def encode_reference(
    encoder: AudioVAEEncoder, audio: torch.Tensor, patch_size: int
) -> torch.Tensor:
    """A reference clip's patches ``[R, P, C]``: ``audio`` ``[samples]`` float at the encoder's
    rate (16 kHz), right-padded with zeros to whole patches, encoded (upstream ``_encode_wav``
    with ``padding_mode="right"``)."""
    span = patch_size * encoder.hop
    audio = F.pad(audio.float(), (0, -audio.shape[-1] % span))
    with torch.no_grad():
        latents = encoder.encode(audio[None])[0]  # [C, R * P]
    return latents.view(latents.shape[0], -1, patch_size).permute(1, 2, 0)


class VoxCPMBackbone(nn.Module):
    """Everything of ``VoxCPM2Model`` but the AudioVAE, under upstream's parameter names:
    ``base_lm.{embed_tokens,layers,norm}``, ``residual_lm.{layers,norm}``, ``feat_encoder``,
    ``feat_decoder.estimator``, ``fsq_layer``, ``enc_to_lm_proj``, ``lm_to_dit_proj``,
    ``res_to_dit_proj``, ``fusion_concat_proj``, ``stop_proj``, ``stop_head``."""

    def __init__(self, config: VoxCPMConfig):
        super().__init__()
        self.config = config
        width = config.hidden_size
        self.embed_tokens = nn.Embedding(int(config.lm["vocab_size"]), width)
        self.base_lm = LlamaModel(config.base_lm())
        self.residual_lm = LlamaModel(config.residual_lm())
        self.feat_encoder = LocEnc(config.local_stack(config.encoder), config.feat_dim)
        self.estimator = LocDiT(config.local_stack(config.dit), config.feat_dim)
        self.fsq_layer = ScalarQuantizer(width, config.fsq_latent_dim, config.fsq_scale)
        self.enc_to_lm_proj = nn.Linear(config.encoder.hidden_dim, width)
        self.lm_to_dit_proj = nn.Linear(width, config.dit.hidden_dim)
        self.res_to_dit_proj = nn.Linear(width, config.dit.hidden_dim)
        self.fusion_concat_proj = nn.Linear(2 * width, width)
        self.stop_proj = nn.Linear(width, width)
        self.stop_head = nn.Linear(width, 2, bias=False)

    def embed_patches(self, patches: torch.Tensor) -> torch.Tensor:
        """``[T, P, C]`` patches -> ``[T, width]`` LM input rows (LocEnc, ``enc_to_lm_proj``)."""
        return self.enc_to_lm_proj(self.feat_encoder(patches.unsqueeze(0))[0])

    def prompt_rows(self, prompt: Prompt) -> tuple[torch.Tensor, torch.Tensor]:
        """``(combined [L, width], patch_embeds [L, width])``: the base LM's input rows and
        each row's patch embedding (used again, masked, by the residual LM).

        The LocEnc runs over the audio rows only; a text row's patch embedding is 0. Upstream
        encodes every row's (zero) patch and multiplies the text rows' by the audio mask 0, so
        the rows are the same; skipping them saves a LocEnc forward of ``P + 1`` rows per
        text token (measured at the published LocEnc width, 1 layer, on the shared 2-core
        box: 0.8-1.3 s of a 62-row prompt's admission, now 0)."""
        text = self.embed_tokens(prompt.text_ids) * self.config.scale_emb
        audio = prompt.audio_mask.nonzero()[:, 0]
        patch = text.new_zeros(text.shape)
        if audio.numel():
            patch[audio] = self.embed_patches(prompt.feats[audio]).to(patch.dtype)
        combined = prompt.text_mask[:, None] * text + prompt.audio_mask[:, None] * patch
        return combined, patch

    def dit_condition(self, lm_hidden: torch.Tensor, res_hidden: torch.Tensor) -> torch.Tensor:
        """``mu`` ``[N, 2 * dit_width]`` of the LMs' rows ``[N, width]``."""
        return torch.cat([self.lm_to_dit_proj(lm_hidden), self.res_to_dit_proj(res_hidden)], -1)

    def stop_logits(self, lm_hidden: torch.Tensor) -> torch.Tensor:
        """``[N, 2]`` logits (index 1: stop) of the base LM's rows (after the quantizer on
        audio rows)."""
        return self.stop_head(F.silu(self.stop_proj(lm_hidden)))

    def teacher_forced(self, prompt: Prompt, patches: torch.Tensor) -> dict[str, torch.Tensor]:
        """Every step of an utterance whose generated patches are ``patches`` ``[T, P, C]``:
        the prompt prefilled, then one decode row per patch but the last, with the attention
        calls serving makes (``LlamaModel.forward_dense`` with ``prefill_len``).

        Returns ``lm`` ``[T, width]`` (each step's base-LM row after the quantizer where
        upstream applies it), ``residual`` ``[T, width]``, ``mu`` ``[T, 2 * dit_width]``,
        ``stop_logits`` ``[T, 2]``, ``prefill_lm`` / ``prefill_residual`` ``[L, width]``
        (the stacks' outputs over the prompt, before the quantizer).
        """
        length, steps = prompt.text_ids.shape[0], patches.shape[0]
        combined, patch_embeds = self.prompt_rows(prompt)
        new_embeds = self.embed_patches(patches[:-1]) if steps > 1 else combined[:0]
        base_in = torch.cat([combined, new_embeds])
        base_out = self.base_lm.forward_dense(base_in, prefill_len=length)
        audio = torch.cat([prompt.audio_mask, torch.ones(steps - 1, dtype=base_out.dtype)])
        text = torch.cat([prompt.text_mask, torch.zeros(steps - 1, dtype=base_out.dtype)])
        lm_rows = self.fsq_layer(base_out) * audio[:, None] + base_out * text[:, None]
        embeds = torch.cat([patch_embeds * prompt.audio_mask[:, None], new_embeds])
        res_in = self.fusion_concat_proj(torch.cat([lm_rows, embeds], dim=-1))
        res_out = self.residual_lm.forward_dense(res_in, prefill_len=length)
        lm, res = lm_rows[length - 1 :], res_out[length - 1 :]
        return {
            "lm": lm,
            "residual": res,
            "mu": self.dit_condition(lm, res),
            "stop_logits": self.stop_logits(lm),
            "prefill_lm": base_out[:length],
            "prefill_residual": res_out[:length],
        }
