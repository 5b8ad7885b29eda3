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
prefill still streams one row per prompt row. ``num_prefill_rows`` counts the rows prefill
forwards computed, ``num_cached_rows`` those taken from the cache. Unsalted prefills (the
default) never look: their numbers never depend on what ran before.

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

Imports torch, ``omnistep.core``, ``omnistep.kv``, the AR loop's payload types
(``omnistep.loops.ar_decode``), ``omnistep.sampling`` and the other layers.
"""

from __future__ import annotations

import hashlib
import itertools
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from omnistep.core import WorkUnitKind
from omnistep.kv import BlockManager, KVCacheConfig, KVCacheFullError, SequenceTable, chain_hashes
from omnistep.layers.batch_invariant import map_row_chunks
from omnistep.layers.linear import linear
from omnistep.layers.llama import LlamaConfigLite, LlamaModel
from omnistep.layers.paged_attention import AttentionMetadata
from omnistep.layers.training import require_training_copy, training_copy
from omnistep.loops.ar_decode import ARPrefillInput, ARStepOutput
from omnistep.sampling import (
    SamplingRow,
    entropy,
    policy_distribution,
    processed_logprobs,
    sample,
)

UNCOND_SUFFIX = "#uncond"
"""The unconditional sequence of a guided request is its ``seq_id`` plus this suffix."""


def uncond_id(seq_id: str) -> str:
    """The KV sequence id of ``seq_id``'s unconditional (classifier-free guidance) row."""
    return seq_id + UNCOND_SUFFIX


SCORE_MODES = ("processed", "policy")
"""``score_logprobs`` modes: the distribution sampled, or ``log_softmax(logits / T)``."""


@dataclass(frozen=True)
class _SharedPrompt:
    """A computed prompt that later members of its group start from."""

    seq_id: str
    num_tokens: int
    last_hidden: torch.Tensor  # [hidden], the final hidden state of the prompt's last row
    stream: Any  # what the computing sequence's prefill output streamed
    routing: torch.Tensor | None = None  # MoE routing of its rows [n, layers, k], if recorded


@dataclass(frozen=True)
class _Entry:
    """An admitted prefill: the rows to compute (those past its kept prefix or cached
    prefix), or None for a group member that forks its group's prompt (``key``);
    ``cached_stream``: the streamed rows ``[n, ...]`` of a cached prefix, streamed before the
    computed rows'; ``num_cached``: the rows taken from the prefix cache."""

    unit: ARPrefillInput
    rows: torch.Tensor | None
    key: Hashable | None
    cached_stream: torch.Tensor | None = None
    num_cached: int = 0


@dataclass
class _SaltedRows:
    """What a salted sequence fed so far (prefix caching): per row a digest of its input
    bytes and positions keyed by the salt, and (``stream_prompt_rows``) its streamed row
    ``[1, ...]``; ``streams`` None once a row's stream is unknown (a replay after a
    preemption streams only its last row). Nothing is cached for a sequence freed before its
    prefill ran."""

    salt: bytes
    digests: list[bytes]
    streams: list[torch.Tensor] | None
    computed: bool = False  # its prefill ran: the K/V of its rows are in its blocks


@dataclass
class _Admitted:
    """The prefills admitted for the next PREFILL batch, and what they hold together."""

    entries: dict[str, _Entry] = field(default_factory=dict)
    computing: set[Hashable] = field(default_factory=set)  # group prompts a member computes
    # kept prefixes made for the batch, computed before its prefills: key -> (rows, table)
    prefixes: dict[Hashable, tuple[torch.Tensor, list[int]]] = field(default_factory=dict)
    pinned: set[Hashable] = field(default_factory=set)  # kept prefixes it forks: not evicted


@dataclass(frozen=True)
class _KeptPrefix:
    """A prompt prefix computed once (``_prompt_prefix``), kept for later prompts with it."""

    seq_id: str  # the sequence holding its blocks
    num_tokens: int
    label: Hashable  # the family's name for it (``_prompt_prefix``), for ``drop_prefixes``
    hashes: tuple[int, ...]  # chained content hashes of its rows, one per block


