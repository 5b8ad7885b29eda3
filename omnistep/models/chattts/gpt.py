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

KV admission: blocks are allocated as sequences grow. A prefill that does not fit answers
``preempted`` (its loop retries later); a decode batch that does not fit preempts its youngest
sequences (freed; their loops recompute by a new prefill).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, fields
from pathlib import Path

import torch
from torch import nn

from omnistep.core import WorkUnitKind
from omnistep.kv import BlockManager, KVCacheConfig, SequenceTable
from omnistep.layers import AttentionMetadata, LlamaModel, PagedKVCache
from omnistep.layers.batch_invariant import map_row_chunks
from omnistep.layers.llama import LlamaConfigLite
from omnistep.loops.ar_decode import ARPrefillInput, ARStepInput, ARStepOutput
from omnistep.sampling import SamplingRow, sample


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


def fold_weight_norm(g: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``g * v / ||v||`` with the norm over all dims but 0 (``torch.nn.utils.weight_norm``,
    dim 0): ``g`` ``[out, 1]``, ``v`` ``[out, in]`` -> weight ``[out, in]``."""
    return g * v / v.norm(dim=1, keepdim=True)


class ChatTTSGPT:
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
        self.config = config
        self.device = torch.device(device)
        self.dtype = dtype
        self.batch_invariant = batch_invariant
        self.llama = LlamaModel(config.llama()).to(self.device, dtype).eval()
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
        self.text_mode: dict[str, bool] = {}
        head_dim = h // config.num_attention_heads
        self.cache = PagedKVCache(
            config.num_hidden_layers,
            kv.num_blocks,
            kv.block_size,
            config.num_key_value_heads,
            head_dim,
            dtype,
            self.device,
        )
        self.table = SequenceTable(BlockManager(kv.num_blocks, kv.block_size))
        self.blocks = self.table.blocks
        self.lengths = self.table.lengths  # tokens in the cache per sequence (shared dict)

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
        for j in range(self.config.num_vq):
            prefix = f"head_code.{j}.parametrizations.weight"
            w = fold_weight_norm(
                embed_state[f"{prefix}.original0"].float(),
                embed_state[f"{prefix}.original1"].float(),
            )
            self.head_code[j].copy_(w.to(self.dtype))
        prefix = "head_text.parametrizations.weight"
        w = fold_weight_norm(
            embed_state[f"{prefix}.original0"].float(), embed_state[f"{prefix}.original1"].float()
        )
        self.head_text[0].copy_(w.to(self.dtype))

    # ---------------------------------------------------------------- Component API
    def free_sequence(self, seq_id: str) -> None:
        """Free the sequence's KV blocks (idempotent)."""
        self.table.free(seq_id)
        self.text_mode.pop(seq_id, None)

    @torch.inference_mode()
    def execute(self, kind: WorkUnitKind, payloads: Sequence) -> list[ARStepOutput]:
        """Run a batch of PREFILL (``ARPrefillInput``) or AR_TOKEN (``ARStepInput``) units."""
        if kind is WorkUnitKind.PREFILL:
            return self._prefill(payloads)
        if kind is WorkUnitKind.AR_TOKEN:
            return self._decode(payloads)
        raise ValueError(f"ChatTTS GPT cannot run {kind}")

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
        seq_id = f"teacher-forced/{id(prompt)}"
        frames = [tuple(f) for f in frames]
        head = [] if incremental else frames
        unit = ARPrefillInput(seq_id, prompt, tuple(head), (), None, None)
        num_tokens = len(prompt.input_ids) + len(head)
        try:
            self.blocks.allocate(seq_id, num_tokens)
            self.lengths[seq_id] = num_tokens
            positions = torch.arange(num_tokens, device=self.device)
            hidden = self._forward(self._prompt_embeds(unit), positions, [seq_id], [num_tokens])
            rows = [hidden[len(prompt.input_ids) - 1 :]]
            for frame in frames if incremental else []:
                self.lengths[seq_id] += 1
                self.blocks.allocate(seq_id, self.lengths[seq_id])
                embeds = self._frame_embeds(
                    torch.tensor([frame], device=self.device), prompt.text_mode
                )
                position = torch.tensor([self.lengths[seq_id] - 1], device=self.device)
                rows.append(self._forward(embeds, position, [seq_id], [1]))
        finally:
            self.free_sequence(seq_id)
        # heads per forward, as generation applies them (the GEMM shape changes the last bits)
        return torch.cat([self._logits(r, prompt.text_mode) for r in rows]).float()

    # ---------------------------------------------------------------- prefill / decode
    def _prefill(self, units: Sequence[ARPrefillInput]) -> list[ARStepOutput]:
        results: list[ARStepOutput | None] = [None] * len(units)
        run: list[int] = []
        for i, unit in enumerate(units):
            num_tokens = len(unit.prompt.input_ids) + len(unit.generated)
            if not self.table.admit_prefill(unit.seq_id, num_tokens):
                results[i] = ARStepOutput(preempted=True)
                continue
            self.text_mode[unit.seq_id] = unit.prompt.text_mode
            run.append(i)
        if run:
            embeds = torch.cat([self._prompt_embeds(units[i]) for i in run])
            lens = [embeds_len for embeds_len in (self.lengths[units[i].seq_id] for i in run)]
            positions = torch.cat([torch.arange(n, device=self.device) for n in lens])
            hidden = self._forward(embeds, positions, [units[i].seq_id for i in run], lens)
            ends = torch.tensor(lens, device=self.device).cumsum(0) - 1
            for i, out in zip(
                run, self._sample(hidden[ends], [units[i] for i in run]), strict=True
            ):
                results[i] = out
        return results  # type: ignore[return-value]

    def _decode(self, units: Sequence[ARStepInput]) -> list[ARStepOutput]:
        keep = self._admit_decode(units)
        results: list[ARStepOutput] = [ARStepOutput(preempted=True)] * len(units)
        if keep:
            last = torch.tensor([units[i].last for i in keep], device=self.device)
            # one mode per batch: the loops' ShapeSignatures keep text and code units apart
            embeds = self._frame_embeds(last, self.text_mode[units[keep[0]].seq_id])  # [B, hidden]
            positions = torch.tensor(
                [self.lengths[units[i].seq_id] - 1 for i in keep], device=self.device
            )
            hidden = self._forward(
                embeds, positions, [units[i].seq_id for i in keep], [1] * len(keep)
            )
            for i, out in zip(keep, self._sample(hidden, [units[i] for i in keep]), strict=True):
                results[i] = out
        return results

    def _admit_decode(self, units: Sequence[ARStepInput]) -> list[int]:
        """Grow every sequence by one token, preempting the youngest if the pool runs out
        (``SequenceTable.grow``). Returns the indices that run."""
        return self.table.grow([u.seq_id for u in units])

    @property
    def num_preemptions(self) -> int:
        """Sequences freed so far to make room for older ones."""
        return self.table.num_preemptions

    def _forward(
        self,
        embeds: torch.Tensor,
        positions: torch.Tensor,
        seq_ids: list[str],
        query_lens: list[int],
    ) -> torch.Tensor:
        context_lens, block_tables = self.table.context(seq_ids)
        meta = AttentionMetadata.build(
            query_lens,
            context_lens,
            block_tables,
            self.blocks.block_size,
            self.device,
            batch_invariant=self.batch_invariant,
        )
        return self.llama(embeds.to(self.dtype), positions, self.cache, meta)

    def _logits(self, hidden: torch.Tensor, text_mode: bool = False) -> torch.Tensor:
        """Logits from hidden states ``[B, hidden]``: code ``[B, num_vq, num_audio_tokens]``,
        or text ``[B, 1, num_text_tokens]``."""
        weight = self.head_text if text_mode else self.head_code

        def heads(h: torch.Tensor) -> torch.Tensor:
            return torch.einsum("bh,jvh->bjv", h, weight)

        h = hidden.to(self.dtype)
        return map_row_chunks(heads, h) if self.batch_invariant else heads(h)

    def _sample(self, hidden: torch.Tensor, units: Sequence) -> list[ARStepOutput]:
        """Sample every row of ``hidden`` ``[B, hidden]`` with its unit's settings."""
        logits = self._logits(hidden, self.text_mode[units[0].seq_id])
        history = [self._history(u.history, logits.shape[1]) for u in units]
        num_generated = [
            len(u.generated) if isinstance(u, ARPrefillInput) else u.num_generated for u in units
        ]
        rows: list[SamplingRow] = [u.sampling for u in units]
        out = sample(logits.float(), rows, history, num_generated, [u.generator for u in units])
        tokens, logprobs = out.tokens.tolist(), out.logprobs.tolist()
        hidden_cpu = hidden.float().cpu()
        return [
            ARStepOutput(tuple(t), tuple(lp), hidden_cpu[b])
            for b, (t, lp) in enumerate(zip(tokens, logprobs, strict=True))
        ]

    def _history(self, frames: tuple[tuple[int, ...], ...], width: int) -> torch.Tensor:
        """``[width, T]`` long tensor of recent frames (width: ids per frame)."""
        if not frames:
            return torch.zeros(width, 0, dtype=torch.long, device=self.device)
        return torch.tensor(frames, dtype=torch.long, device=self.device).T

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
