"""The code predictor of the Qwen3 speech talkers (Qwen3-TTS, Qwen3-Omni): a small Qwen3 decoder
that fills codebooks 1..G-1 of a codec frame inside each talker step, from the talker's hidden
state and the frame's code 0, batched over the rows of a step.

Imports torch and ``omnistep.layers`` only. Mirrors qwen_tts 0.1.1's
``Qwen3TTSTalkerCodePredictorModelForConditionalGeneration`` (core/models/modeling_qwen3_tts.py)
and transformers 5.25's ``Qwen3OmniMoeTalkerCodePredictorModelForConditionalGeneration``
(models/qwen3_omni_moe/modeling_qwen3_omni_moe.py), both driven by ``generate(max_new_tokens=G -
1)``: Qwen3 decoder layers (q/k/v/o without bias, per-head ``q_norm``/``k_norm``, SwiGLU,
RMSNorm, 1-D rope at positions ``0..G-1`` per frame), ``G - 1`` codec embeddings of the talker's
width, ``G - 1`` heads, and ``small_to_mtp_projection`` from the talker's width to the
predictor's where they differ (Qwen3-TTS 1.7B; Qwen3-Omni has equal widths and no projection).

Sub-step 0 reads two rows, ``[talker hidden, codec_embedding(code 0)]`` (the talker's own code-0
table), and ``lm_head[0]`` gives code 1's logits; sub-step ``j`` reads the embedding of code
``j`` (``codec_embedding[j - 1]``) and ``lm_head[j]`` gives code ``j + 1``'s. The caller picks
each code (``choose``: sampling, or the recorded code when teacher-forcing), so the same ``run``
serves decode and a trainer's score. A family configures it with a ``CodePredictorConfig`` (its
loader reads its ``code_predictor_config`` into one) and the talker's width.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from omnistep.layers.batch_invariant import map_row_groups
from omnistep.layers.linear import linear
from omnistep.layers.llama import LlamaConfigLite, LlamaModel
from omnistep.layers.paged_attention import repeat_kv


@dataclass(frozen=True)
class CodePredictorConfig:
    """The sizes of a code predictor.

    Attributes:
        stack: its Qwen3 decoder (``LlamaConfigLite.qwen3``).
        vocab_size: the codebook size of codebooks 1..G-1 (2048 in both families).
        num_code_groups: G, codebooks per frame (16 in both).
    """

    stack: LlamaConfigLite
    vocab_size: int
    num_code_groups: int

    def __post_init__(self) -> None:
        if self.vocab_size <= 0 or self.num_code_groups < 2:
            raise ValueError(
                f"a code predictor needs vocab_size > 0 and num_code_groups >= 2, got "
                f"{self.vocab_size} and {self.num_code_groups}"
            )

    @classmethod
    def of(cls, cfg: Any) -> CodePredictorConfig:
        """From a family's parsed ``code_predictor_config``: any object with the Qwen3 stack's
        fields (``LlamaConfigLite.SIZE_FIELDS``, ``rope_theta`` included), ``hidden_act``,
        ``attention_bias``, ``vocab_size`` and ``num_code_groups`` (Qwen3-TTS's
        ``TalkerCodePredictorConfig``; Qwen3-Omni's section has the same keys, with
        ``rope_theta`` inside transformers 5's ``rope_parameters``).

        Raises:
            ValueError: what ``LlamaConfigLite.qwen3`` raises, or bad sizes.
        """
        return cls(LlamaConfigLite.qwen3(cfg), cfg.vocab_size, cfg.num_code_groups)


class CodePredictor:
    """Codebooks 1..G-1 of a frame from the talker's hidden state and code 0, batched over
    rows (module docstring), on a dense per-frame KV cache.

    Attributes:
        llama: the stack. ``codec_embedding[j]``: ``[vocab, talker_hidden]`` (code ``j + 1``'s
        table); ``lm_head[j]``: ``[vocab, hidden]`` (code ``j + 1``'s head); ``proj_weight``,
        ``proj_bias``: ``small_to_mtp_projection`` ``[hidden, talker_hidden]``, ``[hidden]``
        (None when the widths are equal: identity).
    """

    def __init__(
        self,
        config: CodePredictorConfig,
        talker_hidden: int,
        device: torch.device,
        dtype: torch.dtype,
        batch_invariant: bool,
    ):
        self.config = config
        self.device, self.dtype, self.batch_invariant = device, dtype, batch_invariant
        self.llama = LlamaModel(config.stack, device=device, dtype=dtype).eval()
        factory = {"device": device, "dtype": dtype}
        groups = config.num_code_groups - 1
        self.codec_embedding = [
            torch.zeros(config.vocab_size, talker_hidden, **factory) for _ in range(groups)
        ]
        self.lm_head = [
            torch.zeros(config.vocab_size, config.stack.hidden_size, **factory)
            for _ in range(groups)
        ]
        self.proj_weight: torch.Tensor | None = None
        self.proj_bias: torch.Tensor | None = None
        if config.stack.hidden_size != talker_hidden:
            self.proj_weight = torch.zeros(config.stack.hidden_size, talker_hidden, **factory)
            self.proj_bias = torch.zeros(config.stack.hidden_size, **factory)

    def weight_tensors(self, prefix: str = "talker.code_predictor.") -> dict[str, torch.Tensor]:
        """Live tensors by their official names."""
        tensors = {
            f"{prefix}model.{k}": v for k, v in self.llama.state_dict(keep_vars=True).items()
        }
        for j, (emb, head) in enumerate(zip(self.codec_embedding, self.lm_head, strict=True)):
            tensors[f"{prefix}model.codec_embedding.{j}.weight"] = emb
            tensors[f"{prefix}lm_head.{j}.weight"] = head
        if self.proj_weight is not None:
            tensors[f"{prefix}small_to_mtp_projection.weight"] = self.proj_weight
            tensors[f"{prefix}small_to_mtp_projection.bias"] = self.proj_bias
        return tensors

    def _linear(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``layers.linear.linear`` (``F.linear`` on a pre-packed CPU weight) over rows, in
        fixed 16-row chunks in batch-invariant mode."""
        fn = lambda rows: linear(rows, weight, bias)  # noqa: E731
        if not self.batch_invariant:
            return fn(x)
        plan = self.llama.row_chunking.plan([1] * x.shape[0], x.device)
        return map_row_groups(fn, x, plan)

    def _project(self, x: torch.Tensor, rows_per_seq: int) -> torch.Tensor:
        """``small_to_mtp_projection`` of rows ``[N, talker_hidden]``."""
        if self.proj_weight is None:
            return x
        fn = lambda rows: linear(rows, self.proj_weight, self.proj_bias)  # noqa: E731
        if not self.batch_invariant:
            return fn(x)
        query_lens = [rows_per_seq] * (x.shape[0] // rows_per_seq)
        return map_row_groups(fn, x, self.llama.row_chunking.plan(query_lens, x.device))

    def run(
        self,
        talker_hidden: torch.Tensor,
        first_embed: torch.Tensor,
        choose: Any,
    ) -> torch.Tensor:
        """Run the G-1 sub-steps for ``B`` rows.

        Args:
            talker_hidden: ``[B, talker_hidden]`` the talker's final normed hidden states.
            first_embed: ``[B, talker_hidden]``: ``codec_embedding(code 0)`` (talker table).
            choose: ``choose(j, logits [B, vocab] float32) -> LongTensor [B]``: code ``j + 1``
                given its logits (sampling, or the recorded code when teacher-forcing).

        Returns:
            Raw logits ``[B, G - 1, vocab]`` float32 of every sub-step.
        """
        batch = talker_hidden.shape[0]
        keys: list[torch.Tensor | None] = [None] * self.config.stack.num_hidden_layers
        values: list[torch.Tensor | None] = [None] * self.config.stack.num_hidden_layers

        def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
            n = q.shape[0] // batch  # new rows per sequence (all sequences alike)
            q = q.view(batch, n, *q.shape[1:]).transpose(1, 2)  # [B, H, n, D]
            k = k.view(batch, n, *k.shape[1:]).transpose(1, 2)  # [B, Hkv, n, D]
            v = v.view(batch, n, *v.shape[1:]).transpose(1, 2)
            if keys[layer] is not None:
                k = torch.cat([keys[layer], k], dim=2)
                v = torch.cat([values[layer], v], dim=2)
            keys[layer], values[layer] = k, v
            rep = q.shape[1] // k.shape[1]
            k, v = repeat_kv(k, rep), repeat_kv(v, rep)
            scale = self.config.stack.head_dim**-0.5
            causal = n > 1  # the first sub-step: 2 rows from scratch
            if self.batch_invariant:  # one call per sequence: its result ignores the batch
                out = torch.cat(
                    [
                        F.scaled_dot_product_attention(
                            q[b : b + 1], k[b : b + 1], v[b : b + 1], is_causal=causal, scale=scale
                        )
                        for b in range(batch)
                    ]
                )
            else:
                out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)
            return out.transpose(1, 2).reshape(batch * n, *out.shape[1:2], out.shape[-1])

        rows = torch.stack([talker_hidden, first_embed], dim=1).reshape(2 * batch, -1)
        positions = torch.arange(2, device=self.device).repeat(batch)
        hidden = self.llama.forward_attend(
            self._project(rows.to(self.dtype), 2),
            positions,
            attend,
            [2] * batch,
            self.batch_invariant,
        )
        last = hidden.view(batch, 2, -1)[:, 1]
        logits = []
        groups = self.config.num_code_groups - 1
        for j in range(groups):
            step_logits = self._linear(last, self.lm_head[j]).float()  # [B, vocab]
            logits.append(step_logits)
            codes = choose(j, step_logits)
            if j == groups - 1:
                break
            embed = self.codec_embedding[j][codes]  # [B, talker_hidden]
            position = torch.full((batch,), j + 2, device=self.device)
            last = self.llama.forward_attend(
                self._project(embed, 1), position, attend, [1] * batch, self.batch_invariant
            )
        return torch.stack(logits, dim=1)

    def teacher_forced(
        self, talker_hidden: torch.Tensor, first_embed: torch.Tensor, codes: torch.Tensor
    ) -> torch.Tensor:
        """``run`` with every code known (a trainer's teacher-forced score): the ``G`` rows
        of each frame (talker hidden state, ``codec_embedding(code 0)``, then code ``j``'s
        embedding ``codec_embedding[j - 1]`` for ``j = 1 .. G - 2``) go through the stack in
        one causal forward of ``G`` rows per frame, instead of ``G - 1`` sub-steps over a
        growing per-frame cache. The same function of the weights (row ``j + 1`` of a frame
        sees rows ``0..j + 1``, as sub-step ``j`` did); the numbers equal ``run``'s within
        float32 rounding (GEMMs over ``G`` times the rows, one attention call per frame
        instead of one per sub-step), not to the bit, so batch-invariant scoring keeps
        ``run``. Autograd works.

        Args:
            talker_hidden, first_embed: ``[B, talker_hidden]`` as in ``run``.
            codes: LongTensor ``[B, G - 1]``: codes ``1 .. G - 1`` of each frame (the last is
                only scored, never fed).

        Returns:
            Raw logits ``[B, G - 1, vocab]`` float32, equal to ``run(..., choose)`` where
            ``choose`` returns ``codes[:, j]``.

        Raises:
            ValueError: ``codes`` of another shape.
        """
        batch, groups = talker_hidden.shape[0], self.config.num_code_groups
        if tuple(codes.shape) != (batch, groups - 1):
            raise ValueError(f"codes {tuple(codes.shape)} for {batch} frames of {groups} codes")
        fed = [self.codec_embedding[j][codes[:, j]] for j in range(groups - 2)]
        rows = torch.stack([talker_hidden.to(self.dtype), first_embed, *fed], dim=1)
        rows = rows.reshape(batch * groups, -1)  # [B * G, talker_hidden], frame by frame
        scale = self.config.stack.head_dim**-0.5

        def attend(_layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
            q = q.view(batch, groups, *q.shape[1:]).transpose(1, 2)  # [B, H, G, D]
            k = k.view(batch, groups, *k.shape[1:]).transpose(1, 2)  # [B, Hkv, G, D]
            v = v.view(batch, groups, *v.shape[1:]).transpose(1, 2)
            rep = q.shape[1] // k.shape[1]
            k, v = repeat_kv(k, rep), repeat_kv(v, rep)
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
            return out.transpose(1, 2).reshape(batch * groups, *out.shape[1:2], out.shape[-1])

        positions = torch.arange(groups, device=self.device).repeat(batch)
        hidden = self.llama.forward_attend(
            self._project(rows, groups), positions, attend, [groups] * batch, False
        ).view(batch, groups, -1)
        logits = [
            self._linear(hidden[:, j + 1], self.lm_head[j]).float() for j in range(groups - 1)
        ]
        return torch.stack(logits, dim=1)
