"""What the Qwen omni families (``qwen2_5_omni``, ``qwen3_omni``) share between a chat's media
parts and their thinker's prefill: the checks on media items, the chat-template content parts,
the list of items the ENCODE units run, and the thinker prompt built from their outputs.

As the processors do, each media item's single placeholder in the chat-templated ids (Qwen2.5:
``<|audio_bos|><|AUDIO|><|audio_eos|>``; Qwen3: ``<|audio_start|><|audio_pad|><|audio_end|>``,
``<|vision_start|><|image_pad|><|vision_end|>``) becomes one placeholder token per encoder row;
as the thinkers do, the input embedding of a placeholder token is replaced by its row
(``masked_scatter``), and the positions are the families' 3-row M-RoPE ones
(``runners.mrope.rope_index``). A video read with ``use_audio_in_video`` (``MediaItem.audio``)
becomes one interleaved block of frame and audio tokens (``mrope.audio_in_video_layout``,
the family's interleaving rule).

Imports numpy, torch, ``omnistep.core``, ``omnistep.loops.encode`` and ``runners.mrope``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from omnistep.core import (
    Capability,
    ChatMessage,
    ComponentSpec,
    InvalidRequestError,
    KernelNode,
    LoopKind,
    LoopNode,
    LoopSpec,
    MediaItem,
    MediaKind,
    ProgramContext,
    WorkUnitKind,
)
from omnistep.loops.encode import EncodeConfig, EncodeLoop
from omnistep.runners.mrope import MediaTokenIds, audio_in_video_layout, rope_index


@dataclass(frozen=True)
class MediaRules:
    """What media the card's encoders take.

    Attributes:
        capabilities: the media input capabilities of the folder (its towers).
        sample_rate: Hz audio items must have (the feature extractor's, 16 kHz).
        max_audio_seconds: the longest clip the feature extractor reads (its ``chunk_length``,
            300 s published: the processor cuts longer clips there).
        min_audio_samples: the shortest clip, in samples at ``sample_rate``, from which the
            audio tower makes at least one row (its stride-2 convs and pooling leave none of
            fewer mel frames; Qwen2.5-Omni: 321 samples; Qwen3-Omni: 201, what its STFT's
            reflect padding needs).
        placeholders: the thinker's media placeholder ids (``MediaTokenIds``); None: not
            checked (``check_prompt``).
        max_prompt_tokens: the thinker's ``max_position_embeddings``: a templated prompt of
            as many tokens is refused (``check_prompt``); None: not checked.
    """

    capabilities: frozenset[Capability] = frozenset()
    sample_rate: int = 16000
    max_audio_seconds: float = 300.0
    min_audio_samples: int = 1
    placeholders: MediaTokenIds | None = None
    max_prompt_tokens: int | None = None

    def check_prompt(self, ids: Sequence[int], media: Sequence[MediaItem]) -> None:
        """Raises InvalidRequestError (param ``messages``) when the templated prompt's
        placeholder tokens are not one per media item, in order: the messages' text spelled a
        placeholder (``<|AUDIO|>``, ``<|image_pad|>``, ...), which the tokenizer reads as the
        special token (it was a 500 from the ENCODE step, or an unfilled placeholder); or
        when the prompt before media expansion has ``max_prompt_tokens`` tokens or more (code
        ``context_length_exceeded``, OpenAI's; it was a 500 from the thinker's prefill)."""
        limit = self.max_prompt_tokens
        if limit is not None and len(ids) >= limit:
            raise InvalidRequestError(
                f"the messages are {len(ids)} tokens, and this model's context is {limit} "
                "tokens (max_position_embeddings): shorten them",
                param="messages",
                code="context_length_exceeded",
            )
        if self.placeholders is None:
            return
        p = self.placeholders
        kinds = {p.audio: MediaKind.AUDIO, p.image: MediaKind.IMAGE, p.video: MediaKind.VIDEO}
        slots = [kinds[t] for t in ids if t in kinds]
        if slots != [m.kind for m in media]:
            raise InvalidRequestError(
                f"the messages hold {len(slots)} media placeholder tokens for {len(media)} "
                "media parts: their text spells the model's placeholder tokens (such as "
                "<|AUDIO|>, <|IMAGE|>, <|audio_pad|>, <|image_pad|>); send media as content "
                "parts and remove those tokens from the text",
                param="messages",
                code="invalid_value",
            )

    def check(self, item: MediaItem) -> None:
        """Raises InvalidRequestError naming the item's request part (``MediaItem.source``):
        a kind without its encoder (``unsupported_modality``), audio at another rate
        (``invalid_audio``), longer than ``max_audio_seconds`` (``audio_too_long``) or shorter
        than ``min_audio_samples`` (``audio_too_short``); a video's audio track is checked as
        audio."""
        param = item.source or "messages"
        if item.audio is not None:
            self.check(item.audio)
        if item.kind.capability not in self.capabilities:
            raise InvalidRequestError(
                f"{param}: this checkpoint has no {item.kind} encoder",
                param=param,
                code="unsupported_modality",
            )
        if item.kind is not MediaKind.AUDIO:
            return
        if item.sample_rate != self.sample_rate:
            raise InvalidRequestError(
                f"{param}: audio must be {self.sample_rate} Hz mono, got {item.sample_rate} Hz",
                param=param,
                code="invalid_audio",
            )
        if item.data.shape[0] > self.max_audio_seconds * self.sample_rate:
            raise InvalidRequestError(
                f"{param} lasts {item.data.shape[0] / self.sample_rate:.1f} s, more than the "
                f"audio encoder reads ({self.max_audio_seconds:g} s)",
                param=param,
                code="audio_too_long",
            )
        if item.data.shape[0] < self.min_audio_samples:
            raise InvalidRequestError(
                f"{param} lasts {1000 * item.data.shape[0] / self.sample_rate:.1f} ms, shorter "
                f"than the audio encoder reads ({self.min_audio_samples} samples at "
                f"{self.sample_rate} Hz)",
                param=param,
                code="audio_too_short",
            )


def encode_list(media: tuple[MediaItem, ...]) -> tuple[MediaItem, ...]:
    """The items the ENCODE units run, in order: each prompt item, and right after a video
    its audio track when it carries one (``use_audio_in_video``)."""
    return tuple(x for m in media for x in ((m,) if m.audio is None else (m, m.audio)))


def template_content(message: ChatMessage) -> str | list[dict[str, str]]:
    """A message's ``content`` for the chat template: its text, or its parts as content
    parts (media as ``{"type": kind}``) when it has media."""
    if not message.parts:
        return message.content
    return [
        {"type": "text", "text": p} if isinstance(p, str) else {"type": str(p.kind)}
        for p in message.parts
    ]


def splice_replies(
    ids: list[int], replies: list[tuple[int, ...] | None], head: list[int]
) -> list[int]:
    """Put assistant turns' generated ids into a templated prompt whose assistant messages
    were rendered empty: ``replies[k]`` (None: that message was rendered with its text) goes
    right after the ``k``-th occurrence of ``head`` (the ids of ``<|im_start|>assistant\n``),
    in order; later occurrences (the generation prompt) are left as they are.

    Raises:
        ValueError: fewer occurrences of ``head`` than replies.
    """
    out, start, k = [], 0, 0
    n = len(head)
    i = 0
    while k < len(replies) and i <= len(ids) - n:
        if ids[i : i + n] == head:
            out += ids[start : i + n]
            if replies[k] is not None:
                out += replies[k]
            start = i = i + n
            k += 1
        else:
            i += 1
    if k < len(replies):
        raise ValueError(f"{len(replies)} assistant turns, {k} found in the templated prompt")
    return out + ids[start:]


def chat_prompt_ids(tokenizer: Any, messages: Sequence[ChatMessage]) -> list[int]:
    """The chat template's ids of ``messages`` with the generation prompt: media as content
    parts (``template_content``); an assistant message with ``token_ids`` (a realtime
    session's earlier answer, as generated) rendered empty and its ids spliced in
    (``splice_replies``), so the prompt repeats the sequence the prefix cache holds."""
    replies = [m.token_ids for m in messages if m.role == "assistant"]
    rendered = [
        {"role": m.role, "content": "" if m.token_ids is not None else template_content(m)}
        for m in messages
    ]
    ids = tokenizer.apply_chat_template(
        rendered, add_generation_prompt=True, tokenize=True, return_dict=True
    )["input_ids"]
    ids = [int(i) for i in ids]
    if any(r is not None for r in replies):
        head = tokenizer.encode("<|im_start|>assistant\n", add_special_tokens=False)
        ids = splice_replies(ids, replies, [int(i) for i in head])
    return ids


@dataclass(frozen=True, eq=False)
class EncodedMedia:
    """One media item as the thinker takes it (an ENCODE unit's output).

    Attributes:
        rows: float32 ``[num_tokens, thinker hidden]`` on the CPU: one row per placeholder.
        grid: ``(t, h, w)`` patch grid of an image or video (None for audio).
        seconds_per_grid: a video's seconds per temporal patch (None otherwise).
        deepstack: an image's or video's deepstack features (Qwen3-VL's vision encoder), one
            float32 ``[num_tokens, thinker hidden]`` per thinker layer they are added after
            (empty: none).
    """

    rows: torch.Tensor
    grid: tuple[int, int, int] | None = None
    seconds_per_grid: float | None = None
    deepstack: tuple[torch.Tensor, ...] = ()


@dataclass(frozen=True, eq=False)
class ThinkerPrompt:
    """A thinker prompt holding media (audio, images, video).

    Attributes:
        ids: the chat-templated ids with each media placeholder repeated once per encoder row.
        media_rows: per media item, float32 ``[num_rows, hidden]`` (CPU), in prompt order:
            they replace the embeddings of the placeholder tokens (``placeholder_ids``).
        positions: int64 ``[3, len(ids)]`` TMRoPE positions (``mrope.rope_index``).
        rope_delta: rows after the prompt sit at ``index + rope_delta``.
        placeholder_ids: the audio, image and video placeholder token ids.
        media: the items' ``MediaItem.sha256``, in prompt order (what a rollout records).
        deepstack: per thinker layer ``k``, float32 ``[num image and video tokens, hidden]``
            (CPU), in prompt order: added to those tokens' hidden states after decoder layer
            ``k`` (Qwen3-Omni; empty: none).
        visual_ids: the placeholder ids whose tokens take the ``deepstack`` rows (image and
            video).
    """

    ids: tuple[int, ...]
    media_rows: tuple[torch.Tensor, ...]
    positions: np.ndarray
    rope_delta: int
    placeholder_ids: tuple[int, ...]
    media: tuple[str, ...] = ()
    deepstack: tuple[torch.Tensor, ...] = ()
    visual_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.positions.shape != (3, len(self.ids)):
            raise ValueError(f"positions {self.positions.shape} for {len(self.ids)} ids")
        expected = sum(1 for t in self.ids if t in self.placeholder_ids)
        got = sum(r.shape[0] for r in self.media_rows)
        if expected != got:
            raise ValueError(f"{expected} placeholder tokens for {got} encoder rows")
        visual = sum(1 for t in self.ids if t in self.visual_ids)
        if any(d.shape[0] != visual for d in self.deepstack):
            raise ValueError(f"deepstack rows for {visual} image and video tokens do not match")

    def __len__(self) -> int:
        return len(self.ids)


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
    visual = [p.encoded for p in pieces if p.item.kind is not MediaKind.AUDIO]
    layers = {len(e.deepstack) for e in visual}
    if len(layers) > 1:
        raise ValueError("image and video items with different deepstack depths")
    deepstack = tuple(
        torch.cat([e.deepstack[k] for e in visual]) for k in range(max(layers, default=0))
    )
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
        deepstack,
        (ids.image, ids.video) if deepstack else (),
    )


class MediaPromptNode:
    """The ``media_prompt`` kernel node of an omni card: ``chat_ids`` + ``media`` + the ENCODE
    outputs (``encoded``) -> ``thinker_prompt`` (a ``ThinkerPrompt``; the ids unchanged when
    the request has no media); ``usage["input_tokens"]`` counts the expanded prompt.

    Args:
        ids: the placeholder ids (``MediaTokenIds.from_config``).
        spatial_merge_size: the vision encoder's patch merge.
        max_prompt_tokens: the thinker's ``max_position_embeddings``: an expanded prompt of
            as many tokens raises InvalidRequestError (``context_length_exceeded``; the engine
            fails the request with it, a 400, where the prefill's ValueError was a 500).
    """

    def __init__(
        self, ids: MediaTokenIds, spatial_merge_size: int, max_prompt_tokens: int | None = None
    ):
        self.ids = ids
        self.spatial_merge_size = spatial_merge_size
        self.max_prompt_tokens = max_prompt_tokens

    def __call__(self, ctx: ProgramContext) -> None:
        media, encoded = ctx.slots["media"], ctx.slots.get("encoded")
        if not media:
            ctx.slots["thinker_prompt"] = ctx.slots["chat_ids"]
            return
        prompt = thinker_prompt(
            ctx.slots["chat_ids"], self.ids, media, encoded, self.spatial_merge_size
        )
        limit = self.max_prompt_tokens
        if limit is not None and len(prompt.ids) >= limit:
            raise InvalidRequestError(
                f"the messages with their media are {len(prompt.ids)} tokens, and this model's "
                f"context is {limit} tokens (max_position_embeddings): send fewer or smaller "
                "media parts",
                param="messages",
                code="context_length_exceeded",
            )
        ctx.slots["thinker_prompt"] = prompt
        ctx.usage["input_tokens"] = len(prompt.ids)


def language_name(code: str | None) -> str:
    """The English name of an ISO-639-1 ``code`` (``"de"`` -> ``"German"``), from the list of
    Whisper's tokenizer (``transformers.models.whisper.tokenization_whisper.LANGUAGES``, 100
    languages: the Qwen omni audio towers are Whisper's); None -> ``"English"``, the Qwen ASR
    cookbooks' default.

    Raises:
        InvalidRequestError: (code ``unsupported_language``) a code not in that list.
    """
    from transformers.models.whisper.tokenization_whisper import LANGUAGES

    if code is None:
        return "English"
    name = LANGUAGES.get(code.lower())
    if name is None:
        raise InvalidRequestError(
            f"'language' {code!r} is not one the Whisper-style audio tower knows; use an "
            "ISO-639-1 code such as 'en', 'zh', 'de'",
            param="language",
            code="unsupported_language",
        )
    return name.title()


@dataclass(frozen=True)
class MediaStages:
    """An omni card's media stages: program nodes (``encode``, a LoopNode run only for
    requests with media, when the folder has encoders; ``media_prompt``), the ``encoder``
    component and the ``encode`` loop (both empty without encoders).

    The program's ``frontend`` binds ``chat_ids`` and ``media``; ``media_prompt`` binds
    ``thinker_prompt``, which the thinker's loop reads."""

    nodes: tuple[Any, ...]
    components: tuple[ComponentSpec, ...]
    loops: tuple[LoopSpec, ...]


def media_stages(
    media_caps: frozenset[Capability],
    build_encoder: Callable[[str], Any],
    max_batch_size: int,
    description: str,
    ids: MediaTokenIds,
    spatial_merge_size: int,
    max_prompt_tokens: int | None = None,
) -> MediaStages:
    """The ``MediaStages`` of a card whose encoders give ``media_caps`` (empty: no encoder
    component; requests with media are then refused by the frontend's ``MediaRules``).

    Args:
        build_encoder: ``device -> MediaEncoderRunner`` (the ``encoder`` component).
        ids, spatial_merge_size, max_prompt_tokens: for ``MediaPromptNode``.
    """
    prompt = KernelNode(
        "media_prompt",
        MediaPromptNode(ids, spatial_merge_size, max_prompt_tokens),
        needs=("chat_ids", "media", *(("encoded",) if media_caps else ())),
        binds=("thinker_prompt",),
    )
    if not media_caps:
        return MediaStages((prompt,), (), ())
    encode = LoopNode(
        "encode", "encode", needs=("media",), binds="encoded", when=lambda req: bool(req.media)
    )
    component = ComponentSpec("encoder", build_encoder, max_batch_size, description)
    loop = LoopSpec(
        "encode",
        LoopKind.ENCODE,
        (WorkUnitKind.ENCODE,),
        ("encoder",),
        lambda: EncodeLoop(EncodeConfig("encode", "encoder", "media")),
    )
    return MediaStages((encode, prompt), (component,), (loop,))
