"""The thinker prompt of a Qwen2.5-Omni chat holding audio, images and video: placeholders
expanded to one token per encoder row, the rows, and TMRoPE positions.

``thinker_prompt`` is what the card's ``media_prompt`` node runs on the ENCODE units' outputs
(a ``ThinkerPrompt`` the paged thinker prefills; a video carrying its audio track,
``use_audio_in_video``, becomes the interleaved block of ``mrope``); ``build_media_prompt``
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
from omnistep.models.qwen2_5_omni.encoders import EncodedMedia, OmniEncoders
from omnistep.models.qwen2_5_omni.mrope import MediaTokenIds, audio_in_video_layout, rope_index
from omnistep.models.qwen2_5_omni.thinker import QwenThinker, ThinkerPrompt


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


@dataclass(frozen=True)
class _PromptItem:
    """One media item of the prompt with its encoder output (and its track's, if any)."""

    item: MediaItem
    encoded: EncodedMedia
    track: EncodedMedia | None = None


def _pair(media: Sequence[MediaItem], encoded: Sequence[EncodedMedia]) -> list[_PromptItem]:
    """Prompt items from the encode list (``frontend.encode_list``) and its outputs."""
    if len(encoded) != len(media):
        raise ValueError(f"{len(encoded)} encoder outputs for {len(media)} items")
    out: list[_PromptItem] = []
    i = 0
    while i < len(media):
        item = media[i]
        if item.audio is not None:
            if i + 1 >= len(media) or media[i + 1].sha256 != item.audio.sha256:
                raise ValueError(f"the video {item.source} is not followed by its audio track")
            out.append(_PromptItem(item, encoded[i], encoded[i + 1]))
            i += 2
        else:
            out.append(_PromptItem(item, encoded[i]))
            i += 1
    return out


def _expand(
    token: int, piece: _PromptItem, ids: MediaTokenIds, merge: int
) -> tuple[list[int], torch.Tensor]:
    """The tokens a placeholder becomes and the rows they take, in order."""
    rows = piece.encoded.rows
    if piece.track is None:
        return [token] * rows.shape[0], rows
    if ids.audio_start is None or ids.audio_end is None:
        raise ValueError("the config has no audio_start/end_token_id for use_audio_in_video")
    grid, seconds = piece.encoded.grid, piece.encoded.seconds_per_grid
    audio = piece.track.rows
    layout = audio_in_video_layout(grid, seconds, audio.shape[0], ids, merge)
    tokens = [ids.audio_start]
    for kind, a, b in layout:
        tokens += [ids.video if kind == "video" else ids.audio] * (b - a)
    tokens.append(ids.audio_end)
    chunks = [(rows if kind == "video" else audio)[a:b] for kind, a, b in layout]
    return tokens, torch.cat(chunks)


def thinker_prompt(
    template_ids: Sequence[int],
    ids: MediaTokenIds,
    media: Sequence[MediaItem],
    encoded: Sequence[EncodedMedia],
    spatial_merge_size: int,
) -> ThinkerPrompt:
    """The ``ThinkerPrompt`` of a chat-templated prompt and its encoded media.

    Args:
        template_ids: the chat template's ids, one placeholder token per media item.
        media: the encode list (``frontend.encode_list``: the items in prompt order, a video's audio
            track right after it); ``encoded``: their ENCODE outputs, same order.
        spatial_merge_size: the vision encoder's patch merge (``vision_config``).

    Raises:
        ValueError: placeholders and items that do not pair up (count or kind).
    """
    kinds = {ids.audio: MediaKind.AUDIO, ids.image: MediaKind.IMAGE, ids.video: MediaKind.VIDEO}
    pieces = _pair(media, encoded)
    slots = [kinds[t] for t in template_ids if t in kinds]
    if slots != [p.item.kind for p in pieces]:
        raise ValueError(f"placeholders {slots} do not match the media {[m.kind for m in media]}")
    expanded: list[int] = []
    rows: list[torch.Tensor] = []
    queue = iter(pieces)
    for token in template_ids:
        if token not in kinds:
            expanded.append(token)
            continue
        tokens, item_rows = _expand(token, next(queue), ids, spatial_merge_size)
        expanded += tokens
        rows.append(item_rows)
    of = lambda kind: [p for p in pieces if p.item.kind is kind]  # noqa: E731
    videos = of(MediaKind.VIDEO)
    positions, delta = rope_index(
        expanded,
        ids,
        audio_lengths=[p.encoded.rows.shape[0] for p in of(MediaKind.AUDIO)],
        image_grids=[p.encoded.grid for p in of(MediaKind.IMAGE)],
        video_grids=[p.encoded.grid for p in videos],
        video_seconds_per_grid=[p.encoded.seconds_per_grid for p in videos],
        spatial_merge_size=spatial_merge_size,
        video_audio_lengths=[None if p.track is None else p.track.rows.shape[0] for p in videos],
    )
    return ThinkerPrompt(
        tuple(expanded),
        tuple(rows),
        positions,
        delta,
        tuple(kinds),
        tuple(m.sha256 for m in media),
    )


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
