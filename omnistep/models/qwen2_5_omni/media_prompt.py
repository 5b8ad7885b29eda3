"""The thinker prompt of a Qwen2.5-Omni chat holding audio, images and video: placeholders
expanded to one token per encoder row, the rows, and TMRoPE positions.

``thinker_prompt`` (shared with Qwen3-Omni: ``runners.media_prompt``) is what the card's
``media_prompt`` node runs on the ENCODE units' outputs; ``build_media_prompt``
+ ``prefill_logits`` are an offline dense path over the same pieces, checked against transformers'
``Qwen2_5OmniThinkerForConditionalGeneration`` (tests/test_omni_encoders.py).

As the processor does, each media item's single placeholder in the chat-templated ids
(``<|audio_bos|><|AUDIO|><|audio_eos|>``, ``<|vision_bos|><|IMAGE|><|vision_eos|>``) becomes one
placeholder token per encoder row; as the thinker does, the input embedding of a placeholder
token is replaced by its row (``masked_scatter``). M-RoPE (``Qwen2_5OmniRotaryEmbedding``): the
``head_dim / 2`` rotary frequencies are cut by ``mrope_section`` into (temporal, height, width)
sections, each taking its angle from that row of the positions; the layout repeats over the two
halves of the head (rotate-half).

Imports numpy, torch, ``omnistep.core``, ``omnistep.layers`` and this family's thinker, encoder
and mrope modules.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from omnistep.core import MediaItem, MediaKind
from omnistep.models.qwen2_5_omni.encoders import OmniEncoders
from omnistep.models.qwen2_5_omni.thinker import QwenThinker
from omnistep.runners.media_prompt import thinker_prompt
from omnistep.runners.mrope import MediaTokenIds, rope_index

__all__ = ["MediaPrompt", "build_media_prompt", "mrope_cos_sin", "prefill_logits", "thinker_prompt"]


@dataclass(frozen=True)
class MediaPrompt:
    """A thinker prefill with media.

    Attributes:
        input_ids: the prompt with every placeholder expanded to one token per encoder row.
        embeds: ``[len(input_ids), hidden]`` input rows (token embeddings; encoder rows at
            placeholders), the thinker's dtype and device.
        positions: int64 ``[3, len(input_ids)]`` TMRoPE positions (``mrope.rope_index``).
        rope_delta: decode positions continue at ``len(input_ids) + rope_delta``.
    """

    input_ids: tuple[int, ...]
    embeds: torch.Tensor
    positions: np.ndarray
    rope_delta: int


def _encode(encoders: OmniEncoders, media: Sequence[MediaItem]) -> list[torch.Tensor]:
    """Rows per item in order; all audio in one batch, all images in one, all videos in one."""
    batches = {
        MediaKind.AUDIO: encoders.encode_audio,
        MediaKind.IMAGE: encoders.encode_images,
        MediaKind.VIDEO: encoders.encode_videos,
    }
    rows = {kind: iter(run([m for m in media if m.kind is kind])) for kind, run in batches.items()}
    return [next(rows[m.kind]) for m in media]


def build_media_prompt(
    thinker: QwenThinker,
    encoders: OmniEncoders,
    ids: MediaTokenIds,
    template_ids: Sequence[int],
    media: Sequence[MediaItem],
) -> MediaPrompt:
    """Expand placeholders, embed, place the encoder rows, compute positions.

    Args:
        template_ids: the chat-templated prompt, one placeholder token per media item.
        media: the items in prompt order (audio at the encoders' rate, images, videos
            without an audio track: this dense path has no ``use_audio_in_video``; the card's
            ``thinker_prompt`` has).

    Raises:
        ValueError: placeholders and items that do not pair up (count or kind), a video
            carrying an audio track.
    """
    if any(m.audio is not None for m in media):
        raise ValueError("build_media_prompt has no use_audio_in_video: use thinker_prompt")
    kinds = {ids.audio: MediaKind.AUDIO, ids.image: MediaKind.IMAGE, ids.video: MediaKind.VIDEO}
    slots = [kinds[t] for t in template_ids if t in kinds]
    if slots != [m.kind for m in media]:
        raise ValueError(f"placeholders {slots} do not match the media {[m.kind for m in media]}")
    rows = _encode(encoders, media)
    expanded: list[int] = []
    pieces = iter(rows)
    for token in template_ids:
        expanded.extend([token] * (next(pieces).shape[0] if token in kinds else 1))
    id_tensor = torch.tensor(expanded, device=thinker.device)
    embeds = thinker.embed_weight[id_tensor].clone()
    is_media = torch.isin(id_tensor, torch.tensor(list(kinds), device=thinker.device))
    if rows:
        embeds[is_media] = torch.cat(rows).to(embeds.dtype)
    images = [m for m in media if m.kind is MediaKind.IMAGE]
    videos = encoders.video_grids([m for m in media if m.kind is MediaKind.VIDEO])
    positions, delta = rope_index(
        expanded,
        ids,
        audio_lengths=[
            r.shape[0] for r, m in zip(rows, media, strict=True) if m.kind is MediaKind.AUDIO
        ],
        image_grids=encoders.image_grids(images),
        video_grids=[g for g, _ in videos],
        video_seconds_per_grid=[s for _, s in videos],
        spatial_merge_size=encoders.vision.config.spatial_merge_size,
    )
    return MediaPrompt(tuple(expanded), embeds, positions, delta)


def mrope_cos_sin(
    thinker: QwenThinker, positions: np.ndarray, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """M-RoPE ``(cos, sin)`` ``[N, head_dim]`` of positions ``[3, N]``, from the stack's rope
    table (so text-only positions give exactly the 1-D rope's values)."""
    rotary = thinker.llama.rotary_emb
    half = thinker.config.head_dim // 2
    section_rows = np.repeat(np.arange(3), thinker.config.mrope_section)  # [head_dim / 2]
    column_rows = torch.tensor(np.concatenate([section_rows, section_rows]))  # [head_dim]
    pos = torch.as_tensor(positions, device=rotary.cos_cached.device)
    tables = [rotary(pos[r], torch.float32) for r in range(3)]  # 3 x (cos, sin) [N, head_dim]
    cos = torch.stack([c for c, _ in tables])  # [3, N, head_dim]
    sin = torch.stack([s for _, s in tables])
    cols = torch.arange(2 * half)
    cos = cos[column_rows, :, cols].T  # [N, head_dim]: column j from row column_rows[j]
    sin = sin[column_rows, :, cols].T
    return cos.to(dtype), sin.to(dtype)


@torch.inference_mode()
def prefill_logits(thinker: QwenThinker, prompt: MediaPrompt) -> torch.Tensor:
    """Thinker logits ``[N, vocab]`` float32 of every prompt position: one dense causal forward
    of the prompt's rows with M-RoPE (the thinker's stack, norms and ``lm_head``)."""
    llama = thinker.llama
    x = prompt.embeds.to(thinker.dtype)
    cos, sin = mrope_cos_sin(thinker, prompt.positions, x.dtype)
    cos, sin = cos.to(x.device), sin.to(x.device)
    for layer in llama.layers:
        x = layer.forward_dense(x, cos, sin)
    hidden = llama.norm(x)
    return (hidden @ thinker.lm_head.T).float()