class PagedARModel:
    """Prefill/decode of a decoder stack on a paged KV cache, batched across requests (see the
    module docstring for the subclass hooks).

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
        "_shared",
        "_prefixes",
        "_admitted",
        "_waiting_rows",
        "_position_deltas",
        "_guided",
        "_uncond_last",
        "_salted",
        "_cached_streams",
    )
    """Attributes a ``training_copy`` leaves out (the KV pool and its bookkeeping)."""

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
        self._teacher_ids = itertools.count()
        # (group, content hash of the prompt's rows) -> prompt
        self._shared: dict[Hashable, _SharedPrompt] = {}
        # content hash of the prefix's rows -> kept prefix, least recently used first
        self._prefixes: OrderedDict[int, _KeptPrefix] = OrderedDict()
        self._prefix_ids = itertools.count()
        self._admitted: _Admitted | None = None  # prefills ``admit`` took blocks for
        self._waiting_rows: tuple[ARPrefillInput, torch.Tensor] | None = None  # not admitted
        # sequences whose decode positions are not their row index (``_prompt_positions``)
        self._position_deltas: dict[str, int] = {}
        self._guided: dict[str, float] = {}  # seq_id -> guidance weight, while it holds blocks
        # seq_id -> the unconditional row's last hidden state [hidden], from this step's forward
        # to its sampling (emptied by ``_sample``)
        self._uncond_last: dict[str, torch.Tensor] = {}
        self._salted: dict[str, _SaltedRows] = {}  # live salted sequences (prefix caching)
        # block content hash -> the rows a cached block streamed [block_size, ...]
        self._cached_streams: dict[int, torch.Tensor] = {}
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
        seq_ids = self._with_uncond([p.seq_id for p in payloads if p.seq_id in self.lengths])
        return self.table.blocks_to_grow(seq_ids) <= self.kv_blocks()[1]

    def preemption_frees(self, payload: Any) -> int:
        """``omnistep.kv.KVPool.preemption_frees``: blocks only the unit's sequence holds."""
        return sum(self.table.preemption_frees(s) for s in self._with_uncond([payload.seq_id]))

    def preempt(self, payload: Any) -> int:
        """``omnistep.kv.KVPool.preempt``: free the unit's sequence (and a group prompt it
        computed); its decode step answers ``preempted``. Returns the blocks freed."""
        self._forget_shared(payload.seq_id)
        self._salted.pop(payload.seq_id, None)
        freed = self.table.preempt(payload.seq_id)
        if self._guided.pop(payload.seq_id, None) is not None:  # its unconditional row too
            uncond = uncond_id(payload.seq_id)
            freed += self.table.preemption_frees(uncond)
            self.table.free(uncond)  # not marked: only the request's own step answers
        return freed

    @property
    def kept_prefix_blocks(self) -> int:
        """Blocks held by kept prefixes and by no request (what ``drop_prefixes`` frees)."""
        return sum(
            1
            for kept in self._prefixes.values()
            for block in self.blocks.block_table(kept.seq_id)
            if self.blocks.ref_count(block) == 1
        )

    @property
    def num_kept_prefixes(self) -> int:
        """Prompt prefixes kept now."""
        return len(self._prefixes)

    def drop_prefixes(self, match: Callable[[Hashable], bool] | None = None) -> int:
        """Forget kept prefixes (all, or those whose label ``match`` accepts: the label
        ``_prompt_prefix`` gave) and free their blocks (those requests share stay with the
        requests). Call between steps. Returns how many were dropped."""
        keys = [k for k, kept in self._prefixes.items() if match is None or match(kept.label)]
        for key in keys:
            self._drop_prefix(key)
        return len(keys)

    def free_sequence(self, seq_id: str) -> None:
        """Free the sequence's KV blocks (those it shares stay with their other holders) and
        forget a group prompt it computed (idempotent). A salted sequence's full blocks stay
        in the evictable cache (prefix caching)."""
        self._keep_cached(seq_id)
        for held in self._with_uncond([seq_id]):
            self.table.free(held)
        self._guided.pop(seq_id, None)
        self._position_deltas.pop(seq_id, None)
        self._forget_shared(seq_id)

    def _with_uncond(self, seq_ids: Sequence[str]) -> list[str]:
        """``seq_ids`` with each guided one's unconditional sequence right after it."""
        out = []
        for seq_id in seq_ids:
            out.append(seq_id)
            if seq_id in self._guided:
                out.append(uncond_id(seq_id))
        return out

    def _forget_shared(self, seq_id: str) -> None:
        """Forget the group prompts ``seq_id`` computed."""
        for key in [k for k, shared in self._shared.items() if shared.seq_id == seq_id]:
            del self._shared[key]

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
        self._salted.clear()
        self._cached_streams.clear()

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
        with torch.set_grad_enabled(torch.is_grad_enabled() and not self.serving):
            hidden = self._score_hidden_batch(prompts, frames, match_serving, routing=routing)
            logits = self._score_heads(hidden, prompts)
            guided = [i for i, p in enumerate(prompts) if self._guidance(p) is not None]
            if not guided:
                return logits
            if routing is not None:
                raise ValueError("routing replay of a guided (CFG) prompt is not supported")
            picked = [prompts[i] for i in guided]
            hidden = self._score_hidden_batch(
                picked, [frames[i] for i in guided], match_serving, unconditional=True
            )
            for i, uncond in zip(guided, self._score_heads(hidden, picked), strict=True):
                weight = float(self._guidance(prompts[i]))
                logits[i] = logits[i] + weight * (logits[i] - uncond)
            return logits

    def _score_heads(
        self, hidden: list[torch.Tensor], prompts: Sequence[Any]
    ) -> list[torch.Tensor]:
        """``_score_head`` of each trajectory's hidden states ``[T_i, hidden]``, one call per
        group of prompts with equal ``_score_head_key``: float32 logits per trajectory."""
        groups: dict[Hashable, list[int]] = {}
        for i, prompt in enumerate(prompts):
            groups.setdefault(self._score_head_key(prompt), []).append(i)
        out: list[torch.Tensor] = [hidden[0]] * len(hidden)
        for members in groups.values():
            packed = torch.cat([hidden[i] for i in members])
            logits = self._score_head(packed, prompts[members[0]]).float()
            sizes = [hidden[i].shape[0] for i in members]
            for i, part in zip(members, logits.split(sizes), strict=True):
                out[i] = part
        return out

    def _score_head_key(self, prompt: Any) -> Hashable:
        """Prompts with equal keys get the same ``_score_head`` (ChatTTS: its text or code
        heads), so their rows run it in one call. Default: one head for every prompt."""
        return None

    def _score_hidden(
        self, prompt: Any, frames: Sequence[Sequence[int]], match_serving: bool
    ) -> torch.Tensor:
        """The final hidden states ``[T, hidden]`` that ``score_logits`` applies the head to:
        row ``i`` is the state frame ``i`` was drawn from.

        Raises:
            ValueError: no frames, a frame of another width, a malformed prompt.
        """
        return self._score_hidden_batch([prompt], [frames], match_serving)[0]

    def _score_hidden_batch(
        self,
        prompts: Sequence[Any],
        frames_of: Sequence[Sequence[Sequence[int]]],
        match_serving: bool,
        unconditional: bool = False,
        routing: Sequence[Any] | None = None,
    ) -> list[torch.Tensor]:
        """``_score_hidden`` of several trajectories, in one ``forward_packed``; with
        ``unconditional``, of their guided prompts' unconditional rows; with ``routing``
        (``score_logits_batch``), replaying each trajectory's experts."""
        if len(prompts) != len(frames_of) or not prompts:
            raise ValueError(f"{len(prompts)} prompts for {len(frames_of)} trajectories")
        if routing is not None and len(routing) != len(prompts):
            raise ValueError(f"{len(routing)} routings for {len(prompts)} trajectories")
        rows, lens, query_lens, pieces_of, prompt_lens, positions = [], [], [], [], [], []
        replay: list[torch.Tensor] = []
        shared: list[tuple[int, int] | None] = []
        firsts: dict[Hashable, int] = {}  # (prompt key, prompt rows) -> its first trajectory
        for i, (prompt, frames) in enumerate(zip(prompts, frames_of, strict=True)):
            frames = tuple(tuple(int(t) for t in frame) for frame in frames)
            if not frames:
                raise ValueError("score needs at least one frame")
            if any(len(f) != len(frames[0]) for f in frames):
                raise ValueError("frames of different widths")
            unit = ARPrefillInput(self._score_seq_id(), prompt, frames[:-1], (), None, None)
            inputs = self._unconditional_inputs if unconditional else self._prefill_inputs
            x = inputs(unit)  # [prompt_len + T - 1, in_dim]
            num_rows = x.shape[0]
            prompt_len = num_rows - (len(frames) - 1)
            prompt_lens.append(prompt_len)
            experts = None if routing is None else self._replay_rows(routing[i], num_rows, i)
            first = self._shared_prompt(firsts, x[:prompt_len], i, num_rows, match_serving)
            if first is not None and experts is not None:
                experts = experts[prompt_len:]
            if experts is not None:
                replay.append(experts)
            if first is not None:  # a group's prompt computed once: only the frames' rows
                shared.append((first, prompt_len))
                positions.append(self._positions(prompt, prompt_len, num_rows))
                rows.append(x[prompt_len:])
                lens.append(num_rows - prompt_len)
                query_lens += [1] * (num_rows - prompt_len)
                pieces_of.append(None)
                continue
            shared.append(None)
            if match_serving:  # the prompt as serving prefilled it: whole, or prefix then rest
                split = self._split(prompt, prompt_len)
                pieces = [prompt_len] if split is None else [split[1], prompt_len - split[1]]
                query_lens += pieces + [1] * (len(frames) - 1)
                pieces_of.append(pieces)
            else:
                query_lens.append(num_rows)
                pieces_of.append(None)
            rows.append(x)
            lens.append(num_rows)
            positions.append(self._positions(prompt, 0, num_rows))
        packed = torch.cat(rows) if len(rows) > 1 else rows[0]
        embeds = self._lm_inputs(packed, query_lens)
        after = self._after_layer(packed)  # as serving runs it (Qwen3-Omni's deepstack)
        hidden = self.llama.forward_packed(
            embeds,
            lens,
            pieces_of,
            self.batch_invariant,
            shared,
            torch.cat(positions, dim=-1),
            torch.cat(replay) if replay else None,
            **({} if after is None else {"after_layer": after}),
        ).split(lens)
        out = []
        for h, p, share in zip(hidden, prompt_lens, shared, strict=True):
            if share is None:
                out.append(h[p - 1 :])
            else:  # the prompt's last row is the first trajectory's
                out.append(torch.cat([hidden[share[0]][p - 1 : p], h]))
        return out

    def _replay_rows(self, routing: Any, num_rows: int, index: int) -> torch.Tensor:
        """Trajectory ``index``'s recorded routing as LongTensor ``[num_rows, layers, k]`` on
        the device.

        Raises:
            ValueError: a dense stack, or another number of rows.
        """
        if self.llama.config.moe is None:
            raise ValueError(f"{type(self).__name__} has no MoE layers: no routing to replay")
        experts = torch.as_tensor(routing).to(self.device, torch.long)
        if experts.ndim != 3 or experts.shape[0] != num_rows:
            raise ValueError(
                f"routing of trajectory {index} must be [{num_rows} rows (prompt rows + frames - "
                f"1), MoE layers, k], got {list(experts.shape)}"
            )
        return experts

    def _shared_prompt(
        self,
        firsts: dict[Hashable, int],
        prompt_rows: torch.Tensor,
        index: int,
        num_rows: int,
        match_serving: bool,
    ) -> int | None:
        """The earlier trajectory whose prompt rows trajectory ``index`` reuses (equal rows
        ``[prompt_len, in_dim]``, by content hash), else None (then it is the first of its
        rows). Only in the default mode (within rounding: under ``batch_invariant`` the
        reused rows differed from a trajectory's own in the last bits, ~1e-6, measured on
        ChatTTS; not yet explained), and not for a trajectory with no frame rows."""
        if self.batch_invariant:
            return None
        prompt_len = prompt_rows.shape[0]
        key = self._content_hashes(prompt_rows, max(1, prompt_len))[-1]  # a copy has no pool
        if key not in firsts:
            firsts[key] = index
            return None
        return firsts[key] if num_rows > prompt_len else None

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
        if mode not in SCORE_MODES:
            raise ValueError(f"mode must be one of {', '.join(SCORE_MODES)}, got {mode!r}")
        logits = self.score_logits_batch(prompts, frames, match_serving, routing)
        logits = self._sampling_logits(torch.cat(logits) if len(logits) > 1 else logits[0])
        tokens = [self._frame_tensor(f) for f in frames]
        logp = self._distribution(logits, tokens, samplings, mode, penalty_window)
        return self._gather_scores(logp, tokens, entropy)

    def _frame_tensor(self, frames: Sequence[Sequence[int]]) -> torch.Tensor:
        """LongTensor ``[T, width]`` of recorded frames on the device."""
        return torch.tensor([tuple(f) for f in frames], dtype=torch.long, device=self.device)

    def _distribution(
        self,
        logits: torch.Tensor,
        tokens: Sequence[torch.Tensor],
        samplings: Sequence[Any],
        mode: str,
        penalty_window: int,
    ) -> torch.Tensor:
        """Log-probs ``[sum T_i, C, V]`` of the scored distribution of every step of packed
        trajectories (``logits`` after ``_sampling_logits``; ``tokens`` ``[T_i, C]`` each)."""
        rows = [row for t, row in zip(tokens, samplings, strict=True) for _ in range(t.shape[0])]
        if mode == "policy":
            return policy_distribution(logits, rows)
        history, generated = [], []
        for t in tokens:  # the loop passes frames[-penalty_window:] (all for a window of 0)
            history += [
                t[max(0, i - penalty_window) if penalty_window else 0 : i].T
                for i in range(t.shape[0])
            ]
            generated += range(t.shape[0])
        return processed_logprobs(logits, rows, history, generated)[0]

    @staticmethod
    def _gather_scores(
        logp: torch.Tensor, tokens: Sequence[torch.Tensor], with_entropy: bool
    ) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """Split packed log-probs ``[sum T_i, C, V]`` into each trajectory's recorded ids'
        ``[T_i, C]`` and, asked, its entropies."""
        ids = torch.cat(tokens) if len(tokens) > 1 else tokens[0]
        picked = logp.gather(-1, ids.to(logp.device).unsqueeze(-1)).squeeze(-1)
        sizes = [t.shape[0] for t in tokens]
        ent = entropy(logp).split(sizes) if with_entropy else [None] * len(sizes)
        return list(zip(picked.split(sizes), ent, strict=True))

    def _score_seq_id(self) -> str:
        return f"score/{type(self).__name__}"

    @property
    def num_preemptions(self) -> int:
        """Sequences freed so far to make room for older ones."""
        return self.table.num_preemptions

    # ------------------------------------------------------------ positions
    def _positions(self, prompt: Any, start: int, end: int) -> torch.Tensor:
        """Rope positions of rows ``start .. end - 1`` of a sequence with ``prompt``: LongTensor
        ``[n]``, or ``[position_rows, n]`` for an M-RoPE family, on the device."""
        given = self._prompt_positions(prompt)
        if given is None:
            return self._plain_positions(start, end)
        table, delta = given
        num_prompt = table.shape[-1]
        head = table[..., start : min(end, num_prompt)].to(self.device)
        tail = torch.arange(max(start, num_prompt), end, device=self.device) + delta
        positions = torch.cat([head, tail.expand(*head.shape[:-1], -1)], dim=-1)
        if self.position_rows > 1 and positions.ndim == 1:
            positions = positions.expand(self.position_rows, -1)
        return positions

    def _plain_positions(self, start: int, end: int) -> torch.Tensor:
        """Positions ``start .. end - 1`` as ``_positions`` shapes them, for rows without a
        prompt of their own (a guided request's unconditional rows)."""
        positions = torch.arange(start, end, device=self.device)
        return positions.expand(self.position_rows, -1) if self.position_rows > 1 else positions

    def _step_positions(self, seq_ids: Sequence[str]) -> torch.Tensor:
        """Positions of each sequence's next row (its last cached one), ``[B]`` or
        ``[position_rows, B]``."""
        deltas = self._position_deltas
        positions = torch.tensor(
            [self.lengths[s] - 1 + deltas.get(s, 0) for s in seq_ids], device=self.device
        )
        if self.position_rows > 1:
            positions = positions.expand(self.position_rows, -1)
        return positions

    def _note_positions(self, unit: ARPrefillInput) -> None:
        """Remember the decode offset of a sequence whose prompt has its own positions."""
        given = self._prompt_positions(unit.prompt)
        if given is None or given[1] == 0:
            self._position_deltas.pop(unit.seq_id, None)
        else:
            self._position_deltas[unit.seq_id] = given[1]

    # ------------------------------------------------------------ prefill / decode
    def _prefill(self, units: Sequence[ARPrefillInput]) -> list[ARStepOutput]:
        batch, self._admitted = self._admitted or _Admitted(), None
        try:
            return self._run_prefills(units, batch)
        except BaseException:
            for key in batch.prefixes:  # kept prefixes this batch made, never computed
                self._drop_prefix(key)
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
        self._trim_prefixes(batch.pinned)
        keys = [
            batch.entries[unit.seq_id].key if unit.seq_id in batch.entries else None
            for unit in units
        ]
        rows_out: dict[int, tuple[torch.Tensor, Any]] = {}
        routing: dict[int, torch.Tensor | None] = {}  # recorded units' rows' MoE routing
        if run:
            if batch.prefixes:
                self._compute_prefixes(list(batch.prefixes.values()))
            batch.prefixes.clear()  # computed: kept from now on
            self.cache.copy_blocks(self.table.take_copies())  # forks writing past a prefix
            inputs = [batch.entries[units[i].seq_id].rows for i in run]
            computed = self._compute_prefills([units[i] for i in run], inputs)
            rows_out = dict(zip(run, computed, strict=True))
            routing = self._prefill_routing([units[i] for i in run], run, inputs)
            for i in run:
                entry = batch.entries[units[i].seq_id]
                last, stream = rows_out[i]
                if entry.cached_stream is not None and stream is not None:
                    rows_out[i] = (last, torch.cat([entry.cached_stream, stream]))
                self._note_prefill(units[i], rows_out[i][1])
            for i in run:
                if keys[i] is not None:
                    last, stream = rows_out[i]
                    self._shared[keys[i]] = _SharedPrompt(
                        units[i].seq_id,
                        self.lengths[units[i].seq_id],
                        last.clone(),
                        stream,
                        None if routing.get(i) is None else routing[i].clone(),
                    )
        for i in forks:
            shared = self._shared[keys[i]]
            self.table.fork(shared.seq_id, units[i].seq_id, shared.num_tokens)
            self._note_positions(units[i])
            self._on_admit(units[i])
            rows_out[i] = (shared.last_hidden, shared.stream)
            if units[i].record and shared.routing is not None:  # the group's prompt rows
                routing[i] = shared.routing
        done = sorted(rows_out)
        if done:
            hidden = torch.stack([rows_out[i][0] for i in done])
            streams = [rows_out[i][1] for i in done]
            outputs = self._sample(hidden, [units[i] for i in done], streams)
            for i, out in zip(done, outputs, strict=True):
                out = self._with_routing(out, routing.get(i), prefill=True)
                entry = batch.entries.get(units[i].seq_id)
                if entry is not None and entry.num_cached:
                    out = replace(out, cached_rows=entry.num_cached)
                results[i] = out
        return results

    def _prefill_routing(
        self, units: Sequence[ARPrefillInput], index: Sequence[int], inputs: Sequence[torch.Tensor]
    ) -> dict[int, torch.Tensor | None]:
        """The MoE routing ``[rows, layers, k]`` (device) of each recorded unit of the
        prefill forward just run (``last_routing``, its rows in ``inputs``' order), by the
        unit's index in ``index``; None where the forward computed only some of the
        sequence's rows (a cached or kept prefix: the rest's routing is unknown)."""
        if self.last_routing is None:
            return {}
        out: dict[int, torch.Tensor | None] = {}
        start = 0
        for i, unit, rows in zip(index, units, inputs, strict=True):
            n = rows.shape[0]
            if unit.record:
                whole = n == self.lengths.get(unit.seq_id, -1)
                out[i] = self.last_routing[start : start + n] if whole else None
            start += n
        return out

    @staticmethod
    def _with_routing(out: ARStepOutput, rows: torch.Tensor | None, prefill: bool) -> ARStepOutput:
        """``out`` with its step's MoE routing (``ARStepOutput.routing``; a prefill's also
        ``prompt_routing``) from its rows' routing ``[n, layers, k]``: int16 on the CPU."""
        if rows is None or out.preempted:
            return out
        host = rows.to("cpu", torch.int16).numpy()
        return replace(out, routing=host[-1], prompt_routing=host[:-1] if prefill else None)

    def _admit_unit(self, unit: ARPrefillInput, batch: _Admitted) -> bool:
        """Admit one prefill into ``batch``: a fresh member of a group whose prompt is kept
        or computed in the batch forks it (no block taken); otherwise its blocks (after the
        kept prefix it shares) are taken now. False: nothing held.

        Raises:
            ValueError: a malformed prompt. KVCacheFullError: longer than the whole pool.
        """
        waiting = self._waiting_rows
        rows = waiting[1] if waiting and waiting[0] is unit else self._prefill_inputs(unit)
        self._waiting_rows = None
        weight = self._guidance(unit.prompt)
        if weight is not None:
            return self._admit_guided(unit, rows, float(weight), batch)
        key = self._share_key(unit, rows)
        if key is not None and (key in batch.computing or self._live_shared(key)):
            batch.entries[unit.seq_id] = _Entry(unit, None, key)
            return True
        salt = self._cache_salt(unit)
        self._salted.pop(unit.seq_id, None)
        if salt is not None:
            return self._admit_cached(unit, rows, salt, batch)
        split = self._split(unit.prompt, rows.shape[0])
        if split is None:
            admitted = self._admit(unit.seq_id, rows.shape[0], batch.pinned)
        else:
            admitted = self._admit_split(unit.seq_id, rows, split, batch.prefixes, batch.pinned)
        if not admitted:
            self._waiting_rows = (unit, rows)  # asked again at the next batch: not recomputed
            return False
        batch.entries[unit.seq_id] = _Entry(unit, rows if split is None else rows[split[1] :], key)
        if key is not None:
            batch.computing.add(key)
        return True

    def _admit_guided(
        self, unit: ARPrefillInput, rows: torch.Tensor, weight: float, batch: _Admitted
    ) -> bool:
        """Admit a guided prefill's conditional and unconditional sequences together (whole
        prompts, no sharing); False: neither is held."""
        n = rows.shape[0]
        uncond = uncond_id(unit.seq_id)
        if self._admit(unit.seq_id, n, batch.pinned):
            if self._admit(uncond, n, batch.pinned):
                self._guided[unit.seq_id] = weight
                batch.entries[unit.seq_id] = _Entry(unit, rows, None)
                return True
            self.table.free(unit.seq_id)
        self._waiting_rows = (unit, rows)
        return False

    def _fork_ready(self, entry: _Entry, batch: _Admitted) -> bool:
        """Whether a fork admitted earlier still has its group prompt: computed in this
        batch, or kept by a live sequence."""
        return entry.key in batch.computing or self._live_shared(entry.key)

    def _compute_prefills(
        self, units: list[ARPrefillInput], inputs: list[torch.Tensor]
    ) -> list[tuple[torch.Tensor, Any]]:
        """One varlen forward over admitted prefills: each unit's ``inputs`` are its last rows
        (all of them, or those past a forked prefix: positions continue from the tokens its
        sequence already holds). Per unit, the final hidden state of its last row ``[hidden]``
        and what its output streams."""
        for unit in units:
            self._note_positions(unit)
            self._on_admit(unit)
        guided = [u for u in units if u.seq_id in self._guided]
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
                self._positions(p, e - n, e) if p is not None else self._plain_positions(e - n, e)
                for p, n, e in zip(prompts, lens, ends_at, strict=True)
            ],
            dim=-1,
        )
        hidden = self._forward(rows, positions, seq_ids, lens)
        self.num_prefill_rows += sum(lens[:num])
        ends = torch.tensor(lens, device=self.device).cumsum(0) - 1
        last = hidden[ends]  # [len(units) + len(guided), hidden]
        for j, unit in enumerate(guided):
            self._uncond_last[unit.seq_id] = last[num + j]
        whole = [self.stream_prompt_rows and not u.generated for u in units]
        cond_rows = sum(lens[:num])
        streams = self._streams(rows[:cond_rows], hidden[:cond_rows], lens[:num], whole)
        return list(zip(last[:num], streams, strict=True))

    # ------------------------------------------------------------ prefix caching
    def _cache_salt(self, unit: ARPrefillInput) -> bytes | None:
        """The unit's salt as a BLAKE2b key (at most 64 bytes: longer salts are digested),
        or None when the prefill neither reuses nor keeps blocks (no salt, no
        ``prefix_caching``, a guided or group prompt, or one with a kept prefix)."""
        salt = getattr(unit, "cache_salt", None)
        if salt is None or not self.prefix_caching or unit.share_group is not None:
            return None
        if self._guidance(unit.prompt) is not None or self._prompt_prefix(unit.prompt):
            return None
        key = str(salt).encode()
        return key if len(key) <= 64 else hashlib.blake2b(key).digest()

    @staticmethod
    def _row_digests(rows: torch.Tensor, positions: torch.Tensor, salt: bytes) -> list[bytes]:
        """A 16-byte BLAKE2b digest, keyed by ``salt``, of each input row ``[n, in_dim]``
        with its rope positions (``[n]`` or ``[position_rows, n]``): equal digests, equal K/V
        inputs (M-RoPE positions differ between equal ids in other places)."""
        raw = rows.detach().contiguous().view(torch.uint8).cpu().numpy()
        pos = positions.reshape(-1, rows.shape[0]).T.contiguous().cpu().numpy().astype("<i8")
        return [
            hashlib.blake2b(r.tobytes() + p.tobytes(), digest_size=16, key=salt).digest()
            for r, p in zip(raw, pos, strict=True)
        ]

    def _admit_cached(
        self, unit: ARPrefillInput, rows: torch.Tensor, salt: bytes, batch: _Admitted
    ) -> bool:
        """Admit a salted prefill: start on the longest cached prefix of its rows (whole
        blocks, the last row always computed; for ``stream_prompt_rows`` a fresh prefill
        only as far as the blocks' streamed rows are kept), grow to all its rows. False:
        nothing held.

        Raises:
            KVCacheFullError: longer than the whole pool.
        """
        seq_id, num_rows, size = unit.seq_id, rows.shape[0], self.blocks.block_size
        whole = self.blocks.blocks_needed(num_rows)
        if whole > self.blocks.num_blocks:
            raise KVCacheFullError(seq_id, whole, self.blocks.num_blocks)
        digests = self._row_digests(rows, self._positions(unit.prompt, 0, num_rows), salt)
        hashes = chain_hashes(digests, size)[: (num_rows - 1) // size]
        matched = self.blocks.match(hashes)
        fresh_stream = self.stream_prompt_rows and not unit.generated
        if fresh_stream:
            known = itertools.takewhile(lambda h: h in self._cached_streams, hashes)
            matched = matched[: len(list(known))]
        num_cached = len(matched) * size
        self.table.free(seq_id)
        if matched:
            self.table.share(seq_id, matched, num_cached)
            room = self._make_room(self.table.extend_cost(seq_id, num_rows), batch.pinned)
            admitted = room and self.table.extend(seq_id, num_rows)
            if not admitted:
                self.table.free(seq_id)  # the cached blocks go back to the cache
        else:
            admitted = self._admit(seq_id, num_rows, batch.pinned)
        if not admitted:
            self._waiting_rows = (unit, rows)
            return False
        cached_stream = None
        if fresh_stream and matched:
            cached_stream = torch.cat([self._cached_streams[h] for h in hashes[: len(matched)]])
        streams = [] if fresh_stream else None
        self._salted[seq_id] = _SaltedRows(salt, digests, streams)
        batch.entries[seq_id] = _Entry(unit, rows[num_cached:], None, cached_stream, num_cached)
        self.num_cached_rows += num_cached
        return True

    def _note_prefill(self, unit: ARPrefillInput, stream: Any) -> None:
        """Keep a salted prefill's streamed rows (one per prompt row when fresh)."""
        record = self._salted.get(unit.seq_id)
        if record is None:
            return
        record.computed = True
        if record.streams is None:
            return
        if isinstance(stream, torch.Tensor) and stream.shape[0] == len(record.digests):
            record.streams.append(stream)
        else:
            record.streams = None

    def _note_fed(
        self, units: Sequence[Any], rows: torch.Tensor, positions: torch.Tensor, streams: list
    ) -> None:
        """Add each salted sequence's fed row (digest and streamed row) of a decode step;
        ``rows`` ``[B, in_dim]`` and the first ``B`` columns of ``positions`` are the units'."""
        for j, unit in enumerate(units):
            record = self._salted.get(unit.seq_id)
            if record is None:
                continue
            pos = positions[..., j : j + 1]
            record.digests += self._row_digests(rows[j : j + 1], pos, record.salt)
            if record.streams is not None:
                if isinstance(streams[j], torch.Tensor):
                    record.streams.append(streams[j])
                else:
                    record.streams = None

    def _keep_cached(self, seq_id: str) -> None:
        """Register a salted sequence's full blocks in the evictable cache (with their
        streamed rows), before it is freed; forget its record."""
        record = self._salted.pop(seq_id, None)
        if record is None or not record.computed or seq_id not in self.lengths:
            return
        size = self.blocks.block_size
        num_rows = min(self.lengths[seq_id], len(record.digests))
        hashes = chain_hashes(record.digests[:num_rows], size)[: num_rows // size]
        if not hashes:
            return
        self.blocks.cache(seq_id, hashes, keep=True)
        if record.streams is not None:
            streamed = torch.cat(record.streams) if record.streams else None
            if streamed is not None and streamed.shape[0] >= len(hashes) * size:
                for b, content in enumerate(hashes):
                    self._cached_streams[content] = streamed[b * size : (b + 1) * size].clone()
        live = self.blocks.cached_hashes()
        for content in [h for h in self._cached_streams if h not in live]:
            del self._cached_streams[content]

    # ------------------------------------------------------------ kept prefixes
    def _split(self, prompt: Any, num_rows: int) -> tuple[Hashable, int] | None:
        """``(label, n)`` of a prefill of ``num_rows`` rows whose first ``n`` rows come from a
        kept prefix (``_prompt_prefix``, at most ``num_rows - 1`` rows so the last row is
        computed), else None (also for ``stream_prompt_rows`` families)."""
        if self.stream_prompt_rows or self._guidance(prompt) is not None:
            return None
        prefix = self._prompt_prefix(prompt)
        if prefix is None:
            return None
        label, n = prefix
        n = min(int(n), num_rows - 1)
        return None if n < 1 else (label, n)

    def _content_hashes(self, rows: torch.Tensor, block_size: int | None = None) -> list[int]:
        """Chained content hashes (``omnistep.kv.chain_hashes``) of input rows
        ``[n, in_dim]``, one per block of ``block_size`` rows (default: the KV pool's):
        equal hashes, bit-equal rows."""
        raw = rows.detach().contiguous().view(torch.uint8).cpu().numpy()  # [n, in_dim * bytes]
        size = block_size or self.blocks.block_size
        return chain_hashes([row.tobytes() for row in raw], size)

    def _admit(self, seq_id: str, num_tokens: int, pinned: set[Hashable]) -> bool:
        """``SequenceTable.admit_prefill``, evicting kept prefixes when the blocks are short."""
        if self.table.admit_prefill(seq_id, num_tokens):
            return True
        needed = self.blocks.blocks_needed(num_tokens)
        return self._make_room(needed, pinned) and self.table.admit_prefill(seq_id, num_tokens)

    def _admit_split(
        self,
        seq_id: str,
        rows: torch.Tensor,
        split: tuple[Hashable, int],
        prefixes: dict[Hashable, tuple[torch.Tensor, list[int]]],
        pinned: set[Hashable],
    ) -> bool:
        """Admit a prefill of ``rows`` whose first ``n`` rows are a kept prefix, found by their
        content hash in the block manager (``BlockManager.match``): the sequence shares the
        prefix's blocks (made now, and queued in ``prefixes`` for this batch to compute, if
        none is kept) and grows to all its rows. Kept prefixes are evicted when blocks are
        short; last, the sequence takes its prefix's blocks over (the prefix is no longer
        kept), so it needs no more blocks than a whole prefill. False: not admitted (nothing
        held)."""
        label, n = split
        hashes = tuple(self._content_hashes(rows[:n]))
        key = hashes[-1]
        num_rows = rows.shape[0]
        blocks = self.blocks
        self.table.free(seq_id)
        whole = blocks.blocks_needed(num_rows)
        if whole > blocks.num_blocks:
            raise KVCacheFullError(seq_id, whole, blocks.num_blocks)
        pinned.add(key)
        kept = self._prefixes.get(key)
        created = kept is None
        if kept is None:
            keeping = blocks.blocks_needed(n) + whole - n // blocks.block_size
            if not self._make_room(keeping, pinned) and not self._make_room(whole, pinned):
                return False
            prefix_id = f"prefix/{type(self).__name__}/{next(self._prefix_ids)}"
            kept = _KeptPrefix(prefix_id, n, label, hashes)
            self.table.admit_prefill(kept.seq_id, n)
            blocks.cache(kept.seq_id, hashes)  # computed by this batch before any reads it
            self._prefixes[key] = kept
            prefixes[key] = (rows[:n], blocks.block_table(kept.seq_id))
        self._prefixes.move_to_end(key)
        self.table.share(seq_id, blocks.match(hashes), n)
        if not self._make_room(self.table.extend_cost(seq_id, num_rows), pinned):
            self._drop_prefix(key)  # take its blocks over: no private copy of the last one
        if self.table.extend(seq_id, num_rows):
            return True
        self.table.free(seq_id)
        if created:
            self._drop_prefix(key)
            del prefixes[key]
        return False

    def _compute_prefixes(self, prefixes: list[tuple[torch.Tensor, list[int]]]) -> None:
        """One varlen forward of prefixes alone (rows ``[n, in_dim]``, positions ``0..n-1``)
        into their blocks."""
        lens = [r.shape[0] for r, _ in prefixes]
        rows = torch.cat([r for r, _ in prefixes])
        positions = torch.cat([torch.arange(n, device=self.device) for n in lens])
        self._forward_tables(rows, positions, lens, lens, [t for _, t in prefixes])
        self.num_prefill_rows += sum(lens)

    def _make_room(self, num_blocks: int, pinned: set[Hashable]) -> bool:
        """Evict kept prefixes (least recently used first, none in ``pinned``) until
        ``num_blocks`` blocks are free; whether they are."""
        while self.blocks.num_free_blocks < num_blocks:
            victim = next((k for k in self._prefixes if k not in pinned), None)
            if victim is None:
                return False
            self._drop_prefix(victim)
        return True

    def _trim_prefixes(self, pinned: set[Hashable]) -> None:
        """Evict the least recently used kept prefixes beyond ``max_kept_prefixes``."""
        extra = len(self._prefixes) - self.max_kept_prefixes
        for key in [k for k in self._prefixes if k not in pinned][: max(0, extra)]:
            self._drop_prefix(key)

    def _drop_prefix(self, key: Hashable) -> None:
        kept = self._prefixes.pop(key, None)
        if kept is not None:
            self.table.free(kept.seq_id)

    def _share_key(self, unit: ARPrefillInput, rows: torch.Tensor) -> Hashable | None:
        """``(group, content hash of its rows)`` of a fresh prefill that may share its
        group's equal prompt, else None."""
        if unit.share_group is None or unit.generated:
            return None
        return unit.share_group, self._content_hashes(rows)[-1]

    def _live_shared(self, key: Hashable) -> bool:
        """Whether a group prompt is kept and its sequence still holds its blocks (a
        preempted sequence lost them; its entry is dropped then)."""
        shared = self._shared.get(key)
        if shared is None:
            return False
        if shared.seq_id in self.lengths and self.lengths[shared.seq_id] >= shared.num_tokens:
            return True
        del self._shared[key]
        return False

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
        guided = [j for j, u in enumerate(run_units) if u.seq_id in self._guided]
        seq_ids = [u.seq_id for u in run_units] + [uncond_id(run_units[j].seq_id) for j in guided]
        if guided:  # the unconditional rows are fed the same frame
            rows = torch.cat([rows, rows[guided]])
        positions = self._step_positions(seq_ids)
        hidden = self._forward(rows, positions, seq_ids, [1] * len(seq_ids))
        step_routing = self.last_routing
        for k, j in enumerate(guided):
            self._uncond_last[run_units[j].seq_id] = hidden[len(keep) + k]
        hidden, rows = hidden[: len(keep)], rows[: len(keep)]
        streams = self._streams(rows, hidden, [1] * len(keep), [True] * len(keep))
        if self._salted:
            self._note_fed(run_units, rows, positions, streams)
        sampled = self._sample(hidden, run_units, streams)
        for j, (i, out) in enumerate(zip(keep, sampled, strict=True)):
            rec = step_routing is not None and run_units[j].record
            results[i] = self._with_routing(out, step_routing[j : j + 1] if rec else None, False)
        return results

    def _grow(self, units: Sequence[Any], held: list[int]) -> list[int]:
        """Grow the held units' sequences (a guided one's unconditional sequence with it) by one
        token, preempting the youngest when the pool runs out; a guided unit whose pair lost a
        member is freed whole. Returns the indices of ``units`` that step."""
        seq_ids = self._with_uncond([units[i].seq_id for i in held])
        if self._prefixes and all(s in self.lengths for s in seq_ids):
            self._make_room(self.table.blocks_to_grow(seq_ids), set())  # before preempting
        grown = {seq_ids[k] for k in self.table.grow(seq_ids)}
        keep = []
        for i in held:
            pair = self._with_uncond([units[i].seq_id])
            if all(s in grown for s in pair):
                keep.append(i)
            elif any(s in grown for s in pair):  # half of a guided pair: free the other half
                self.free_sequence(units[i].seq_id)
        return keep

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

    def _sample(
        self, hidden: torch.Tensor, units: Sequence[Any], streams: Sequence[Any]
    ) -> list[ARStepOutput]:
        """Sample each row of ``hidden`` ``[B, hidden]`` with its unit's settings."""
        logits = self._guide(self._head(hidden, units[0].seq_id).float(), units)
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

    def _guide(self, logits: torch.Tensor, units: Sequence[Any]) -> torch.Tensor:
        """Classifier-free guidance of the guided rows of ``logits`` ``[B, C, V]`` float32:
        ``cond + w * (cond - uncond)`` with the unconditional rows' head logits (their hidden
        states kept by this step's forward in ``_uncond_last``)."""
        guided = [j for j, u in enumerate(units) if u.seq_id in self._uncond_last]
        if not guided:
            return logits
        uncond = torch.stack([self._uncond_last.pop(units[j].seq_id) for j in guided])
        uncond_logits = self._head(uncond, units[guided[0]].seq_id).float()
        index = torch.tensor(guided, device=logits.device)
        weight = torch.tensor(
            [self._guided[units[j].seq_id] for j in guided], device=logits.device
        ).view(-1, 1, 1)
        cond = logits[index]
        logits = logits.clone()
        logits[index] = cond + weight * (cond - uncond_logits)
        return logits

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

    # ------------------------------------------------------------ teacher forcing
    def _teacher_forced(self, first: ARPrefillInput, steps: Sequence[Any]) -> torch.Tensor:
        """Raw logits ``[len(first.generated) + len(steps) + 1, num_codebooks, V]`` float32 of
        a prefill followed by decode steps, on a temporary sequence (freed after): row ``i`` is
        the distribution frame ``i`` after the prompt was drawn from.

        Raises:
            KVCacheFullError: the sequence does not fit the KV pool.
        """
        inputs = self._prefill_inputs(first)
        num_tokens = inputs.shape[0]
        num_prompt = num_tokens - len(first.generated)
        seq_id = first.seq_id
        try:
            self.blocks.allocate(seq_id, num_tokens)
            self.lengths[seq_id] = num_tokens
            self._note_positions(first)
            self._on_admit(first)
            positions = self._positions(first.prompt, 0, num_tokens)
            hidden = self._forward(inputs, positions, [seq_id], [num_tokens])
            # the head per forward, as generation applies it (the GEMM shape changes the last
            # bits)
            logits = [self._head(hidden[num_prompt - 1 :], seq_id)]
            for unit in steps:
                self.lengths[seq_id] += 1
                self.blocks.allocate(seq_id, self.lengths[seq_id])
                position = self._step_positions([seq_id])
                hidden = self._forward(self._step_inputs([unit]), position, [seq_id], [1])
                logits.append(self._head(hidden, seq_id))
        finally:
            self.free_sequence(seq_id)
        return torch.cat(logits).float()

    def _teacher_seq_id(self) -> str:
        return f"teacher-forced/{type(self).__name__}/{next(self._teacher_ids)}"
