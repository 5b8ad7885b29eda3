"""ChatTTS prompts: the tokenizer from the asset folder and the code / refine prompt formats.

Code prompt (``infer_code``): ``[Stts][spk_emb]{prompt}{text}[Ptts]`` where ``prompt`` is the
speed token ``[speed_N]`` (upstream default ``[speed_5]``) and ``[spk_emb]`` is replaced by
``[empty_spk]`` when no speaker is given. Refine prompt (``refine_text``):
``[Sbreak]{text}[Pbreak]``. Ids come from the BERT tokenizer in ``asset/tokenizer/`` without
special tokens ([CLS]/[SEP]); user text has ``[Stts]``, ``[spk_emb]`` and ``[empty_spk]`` removed
as upstream does.

Source: ChatTTS 0.2.5 ``ChatTTS/model/tokenizer.py`` (``Tokenizer.encode``) and
``ChatTTS/model/speaker.py`` (``decorate_code_prompts``, ``decorate_text_prompts``), ``core.py``
(``InferCodeParams.prompt``). Imports: transformers (tokenizer only).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from omnistep.core import InvalidRequestError, ModelFilesError

DEFAULT_SPEED_LEVEL = 5
MAX_SPEED_LEVEL = 9


def speed_level(speed: float) -> int:
    """The ``[speed_N]`` level for an OpenAI ``speed`` factor: ``clamp(round(5 * speed), 1, 9)``,
    so 1.0 gives upstream's default ``[speed_5]``."""
    return max(1, min(MAX_SPEED_LEVEL, round(DEFAULT_SPEED_LEVEL * speed)))


@dataclass(frozen=True, slots=True)
class CodePrompt:
    """A tokenized code prompt.

    Attributes:
        input_ids: text token ids of the prompt, ``[T]``.
        spk_positions: indices in ``input_ids`` holding ``[spk_emb]``.
    """

    input_ids: tuple[int, ...]
    spk_positions: tuple[int, ...]


class ChatTTSTokenizer:
    """The BERT tokenizer of a ChatTTS asset folder.

    Raises:
        ModelFilesError: (a FileNotFoundError) ``tokenizer_dir`` is missing (named).
        ValueError: the tokenizer lacks a special token ChatTTS needs.
    """

    SPECIAL = (
        "[Stts]",
        "[Ptts]",
        "[spk_emb]",
        "[empty_spk]",
        "[Sbreak]",
        "[Pbreak]",
        "[Ebreak]",
        "[break_0]",
    )

    def __init__(self, tokenizer_dir: str | Path):
        from transformers import BertTokenizerFast

        path = Path(tokenizer_dir)
        if not path.is_dir():
            raise ModelFilesError(f"ChatTTS tokenizer folder not found: {path}")
        self._tok = BertTokenizerFast.from_pretrained(str(path))
        self.vocab_size = len(self._tok)
        ids = {t: self._tok.convert_tokens_to_ids(t) for t in self.SPECIAL}
        unknown = [t for t, i in ids.items() if i is None or i == self._tok.unk_token_id]
        if unknown:
            raise ValueError(f"tokenizer in {path} lacks special tokens {unknown}")
        self.spk_emb_id = ids["[spk_emb]"]
        self.refine_eos_id = ids["[Ebreak]"]
        self.break_0_id = ids["[break_0]"]

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (no [CLS]/[SEP])."""
        return list(self._tok(text, add_special_tokens=False)["input_ids"])

    def code_prompt(self, text: str, speed: float = 1.0, with_speaker: bool = True) -> CodePrompt:
        """The code prompt for ``text``.

        Raises:
            InvalidRequestError: (param ``input``) nothing left after cleaning.
        """
        clean = (
            text.replace("[Stts]", "").replace("[spk_emb]", "").replace("[empty_spk]", "").strip()
        )
        if not clean:
            raise InvalidRequestError(
                "input must contain text to speak", param="input", code="empty_input"
            )
        spk = "[spk_emb]" if with_speaker else "[empty_spk]"
        ids = self.encode(f"[Stts]{spk}[speed_{speed_level(speed)}]{clean}[Ptts]")
        return CodePrompt(tuple(ids), tuple(i for i, t in enumerate(ids) if t == self.spk_emb_id))

    def refine_prompt(self, text: str) -> list[int]:
        """Ids of the refine-text prompt ``[Sbreak]{text}[Pbreak]``.

        Raises:
            InvalidRequestError: (param ``input``) empty text.
        """
        if not text.strip():
            raise InvalidRequestError(
                "input must contain text to speak", param="input", code="empty_input"
            )
        return self.encode(f"[Sbreak]{text.strip()}[Pbreak]")

    def refined_text(self, ids: list[int]) -> str:
        """The text of a refine-stage output: ids from ``[break_0]`` on (the ``[break_N]`` /
        ``[laugh_N]`` / ``[oral_N]`` / ``[speed_N]`` controls) are dropped, as upstream ``_infer``
        does, and the rest decoded (``[uv_break]``, ``[laugh]`` stay as text)."""
        return self._tok.decode([i for i in ids if i < self.break_0_id], skip_special_tokens=False)
