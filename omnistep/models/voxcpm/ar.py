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
  ``min_new_tokens = min_len + 1``), or with a temperature (``stop_temperature``: a
  request's ``temperature``, 1.0 by default under ``flow_noise_level`` > 0) a draw from the
  stop head's softmax with the request's generator, before the step's noise;
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
RL: a prompt with ``noise_level`` a > 0 (the request's ``flow_noise_level``) solves every
patch as Flow-GRPO's SDE (``LocDiT.solve_sde``; its noise drawn from the request's generator
after the initial noise, ``_sde_noise``), and a recorded unit's ``hidden`` is then a
``SolvedPatch`` (chain, means, stds, Gaussian log-probs). ``score_patches`` recomputes a
recorded trajectory's stop and SDE log-probs teacher-forced (``DualStack.forward_packed``, then
``LocDiT.sde_step`` from each recorded state), bit-equal under ``batch_invariant``;
``weight_specs`` / ``update_weights`` / ``trainable_weights`` name the backbone's tensors as
the published ``model.safetensors`` does (``loader.published_name``).

Kept prefixes (``PagedARModel``'s "Prefixes"): a cloned voice's rows (``ref_audio_start``, the
clip's patches, ``ref_audio_end``: the first ``VoxCPMPrompt.voice_rows`` rows, the same whatever
the text) are ``_prompt_prefix``: every request of the voice prefills them apart from its text
rows; they are computed once and kept, and later requests of the voice share their blocks (in
both LMs' caches) and compute only their own rows. A kept prefix is found by the chained content
hash of its input rows, which hold the clip's raw latent patch (the ``P * C`` float bytes) and
its LocEnc embedding, not only ids: two clips of the same length never share. The zero-shot
voice has no voice rows (its prompt starts with the text).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from omnistep.core import SamplingParams
from omnistep.kv import KVCacheConfig
from omnistep.layers.batch_invariant import map_row_chunks
from omnistep.layers.llama import LlamaConfigLite
from omnistep.layers.paged_attention import AttentionMetadata, PagedKVCache
from omnistep.loops.ar_decode import ARPrefillInput, ARStepOutput
from omnistep.models.voxcpm.lm import Prompt, VoxCPMBackbone
from omnistep.models.voxcpm.loader import published_name
from omnistep.models.voxcpm.locdit import sde_steps
from omnistep.runners.flow_matching import gaussian_logprob
from omnistep.runners.paged_ar import SCORE_MODES, PagedARModel
from omnistep.sampling import SamplingRow

STOP = 1
"""The stop decision's id (upstream ``stop_flag == 1``)."""


def stop_sampling(min_len: int = 2, temperature: float = 0.0) -> SamplingRow:
    """The stop rule as sampler settings: no stop at step ``i <= min_len`` (upstream
    ``_inference``: ``if i > min_len and stop_flag == 1``), and the decision the argmax of
    the stop logits (``temperature`` 0, upstream's rule) or drawn from
    ``softmax(logits / temperature)`` with the request's generator (``stop_temperature``)."""
    return SamplingRow(temperature=temperature, min_new_tokens=min_len + 1, eos_token_id=STOP)


def stop_temperature(params: SamplingParams) -> float:
    """The stop decision's temperature for a request: its ``temperature`` when set (0: the
    argmax); unset, 1.0 for an SDE request (``flow_noise_level`` > 0: an RL rollout samples
    its whole policy, the stop from the stop head's softmax and the patches from the SDE, so
    both recorded log-probs are of the actions taken) and 0 otherwise (upstream's argmax)."""
    if params.temperature is not None:
        return float(params.temperature)
    return 1.0 if params.or_default("flow_noise_level", 0.0) > 0 else 0.0


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
        noise_level: the SDE noise scale a of every patch's solve
            (``SamplingParams.flow_noise_level``; 0: upstream's ODE).
        voice_rows: the prompt's first rows that are the voice's (a cloned voice:
            ``ref_audio_start``, its ``R`` patches, ``ref_audio_end``, so ``R + 2``), shared with
            every request of the voice (``VoxCPMAR._prompt_prefix``); 0: none (zero-shot).
    """

    rows: Prompt
    cfg_value: float = 2.0
    timesteps: int = 10
    patches: tuple[torch.Tensor, ...] = ()
    max_len: int | None = None
    noise_level: float = 0.0
    voice_rows: int = 0


@dataclass(frozen=True, eq=False)
class SolvedPatch:
    """A recorded step's patch solved as an SDE (``ARStepOutput.hidden`` of a unit with
    ``record`` and a noise level > 0; otherwise ``hidden`` is the patch alone).

    Attributes:
        patch: ``[P, C]`` float32, the step's patch (``states[-1]``).
        states: ``[S + 1, P, C]`` float32: the state before each of the S SDE steps, then the
            patch.
        means: ``[S, P, C]`` float32: each SDE step's Gaussian mean.
        stds: the S steps' standard deviations.
        logprobs: ``[S]`` float64: ``log N(states[s + 1]; means[s], stds[s]^2 I)`` summed
            over the patch's ``P * C`` elements.
    """

    patch: torch.Tensor
    states: torch.Tensor
    means: torch.Tensor
    stds: tuple[float, ...]
    logprobs: torch.Tensor


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
        lm, res_in = self._mix(base, embeds, audio, text)
        res = b.residual_lm(res_in, positions, cache.residual, meta)
        return torch.cat([lm, res, raw], dim=-1)

    def forward_packed(
        self,
        rows: torch.Tensor,
        seq_lens: Sequence[int],
        prefill_lens: Sequence[Any] | None = None,
        batch_invariant: bool = False,
        shared: Sequence[tuple[int, int] | None] | None = None,
        positions: torch.Tensor | None = None,
        expert_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``forward_dense`` of several whole sequences packed into one call
        (``LlamaModel.forward_packed`` for both LMs, with the same arguments; the quantizer and
        fusion row-wise between them): input rows ``[sum N_i, 2H + 2 + P C]`` -> ``[sum N_i,
        2H + P C]``. What ``TeacherForcedScorer.hidden_batch`` calls.

        Raises:
            ValueError: ``expert_ids`` (no MoE layers), or what ``forward_packed`` raises.
        """
        if expert_ids is not None:
            raise ValueError("VoxCPM's LMs have no MoE layers: no routing to replay")
        b, h = self.backbone, self.width
        combined, embeds = rows[:, :h], rows[:, h : 2 * h]
        audio, text, raw = (
            rows[:, 2 * h : 2 * h + 1],
            rows[:, 2 * h + 1 : 2 * h + 2],
            rows[:, 2 * h + 2 :],
        )
        args = (seq_lens, prefill_lens, batch_invariant, shared, positions)
        base = b.base_lm.forward_packed(combined, *args)
        lm, res_in = self._mix(base, embeds, audio, text)
        res = b.residual_lm.forward_packed(res_in, *args)
        return torch.cat([lm, res, raw], dim=-1)

    def _mix(self, base, embeds, audio, text) -> tuple[torch.Tensor, torch.Tensor]:  # noqa: ANN001
        """Row-wise: the quantizer on audio rows, then the fusion projection; ``(lm rows,
        residual LM inputs)``, each ``[N, H]``."""
        b, h = self.backbone, self.width

        def mix(x: torch.Tensor) -> torch.Tensor:
            base, embeds, audio, text = x[:, :h], x[:, h : 2 * h], x[:, -2:-1], x[:, -1:]
            lm = b.fsq_layer(base) * audio + base * text
            return torch.cat([lm, b.fusion_concat_proj(torch.cat([lm, embeds * audio], -1))], -1)

        mixed = torch.cat([base, embeds, audio, text], dim=-1)
        mixed = map_row_chunks(mix, mixed) if self.batch_invariant else mix(mixed)
        return mixed[:, :h], mixed[:, h:]


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
        # seq_id -> (cfg_value, timesteps, noise_level)
        self._settings: dict[str, tuple[float, int, float]] = {}
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
        # autograd as the caller's mode: serving runs under inference mode, scoring
        # (``TeacherForcedScorer.hidden_batch``) on a trainer's copy needs the graph to the LocEnc
        rows = self._prompt_inputs(prompt)
        if prompt.patches:
            patches = torch.stack(list(prompt.patches)).to(self.device, self.dtype)
            # the row chunks of ``_step_inputs``: a replayed row equals the step's own
            rows = torch.cat([rows, self._row_wise(self._patch_rows, patches)])
        return rows

    def _prompt_inputs(self, prompt: VoxCPMPrompt) -> torch.Tensor:
        """Input rows ``[L, in_dim]`` of the prompt rows (autograd as the caller's mode)."""
        p, dtype = prompt.rows, self.dtype
        combined, embeds = self.backbone.prompt_rows(_to(p, self.device, dtype))
        return self._input_rows(
            combined,
            embeds,
            p.audio_mask.to(self.device, dtype),
            p.text_mask.to(self.device, dtype),
            p.feats.to(self.device, dtype).flatten(1),
        )

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
        p = unit.prompt
        self._settings[unit.seq_id] = (p.cfg_value, p.timesteps, float(p.noise_level))

    def free_sequence(self, seq_id: str) -> None:
        """Free the sequence's KV blocks and its solve settings."""
        super().free_sequence(seq_id)
        self._settings.pop(seq_id, None)

    def _weight_tensors(self) -> dict[str, torch.Tensor]:
        """The backbone's parameters (both LMs, LocEnc, LocDiT, projections, stop head) by
        their names in the published ``model.safetensors`` (``loader.published_names``)."""
        return {published_name(n): t for n, t in self.backbone.named_parameters()}

    def _noise(self, unit: Any) -> torch.Tensor:
        """The step's initial LocDiT noise ``[C, P]`` (float32, standard normal, from the
        request's generator)."""
        gen = unit.generator
        device = gen.device if isinstance(gen, torch.Generator) else "cpu"
        return torch.randn(self.feat, self.patch, generator=gen, device=device)

    def _sde_noise(self, unit: Any, num_sde: int) -> torch.Tensor:
        """The step's SDE noise ``[S, C, P]`` (float32, standard normal), drawn from the
        request's generator after ``_noise`` and only for an SDE solve (an ODE request's
        stream stays upstream's)."""
        gen = unit.generator
        device = gen.device if isinstance(gen, torch.Generator) else "cpu"
        return torch.randn(num_sde, self.feat, self.patch, generator=gen, device=device)

    def _solve_rows(self, num_steps: int, noise_level: float) -> Any:
        """The row function of one solve group: packed rows ``[lm (H) | residual (H) |
        previous patch (P C) | noise ((1 + S) C P) | cfg (1)]`` -> ``[patch (C P) | states
        ((S + 1) C P) | means (S C P)]`` (S = 0 for an ODE)."""
        h, c, p = self.width, self.feat, self.patch
        num_sde = sde_steps(num_steps) if noise_level > 0 else 0

        def solve(x: torch.Tensor) -> torch.Tensor:
            mu = self.backbone.dit_condition(x[:, :h], x[:, h : 2 * h])
            rest = x[:, 2 * h :]
            cond = rest[:, : p * c].reshape(-1, p, c).transpose(1, 2)
            noise = rest[:, p * c : -1].reshape(-1, 1 + num_sde, c, p)
            est = self.backbone.estimator
            out, states, means = est.solve_sde(
                mu, cond, noise[:, 0], num_steps, rest[:, -1], noise_level, noise[:, 1:]
            )
            if not num_sde:
                return out.flatten(1)
            return torch.cat([out.flatten(1), states.flatten(1), means.flatten(1)], dim=-1)

        return solve

    def _sample(
        self, hidden: torch.Tensor, units: Sequence[Any], streams: Sequence[Any]
    ) -> list[ARStepOutput]:
        """The stop decision (the shared sampler), then every row's patch: one solve per
        (steps, noise level) group of rows (normally one), an SDE where the level is > 0."""
        outs = super()._sample(hidden, units, streams)
        settings = [self._settings[u.seq_id] for u in units]
        solved: list[Any] = [None] * len(units)
        with torch.no_grad():
            for n, level in dict.fromkeys((s, a) for _, s, a in settings):
                rows = [i for i, (_, s, a) in enumerate(settings) if (s, a) == (n, level)]
                num_sde = sde_steps(n) if level > 0 else 0
                noise = torch.stack(
                    [
                        torch.cat([self._noise(units[i])[None], self._sde_noise(units[i], num_sde)])
                        for i in rows
                    ]
                )
                noise = noise.to(hidden.device, hidden.dtype).flatten(1)
                cfg = torch.tensor([settings[i][0] for i in rows], dtype=hidden.dtype)
                index = torch.tensor(rows, device=hidden.device)
                # per row: [lm (H) | residual (H) | previous patch | noise | cfg (1)]
                packed = torch.cat([hidden[index], noise, cfg[:, None].to(hidden.device)], -1)
                out = self._row_wise(self._solve_rows(n, level), packed).float().cpu()
                est = self.backbone.estimator
                stds = est.sde_stds(n, level, hidden.dtype, hidden.device) if num_sde else ()
                for j, i in enumerate(rows):
                    solved[i] = self._solved(out[j], num_sde, stds, units[i].record)
        return [
            ARStepOutput(
                o.tokens, o.logprobs, patch, o.preempted, o.policy_logprobs, o.weight_version
            )
            for o, patch in zip(outs, solved, strict=True)
        ]

    def _solved(
        self, row: torch.Tensor, num_sde: int, stds: tuple[float, ...], record: bool
    ) -> torch.Tensor | SolvedPatch:
        """A solve row's patch ``[P, C]``, or its ``SolvedPatch`` for a recorded SDE step."""
        c, p = self.feat, self.patch
        patch = row[: c * p].view(c, p).T.contiguous()
        if not (record and num_sde):
            return patch
        states = row[c * p : c * p * (num_sde + 2)].view(num_sde + 1, c, p)
        means = row[c * p * (num_sde + 2) :].view(num_sde, c, p)
        # [C, P] order, as ``_score_sde`` sums them
        logprobs = torch.cat(
            [
                gaussian_logprob(states[s + 1 : s + 2], means[s : s + 1], stds[s])
                for s in range(num_sde)
            ]
        )
        states, means = states.transpose(1, 2), means.transpose(1, 2)
        return SolvedPatch(patch, states.contiguous(), means.contiguous(), stds, logprobs)

    # ------------------------------------------------------------ scoring (RL)
    def score_patches(
        self,
        prompt: VoxCPMPrompt,
        frames: Sequence[Sequence[int]],
        patches: torch.Tensor,
        sampling: SamplingRow,
        mode: str = "processed",
        states: torch.Tensor | None = None,
        noise_level: float = 0.0,
        match_serving: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The log-probs of one recorded trajectory, recomputed teacher-forced: the stop
        decisions and, for an SDE rollout, every patch's SDE steps. ``score_patches_batch``
        of one trajectory.

        Both LMs run over the prompt and the recorded patches but the last
        (``DualStack.forward_packed``, serving's attention calls with ``match_serving``, the
        same row chunks under ``batch_invariant``); each step's stop logits are scored as
        the sampler did (``mode``: processed or policy, ``sampling`` the loop's row, with the
        request's stop temperature: ``stop_sampling``); each recorded SDE step's mean is
        recomputed from its recorded state ``x_t`` by the LocDiT (``LocDiT.sde_step``:
        conditioning from that step's LM rows, the previous patch, the guided velocity, the
        drift correction) and scored as ``log N(x_next; mean, std^2 I)``. Autograd follows
        the caller's grad mode on a training copy (gradients reach the LMs, LocEnc and
        LocDiT); on the serving component never.

        Args:
            prompt: the loop's recorded prompt (``VoxCPMPrompt``).
            frames: ``T`` stop decisions (``(0,)`` / ``(1,)``), the last one included.
            patches: ``[T, P, C]`` every step's patch (the stop step's included).
            sampling: the loop's sampling row (``stop_sampling``).
            mode: ``"processed"`` or ``"policy"``.
            states: ``[T, S + 1, P, C]`` the SDE chains (``SolvedPatch.states``); None or
                ``S = 0``: no SDE steps.
            noise_level: the SDE's noise scale a.
            match_serving: serving's attention calls (see ``PagedARModel.score_logits``).

        Returns:
            ``(stop [T, 1] float32, sde [T, S] float64)`` on the component's device.

        Raises:
            ValueError: shapes that do not agree, an unknown mode.
        """
        [out] = self.score_patches_batch(
            [prompt], [frames], [patches], [sampling], mode, [states], [noise_level], match_serving
        )
        return out

    def score_patches_batch(
        self,
        prompts: Sequence[VoxCPMPrompt],
        frames: Sequence[Sequence[Sequence[int]]],
        patches: Sequence[torch.Tensor],
        samplings: Sequence[SamplingRow],
        mode: str = "processed",
        states: Sequence[torch.Tensor | None] | None = None,
        noise_levels: Sequence[float] | None = None,
        match_serving: bool = True,
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``score_patches`` of several trajectories packed: both LMs in one
        ``DualStack.forward_packed`` over every trajectory's rows (the shared
        ``TeacherForcedScorer.hidden_batch``: GEMMs over all rows, attention per trajectory),
        the stop head once over all their rows, and each SDE step's LocDiT mean once over
        the rows of every trajectory with the same solve (timesteps, noise level). Each
        trajectory's result equals its own ``score_patches`` to the bit under
        ``batch_invariant`` (row chunks), else within float rounding of the larger GEMMs.

        Args:
            prompts, frames, patches, samplings, mode, match_serving: per trajectory, as
                ``score_patches``' arguments.
            states: per trajectory ``score_patches``' ``states``; None: none has SDE steps.
            noise_levels: per trajectory its noise scale a; None: 0 for all.

        Returns:
            Per trajectory ``(stop [T_i, 1] float32, sde [T_i, S_i] float64)``, in order.

        Raises:
            ValueError: lists of different lengths, shapes that do not agree, an unknown mode.
        """
        count = len(prompts)
        states = [None] * count if states is None else list(states)
        levels = [0.0] * count if noise_levels is None else [float(a) for a in noise_levels]
        if not count or {len(frames), len(patches), len(samplings), len(states), len(levels)} != {
            count
        }:
            raise ValueError(f"{count} prompts: frames, patches, samplings, states must match")
        if mode not in SCORE_MODES:
            raise ValueError(f"mode must be one of {', '.join(SCORE_MODES)}, got {mode!r}")
        with torch.set_grad_enabled(torch.is_grad_enabled() and not self.serving):
            triples = zip(prompts, frames, patches, strict=True)
            replays = [self._replay_prompt(p, f, x) for p, f, x in triples]
            hidden = self.scorer.hidden_batch(replays, frames, match_serving)
            logits = torch.cat(self.scorer.heads(hidden, replays))
            tokens = [self.scorer.frame_tensor(f) for f in frames]
            logp = self.scorer.distribution(logits, tokens, samplings, mode, 0)
            stops = [stop for stop, _ in self.scorer.gather(logp, tokens, False)]
            sde = self._score_sde_batch(prompts, hidden, states, levels)
        return list(zip(stops, sde, strict=True))

    def _replay_prompt(
        self, prompt: VoxCPMPrompt, frames: Sequence[Sequence[int]], patches: torch.Tensor
    ) -> VoxCPMPrompt:
        """``prompt`` with the recorded patches but the last as its replayed ``patches`` (the
        rows ``_prefill_inputs`` feeds after the prompt, as a preempted request's replay).

        Raises:
            ValueError: not a ``VoxCPMPrompt``, or patches that are not ``[T, P, C]``.
        """
        if not isinstance(prompt, VoxCPMPrompt):
            raise ValueError(f"VoxCPM scores a VoxCPMPrompt, got {type(prompt).__name__}")
        steps = len(frames)
        if steps < 1 or tuple(patches.shape) != (steps, self.patch, self.feat):
            raise ValueError(
                f"{steps} frames need patches [{steps}, {self.patch}, {self.feat}], got "
                f"{tuple(patches.shape)}"
            )
        return dataclasses.replace(prompt, patches=tuple(patches[:-1]))

    def _score_sde_batch(
        self,
        prompts: Sequence[VoxCPMPrompt],
        hidden: Sequence[torch.Tensor],
        states: Sequence[torch.Tensor | None],
        levels: Sequence[float],
    ) -> list[torch.Tensor]:
        """Per trajectory the ``[T_i, S]`` float64 log-probs of its recorded SDE chain
        (``[T_i, 0]`` without one); trajectories with the same (timesteps, noise level) are
        scored together (``_score_sde`` over their concatenated rows)."""
        out: list[torch.Tensor] = [h.new_zeros(h.shape[0], 0, dtype=torch.float64) for h in hidden]
        groups: dict[tuple[int, float], list[int]] = {}
        for i, (prompt, chain) in enumerate(zip(prompts, states, strict=True)):
            if chain is None or chain.shape[1] < 2:
                continue
            if chain.shape[0] != hidden[i].shape[0]:
                raise ValueError(f"{hidden[i].shape[0]} frames but {chain.shape[0]} SDE chains")
            groups.setdefault((prompt.timesteps, levels[i]), []).append(i)
        for (timesteps, level), members in groups.items():
            rows = torch.cat([hidden[i] for i in members])
            chains = torch.cat([states[i] for i in members])  # type: ignore[misc]
            cfg = torch.cat(
                [hidden[i].new_full((hidden[i].shape[0], 1), prompts[i].cfg_value) for i in members]
            )
            scored = self._score_sde(timesteps, rows, chains, cfg, level)
            sizes = [hidden[i].shape[0] for i in members]
            for i, part in zip(members, scored.split(sizes), strict=True):
                out[i] = part
        return out

    def _score_sde(
        self,
        timesteps: int,
        hidden: torch.Tensor,
        states: torch.Tensor,
        cfg: torch.Tensor,
        noise_level: float,
    ) -> torch.Tensor:
        """``[T, S]`` float64 log-probs of recorded SDE chains ``states`` ``[T, S + 1, P,
        C]`` of a ``timesteps``-step solve, every step's mean recomputed from its recorded
        state (see ``score_patches``); ``hidden`` ``[T, 2H + P C]`` the rows each patch was
        solved from, ``cfg`` ``[T, 1]`` their guidance scales."""
        h, c, p = self.width, self.feat, self.patch
        steps, num_sde = states.shape[0], states.shape[1] - 1
        est = self.backbone.estimator
        n = timesteps
        if num_sde != sde_steps(n):
            raise ValueError(f"{num_sde} SDE steps recorded, a {n}-step solve has {sde_steps(n)}")
        schedule = est.schedule(n, hidden.dtype, hidden.device)
        stds = est.sde_stds(n, noise_level, hidden.dtype, hidden.device)
        zero_steps = n - num_sde
        x = states.to(hidden.device, hidden.dtype).transpose(2, 3).flatten(2)  # [T, S+1, C P]
        cfg = cfg.to(hidden.device, hidden.dtype)
        out = []
        for s in range(num_sde):
            step = zero_steps + s + 1

            def mean_rows(r: torch.Tensor, step: int = step) -> torch.Tensor:
                mu = self.backbone.dit_condition(r[:, :h], r[:, h : 2 * h])
                rest = r[:, 2 * h :]
                cond = rest[:, : p * c].reshape(-1, p, c).transpose(1, 2)
                z = rest[:, p * c : -1].reshape(-1, c, p)
                mean, _ = est.sde_step(mu, cond, z, schedule, step, rest[:, -1], noise_level)
                return mean.flatten(1)

            packed = torch.cat([hidden, x[:, s], cfg], dim=-1)
            mean = self._row_wise(mean_rows, packed).view(steps, c, p)
            target = x[:, s + 1].view(steps, c, p)
            out.append(gaussian_logprob(target, mean, stds[s]))
        return torch.stack(out, dim=1)


def _to(prompt: Prompt, device: torch.device, dtype: torch.dtype) -> Prompt:
    return Prompt(
        prompt.text_ids.to(device),
        prompt.text_mask.to(device, dtype),
        prompt.audio_mask.to(device, dtype),
        prompt.feats.to(device, dtype),
    )
