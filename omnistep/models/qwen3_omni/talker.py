"""Qwen3-Omni's talker decoder stack and codebook-0 head (a first piece of the talker).

The talker's text model is transformers' ``Qwen3OmniMoeTalkerModel``: a Qwen3-MoE stack like
the thinker's (``thinker.ThinkerTextConfig`` read from ``talker_config``) whose MoE blocks add a
gated shared expert (``shared_expert_intermediate_size``; ``layers.moe.MoEFeedForward``), no
top-k renormalisation (``norm_topk_prob`` false), then ``codec_head`` ``[vocab, hidden]``: the
logits of codebook 0 (codes, then the control and speaker ids). ``codec_embedding`` ``[vocab,
hidden]`` embeds codebook 0 on the input side. The code predictor that fills codebooks 1..15
inside each step is the shared ``layers.code_predictor``.

Not here yet: the talker's prompt (projections of the thinker's embeddings and hidden states,
``text_projection`` / ``hidden_projection``), its in-step loop with the code predictor, and the
component on the paged-KV AR runner.

Imports torch, ``omnistep.layers``, this family's ``thinker`` (its config) and ``loader``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from omnistep.layers.llama import LlamaModel
from omnistep.models.qwen3_omni.thinker import ThinkerTextConfig


@dataclass
class TalkerStack:
    """The talker's decoder stack with its codec embedding and codebook-0 head.

    Attributes:
        config: the talker's text config.
        llama: the MoE decoder stack (``LlamaModel``, no cache needed for ``codec_logits``).
        codec_embedding: ``[vocab, hidden]`` (``talker.model.codec_embedding.weight``).
        codec_head: ``[vocab, hidden]`` (``talker.codec_head.weight``).
    """

    config: ThinkerTextConfig
    llama: LlamaModel
    codec_embedding: torch.Tensor
    codec_head: torch.Tensor

    @torch.inference_mode()
    def codec_logits(
        self, inputs_embeds: torch.Tensor, routing: list[torch.Tensor] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One sequence's rows through the stack (causal, positions 0..N-1: a text-only
        talker prompt's MRoPE positions are all equal, which is plain RoPE).

        Args:
            inputs_embeds: ``[N, hidden]``.

        Returns:
            (codebook-0 logits ``[N, vocab]``, final hidden states ``[N, hidden]``), in the
            stack's dtype.
        """
        hidden = self.llama.forward_dense(inputs_embeds.to(self.codec_head.dtype))
        return hidden @ self.codec_head.T, hidden


def load_talker_stack(
    checkpoint: Any, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32
) -> TalkerStack:
    """The talker stack of a ``loader.Qwen3OmniCheckpoint``, loaded strictly.

    Raises:
        Qwen3OmniCheckpointError: the checkpoint has no talker.
        KeyError / RuntimeError: a missing or mis-shaped tensor (named).
    """
    checkpoint.need_talker("talker")
    config = ThinkerTextConfig.from_dict(checkpoint.config, "talker_config")
    tensors = checkpoint.tensors("talker.")
    llama = LlamaModel(config.llama(), device=device, dtype=dtype).eval()
    model = {
        k.removeprefix("talker.model."): v
        for k, v in tensors.items()
        if k.startswith("talker.model.") and not k.startswith("talker.model.codec_embedding.")
    }
    llama.load_hf_state_dict(model)
    for name in ("talker.model.codec_embedding.weight", "talker.codec_head.weight"):
        if name not in tensors:
            raise KeyError(f"missing talker tensor {name}")
    return TalkerStack(
        config,
        llama,
        tensors["talker.model.codec_embedding.weight"].to(device, dtype),
        tensors["talker.codec_head.weight"].to(device, dtype),
    )
