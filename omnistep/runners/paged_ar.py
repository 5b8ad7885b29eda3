"""The shared paged-KV autoregressive component every AR family configures.

``PagedARModel`` runs prefill and decode of a decoder stack (``LlamaModel``: Llama, or Qwen2 with
q/k/v bias) over input rows on a paged KV cache, batched across requests, and samples each
sequence's next frame with its own settings and generator. One ``execute`` call runs a batch of
PREFILL units (varlen prompts, flattened into one forward) or of AR_TOKEN units (one frame each);
a batch of one takes the same path. A family subclass says only what is its own:

    _prefill_inputs(unit)   input rows ``[prompt rows + len(unit.generated), in_dim]``
    _step_inputs(units)     input rows ``[B, in_dim]``: each unit's ``last`` frame
    _lm_inputs(rows, lens)  ``inputs_embeds`` ``[N, hidden]`` of the stack (default: the rows)
    _after_layer(rows)      a hook between the stack's layers for a forward (default: none)
    _make_stack(cfg, dtype) the decoder stack (default: ``LlamaModel``)
    _head(hidden, seq_id)   logits ``[B, num_codebooks, vocab]`` of final hidden states
    _sampling_logits(l)     logits as the sampler sees them (default: unchanged)
    _score_head(h, prompt)  ``_head`` for ``score_logits``: chosen by the prompt, not by a
                            sequence, and differentiable in the weights it derives from
                            (default: ``_head``)
    _stream(rows, hidden)   what each output carries in ``ARStepOutput.hidden`` (default: None)
    _prompt_positions(p)    ``(positions [position_rows, L], delta)`` of a prompt whose rows do
                            not sit at ``0..L-1`` (M-RoPE media prompts; later rows continue at
                            ``index + delta``, decode steps too); default None: row indices

Frames are tuples of ``num_codebooks`` ids (1 for a text LM, 4 for ChatTTS's codebooks).

Classifier-free guidance (``_guidance``, ``_unconditional_inputs``): a family whose prompt names
a guidance weight ``w`` gets a second, unconditional sequence per request (``uncond_id``), fed
the rows ``_unconditional_inputs`` gives for the prompt and the same frames as the conditional
one. The two are admitted together (both or neither), run in the same forward of every step,
grown, preempted and freed together; the sampler sees ``cond + w * (cond - uncond)`` (Chatterbox
T3, upstream ``t3.py``), so the log-probs a step reports are of the guided distribution it
sampled from; ``score_logits`` scores a guided prompt the same way (a teacher-forced forward of
each row, guided logits). A guided prompt is prefilled whole (no kept prefix, no group
sharing).

KV admission: the component is the scheduler's ``omnistep.kv.KVPool``. ``admit`` takes a
prefill's blocks when they fit (after its shared prefix or group prompt), and the scheduler runs
only admitted prefills; ``can_append`` says whether a decode batch's next tokens fit, and the
scheduler ``preempt``s the least urgent sequences until they do (freed; their steps answer
``preempted`` and their loops recompute by a new prefill). Called directly (tests, a component
in a Ray actor), ``execute`` admits by itself: a prefill that does not fit answers ``preempted``
(counted in ``num_refused_prefills``) and a decode batch that does not fit preempts its youngest
sequences (``omnistep.kv.SequenceTable.grow``).

Groups (``ARPrefillInput.share_group``, a rollout's samples of one input): a fresh prefill whose
group already holds an equal prompt (equal rows, found by their chained content hash,
``omnistep.kv.chain_hashes``; every family shares so, with no hook) is not computed again. The
new sequence starts on that prompt's blocks by reference (``SequenceTable.fork``), its first
frame is sampled with its own generator from the prompt's kept last hidden state, and a block it
shares is copied before it writes there (copy-on-write, ``PagedKVCache.copy_blocks``). Members
of one group in one prefill batch: the first computes, the others fork from it. The kept prompt
lives as long as the sequence that computed it.

Prefixes (``_prompt_prefix``, across requests): a family may name a prefix of a prompt's rows
shared by other requests (Qwen3-TTS: a voice's rows, whatever the text). The block manager
finds a kept copy by the chained content hash of those rows (``BlockManager.cache`` /
``match`` / ``share``, as vLLM's and nano-vllm's prefix caching); the family only says where
the prefix ends. A prefill of
such a prompt (fresh, or a replay after a preemption) always runs split, whether or not the
prefix is kept, so a request's numbers never depend on what ran before it: the prefix's K/V come
from a kept prefix sequence (computed once by a prefill of the prefix rows alone, positions
``0..n-1``), the request's sequence shares its blocks (full blocks by reference, the partly
filled last one copied before the request writes there), and a suffix prefill computes the remaining
rows (positions ``n..``, attending to prefix + suffix). Kept prefixes live in an LRU of at most
``max_kept_prefixes``; when an admission (a prefill, or a decode step's growth, before it
preempts anyone) lacks blocks, the least recently used are evicted (never one a fork of the same
batch uses), and as a last resort a request takes its prefix's blocks over (the prefix is then
no longer kept): a request never needs more blocks than its whole prefill. ``kv_blocks``
reports blocks only kept prefixes hold as free (the engine's ``kv_blocks_used`` counts blocks
requests hold); ``drop_prefixes`` frees them; a weight update drops them all. Scoring with
``match_serving`` runs the same two prefill pieces. Families with ``stream_prompt_rows`` are not
split. Groups work on top: a group's first member computes (split), the others fork it whole.

Prefix caching (``prefix_caching``, per request by ``ARPrefillInput.cache_salt``; vLLM's
automatic prefix caching with its ``cache_salt``): a salted sequence's rows are hashed as
they are fed (each row's input bytes and rope positions, keyed by the salt; chained per
block, ``omnistep.kv.chain_hashes``), and when it ends (finished or aborted, not preempted)
its full blocks are registered in the block manager's evictable cache
(``BlockManager.cache(keep=True)``): held by no one, counted as free, evicted least recently
freed first only when an admission needs their room. A later prefill with the same salt
``match``es the longest cached prefix of its rows (all but its last row), starts on those
blocks by reference and computes only the rest (positions continue). A family with
``stream_prompt_rows`` keeps the streamed rows of each cached block beside it, so a fresh
prefill still streams one row per prompt row; a MoE stack keeps each cached block's routing
beside it too (and a kept prefix its rows'), so a prompt that starts on reused rows reports
the routing of every row (``ARStepOutput.prompt_routing``). ``num_prefill_rows`` counts the
rows prefill forwards computed, ``num_cached_rows`` those taken from the cache. Unsalted
prefills (the default) never look: their numbers never depend on what ran before.

Streams (``ARStepOutput.hidden``): with ``stream_prompt_rows`` (the Qwen thinker, whose every fed
token conditions the talker) a fresh prefill streams one row per prompt row and a replay after a
preemption only its last row; otherwise every output streams its last row only (ChatTTS: the
hidden state its vocoder decodes).

Train = serve (``score_logits``, ``score_logprobs``): a teacher-forced forward of a recorded
trajectory through the same hooks and layers with no paged cache and autograd on
(``LlamaModel.forward_dense``), so a trainer's loss backpropagates into the component's own
weights (``trainable_weights``). With ``match_serving`` (the default) every row runs the
attention call and kernel shapes serving ran (the prompt as one prefill, each later frame as one
decode step; in ``batch_invariant`` mode the same row chunks): the log-probs then equal the
recorded ones to float32 rounding of the last bit or better (tests/test_score.py measures it).
It touches neither the cache nor any per-sequence state: a trainer may call it while the
component serves. ``score_batch`` packs several trajectories into one such forward
(``LlamaModel.forward_packed``: the GEMMs over all their rows, attention per sequence), equal
to scoring each alone to the bit in ``batch_invariant`` mode and within float rounding
otherwise, and can add each step's entropy per codebook.

Collaborators: the model keeps admission, ``execute`` (prefill and decode), the forward and
sampling, and calls one object per other concern, each in its own module: ``groups``
(``GroupPrompts``), ``prefixes`` (``KeptPrefixes``) and ``prefix_cache`` (``PrefixCache``) in
``ar_prefix``; ``positions`` (``PromptPositions``, ``ar_positions``); ``guidance``
(``Guidance``, ``ar_guidance``); ``moe_routing`` (``RoutingRecorder``, ``ar_routing``);
``scorer`` (``TeacherForcedScorer``, ``ar_scoring``). The hooks above stay the model's.

Imports torch, ``omnistep.core``, ``omnistep.kv``, the AR loop's payload types
(``omnistep.loops.ar_decode``), ``omnistep.sampling`` and the other layers.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from omnistep.core import WorkUnitKind
from omnistep.kv import BlockManager, KVCacheConfig, KVCacheFullError, SequenceTable
from omnistep.layers.batch_invariant import map_row_chunks
from omnistep.layers.linear import linear
from omnistep.layers.llama import LlamaConfigLite, LlamaModel
from omnistep.layers.paged_attention import AttentionMetadata
from omnistep.layers.training import require_training_copy, training_copy
from omnistep.loops.ar_decode import ARPrefillInput, ARStepOutput
from omnistep.runners.ar_guidance import UNCOND_SUFFIX, Guidance, uncond_id
from omnistep.runners.ar_positions import PromptPositions
from omnistep.runners.ar_prefix import (
    GroupPrompts,
    KeptPrefixes,
    PrefixCache,
    PrefixJobs,
    SharedPrompt,
    prefix_split,
)
from omnistep.runners.ar_routing import RoutingRecorder
from omnistep.runners.ar_scoring import SCORE_MODES, TeacherForcedScorer
from omnistep.sampling import SamplingRow, sample

__all__ = ["SCORE_MODES", "UNCOND_SUFFIX", "PagedARModel", "uncond_id"]


@dataclass(frozen=True)
class _Entry:
    """An admitted prefill: the rows to compute (those past its kept prefix or cached
    prefix), or None for a group member that forks its group's prompt (``key``);
    ``cached_stream``: the streamed rows ``[n, ...]`` of a cached prefix, streamed before the
    computed rows'; ``num_cached``: the rows taken from the prefix cache; ``prefix``: the key
    of the kept prefix its first rows come from; ``cached_routing``: the MoE routing
    ``[n, layers, k]`` of its cached rows (None: none cached, or unknown)."""

    unit: ARPrefillInput
    rows: torch.Tensor | None
    key: Hashable | None
    cached_stream: torch.Tensor | None = None
    num_cached: int = 0
    prefix: Hashable | None = None
    cached_routing: torch.Tensor | None = None


@dataclass
class _Admitted:
    """The prefills admitted for the next PREFILL batch, and what they hold together."""

    entries: dict[str, _Entry] = field(default_factory=dict)
    computing: set[Hashable] = field(default_factory=set)  # group prompts a member computes
    # kept prefixes made for the batch, computed before its prefills: key -> (rows, table)
    prefixes: PrefixJobs = field(default_factory=dict)
    pinned: set[Hashable] = field(default_factory=set)  # kept prefixes it forks: not evicted


class PagedARModel:
    """Prefill/decode of a decoder stack on a paged KV cache, batched across requests (see the
    module docstring for the subclass hooks and the collaborators).

    Args:
        llama: the decoder stack's sizes.
        kv: KV pool size (blocks of ``block_size`` tokens).
        device: ``"cpu"``, ``"cuda"``, ``"cuda:N"``.
        dtype: compute dtype of weights and cache.
        batch_invariant: a sequence's results do not depend on its batch (fixed-shape row
            chunks, per-sequence attention); slower, bit-exact C3.
        num_codebooks: ids per frame (the width of the repetition-penalty history).

    Attributes:
        llama: the ``LlamaModel`` stack; ``cache``: its ``PagedKVCache``; ``table``: the
            ``SequenceTable`` (``blocks``, ``lengths``: tokens in the cache per sequence).
        groups, prefixes, prefix_cache, positions, guidance, moe_routing, scorer: the
            collaborators (the module docstring).
    """

    stream_prompt_rows: bool = False
    """A fresh prefill streams one row per prompt row (else only the last row)."""

    max_kept_prefixes: int = 16
    """Prompt prefixes (``_prompt_prefix``) kept at most; the least recently used go first."""

    prefix_caching: bool = False
    """Salted prefills (``ARPrefillInput.cache_salt``) reuse cached prefixes and leave their
    blocks cached (the module docstring's "Prefix caching"); False ignores the salt."""

    serving: bool = True
    """False on a ``training_copy``: it scores and trains, and never runs units."""

    position_rows: int = 1
    """Rows of rope positions the stack takes: 1, or 3 for an M-RoPE family (its
    ``llama.rotary_emb`` an ``MRotaryEmbedding``)."""

    _expert_prefix: str | None = None
    """The checkpoint's name of the stack (e.g. ``"thinker.model."``) for the per-expert
    aliases of ``_weight_aliases``; None: none."""

    SERVING_STATE = (
        "cache",
        "table",
        "blocks",
        "lengths",
        "groups",
        "prefixes",
        "prefix_cache",
        "guidance",
        "_admitted",
        "_waiting_rows",
    )
    """Attributes a ``training_copy`` leaves out (the KV pool and its bookkeeping; it keeps
    ``positions``, ``moe_routing`` and ``scorer``, which scoring uses)."""

    def __init__(
        self,
        llama: LlamaConfigLite,
        kv: KVCacheConfig,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        batch_invariant: bool = False,
        num_codebooks: int = 1,
    ):
        self.device = torch.device(device)
        self.dtype = dtype
        self.batch_invariant = batch_invariant
        self.num_codebooks = num_codebooks
        self.llama = self._make_stack(llama, dtype).eval()
        self.cache = self.llama.make_cache(kv.num_blocks, kv.block_size)
        self.table = SequenceTable(BlockManager.from_config(kv))
        self.blocks = self.table.blocks
        self.lengths = self.table.lengths  # tokens in the cache per sequence (shared dict)
        self.groups = GroupPrompts(self)
        self.prefixes = KeptPrefixes(self)
        self.prefix_cache = PrefixCache(self)
        self.positions = PromptPositions(self)
        self.guidance = Guidance(self)
        self.moe_routing = RoutingRecorder(self)
        self.scorer = TeacherForcedScorer(self)
        self._admitted: _Admitted | None = None  # prefills ``admit`` took blocks for
        self._waiting_rows: tuple[ARPrefillInput, torch.Tensor] | None = None  # not admitted
        self.num_prefill_rows = 0
        """Rows prefill forwards computed (prompts, replays, kept prefixes)."""
        self.num_cached_rows = 0
        """Prompt rows taken from the prefix cache instead of computed."""
        self.num_refused_prefills = 0
        """Prefills ``execute`` found no room for (answered preempted): 0 when the scheduler
        admits them (``admit``)."""
        self.weight_version = 0
        self.last_routing: torch.Tensor | None = None
        """A MoE stack's routing in its last forward: LongTensor ``[N, sparse layers, k]``, the
        experts each row went to (most probable first), rows in that forward's order; None for
        a dense stack. A family reads it right after ``_forward`` (e.g. to keep it per
        sequence for a rollout)."""

    # ------------------------------------------------------------ subclass hooks
    def _make_stack(self, llama: LlamaConfigLite, dtype: torch.dtype) -> LlamaModel:
        """The decoder stack, built once at construction (on ``self.device``): a
        ``LlamaModel`` by default; a family whose layers differ (Higgs Audio v2's DualFFN)
        returns its ``LlamaModel`` subclass."""
        return LlamaModel(llama, device=self.device, dtype=dtype)

    def _prefill_inputs(self, unit: ARPrefillInput) -> torch.Tensor:
        """Input rows ``[prompt rows + len(unit.generated), in_dim]`` (compute dtype, on the
        device); raises ValueError for a malformed prompt."""
        raise NotImplementedError

    def _step_inputs(self, units: Sequence[Any]) -> torch.Tensor:
        """Input rows ``[B, in_dim]`` of one decode step per unit (its ``last`` frame)."""
        raise NotImplementedError

    def _head(self, hidden: torch.Tensor, seq_id: str) -> torch.Tensor:
        """Logits ``[B, num_codebooks, vocab]`` (compute dtype) of final hidden states
        ``[B, hidden]``; ``seq_id`` is one sequence of the batch (a batch holds one kind of unit:
        the loops' ShapeSignatures keep, e.g., ChatTTS's text and code frames apart)."""
        raise NotImplementedError

    def _lm_inputs(self, rows: torch.Tensor, query_lens: list[int]) -> torch.Tensor:
        """``inputs_embeds`` ``[N, hidden]`` of the stack from input rows ``[N, in_dim]``."""
        return rows

    def _after_layer(self, rows: torch.Tensor) -> Any:
        """``LlamaModel.forward``'s ``after_layer`` for a forward of input ``rows`` (default
        None: nothing between the layers; Qwen3-Omni's thinker adds deepstack features)."""
        return None

    def _stream(self, rows: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor | None:
        """What outputs stream, ``[n, ...]``, from input rows ``[n, in_dim]`` and their final
        hidden states ``[n, hidden]``; None streams nothing."""
        return None

    def _sampling_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Logits ``[B, num_codebooks, V]`` float32 as the sampler sees them (e.g. suppressed
        ids)."""
        return logits

    def _score_head(self, hidden: torch.Tensor, prompt: Any) -> torch.Tensor:
        """Logits ``[B, num_codebooks, vocab]`` of ``score_logits``: the head ``_head`` applies
        to a sequence with this ``prompt``, computed (with autograd on) from the weights
        ``trainable_weights`` names, so gradients reach them. Default: ``_head``."""
        return self._head(hidden, "")

    def _guidance(self, prompt: Any) -> float | None:
        """The classifier-free guidance weight ``w`` of a prompt's sequence (the sampler sees
        ``cond + w * (cond - uncond)``), or None (the default): no unconditional row."""
        return None

    def _unconditional_inputs(self, unit: ARPrefillInput) -> torch.Tensor:
        """Input rows of a guided prefill's unconditional sequence, shaped as
        ``_prefill_inputs(unit)`` (the same count: both rows share positions)."""
        raise NotImplementedError(f"{type(self).__name__} has no unconditional inputs")

    def _on_admit(self, unit: ARPrefillInput) -> None:
        """Called for each prefill unit that got its blocks (per-sequence bookkeeping)."""

    def _weight_tensors(self) -> dict[str, torch.Tensor]:
        """The live tensors a weight update copies into, by the checkpoint's own tensor names
        (the family's loader names). Empty (the default): the component takes no updates."""
        return {}

    def _weight_aliases(self) -> dict[str, torch.Tensor]:
        """More names a weight update may write, each a view of a ``_weight_tensors`` tensor
        (a MoE layer's published per-expert names inside its fused experts,
        ``layers.moe.expert_views``): in ``weight_specs`` and ``update_weights``, not in
        ``trainable_weights`` (gradients land on the fused tensors). Default: the stack's
        per-expert names under ``_expert_prefix`` when it has MoE layers."""
        prefix = self._expert_prefix
        if prefix is None or self.llama.config.moe is None:
            return {}
        from omnistep.layers.moe import expert_views

        views: dict[str, torch.Tensor] = {}
        for i, layer in enumerate(self.llama.layers):
            if layer.sparse:
                for name, view in expert_views(layer.mlp).items():
                    views[f"{prefix}layers.{i}.mlp.{name}"] = view
        return views

    def _weights_updated(self, names: set[str]) -> None:
        """Refresh what the family derives from the updated tensors (e.g. folded heads).
        Pre-packed linears need nothing: they repack when a weight's version changes."""

    def _prompt_positions(self, prompt: Any) -> tuple[torch.Tensor, int] | None:
        """``(positions, delta)`` of a prompt whose ``L`` rows do not sit at ``0 .. L-1``
        (Qwen's TMRoPE of media): LongTensor ``[position_rows, L]``, and the offset of every
        later row (generated frames: row ``i`` at ``i + delta``). None (the default): each
        row's position is its index."""
        return None

    def _prompt_prefix(self, prompt: Any) -> tuple[Hashable, int] | None:
        """``(label, num_rows)``: the prompt's first ``num_rows`` input rows are shared with
        other requests (a voice's rows, whatever the text), so they are prefilled apart from
        the rest and kept, found again by the content hash of those rows (the module
        docstring's "Prefixes"); ``label`` names them for ``drop_prefixes``. None (the
        default): the prompt is prefilled whole."""
        return None

    # ------------------------------------------------------------ Component API
    def kv_blocks(self) -> tuple[int, int]:
        """``(used, free)`` KV blocks as the engine reports them (``omnistep.kv.kv_usage``):
        blocks only kept prefixes hold count as free (they are evicted when an admission
        needs them); blocks a request holds, shared with a kept prefix or not, as used."""
        cached = self.kept_prefix_blocks
        return self.blocks.num_used_blocks - cached, self.blocks.num_free_blocks + cached

    def admit(self, payload: ARPrefillInput) -> bool:
        """``omnistep.kv.KVPool.admit``: take the blocks of one prefill for the next PREFILL
        batch when they fit now (a group member whose prompt is kept or admitted in the
        batch forks it and takes none; a prompt with a kept prefix takes only the blocks past
        it; kept prefixes are evicted when blocks are short). The batch's ``execute`` runs
        it. A malformed prompt or one longer than the pool is admitted unheld: ``execute``
        raises for it."""
        batch = self._admitted = self._admitted or _Admitted()
        try:
            return self._admit_unit(payload, batch)
        except (ValueError, KVCacheFullError):
            return True

    def can_append(self, payloads: Sequence[Any]) -> bool:
        """``omnistep.kv.KVPool.can_append``: whether one decode step of every held sequence
        of ``payloads`` fits in the free blocks and those only kept prefixes hold (evicted
        first), with no preemption."""
        held = [p.seq_id for p in payloads if p.seq_id in self.lengths]
        seq_ids = self.guidance.with_uncond(held)
        return self.table.blocks_to_grow(seq_ids) <= self.kv_blocks()[1]

    def preemption_frees(self, payload: Any) -> int:
        """``omnistep.kv.KVPool.preemption_frees``: blocks only the unit's sequence holds."""
        seq_ids = self.guidance.with_uncond([payload.seq_id])
        return sum(self.table.preemption_frees(s) for s in seq_ids)

    def preempt(self, payload: Any) -> int:
        """``omnistep.kv.KVPool.preempt``: free the unit's sequence (and a group prompt it
        computed); its decode step answers ``preempted``. Returns the blocks freed."""
        self.groups.forget(payload.seq_id)
        self.prefix_cache.forget(payload.seq_id)
        freed = self.table.preempt(payload.seq_id)
        return freed + self.guidance.preempt(payload.seq_id)  # its unconditional row too

    @property
    def kept_prefix_blocks(self) -> int:
        """Blocks held by kept prefixes and by no request (what ``drop_prefixes`` frees)."""
        return self.prefixes.blocks_held

    @property
    def num_kept_prefixes(self) -> int:
        """Prompt prefixes kept now."""
        return len(self.prefixes)

    def drop_prefixes(self, match: Callable[[Hashable], bool] | None = None) -> int:
        """Forget kept prefixes (all, or those whose label ``match`` accepts: the label
        ``_prompt_prefix`` gave) and free their blocks (those requests share stay with the
        requests). Call between steps. Returns how many were dropped."""
        return self.prefixes.drop(match)

    def free_sequence(self, seq_id: str) -> None:
        """Free the sequence's KV blocks (those it shares stay with their other holders) and
        forget a group prompt it computed (idempotent). A salted sequence's full blocks stay
        in the evictable cache (prefix caching)."""
        self.prefix_cache.keep(seq_id)
        for held in self.guidance.with_uncond([seq_id]):
            self.table.free(held)
        self.guidance.forget(seq_id)
        self.positions.forget(seq_id)
        self.groups.forget(seq_id)

    @torch.inference_mode()
    def execute(self, kind: WorkUnitKind, payloads: Sequence[Any]) -> list[ARStepOutput]:
        """Run a batch of PREFILL or AR_TOKEN units; one ``ARStepOutput`` per payload, in order.

        Raises:
            ValueError: another kind, or a malformed payload.
            KVCacheFullError: a prefill longer than the whole pool.
        """
        if not self.serving:
            raise RuntimeError(f"a training copy of {type(self).__name__} does not serve")
        if kind is WorkUnitKind.PREFILL:
            return self._prefill(payloads)
        if kind is WorkUnitKind.AR_TOKEN:
            return self._decode(payloads)
        raise ValueError(f"{type(self).__name__} cannot run {kind}")

    def weight_specs(self) -> dict[str, tuple[tuple[int, ...], str]]:
        """``name -> (shape, dtype)`` of every tensor ``update_weights`` may change (checkpoint
        names; dtype as ``str(tensor.dtype)``)."""
        tensors = {**self._weight_tensors(), **self._weight_aliases()}
        return {name: (tuple(t.shape), str(t.dtype)) for name, t in tensors.items()}

    @torch.no_grad()
    def update_weights(self, tensors: dict[str, torch.Tensor]) -> None:
        """Copy ``tensors`` (torch tensors or numpy arrays; checked by
        ``ModelInstance.check_weights``: known names, equal shapes and dtypes) into the live
        weights in place, then refresh derived copies. Call only between steps (no batch of
        this component running).

        Raises:
            KeyError: a name ``weight_specs`` does not list (callers check first).
        """
        targets = self._weight_tensors()
        if any(name not in targets for name in tensors):
            targets.update(self._weight_aliases())
        for name, value in tensors.items():  # numpy arrays too (check_weights accepts them)
            targets[name].copy_(torch.as_tensor(value))
        self._weights_updated(set(tensors))
        self.drop_prefixes()  # their K/V came from the old weights
        self.blocks.forget_hashes()
        self.prefix_cache.clear()

    def training_copy(self) -> PagedARModel:
        """A trainer's copy (``omnistep.layers.training``): its own weights, equal to these,
        no KV cache; it scores (``score_logits``, ``score_logprobs``) and hands out
        ``trainable_weights``, and never serves."""
        return training_copy(self, self.SERVING_STATE)

    def trainable_weights(self, names: Sequence[str] | None = None) -> dict[str, torch.Tensor]:
        """A training copy's weights by checkpoint name (``weight_specs``' names; all when
        ``names`` is None), each set to require grad: what a trainer's optimizer takes.
        ``score_logits`` computes from these tensors (a derived copy, such as a folded or
        tied head, is derived again inside its graph), so its gradients land here. Names of
        ``_weight_aliases`` (per-expert views) are skipped: their fused tensors train. Send new
        values to serving with the engine's ``update_weights`` (the copy's ``_weight_tensors``).

        Raises:
            ServingWeightsError: this component serves (take ``training_copy()`` first).
            KeyError: a name the component does not have.
        """
        require_training_copy(self)
        tensors = self._weight_tensors()
        aliases = set(self._weight_aliases()) if names is not None else set()
        picked = (
            tensors
            if names is None
            else {name: tensors[name] for name in names if name not in aliases}
        )
        for tensor in picked.values():
            tensor.requires_grad_(True)
        return picked

    # ------------------------------------------------------------ scoring (``scorer``)
    def score_logits(
        self, prompt: Any, frames: Sequence[Sequence[int]], match_serving: bool = True
    ) -> torch.Tensor:
        """Teacher-forced logits of a recorded trajectory, differentiable in the weights.

        One forward of the prompt rows plus every frame but the last (``_prefill_inputs`` of
        the prompt with ``frames[:-1]`` replayed) through ``LlamaModel.forward_dense`` (no
        paged cache, no per-sequence state: safe while the component serves), then the head
        on rows ``prompt_len - 1 ..``. Runs under the caller's grad mode (on by default).
        ``score_logits_batch`` of one trajectory.

        Args:
            prompt: the prompt as the component consumed it (``LoopActions.prompt``).
            frames: ``T >= 1`` sampled frames of ``num_codebooks`` ids, the last one included
                (its EOS when the loop stopped on one).
            match_serving: run the attention calls and row chunks serving ran (see
                ``LlamaModel.forward_dense``'s ``prefill_len``): equal to serving's logits
                under ``batch_invariant``. False: one causal attention call over the whole
                sequence (faster on a GPU; equal within float rounding, ~1e-6).

        Returns:
            Raw logits ``[T, num_codebooks, V]`` float32 on the component's device: row ``i``
            is the distribution frame ``i`` was drawn from (before ``_sampling_logits``).

        Raises:
            ValueError: no frames, a frame of another width, a malformed prompt.
        """
        return self.score_logits_batch([prompt], [frames], match_serving)[0]

    def score_logits_batch(
        self,
        prompts: Sequence[Any],
        frames: Sequence[Sequence[Sequence[int]]],
        match_serving: bool = True,
        routing: Sequence[Any] | None = None,
    ) -> list[torch.Tensor]:
        """``score_logits`` of several trajectories in one packed forward
        (``LlamaModel.forward_packed``: every GEMM over all of their rows at once, attention
        per trajectory), then the head once per group of prompts with one head
        (``_score_head_key``). Equal to ``score_logits`` of each to the bit under
        ``batch_invariant``, else within float rounding (tests/test_score.py measures it).

        Args:
            routing: Rollout Routing Replay (a MoE stack): per trajectory the experts of
                every row of its forward, integer ``[prompt rows + T - 1, sparse layers, k]``
                (the rollout's ``prompt_routing`` then its ``routing``; numpy or torch), so
                the forward uses the rollout's experts; None: the router chooses.

        Returns:
            One ``[T_i, num_codebooks, V]`` float32 tensor per trajectory, in order.

        Raises:
            ValueError: as ``score_logits``, prompts and frames of different counts, or a
                ``routing`` of another shape (or on a dense stack, or a guided prompt).
        """
        return self.scorer.logits_batch(prompts, frames, match_serving, routing)

    def _score_head_key(self, prompt: Any) -> Hashable:
        """Prompts with equal keys get the same ``_score_head`` (ChatTTS: its text or code
        heads), so their rows run it in one call. Default: one head for every prompt."""
        return None

    def score_logprobs(
        self,
        prompt: Any,
        frames: Sequence[Sequence[int]],
        sampling: SamplingRow,
        mode: str = "processed",
        penalty_window: int = 16,
        match_serving: bool = True,
    ) -> torch.Tensor:
        """Log-probs of a recorded trajectory's frames, recomputed from ``score_logits``.

        Step ``i`` is scored as the AR loop sampled it: ``_sampling_logits`` of row ``i``,
        then in ``"processed"`` mode ``recompute_logprobs`` with ``sampling``, the last
        ``penalty_window`` frames before it as history and ``i`` frames generated; in
        ``"policy"`` mode ``policy_logprobs`` (``log_softmax(logits / temperature)``).
        ``score_batch`` of one trajectory.

        Args:
            prompt, frames, match_serving: as in ``score_logits``.
            sampling: the loop's row for the request (``ARDecodeConfig.make_sampling``).
            penalty_window: the loop's ``ARDecodeConfig.penalty_window``.

        Returns:
            ``[T, num_codebooks]`` float32 on the component's device, with a graph to the
            weights when autograd is on.

        Raises:
            ValueError: an unknown mode, or what ``score_logits`` raises.
        """
        [(logprobs, _)] = self.score_batch(
            [prompt], [frames], [sampling], mode, penalty_window, match_serving
        )
        return logprobs

    def score_batch(
        self,
        prompts: Sequence[Any],
        frames: Sequence[Sequence[Sequence[int]]],
        samplings: Sequence[Any],
        mode: str = "processed",
        penalty_window: int = 16,
        match_serving: bool = True,
        entropy: bool = False,
        routing: Sequence[Any] | None = None,
    ) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """``score_logprobs`` of several trajectories (one ``score_logits_batch``, one
        sampling pass over all their rows), and with ``entropy`` the entropy of each step's
        scored distribution per codebook (``omnistep.sampling.entropy``, nats; processed or
        policy as ``mode`` says); ``routing``: replay each trajectory's recorded MoE routing
        (``score_logits_batch``).

        Returns:
            Per trajectory ``(logprobs [T_i, num_codebooks], entropy [T_i, num_codebooks] or
            None)``, float32 with a graph to the weights when autograd is on.

        Raises:
            ValueError: an unknown mode, or what ``score_logits_batch`` raises.
        """
        return self.scorer.batch(
            prompts, frames, samplings, mode, penalty_window, match_serving, entropy, routing
        )

    @property
    def num_preemptions(self) -> int:
        """Sequences freed so far to make room for older ones."""
        return self.table.num_preemptions

    # ------------------------------------------------------------ admission
    def _admit_unit(self, unit: ARPrefillInput, batch: _Admitted) -> bool:
        """Admit one prefill into ``batch``: a fresh member of a group whose prompt is kept
        or computed in the batch forks it (no block taken); otherwise its blocks (after the
        kept prefix it shares, or its cached prefix) are taken now. False: nothing held.

        Raises:
            ValueError: a malformed prompt. KVCacheFullError: longer than the whole pool.
        """
        waiting = self._waiting_rows
        rows = waiting[1] if waiting and waiting[0] is unit else self._prefill_inputs(unit)
        self._waiting_rows = None
        weight = self._guidance(unit.prompt)
        if weight is not None:  # conditional and unconditional rows, whole prompts
            if not self.guidance.admit(unit, rows.shape[0], float(weight), batch.pinned):
                self._waiting_rows = (unit, rows)
                return False
            batch.entries[unit.seq_id] = _Entry(unit, rows, None)
            return True
        key = self.groups.key(unit, rows)
        if key is not None and (key in batch.computing or self.groups.live(key)):
            batch.entries[unit.seq_id] = _Entry(unit, None, key)
            return True
        salt = self.prefix_cache.salt(unit)
        self.prefix_cache.forget(unit.seq_id)
        if salt is not None:
            start = self.prefix_cache.admit(unit, rows, salt, batch.pinned)
            if start is None:
                self._waiting_rows = (unit, rows)
                return False
            n = start.num_cached
            batch.entries[unit.seq_id] = _Entry(
                unit, rows[n:], None, start.stream, n, cached_routing=start.routing
            )
            return True
        split = prefix_split(self, unit.prompt, rows.shape[0])
        prefix = None
        if split is None:
            admitted = self._admit(unit.seq_id, rows.shape[0], batch.pinned)
        else:
            prefix = self.prefixes.admit(unit.seq_id, rows, split, batch.prefixes, batch.pinned)
            admitted = prefix is not None
        if not admitted:
            self._waiting_rows = (unit, rows)  # asked again at the next batch: not recomputed
            return False
        computed = rows if split is None else rows[split[1] :]
        batch.entries[unit.seq_id] = _Entry(unit, computed, key, prefix=prefix)
        if key is not None:
            batch.computing.add(key)
        return True

    def _admit(self, seq_id: str, num_tokens: int, pinned: set[Hashable]) -> bool:
        """``SequenceTable.admit_prefill``, evicting kept prefixes when the blocks are short."""
        if self.table.admit_prefill(seq_id, num_tokens):
            return True
        needed = self.blocks.blocks_needed(num_tokens)
        return self.prefixes.make_room(needed, pinned) and self.table.admit_prefill(
            seq_id, num_tokens
        )

    def _fork_ready(self, entry: _Entry, batch: _Admitted) -> bool:
        """Whether a fork admitted earlier still has its group prompt: computed in this
        batch, or kept by a live sequence."""
        return entry.key in batch.computing or self.groups.live(entry.key)

    # ------------------------------------------------------------ prefill / decode
    def _prefill(self, units: Sequence[ARPrefillInput]) -> list[ARStepOutput]:
        batch, self._admitted = self._admitted or _Admitted(), None
        try:
            return self._run_prefills(units, batch)
        except BaseException:
            for key in batch.prefixes:  # kept prefixes this batch made, never computed
                self.prefixes.drop_key(key)
            raise

    def _run_prefills(
        self, units: Sequence[ARPrefillInput], batch: _Admitted
    ) -> list[ARStepOutput]:
        """Admit the units ``admit`` did not (a direct call, or a component the scheduler
        cannot see), compute the batch's new prefixes and prompts, fork group members."""
        results = [ARStepOutput(preempted=True)] * len(units)
        run, forks = [], []
        for i, unit in enumerate(units):
            entry = batch.entries.get(unit.seq_id)
            if entry is not None and entry.rows is None and not self._fork_ready(entry, batch):
                entry = None  # its group's prompt was freed since admission: compute it
            if entry is None or entry.unit is not unit:
                if not self._admit_unit(unit, batch):
                    self.num_refused_prefills += 1
                    continue
                entry = batch.entries[unit.seq_id]
            (run if entry.rows is not None else forks).append(i)
        self.prefixes.trim(batch.pinned)
        keys = [
            batch.entries[unit.seq_id].key if unit.seq_id in batch.entries else None
            for unit in units
        ]
        rows_out: dict[int, tuple[torch.Tensor, Any]] = {}
        routing: dict[int, torch.Tensor | None] = {}  # each sequence's rows' MoE routing
        if run:
            prefix_routing = self.prefixes.compute(batch.prefixes) if batch.prefixes else {}
            batch.prefixes.clear()  # computed: kept from now on
            self.cache.copy_blocks(self.table.take_copies())  # forks writing past a prefix
            entries = [batch.entries[units[i].seq_id] for i in run]
            inputs = [entry.rows for entry in entries]
            computed = self._compute_prefills([units[i] for i in run], inputs)
            rows_out = dict(zip(run, computed, strict=True))
            befores = [self._reused_routing(entry, prefix_routing) for entry in entries]
            every = self.moe_routing.prefill_rows(inputs, befores)
            for j, (i, entry) in enumerate(zip(run, entries, strict=True)):
                seq_id = units[i].seq_id
                whole = None if every is None else self.moe_routing.whole(seq_id, every[j])
                routing[i] = whole
                last, stream = rows_out[i]
                if entry.cached_stream is not None and stream is not None:
                    rows_out[i] = (last, torch.cat([entry.cached_stream, stream]))
                computed_routing = None if every is None else every[j][-inputs[j].shape[0] :]
                self.prefix_cache.note_prefill(seq_id, rows_out[i][1], computed_routing)
            for i in run:
                if keys[i] is not None:
                    last, stream = rows_out[i]
                    shared = routing.get(i)
                    self.groups.keep(
                        keys[i],
                        SharedPrompt(
                            units[i].seq_id,
                            self.lengths[units[i].seq_id],
                            last.clone(),
                            stream,
                            None if shared is None or not units[i].record else shared.clone(),
                        ),
                    )
        for i in forks:
            shared = self.groups[keys[i]]
            self.table.fork(shared.seq_id, units[i].seq_id, shared.num_tokens)
            self.positions.note(units[i])
            self._on_admit(units[i])
            rows_out[i] = (shared.last_hidden, shared.stream)
            routing[i] = shared.routing  # the group's prompt rows
        done = sorted(rows_out)
        if done:
            hidden = torch.stack([rows_out[i][0] for i in done])
            streams = [rows_out[i][1] for i in done]
            outputs = self._sample(hidden, [units[i] for i in done], streams)
            for i, out in zip(done, outputs, strict=True):
                facts = self.moe_routing.fields(routing.get(i), prefill=True)
                if not units[i].record:
                    facts = {}
                entry = batch.entries.get(units[i].seq_id)
                if entry is not None and entry.num_cached:
                    facts["cached_rows"] = entry.num_cached
                results[i] = replace(out, **facts) if facts else out
        return results

    def _reused_routing(
        self, entry: _Entry, prefix_routing: dict[Hashable, torch.Tensor]
    ) -> torch.Tensor | None:
        """The recorded MoE routing ``[n, layers, k]`` of the rows an admitted prefill did not
        compute: its cached prefix's, or its kept prefix's (computed by this batch, or kept
        since); None: it computes every row, or their routing is unknown."""
        if entry.num_cached:
            return entry.cached_routing
        if entry.prefix is None:
            return None
        found = prefix_routing.get(entry.prefix)
        return found if found is not None else self.prefixes.routing.get(entry.prefix)

    def _compute_prefills(
        self, units: list[ARPrefillInput], inputs: list[torch.Tensor]
    ) -> list[tuple[torch.Tensor, Any]]:
        """One varlen forward over admitted prefills: each unit's ``inputs`` are its last rows
        (all of them, or those past a forked prefix: positions continue from the tokens its
        sequence already holds). Per unit, the final hidden state of its last row ``[hidden]``
        and what its output streams."""
        for unit in units:
            self.positions.note(unit)
            self._on_admit(unit)
        guidance = self.guidance
        guided = [u for u in units if u.seq_id in guidance.weights]
        uncond = [self._unconditional_inputs(u) for u in guided]
        seq_ids = [u.seq_id for u in units] + [uncond_id(u.seq_id) for u in guided]
        lens = [x.shape[0] for x in [*inputs, *uncond]]
        rows = torch.cat([*inputs, *uncond])
        ends_at = [self.lengths[s] for s in seq_ids]
        num = len(units)
        # an unconditional row has no prompt positions of its own: plain ones (no M-RoPE
        # family guides)
        prompts = [u.prompt for u in units] + [None] * len(guided)
        positions = torch.cat(
            [
                self.positions.rows(p, e - n, e)
                if p is not None
                else self.positions.plain(e - n, e)
                for p, n, e in zip(prompts, lens, ends_at, strict=True)
            ],
            dim=-1,
        )
        hidden = self._forward(rows, positions, seq_ids, lens)
        self.num_prefill_rows += sum(lens[:num])
        ends = torch.tensor(lens, device=self.device).cumsum(0) - 1
        last = hidden[ends]  # [len(units) + len(guided), hidden]
        for j, unit in enumerate(guided):
            guidance.uncond_last[unit.seq_id] = last[num + j]
        whole = [self.stream_prompt_rows and not u.generated for u in units]
        cond_rows = sum(lens[:num])
        streams = self._streams(rows[:cond_rows], hidden[:cond_rows], lens[:num], whole)
        return list(zip(last[:num], streams, strict=True))

    def _streams(
        self, rows: torch.Tensor, hidden: torch.Tensor, lens: list[int], whole: list[bool]
    ) -> list[Any]:
        """Each sequence's ``ARStepOutput.hidden``: ``_stream`` of all its ``lens[i]`` rows
        when ``whole[i]``, else of its last row; one ``_stream`` call for the batch."""
        starts = [0, *itertools.accumulate(lens)]
        picked = [
            range(start, end) if full else range(end - 1, end)
            for start, end, full in zip(starts[:-1], starts[1:], whole, strict=True)
        ]
        index = torch.tensor([r for rng in picked for r in rng], device=self.device)
        stream = self._stream(rows[index], hidden[index])
        if stream is None:
            return [None] * len(lens)
        return list(stream.split([len(rng) for rng in picked]))

    def _decode(self, units: Sequence[Any]) -> list[ARStepOutput]:
        held = [i for i, u in enumerate(units) if u.seq_id not in self.table.preempted]
        keep = self._grow(units, held)
        self.cache.copy_blocks(self.table.take_copies())  # shared blocks written this step
        results = [ARStepOutput(preempted=True)] * len(units)
        if not keep:
            return results
        run_units = [units[i] for i in keep]
        rows = self._step_inputs(run_units)  # [B, in_dim]
        guidance = self.guidance
        guided = [j for j, u in enumerate(run_units) if u.seq_id in guidance.weights]
        seq_ids = [u.seq_id for u in run_units] + [uncond_id(run_units[j].seq_id) for j in guided]
        if guided:  # the unconditional rows are fed the same frame
            rows = torch.cat([rows, rows[guided]])
        positions = self.positions.step(seq_ids)
        hidden = self._forward(rows, positions, seq_ids, [1] * len(seq_ids))
        step_routing = self.last_routing
        for k, j in enumerate(guided):
            guidance.uncond_last[run_units[j].seq_id] = hidden[len(keep) + k]
        hidden, rows = hidden[: len(keep)], rows[: len(keep)]
        streams = self._streams(rows, hidden, [1] * len(keep), [True] * len(keep))
        if self.prefix_cache.salted:
            self.prefix_cache.note_fed(run_units, rows, positions, streams, step_routing)
        sampled = self._sample(hidden, run_units, streams)
        for j, (i, out) in enumerate(zip(keep, sampled, strict=True)):
            rec = step_routing is not None and run_units[j].record
            facts = self.moe_routing.fields(step_routing[j : j + 1] if rec else None, False)
            results[i] = replace(out, **facts) if facts else out
        return results

    def _grow(self, units: Sequence[Any], held: list[int]) -> list[int]:
        """Grow the held units' sequences (a guided one's unconditional sequence with it) by one
        token, preempting the youngest when the pool runs out; a guided unit whose pair lost a
        member is freed whole. Returns the indices of ``units`` that step."""
        with_uncond = self.guidance.with_uncond
        seq_ids = with_uncond([units[i].seq_id for i in held])
        if self.prefixes.kept and all(s in self.lengths for s in seq_ids):
            self.prefixes.make_room(self.table.blocks_to_grow(seq_ids), set())  # before preempting
        grown = {seq_ids[k] for k in self.table.grow(seq_ids)}
        keep = []
        for i in held:
            pair = with_uncond([units[i].seq_id])
            if all(s in grown for s in pair):
                keep.append(i)
            elif any(s in grown for s in pair):  # half of a guided pair: free the other half
                self.free_sequence(units[i].seq_id)
        return keep

    # ------------------------------------------------------------ forward
    def _forward(
        self,
        rows: torch.Tensor,
        positions: torch.Tensor,
        seq_ids: list[str],
        query_lens: list[int],
    ) -> torch.Tensor:
        """Final normed hidden states ``[N, hidden]`` of input rows ``[N, in_dim]``."""
        context_lens, block_tables = self.table.context(seq_ids)
        return self._forward_tables(rows, positions, query_lens, context_lens, block_tables)

    def _forward_tables(
        self,
        rows: torch.Tensor,
        positions: torch.Tensor,
        query_lens: list[int],
        context_lens: list[int],
        block_tables: list[list[int]],
    ) -> torch.Tensor:
        """``_forward`` on explicit context lengths and block tables."""
        meta = AttentionMetadata.build(
            query_lens,
            context_lens,
            block_tables,
            self.blocks.block_size,
            self.device,
            batch_invariant=self.batch_invariant,
        )
        routing: list[torch.Tensor] | None = [] if self.llama.config.moe is not None else None
        embeds = self._lm_inputs(rows, query_lens)
        after = self._after_layer(rows)
        if after is None:  # stacks of their own (Higgs' DualFFN, VoxCPM's two LMs) take no hook
            hidden = self.llama(embeds, positions, self.cache, meta, routing)
        else:
            hidden = self.llama(embeds, positions, self.cache, meta, routing, after_layer=after)
        self.last_routing = torch.stack(routing, dim=1) if routing else None
        return hidden

    def _rows(self, fn: Any, x: torch.Tensor) -> torch.Tensor:
        """``fn`` over rows ``[B, ...]``, in fixed 16-row chunks in batch-invariant mode."""
        return map_row_chunks(fn, x) if self.batch_invariant else fn(x)

    def _linear_rows(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``layers.linear.linear`` (``F.linear`` on a pre-packed CPU weight) over rows
        ``[B, in]`` (row-chunked in batch-invariant mode)."""
        return self._rows(lambda rows: linear(rows, weight, bias), x)

    # ------------------------------------------------------------ sampling
    def _sample(
        self, hidden: torch.Tensor, units: Sequence[Any], streams: Sequence[Any]
    ) -> list[ARStepOutput]:
        """Sample each row of ``hidden`` ``[B, hidden]`` with its unit's settings."""
        logits = self.guidance.guide(self._head(hidden, units[0].seq_id).float(), units)
        logits = self._sampling_logits(logits)  # [B, num_codebooks, V]
        history = [self._history(u.history, logits.shape[1]) for u in units]
        num_generated = [
            len(u.generated) if isinstance(u, ARPrefillInput) else u.num_generated for u in units
        ]
        rows: list[SamplingRow] = [u.sampling for u in units]
        generators = [u.generator for u in units]
        with_policy = any(u.record for u in units)  # a batch may mix recorded and served units
        out = sample(logits, rows, history, num_generated, generators, with_policy)
        tokens, logprobs = out.tokens.tolist(), out.logprobs.tolist()
        policy = out.policy_logprobs.tolist() if with_policy else [()] * len(tokens)
        return [
            ARStepOutput(tuple(t), tuple(lp), stream, False, tuple(pl), self.weight_version)
            for t, lp, pl, stream in zip(tokens, logprobs, policy, streams, strict=True)
        ]

    def _history(self, frames: tuple[tuple[int, ...], ...], width: int) -> torch.Tensor:
        """``[width, T]`` long tensor of recent frames (width: ids per frame)."""
        if not frames:
            return torch.zeros(width, 0, dtype=torch.long, device=self.device)
        return torch.tensor(frames, dtype=torch.long, device=self.device).T

    def _frame_ids(self, frames: Sequence[tuple[int, ...]], vocab_size: int) -> torch.Tensor:
        """LongTensor ``[T]`` of 1-tuple frames, on the device.

        Raises:
            ValueError: a frame is not one id in ``[0, vocab_size)``.
        """
        ids = []
        for frame in frames:
            if len(frame) != 1 or not 0 <= frame[0] < vocab_size:
                raise ValueError(f"frame {frame!r} must be one id in [0, {vocab_size})")
            ids.append(frame[0])
        return torch.tensor(ids, dtype=torch.long, device=self.device)
