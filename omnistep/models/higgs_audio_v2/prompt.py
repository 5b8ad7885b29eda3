"""Higgs Audio v2 prompts: the ChatML (Llama-3 header) conversation the model card's example
builds, with reference clips as earlier assistant audio turns.

Layout (text; ``{...}`` filled in)::

    <|begin_of_text|><|start_header_id|>system<|end_header_id|>\\n\\n{SYSTEM}\\n\\n
    <|scene_desc_start|>\\n{scene}\\n<|scene_desc_end|><|eot_id|>
    per reference clip:
      <|start_header_id|>user<|end_header_id|>\\n\\n{ref_text}<|eot_id|>
      <|start_header_id|>assistant<|end_header_id|>\\n\\n<|audio_out_bos|>{AUDIO}<|audio_eos|><|eot_id|>
    <|start_header_id|>user<|end_header_id|>\\n\\n{text}<|eot_id|>
    <|start_header_id|>assistant<|end_header_id|>\\n\\n<|audio_out_bos|>

``{AUDIO}`` is one placeholder per delayed row of the clip's codes (BOS, codes, EOS, delayed:
``T + 1 + num_codebooks`` rows): ``<|AUDIO_OUT|>`` for all but the last ``num_codebooks - 1``,
which are the delay token, as ``HiggsAudioV2Processor.get_audio_tokens`` expands them. The
system and scene texts are the model card's example (transformers' docstring of
``HiggsAudioV2ForConditionalGeneration.forward``).

Imports: torch, ``omnistep.sampling.delay`` and this family's ``lm`` (prompt type).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from omnistep.models.higgs_audio_v2.lm import HiggsPrompt
from omnistep.sampling.delay import DelayPattern

SYSTEM = "Generate audio following instruction."
SCENE = "Audio is recorded from a quiet room."


@dataclass(frozen=True)
class ReferenceClip:
    """A reference clip as the audio tokenizer encoded it.

    Attributes:
        text: its transcript.
        codes: ``[T, num_codebooks]`` long codes in ``[0, codebook_size)``.
    """

    text: str
    codes: torch.Tensor


class PromptBuilder:
    """Builds ``HiggsPrompt``s with a ``tokenizers.Tokenizer`` holding Higgs' special tokens.

    Raises (constructor):
        ValueError: a special token the tokenizer does not know.
    """

    SPECIALS = (
        "<|begin_of_text|>",
        "<|start_header_id|>",
        "<|end_header_id|>",
        "<|eot_id|>",
        "<|audio_out_bos|>",
        "<|AUDIO_OUT|>",
        "<|audio_eos|>",
        "<|reserved_special_token_6|>",
        "<|scene_desc_start|>",
        "<|scene_desc_end|>",
    )

    def __init__(self, tokenizer: Any, pattern: DelayPattern):
        self.tokenizer = tokenizer
        self.pattern = pattern
        self.ids = {}
        for tok in self.SPECIALS:
            tid = tokenizer.token_to_id(tok)
            if tid is None:
                raise ValueError(f"the tokenizer has no {tok}")
            self.ids[tok] = tid

    def _text(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False).ids)

    def _turn(self, role: str, body: list[int]) -> list[int]:
        i = self.ids
        head = [i["<|start_header_id|>"], *self._text(role), i["<|end_header_id|>"]]
        return head + self._text("\n\n") + body

    def build(
        self, text: str, references: Sequence[ReferenceClip] = (), scene: str = SCENE
    ) -> HiggsPrompt:
        """The prompt of ``text`` spoken after ``references`` (voice cloning; none: the
        model's own voice)."""
        i = self.ids
        system = self._text(f"{SYSTEM}\n\n") + [i["<|scene_desc_start|>"]]
        system += self._text(f"\n{scene}\n") + [i["<|scene_desc_end|>"], i["<|eot_id|>"]]
        ids = [i["<|begin_of_text|>"], *self._turn("system", system)]
        audio: list[tuple[int, ...]] = []
        c = self.pattern.num_codebooks
        for ref in references:
            ids += self._turn("user", self._text(ref.text) + [i["<|eot_id|>"]])
            rows = self.pattern.delay(ref.codes)
            n = rows.shape[0]
            slots = [i["<|AUDIO_OUT|>"]] * (n - (c - 1)) + [i["<|reserved_special_token_6|>"]] * (
                c - 1
            )
            body = [i["<|audio_out_bos|>"], *slots, i["<|audio_eos|>"], i["<|eot_id|>"]]
            ids += self._turn("assistant", body)
            audio += [tuple(int(x) for x in r) for r in rows]
        ids += self._turn("user", self._text(text) + [i["<|eot_id|>"]])
        ids += self._turn("assistant", [i["<|audio_out_bos|>"]])
        return HiggsPrompt(tuple(ids), tuple(audio))
