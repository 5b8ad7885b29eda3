"""The Qwen3-TTS talker prompt: upstream's layout as ids, plus the text track.

Follows ``Qwen3TTSForConditionalGeneration.generate`` (qwen_tts 0.1.1,
core/models/modeling_qwen3_tts.py) and the text templates of ``Qwen3TTSModel``
(inference/qwen3_tts_model.py). The tokenised assistant text
``<|im_start|>assistant\\n{text}<|im_end|>\\n<|im_start|>assistant\\n`` is sliced at fixed
positions: 3 role ids, the text ``ids[3:-5]``, a 5-id tail (never fed). Rows (text id | codec id):

    instruct ids                      | -          (VoiceDesign, or an instructed CustomVoice)
    role ids (3)                      | -
    tts_pad                           | think / nothink            (language given / "auto")
    tts_pad                           | think_bos
    tts_pad                           | language id                (only when one is given)
    tts_pad                           | think_eos
    tts_pad                           | speaker's codec id         (CustomVoice only)
    tts_bos                           | codec_pad
    streaming text (the default of ``generate``):
    text[0]                           | codec_bos
    non-streaming (``non_streaming_mode=True``, the default of ``generate_custom_voice`` /
    ``generate_voice_design``):
    text[0..n-1], tts_eos             | codec_pad each
    tts_pad                           | codec_bos

The text track (one id per decode step, ``talker.text_for_step``): streaming: ``text[1:]`` then
``tts_eos`` (then ``tts_pad`` for ever); non-streaming: empty (``tts_pad`` for ever). The two
layouts give different audio; which one a request gets is ``card.text_layout``'s choice (a
whole text: the variant's public-call default; streamed text: streaming).

Base voice cloning (upstream ``generate`` with a ``voice_clone_prompt`` in ICL mode, and
``generate_icl_prompt``): the codec prefix holds the speaker embedding (the x-vector of
``talker.CloneRows``) where CustomVoice has its speaker id, and ends at ``tts_bos | codec_pad``
(no text row of its own); then the ICL block of two tracks: text ``t = [ref, text, tts_eos]``
(``ref``: the transcript's ids, ``tokenize("<|im_start|>assistant\n{ref}<|im_end|>\n")[3:-2]``)
and codec ``k = [codec_bos, F_0 .. F_{T-1}]`` (``F_j``: reference frame ``j``'s 16 codebook
embeddings summed). Rows::

    role ids (3)                      | -
    tts_pad                           | think / nothink, think_bos, (language), think_eos
    tts_pad                           | speaker embedding (x-vector)
    tts_bos                           | codec_pad
    streaming (the default of ``generate_voice_clone``), len(t) > len(k):
    t[0 .. len(k)-1]                  | k            text track: t[len(k):]
    streaming, len(t) <= len(k):
    t, then tts_pad                   | k            text track: empty (tts_pad)
    non-streaming:
    t                                 | codec_pad each
    tts_pad                           | k            text track: empty (tts_pad)

The voice's rows (``Qwen3TTSPrompt.voice_rows``): everything before the first text id (the
instruction, role and codec control rows, ending at ``tts_bos | codec_pad``), and with a cloned
voice also the ICL rows whose text id is the transcript's (``min(len(ref), len(k))`` streaming,
``len(ref)`` non-streaming); they do not depend on the text, so requests of one voice share
their K/V.

So with a cloned voice the first ``len(k) - len(ref)`` text ids sit in the prompt; a card whose
text streams in waits for that many (or for the end of the text) before its prefill
(``clone_text_needed``). Instructions are not used (upstream's clone path takes none); only ICL
mode is built (upstream's ``x_vector_only_mode`` is not).

Language: "auto" (no language row) or a ``codec_language_id`` name that is not a dialect; a
speaker with a dialect (``spk_is_dialect``) switches "auto" and "chinese" to that dialect's id.
Imports ``omnistep.core``, the loader (its config) and the talker module (its prompt type).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from omnistep.core.errors import InvalidRequestError
from omnistep.models.qwen3_tts.loader import Qwen3TTSConfig
from omnistep.models.qwen3_tts.talker import (
    NO_CODEC,
    REF_FRAME_ROW,
    SPEAKER_ROW,
    CloneRows,
    Qwen3TTSPrompt,
)

ROLE_IDS = 3
"""``<|im_start|>assistant\\n``: the ids before the text."""
TAIL_IDS = 5
"""``<|im_end|>\\n<|im_start|>assistant\\n``: the ids after the text."""
REF_TAIL_IDS = 2
"""``<|im_end|>\\n``: the ids after a cloned voice's transcript (``ref_text``)."""


