"""A chat LM's sampling settings from its checkpoint's ``generation_config.json`` under the
request's own fields, and its end tokens: what the Qwen omni thinkers (Qwen2.5-Omni,
Qwen3-Omni) read, as transformers' ``generate`` does.

Imports: ``omnistep.core`` (the request type) and this package's ``SamplingRow``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from omnistep.core import Request
from omnistep.sampling.params import SamplingRow


def generation_sampling(generation: dict[str, Any]) -> Callable[[Request], SamplingRow]:
    """``Request -> SamplingRow``: the request's fields, else ``generation``'s
    (``generation_config.json``: greedy when it does not ``do_sample``; ``temperature``,
    ``top_p``, ``top_k``, ``repetition_penalty``)."""
    greedy = not generation.get("do_sample", False)

    def build(req: Request) -> SamplingRow:
        sp = req.sampling
        return SamplingRow(
            temperature=float(
                sp.or_default("temperature", 0.0 if greedy else generation.get("temperature", 1.0))
            ),
            top_p=float(sp.or_default("top_p", generation.get("top_p", 1.0))),
            top_k=int(sp.or_default("top_k", generation.get("top_k", 0) or 0)),
            repetition_penalty=float(
                sp.or_default("repetition_penalty", generation.get("repetition_penalty", 1.0))
            ),
            min_keep=1,
        )

    return build


def generation_eos_ids(generation: dict[str, Any], tokenizer: Any) -> tuple[int, ...]:
    """The end tokens: ``generation``'s ``eos_token_id`` (an id or a list), as transformers'
    generate stops; ``<|im_end|>`` of ``tokenizer`` when the file does not say."""
    eos = generation.get("eos_token_id")
    if eos is None:
        return (int(tokenizer.convert_tokens_to_ids("<|im_end|>")),)
    return tuple(int(i) for i in (eos if isinstance(eos, list) else [eos]))
