"""The ChatTTS GPT as a component: Llama backbone on a paged KV cache, text/code embeddings,
``num_vq`` code heads, and the multi-codebook sampler, batched across requests.

One ``execute`` call runs a batch of PREFILL units (varlen prompts, flattened) or of AR_TOKEN
units (one frame each) as a single forward, then samples every row with its own request's
settings and generator. Each output carries the step's last hidden state ``[hidden]``: ChatTTS's
default vocoder decodes hidden states, not codes.

Embeddings: prompt positions use ``emb_text``, except ``[spk_emb]`` positions, which hold the
L2-normalised speaker vector; code frames use ``sum_j emb_code[j](code_j)``. Heads: ``head_code``
are weight-normed linears, folded to plain weights at load time (``w = g * v / ||v||`` per
output row). Sources: ChatTTS 0.2.5 ``model/embed.py``, ``model/gpt.py`` (``generate``: the
hidden state at the last position is the one kept per frame), ``model/speaker.py`` (``apply``).

Prefill/decode, KV admission (a prefill that does not fit answers ``preempted``; a decode batch
that does not fit preempts its youngest sequences), batching and sampling are the shared
``omnistep.runners.paged_ar.PagedARModel``'s; this module configures its inputs, heads and stream.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, fields
from pathlib import Path

import torch
from torch import nn

from omnistep.kv import KVCacheConfig
from omnistep.layers.llama import LlamaConfigLite
from omnistep.layers.weight_norm import (
    check_weight_norms,
    fold_weight_norm,
    weight_norm_problems,
)
from omnistep.loops.ar_decode import ARPrefillInput, ARStepInput
from omnistep.runners.paged_ar import PagedARModel


@dataclass(frozen=True)
class GPTConfig:
    """ChatTTS GPT settings, from ``asset/gpt/config.json`` (a transformers LlamaConfig) and the
    card defaults for the ChatTTS-specific fields (``num_vq``, vocab sizes).

    Attributes: Llama fields as in ``transformers.LlamaConfig``; ``num_vq`` codebooks,
    ``num_audio_tokens`` per codebook (the last id is EOS), ``num_text_tokens``.
    """

    hidden_size: int = 768
    intermediate_size: int = 3072
    num_attention_heads: int = 12
    num_key_value_heads: int = 12
    num_hidden_layers: int = 20
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 4096
    num_vq: int = 4
    num_audio_tokens: int = 626
    num_text_tokens: int = 21178

    @classmethod
    def from_json(cls, path: Path, **overrides: int) -> GPTConfig:
        """Read the known fields of ``config.json``; ``num_key_value_heads`` defaults to heads."""
        raw = json.loads(Path(path).read_text())
        raw.setdefault("num_key_value_heads", raw.get("num_attention_heads", 12))
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in {**raw, **overrides}.items() if k in names})

    @property
    def eos_token_id(self) -> int:
        """The code EOS id: the last audio token."""
        return self.num_audio_tokens - 1

    def llama(self) -> LlamaConfigLite:
        return LlamaConfigLite(
            hidden_size=self.hidden_size,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_hidden_layers,
            rms_norm_eps=self.rms_norm_eps,
            rope_theta=self.rope_theta,
        )


@dataclass(frozen=True, slots=True)
class ChatTTSPromptInput:
    """The prompt of one request: text ids, the ``[spk_emb]`` positions and the speaker vector
    (``[hidden]`` float32, already L2-normalised; None when the prompt has no speaker).

    ``text_mode`` runs the refine-text stage: frames are single text ids, embedded with
    ``emb_text`` and scored by ``head_text`` (upstream ``generate(infer_text=True)``).
    """

    input_ids: tuple[int, ...]
    spk_positions: tuple[int, ...] = ()
    speaker: torch.Tensor | None = None
    text_mode: bool = False


def _weight_norm_parts(head: str) -> tuple[str, str]:
    """The checkpoint names of a weight-normed head's ``g`` and ``v`` (``asset/Embed``)."""
    return (
        f"{head}.parametrizations.weight.original0",
        f"{head}.parametrizations.weight.original1",
    )