def assistant_text(text: str) -> str:
    """The string upstream tokenises for the text to speak (``_build_assistant_text``)."""
    return f"<|im_start|>assistant\n{text}<|im_end|>\n<|im_start|>assistant\n"


def ref_text(transcript: str) -> str:
    """The string upstream tokenises for a cloned voice's transcript (``_build_ref_text``);
    its ids ``[ROLE_IDS:-REF_TAIL_IDS]`` are the ICL block's ``ref`` ids."""
    return f"<|im_start|>assistant\n{transcript}<|im_end|>\n"


def clone_text_needed(clone: CloneRows, ref_ids: Sequence[int]) -> int:
    """Text ids a streaming-layout prompt of this cloned voice needs before it can be built
    while the text may still grow: ``len(k) - len(ref)`` (``len(k)`` = frames + 1), at least
    1. With that many the layout is decided (``len(t) > len(k)`` whatever follows)."""
    return max(1, clone.num_frames + 1 - len(ref_ids))


def instruct_text(instruct: str) -> str:
    """The string upstream tokenises for an instruction (``_build_instruct_text``)."""
    return f"<|im_start|>user\n{instruct}<|im_end|>\n"


@dataclass(frozen=True)
class TalkerPromptParts:
    """What ``build_prompt`` returns.

    Attributes:
        prompt: the PREFILL prompt.
        trailing: the text track for a text known whole (put it on the loop's track channel
            and close it); for text streamed in, the track is ``head``, then ``text[consumed:]``
            as it arrives, then ``eos_id`` (when ``streams_text``; else it stays empty).
        eos_id, pad_id: ``tts_eos_token_id``, ``tts_pad_token_id``.
        consumed: text ids the prompt holds (streaming: 1, or ``len(k) - len(ref)`` with a
            cloned voice; every one otherwise).
        head: ids the track feeds before ``text[consumed:]`` (the transcript ids a cloned
            voice's prompt had no room for; usually empty).
        streams_text: the track carries text (else it is empty: ``tts_pad`` every step).
    """

    prompt: Qwen3TTSPrompt
    trailing: tuple[int, ...]
    eos_id: int
    pad_id: int
    consumed: int = 1
    head: tuple[int, ...] = ()
    streams_text: bool = True


def build_prompt(
    config: Qwen3TTSConfig,
    assistant_ids: Sequence[int],
    speaker: str | None = None,
    language: str = "auto",
    instruct_ids: Sequence[int] | None = None,
    non_streaming: bool = False,
    clone: CloneRows | None = None,
    ref_ids: Sequence[int] = (),
    text_complete: bool = True,
) -> TalkerPromptParts:
    """The talker prompt of one request (see the module docstring for the layout).

    Args:
        assistant_ids: the tokenised ``assistant_text(text)``.
        speaker: a ``spk_id`` name (any case; CustomVoice), or None/"" (VoiceDesign, Base).
        language: "auto" or a supported language name (any case).
        instruct_ids: the tokenised ``instruct_text(instruct)``, or None.
        non_streaming: the whole text in the prompt (upstream ``non_streaming_mode=True``)
            instead of the text track.
        clone: a cloned voice (Base): its x-vector row and ICL block; needs ``speaker`` None.
        ref_ids: the cloned voice's transcript ids (``ref_text(...)`` tokenised, sliced
            ``[ROLE_IDS:-REF_TAIL_IDS]``), non-empty with ``clone``.
        text_complete: ``assistant_ids`` hold the whole text; False: the text may grow (a
            streamed text), which a cloned voice's streaming layout accepts once it holds
            ``clone_text_needed`` ids.

    Raises:
        InvalidRequestError: an unknown speaker (code ``unknown_voice``), an unknown language
            (``unsupported_language``), or no text between the template's role and tail ids
            (``empty_input``).
        ValueError: ``clone`` with a speaker or without ``ref_ids``, or an incomplete text
            too short for a cloned voice's layout.
    """
    ids = [int(t) for t in assistant_ids]
    text = ids[ROLE_IDS:-TAIL_IDS] if len(ids) > ROLE_IDS + TAIL_IDS else []
    if not text:
        raise InvalidRequestError("the input text is empty", param="input", code="empty_input")
    speaker_key = (speaker or "").lower() or None
    if speaker_key is not None and speaker_key not in config.spk_id:
        known = ", ".join(sorted(config.spk_id)) or "none"
        raise InvalidRequestError(
            f"unknown speaker {speaker!r}; this model has: {known}",
            param="voice",
            code="unknown_voice",
        )
    language_key = language.lower()
    if language_key not in config.languages:
        raise InvalidRequestError(
            f"unsupported language {language!r}; supported: {', '.join(config.languages)}",
            param="language",
            code="unsupported_language",
        )
    language_id = None if language_key == "auto" else config.codec_language_id[language_key]
    if speaker_key is not None and language_key in ("chinese", "auto"):
        dialect = config.spk_is_dialect.get(speaker_key, False)
        if dialect:
            language_id = config.codec_language_id[dialect]
    ids_ = config.ids
    if language_id is None:
        codec = [ids_.codec_nothink, ids_.codec_think_bos, ids_.codec_think_eos]
    else:
        codec = [ids_.codec_think, ids_.codec_think_bos, language_id, ids_.codec_think_eos]
    if speaker_key is not None:
        codec.append(config.spk_id[speaker_key])
    if clone is not None:
        if speaker_key is not None or not ref_ids:
            raise ValueError("a cloned voice needs no speaker and its transcript's ids")
        codec.append(SPEAKER_ROW)
    codec.append(ids_.codec_pad)  # paired with tts_bos; codec_bos comes with the text
    bos, eos, pad = ids_.tts_bos, ids_.tts_eos, ids_.tts_pad
    head = [*(instruct_ids or ()), *ids[:ROLE_IDS]]
    text_ids = [*head, *([pad] * (len(codec) - 1)), bos]
    codec_ids = [NO_CODEC] * len(head) + codec
    if clone is not None:
        return _icl_prompt(
            text_ids,
            codec_ids,
            clone,
            [int(r) for r in ref_ids],
            text,
            ids_,
            non_streaming,
            text_complete,
        )
    voice_rows = len(text_ids)  # what precedes the text: the same for every text
    if non_streaming:
        text_ids += [*text, eos, pad]
        codec_ids += [ids_.codec_pad] * (len(text) + 1) + [ids_.codec_bos]
        prompt = Qwen3TTSPrompt(tuple(text_ids), tuple(codec_ids), voice_rows=voice_rows)
        return TalkerPromptParts(prompt, (), eos, pad, len(text), (), False)
    text_ids.append(text[0])
    codec_ids.append(ids_.codec_bos)
    prompt = Qwen3TTSPrompt(tuple(text_ids), tuple(codec_ids), voice_rows=voice_rows)
    return TalkerPromptParts(prompt, (*text[1:], eos), eos, pad)


