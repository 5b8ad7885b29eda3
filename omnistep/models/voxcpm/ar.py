"""VoxCPM2's AR step on the shared paged-KV component: both LMs, the stop decision and the
LocDiT solve of the step's patch, batched across requests (the inner solve runs inside the AR
unit, as Qwen3-TTS's code predictor does; its steps are not WorkUnits of their own here).

``VoxCPMAR`` is a ``PagedARModel`` whose "stack" is ``DualStack``: the base LM, the quantizer,
the fusion projection and the residual LM run in one forward over the same rows, each LM on
its own paged cache (``DualCache``: one block table serves both, since every row is a row of
both LMs). An input row is ``[combined (H) | patch embedding (H) | audio flag | text flag |
the row's raw patch (P * C)]`` (``_prefill_inputs``, ``_step_inputs``); the stack's output row
is ``[lm row (H) | residual row (H) | raw patch]``. From the last row of each sequence:

- the frame is the stop decision, one id of a two-way vocabulary (0 continue, 1 stop) sampled
  by the shared sampler from ``stop_head(silu(stop_proj(lm)))``; ``stop_sampling`` gives
  upstream's rule (argmax, no stop before step ``min_len + 1``: EOS 1 with
  ``min_new_tokens = min_len + 1``);
- the step's patch (``ARStepOutput.hidden``, ``[P, C]`` float32) is the LocDiT solve from
  ``mu = dit_condition(lm, residual)`` and the previous patch (the last row's raw patch), with
  the request's noise (``[C, P]`` drawn from its generator; ``VoxCPMPrompt.cfg_value`` and
  ``timesteps``), every request of the batch in one solve.

The next step's unit carries the patch it feeds back in ``ARStepInput.extra`` (``[P, C]``); a
prefill that replays a preempted request lists the patches it had generated in
``VoxCPMPrompt.patches`` (``loop.VoxCPMLoop`` does both). Under ``batch_invariant`` the
LMs use their RowPlans and the row-wise parts here (quantizer/fusion, the step's LocEnc
embedding, the stop head, the LocDiT solve with its conditioning) run in fixed 16-row chunks
(``layers.batch_invariant.map_row_chunks``), so a request's patches do not depend on its batch.

Kept prefixes (``PagedARModel``'s "Prefixes"): a cloned voice's rows (``ref_audio_start``, the
clip's patches, ``ref_audio_end``: the first ``VoxCPMPrompt.voice_rows`` rows, the same whatever
the text) are ``_prompt_prefix``: every request of the voice prefills them apart from its text
rows; they are computed once and kept, and later requests of the voice share their blocks (in
both LMs' caches) and compute only their own rows. A kept prefix is found by the chained content
hash of its input rows, which hold the clip's raw latent patch (the ``P * C`` float bytes) and
its LocEnc embedding, not only ids: two clips of the same length never share. The zero-shot
voice has no voice rows (its prompt starts with the text).
Not yet: ``score_logits`` (a dense forward over both stacks).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from omnistep.kv import KVCacheConfig
from omnistep.layers.batch_invariant import map_row_chunks
from omnistep.layers.llama import LlamaConfigLite
from omnistep.layers.paged_attention import AttentionMetadata, PagedKVCache
from omnistep.loops.ar_decode import ARPrefillInput, ARStepOutput
from omnistep.models.voxcpm.lm import Prompt, VoxCPMBackbone
from omnistep.runners.paged_ar import PagedARModel
from omnistep.sampling import SamplingRow

STOP = 1
"""The stop decision's id (upstream ``stop_flag == 1``)."""


def stop_sampling(min_len: int = 2) -> SamplingRow:
    """Upstream's stop rule as sampler settings: argmax of the stop logits, and no stop at
    step ``i <= min_len`` (``_inference``: ``if i > min_len and stop_flag == 1``)."""
    return SamplingRow(temperature=0.0, min_new_tokens=min_len + 1, eos_token_id=STOP)


@dataclass(frozen=True)
class VoxCPMPrompt:
    """A PREFILL unit's prompt.

    Attributes:
        rows: the prompt rows (``lm.build_prompt``).
        cfg_value: LocDiT guidance scale (upstream default 2.0).
        timesteps: Euler steps of each patch's solve (upstream ``inference_timesteps``, 10).
        patches: patches generated before a preemption, ``[P, C]`` each, replayed in order.
        max_len: most patches the request generates (upstream ``_generate``'s
            ``min(int(text_len * 6 + 10), max_len)``; read by ``loop.VoxCPMLoop``); None: the
            loop's cap only.
        voice_rows: the prompt's first rows that are the voice's (a cloned voice:
            ``ref_audio_start``, its ``R`` patches, ``ref_audio_end``, so ``R + 2``), shared with
            every request of the voice (``VoxCPMAR._prompt_prefix``); 0: none (zero-shot).
    """

    rows: Prompt
    cfg_value: float = 2.0
    timesteps: int = 10
    patches: tuple[torch.Tensor, ...] = ()
    max_len: int | None = None
    voice_rows: int = 0