class ChatTTSGPT(PagedARModel):
    """The GPT component (see module docstring).

    Args:
        config: model sizes.
        kv: KV pool size (blocks of ``block_size`` tokens).
        device: ``"cpu"``, ``"cuda"``, ``"cuda:N"``.
        dtype: compute dtype of the backbone and the cache.
        batch_invariant: a row's results do not depend on its batch (fixed-shape row chunks and
            per-sequence attention); slower, exact C3.
    """

    def __init__(
        self,
        config: GPTConfig,
        kv: KVCacheConfig,
        device: str = "cpu",
        dtype: torch.dtype = torch.float32,
        batch_invariant: bool = False,
    ):
        super().__init__(config.llama(), kv, device, dtype, batch_invariant, config.num_vq)
        self.config = config
        h = config.hidden_size
        self.emb_text = nn.Embedding(config.num_text_tokens, h).to(self.device, dtype)
        self.emb_code = nn.ModuleList(
            nn.Embedding(config.num_audio_tokens, h) for _ in range(config.num_vq)
        ).to(self.device, dtype)
        # [num_vq, num_audio_tokens, hidden], folded weight-norm heads
        self.head_code = torch.zeros(
            config.num_vq, config.num_audio_tokens, h, device=self.device, dtype=dtype
        )
        # [1, num_text_tokens, hidden]: the refine stage's head, shaped like one codebook
        self.head_text = torch.zeros(1, config.num_text_tokens, h, device=self.device, dtype=dtype)
        # the heads' weight-norm parts as the checkpoint names them, float32 (folded above)
        self.head_parts: dict[str, torch.Tensor] = {}
        self.text_mode: dict[str, bool] = {}

    # ---------------------------------------------------------------- weights
    def load_weights(
        self, gpt_state: dict[str, torch.Tensor], embed_state: dict[str, torch.Tensor]
    ) -> None:
        """Load ``asset/gpt/model.safetensors`` and ``asset/Embed.safetensors`` tensors.

        Raises:
            KeyError / RuntimeError: missing or mis-shaped tensors (named by torch).
        """
        llama_state = {
            k.removeprefix("model."): v
            for k, v in gpt_state.items()
            if not k.removeprefix("model.").startswith("embed_tokens")
        }
        self.llama.load_state_dict(llama_state, strict=True)
        self.emb_text.load_state_dict({"weight": embed_state["emb_text.weight"]})
        for j, emb in enumerate(self.emb_code):
            emb.load_state_dict({"weight": embed_state[f"emb_code.{j}.weight"]})
        self.head_parts = {
            name: embed_state[name].float().to(self.device)
            for head in self._heads()
            for name in _weight_norm_parts(head)
        }
        self._fold_heads(list(self._heads()))

    def _heads(self) -> dict[str, torch.Tensor]:
        """Each head's checkpoint name -> its folded weight (a row view of ``head_code`` or
        ``head_text``), the code heads first."""
        heads = {f"head_code.{j}": self.head_code[j] for j in range(self.config.num_vq)}
        return {**heads, "head_text": self.head_text[0]}

    def _folded(self, head: str) -> torch.Tensor:
        """The head's weight folded from its weight-norm parts (``layers.weight_norm.
        fold_weight_norm``, float32; differentiable in ``head_parts``).

        Raises:
            WeightNormError: a row of ``v`` with norm 0 (the head's ``original1`` named)."""
        g_name, v_name = _weight_norm_parts(head)
        return fold_weight_norm(self.head_parts[g_name], self.head_parts[v_name], 0, v_name)

    def _fold_heads(self, heads: list[str]) -> None:
        """Fold each named head's weight-norm parts into its plain weight (in float32, then
        the compute dtype)."""
        targets = self._heads()
        for head in heads:
            targets[head].copy_(self._folded(head).to(self.dtype))

    # ---------------------------------------------------------------- weight updates
    def _weight_tensors(self) -> dict[str, torch.Tensor]:
        """``asset/gpt/model.safetensors`` names (the Llama's ``layers.*`` and ``norm.weight``;
        its unused ``embed_tokens.weight`` is not a weight here) and ``asset/Embed.safetensors``
        names (embeddings, the heads' weight-norm parts)."""
        tensors = dict(self.llama.state_dict(keep_vars=True))
        tensors["emb_text.weight"] = self.emb_text.weight
        for j, emb in enumerate(self.emb_code):
            tensors[f"emb_code.{j}.weight"] = emb.weight
        return {**tensors, **self.head_parts}

    def _weights_updated(self, names: set[str]) -> None:
        self._fold_heads([h for h in self._heads() if names & set(_weight_norm_parts(h))])

    def weight_problems(self, tensors: dict[str, object]) -> list[str]:
        """What a weight update's values must not be beyond shape and dtype (``ModelInstance.
        check_weights`` asks before anything changes): a head's ``v`` (``original1``) with a
        row of norm 0 would fold to NaN (``layers.weight_norm.weight_norm_problem``)."""
        return list(weight_norm_problems(tensors, self._head_directions()).values())

    def _head_directions(self) -> dict[str, int]:
        """Each head's ``v`` name -> the dim its norm keeps (0: the output rows)."""
        return {_weight_norm_parts(head)[1]: 0 for head in self._heads()}

    def update_weights(self, tensors: dict[str, torch.Tensor]) -> None:
        """``PagedARModel.update_weights``, after ``weight_problems`` (also where no
        ``ModelInstance`` checked first, as in a Ray actor).

        Raises:
            WeightNormError: a head's ``v`` with a row of norm 0 (nothing changed).
        """
        check_weight_norms(tensors, self._head_directions())
        super().update_weights(tensors)

    @torch.inference_mode()
    def teacher_forced_logits(
        self,
        prompt: ChatTTSPromptInput,
        frames: Sequence[tuple[int, ...]] = (),
        incremental: bool = False,
    ) -> torch.Tensor:
        """Code logits ``[len(frames) + 1, num_vq, num_audio_tokens]`` (float32) of the prompt
        followed by ``frames``: row ``i`` is the distribution frame ``i`` was drawn from (row 0:
        after the prompt). Used by parity tests and the rollout gate C2.

        Args:
            incremental: feed the frames one decode step at a time, the path generation takes,
                so the logits are bit-identical to those the frames were sampled from (when the
                request ran alone, or in ``batch_invariant`` mode). False runs one forward over
                prompt and frames (other GEMM shapes: equal within ~1e-5).

        Raises:
            KVCacheFullError: the sequence does not fit the KV pool.
        """
        frames = tuple(tuple(f) for f in frames)
        seq_id = self.scorer.teacher_seq_id()
        head = () if incremental else frames
        first = ARPrefillInput(seq_id, prompt, head, (), None, None)
        steps = [ARStepInput(seq_id, f, i + 1, (), None, None) for i, f in enumerate(frames)]
        return self.scorer.teacher_forced(first, steps if incremental else [])

    # ---------------------------------------------------------------- PagedARModel hooks
    def free_sequence(self, seq_id: str) -> None:
        """Free the sequence's KV blocks (idempotent)."""
        super().free_sequence(seq_id)
        self.text_mode.pop(seq_id, None)

    def _on_admit(self, unit: ARPrefillInput) -> None:
        self.text_mode[unit.seq_id] = unit.prompt.text_mode

    def _prefill_inputs(self, unit: ARPrefillInput) -> torch.Tensor:
        return self._prompt_embeds(unit)

    def _step_inputs(self, units: Sequence[ARStepInput]) -> torch.Tensor:
        last = torch.tensor([u.last for u in units], device=self.device)
        # one mode per batch: the loops' ShapeSignatures keep text and code units apart
        return self._frame_embeds(last, self.text_mode[units[0].seq_id])  # [B, hidden]

    def _lm_inputs(self, rows: torch.Tensor, query_lens: list[int]) -> torch.Tensor:
        return rows.to(self.dtype)

    def _head(self, hidden: torch.Tensor, seq_id: str) -> torch.Tensor:
        """Code logits ``[B, num_vq, num_audio_tokens]``, or text ``[B, 1, num_text_tokens]``
        for a refine-text sequence."""
        weight = self.head_text if self.text_mode[seq_id] else self.head_code
        return self._rows(lambda h: torch.einsum("bh,jvh->bjv", h, weight), hidden.to(self.dtype))

    def _score_head(self, hidden: torch.Tensor, prompt: ChatTTSPromptInput) -> torch.Tensor:
        """``_head`` for the prompt's mode, its weights folded again from the weight-norm parts
        inside the graph (the same float32 fold as at load: equal values), so a loss reaches
        ``head_parts``."""
        heads = ["head_text"] if prompt.text_mode else list(self._heads())[:-1]
        if self.head_parts:
            weight = torch.stack([self._folded(h).to(self.dtype) for h in heads])
        else:  # no checkpoint loaded: the (zero) folded heads
            weight = self.head_text if prompt.text_mode else self.head_code
        return self._rows(lambda h: torch.einsum("bh,jvh->bjv", h, weight), hidden.to(self.dtype))

    def _score_head_key(self, prompt: ChatTTSPromptInput) -> bool:
        """Text-mode prompts share the text head, the others the code heads."""
        return prompt.text_mode

    def _streams(
        self, rows: torch.Tensor, hidden: torch.Tensor, lens: list[int], whole: list[bool]
    ) -> list[torch.Tensor]:
        """The last hidden state ``[hidden]`` float32 (CPU) of each sequence: the vocoder's
        input."""
        ends = torch.tensor(lens, device=self.device).cumsum(0) - 1
        return list(hidden[ends].float().cpu())

    def _frame_embeds(self, frames: torch.Tensor, text_mode: bool) -> torch.Tensor:
        """Embeddings ``[T, hidden]`` of generated frames ``[T, width]``."""
        return self.emb_text(frames[:, 0]) if text_mode else self._code_embeds(frames)

    def _code_embeds(self, frames: torch.Tensor) -> torch.Tensor:
        """``sum_j emb_code[j](frames[:, j])``: frames ``[T, num_vq]`` -> ``[T, hidden]``."""
        return torch.stack([emb(frames[:, j]) for j, emb in enumerate(self.emb_code)], 0).sum(0)

    def _prompt_embeds(self, unit: ARPrefillInput) -> torch.Tensor:
        prompt: ChatTTSPromptInput = unit.prompt
        ids = torch.tensor(prompt.input_ids, device=self.device)
        emb = self.emb_text(ids)
        if prompt.speaker is not None and prompt.spk_positions:
            emb[list(prompt.spk_positions)] = prompt.speaker.to(self.device, emb.dtype)
        if unit.generated:
            frames = torch.tensor(unit.generated, device=self.device)
            emb = torch.cat([emb, self._frame_embeds(frames, prompt.text_mode)])
        return emb