def _icl_prompt(
    text_ids: list[int],
    codec_ids: list[int],
    clone: CloneRows,
    ref: list[int],
    text: list[int],
    ids_: Any,
    non_streaming: bool,
    text_complete: bool,
) -> TalkerPromptParts:
    """The prefix rows plus upstream ``generate_icl_prompt``'s block (module docstring)."""
    eos, pad = ids_.tts_eos, ids_.tts_pad
    k = [ids_.codec_bos, *([REF_FRAME_ROW] * clone.num_frames)]
    # the voice's rows: the prefix rows, then the ICL rows whose text id is the transcript's
    header = len(text_ids)
    voice = {"clone": clone, "voice_rows": header + min(len(ref), len(k))}
    if non_streaming:
        if not text_complete:
            raise ValueError("the non-streaming layout needs the whole text")
        t = [*ref, *text, eos]
        text_ids += [*t, *([pad] * len(k))]
        codec_ids += [ids_.codec_pad] * len(t) + k
        voice["voice_rows"] = header + len(ref)
        prompt = Qwen3TTSPrompt(tuple(text_ids), tuple(codec_ids), **voice)
        return TalkerPromptParts(prompt, (), eos, pad, len(text), (), False)
    needed = max(0, len(k) - len(ref))
    longer = len(ref) + len(text) + 1 > len(k)
    if not text_complete and len(text) < max(1, needed):
        raise ValueError(
            f"a cloned voice's streaming layout needs {max(1, needed)} text ids while the text "
            f"may grow, got {len(text)}"
        )
    if longer:  # t[:len(k)] + k; the text track: t[len(k):]
        t_head = [*ref, *text[:needed]][: len(k)]
        text_ids += t_head
        codec_ids += k
        rest_ref = tuple(ref[len(k) :])
        trailing = (*rest_ref, *text[needed:], eos)
        prompt = Qwen3TTSPrompt(tuple(text_ids), tuple(codec_ids), **voice)
        return TalkerPromptParts(prompt, trailing, eos, pad, needed, rest_ref, True)
    t = [*ref, *text, eos]
    text_ids += [*t, *([pad] * (len(k) - len(t)))]
    codec_ids += k
    prompt = Qwen3TTSPrompt(tuple(text_ids), tuple(codec_ids), **voice)
    return TalkerPromptParts(prompt, (), eos, pad, len(text), (), False)