class DualCache:
    """The base LM's and the residual LM's paged caches, indexed by the same block tables."""

    def __init__(self, base: PagedKVCache, residual: PagedKVCache):
        self.base, self.residual = base, residual

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write in both caches."""
        self.base.copy_blocks(pairs)
        self.residual.copy_blocks(pairs)


class DualStack(nn.Module):
    """Base LM -> quantizer / fusion -> residual LM over one batch of rows (the backbone's own
    modules, shared with it)."""

    def __init__(self, backbone: VoxCPMBackbone, batch_invariant: bool = False):
        super().__init__()
        self.backbone = backbone
        self.config = backbone.base_lm.config
        self.width = backbone.config.hidden_size
        self.batch_invariant = batch_invariant

    def make_cache(self, num_blocks: int, block_size: int) -> DualCache:
        return DualCache(
            self.backbone.base_lm.make_cache(num_blocks, block_size),
            self.backbone.residual_lm.make_cache(num_blocks, block_size),
        )

    def forward(
        self,
        rows: torch.Tensor,
        positions: torch.Tensor,
        cache: DualCache,
        meta: AttentionMetadata,
        routing: list[torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Input rows ``[N, 2H + 2 + P C]`` -> ``[N, 2H + P C]`` (see the module docstring)."""
        b, h = self.backbone, self.width
        combined, embeds = rows[:, :h], rows[:, h : 2 * h]
        audio, text, raw = (
            rows[:, 2 * h : 2 * h + 1],
            rows[:, 2 * h + 1 : 2 * h + 2],
            rows[:, 2 * h + 2 :],
        )
        base = b.base_lm(combined, positions, cache.base, meta)

        def mix(x: torch.Tensor) -> torch.Tensor:  # row-wise: quantizer, then fusion
            base, embeds, audio, text = x[:, :h], x[:, h : 2 * h], x[:, -2:-1], x[:, -1:]
            lm = b.fsq_layer(base) * audio + base * text
            return torch.cat([lm, b.fusion_concat_proj(torch.cat([lm, embeds * audio], -1))], -1)

        mixed = torch.cat([base, embeds, audio, text], dim=-1)
        mixed = map_row_chunks(mix, mixed) if self.batch_invariant else mix(mixed)
        lm, res_in = mixed[:, :h], mixed[:, h:]
        res = b.residual_lm(res_in, positions, cache.residual, meta)
        return torch.cat([lm, res, raw], dim=-1)


