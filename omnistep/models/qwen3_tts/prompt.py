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
``tts_eos`` (then ``tts_pad`` for ever); non-streaming: empty (``tts_pad`` for ever).

Language: "auto" (no language row) or a ``codec_language_id`` name that is not a dialect; a
speaker with a dialect (``spk_is_dialect``) switches "auto" and "chinese" to that dialect's id.
Base voice cloning (speaker embedding row, ICL reference codes) is not built here yet.

Imports ``omnistep.core``, the loader (its config) and the talker module (its prompt type).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from omnistep.core.errors import InvalidRequestError
from omnistep.models.qwen3_tts.loader import Qwen3TTSConfig
from omnistep.models.qwen3_tts.talker import NO_CODEC, Qwen3TTSPrompt

ROLE_IDS = 3
"""``<|im_start|>assistant\\n``: the ids before the text."""
TAIL_IDS = 5
"""``<|im_end|>\\n<|im_start|>assistant\\n``: the ids after the text."""


def assistant_text(text: str) -> str:
    """The string upstream tokenises for the text to speak (``_build_assistant_text``)."""
    return f"<|im_start|>assistant\n{text}<|im_end|>\n<|im_start|>assistant\n"


def instruct_text(instruct: str) -> str:
    """The string upstream tokenises for an instruction (``_build_instruct_text``)."""
    return f"<|im_start|>user\n{instruct}<|im_end|>\n"


@dataclass(frozen=True)
class TalkerPromptParts:
    """What ``build_prompt`` returns.

    Attributes:
        prompt: the PREFILL prompt.
        trailing: the text track for a text known whole (put it on the loop's track channel
            and close it); for text streamed in, a card puts ``text[1:]`` as it arrives, then
            ``eos_id``.
        eos_id, pad_id: ``tts_eos_token_id``, ``tts_pad_token_id``.
    """

    prompt: Qwen3TTSPrompt
    trailing: tuple[int, ...]
    eos_id: int
    pad_id: int


def build_prompt(
    config: Qwen3TTSConfig,
    assistant_ids: Sequence[int],
    speaker: str | None = None,
    language: str = "auto",
    instruct_ids: Sequence[int] | None = None,
    non_streaming: bool = False,
) -> TalkerPromptParts:
    """The talker prompt of one request (see the module docstring for the layout).

    Args:
        assistant_ids: the tokenised ``assistant_text(text)``.
        speaker: a ``spk_id`` name (any case; CustomVoice), or None/"" (VoiceDesign).
        language: "auto" or a supported language name (any case).
        instruct_ids: the tokenised ``instruct_text(instruct)``, or None.
        non_streaming: the whole text in the prompt (upstream ``non_streaming_mode=True``)
            instead of the text track.

    Raises:
        InvalidRequestError: an unknown speaker (code ``unknown_voice``), an unknown language
            (``unsupported_language``), or no text between the template's role and tail ids
            (``empty_input``).
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
    codec.append(ids_.codec_pad)  # paired with tts_bos; codec_bos comes with the text
    bos, eos, pad = ids_.tts_bos, ids_.tts_eos, ids_.tts_pad
    head = [*(instruct_ids or ()), *ids[:ROLE_IDS]]
    text_ids = [*head, *([pad] * (len(codec) - 1)), bos]
    codec_ids = [NO_CODEC] * len(head) + codec
    if non_streaming:
        text_ids += [*text, eos, pad]
        codec_ids += [ids_.codec_pad] * (len(text) + 1) + [ids_.codec_bos]
        trailing: tuple[int, ...] = ()
    else:
        text_ids.append(text[0])
        codec_ids.append(ids_.codec_bos)
        trailing = (*text[1:], eos)
    prompt = Qwen3TTSPrompt(tuple(text_ids), tuple(codec_ids))
    return TalkerPromptParts(prompt, trailing, eos, pad)
