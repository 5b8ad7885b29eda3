"""The thinker loop of a thinking checkpoint (Qwen3-Omni-30B-A3B-Thinking): its reply's text
before ``</think>`` streams as reasoning (``StreamChunk.reasoning``, the chat API's
``reasoning_content``), the rest as content.

The Thinking chat template opens the assistant turn with ``<think>\\n``, so the reply starts
inside the reasoning; a ``<think>`` the reply writes itself is dropped. Text after ``</think>``
is content, as it comes (vLLM's Qwen3 reasoning parser partitions at the marker the same way).
A reply that never closes its reasoning (cut by its token cap) is all reasoning.

Imports: ``omnistep.core``, ``omnistep.loops``.
"""

from __future__ import annotations

from omnistep.core import StreamChunk
from omnistep.loops.ar_decode import ARDecodeLoop, ARDecodeState

THINK_START = "<think>"
THINK_END = "</think>"


def split_reasoning(text: str) -> tuple[str, str | None]:
    """``(reasoning, content)`` of a reply's text: the text before ``THINK_END`` (a leading
    ``THINK_START`` dropped) and the text after it; content None while the reasoning is
    open."""
    if text.startswith(THINK_START):
        text = text[len(THINK_START) :]
    reasoning, marker, content = text.partition(THINK_END)
    return reasoning, content if marker else None


class ThinkingLoop(ARDecodeLoop):
    """``ARDecodeLoop`` whose text deltas are reasoning until ``</think>``, then content."""

    def _emit_text(self, state: ARDecodeState) -> None:
        text = self.config.detokenize([frame[0] for frame in state.frames])
        if text.endswith("\ufffd"):
            return
        reasoning, content = split_reasoning(text)
        # state.text_emitted counts characters of reasoning + content emitted so far
        done = state.text_emitted
        if done < len(reasoning):
            state.outbox.append(StreamChunk.of_text(reasoning[done:], reasoning=True))
            done = len(reasoning)
        if content and done - len(reasoning) < len(content):
            state.outbox.append(StreamChunk.of_text(content[done - len(reasoning) :]))
            done = len(reasoning) + len(content)
        state.text_emitted = done