class VoxCPMAR(PagedARModel):
    """The AR component (PREFILL and AR_TOKEN units; see the module docstring).

    Args:
        backbone: the loaded ``VoxCPMBackbone`` (its modules are used in place).
        kv: KV pool size (each block holds rows of both LMs).
        device, dtype, batch_invariant: as ``PagedARModel``'s.
    """

    def __init__(
        self,
        backbone: VoxCPMBackbone,
        kv: KVCacheConfig,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        batch_invariant: bool = False,
    ):
        self.backbone = backbone
        config = backbone.config
        self.width, self.patch, self.feat = config.hidden_size, config.patch_size, config.feat_dim
        self._settings: dict[str, tuple[float, int]] = {}  # seq_id -> (cfg_value, timesteps)
        self._batch_invariant = batch_invariant
        super().__init__(config.base_lm(), kv, device, dtype, batch_invariant)

    def _make_stack(self, llama: LlamaConfigLite, dtype: torch.dtype) -> DualStack:
        return DualStack(self.backbone.to(self.device, dtype), self._batch_invariant)

    def _input_rows(self, combined, embeds, audio, text, raw) -> torch.Tensor:  # noqa: ANN001
        return torch.cat([combined, embeds, audio[:, None], text[:, None], raw], dim=-1)

    def _prefill_inputs(self, unit: ARPrefillInput) -> torch.Tensor:
        prompt: VoxCPMPrompt = unit.prompt
        if not isinstance(prompt, VoxCPMPrompt):
            raise ValueError(f"a VoxCPM prefill needs a VoxCPMPrompt, got {type(prompt).__name__}")
        if len(prompt.patches) != len(unit.generated):
            raise ValueError(
                f"{len(unit.generated)} generated frames but {len(prompt.patches)} patches"
            )
        p = prompt.rows
        dtype = self.dtype
        with torch.no_grad():
            combined, embeds = self.backbone.prompt_rows(_to(p, self.device, dtype))
            rows = self._input_rows(
                combined,
                embeds,
                p.audio_mask.to(self.device, dtype),
                p.text_mask.to(self.device, dtype),
                p.feats.to(self.device, dtype).flatten(1),
            )
            if prompt.patches:
                patches = torch.stack(list(prompt.patches)).to(self.device, dtype)
                rows = torch.cat([rows, self._patch_rows(patches)])
        return rows

    def _patch_rows(self, patches: torch.Tensor) -> torch.Tensor:
        """Input rows ``[T, in_dim]`` of generated patches ``[T, P, C]``."""
        embeds = self.backbone.embed_patches(patches)
        ones = torch.ones(len(patches), dtype=embeds.dtype, device=embeds.device)
        return self._input_rows(embeds, embeds, ones, ones * 0, patches.flatten(1))

    def _step_inputs(self, units: Sequence[Any]) -> torch.Tensor:
        if any(not isinstance(u.extra, torch.Tensor) for u in units):
            raise ValueError("a VoxCPM step needs its previous patch [P, C] in ARStepInput.extra")
        patches = torch.stack([u.extra for u in units]).to(self.device, self.dtype)
        with torch.no_grad():
            return self._row_wise(self._patch_rows, patches)

    def _row_wise(self, fn: Any, x: torch.Tensor) -> torch.Tensor:
        """``fn`` over rows ``[B, ...]``: in fixed 16-row chunks under ``batch_invariant`` (so
        a row's result does not depend on the batch), else at once."""
        return map_row_chunks(fn, x) if self._batch_invariant else fn(x)

    def _head(self, hidden: torch.Tensor, seq_id: str) -> torch.Tensor:
        logits = self._row_wise(self.backbone.stop_logits, hidden[:, : self.width])
        return logits.unsqueeze(1)  # [B, 1, 2]

    def _prompt_prefix(self, prompt: VoxCPMPrompt) -> tuple[tuple[str, int], int] | None:
        """A cloned voice's rows (``VoxCPMPrompt.voice_rows``), labelled ``("voice", R + 2)``;
        the kept copy is found by the rows' content hash (the module docstring's "Kept
        prefixes"). None for the zero-shot voice."""
        n = getattr(prompt, "voice_rows", 0)
        return ("voice", n) if n > 0 else None

    def _on_admit(self, unit: ARPrefillInput) -> None:
        self._settings[unit.seq_id] = (unit.prompt.cfg_value, unit.prompt.timesteps)

    def free_sequence(self, seq_id: str) -> None:
        """Free the sequence's KV blocks and its solve settings."""
        super().free_sequence(seq_id)
        self._settings.pop(seq_id, None)

    def _noise(self, unit: Any) -> torch.Tensor:
        """The step's initial LocDiT noise ``[C, P]`` (float32, standard normal, from the
        request's generator)."""
        gen = unit.generator
        device = gen.device if isinstance(gen, torch.Generator) else "cpu"
        return torch.randn(self.feat, self.patch, generator=gen, device=device)

    def _sample(
        self, hidden: torch.Tensor, units: Sequence[Any], streams: Sequence[Any]
    ) -> list[ARStepOutput]:
        """The stop decision (the shared sampler), then every row's patch in one solve."""
        outs = super()._sample(hidden, units, streams)
        h = self.width
        lm, res, raw = hidden[:, :h], hidden[:, h : 2 * h], hidden[:, 2 * h :]
        settings = [self._settings[u.seq_id] for u in units]
        steps = {s for _, s in settings}
        c, p = self.feat, self.patch
        with torch.no_grad():
            noise = torch.stack([self._noise(u) for u in units]).to(hidden.device, hidden.dtype)
            cfg = torch.tensor([g for g, _ in settings], dtype=hidden.dtype, device=hidden.device)
            # per row: [lm (H) | residual (H) | previous patch (C P) | noise (C P) | cfg (1)]
            packed = torch.cat([lm, res, raw, noise.flatten(1), cfg[:, None]], dim=-1)
            patches = torch.empty_like(noise)
            for n in steps:  # one solve per distinct step count (normally one)

                def solve(x: torch.Tensor, n: int = n) -> torch.Tensor:
                    mu = self.backbone.dit_condition(x[:, :h], x[:, h : 2 * h])
                    rest = x[:, 2 * h :]
                    cond = rest[:, : p * c].reshape(-1, p, c).transpose(1, 2)
                    z = rest[:, p * c : 2 * p * c].reshape(-1, c, p)
                    out = self.backbone.estimator.solve(mu, cond, z, n, rest[:, -1])
                    return out.flatten(1)

                rows = [i for i, (_, s) in enumerate(settings) if s == n]
                index = torch.tensor(rows, device=hidden.device)
                patches[index] = self._row_wise(solve, packed[index]).view(-1, c, p)
        patches = patches.transpose(1, 2).float().cpu()  # [B, P, C]
        return [
            ARStepOutput(
                o.tokens, o.logprobs, patch, o.preempted, o.policy_logprobs, o.weight_version
            )
            for o, patch in zip(outs, patches, strict=True)
        ]


def _to(prompt: Prompt, device: torch.device, dtype: torch.dtype) -> Prompt:
    return Prompt(
        prompt.text_ids.to(device),
        prompt.text_mask.to(device, dtype),
        prompt.audio_mask.to(device, dtype),
        prompt.feats.to(device, dtype),
    )
