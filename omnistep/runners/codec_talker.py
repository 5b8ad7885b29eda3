"""The talker of the Qwen3 speech models (Qwen3-TTS, Qwen3-Omni) on the paged-KV AR runner: a
decoder over codebook 0 of a multi-codebook codec frame, with the shared code predictor filling
codebooks 1..G-1 inside the same step; every input row a codec part plus a projected text part.

Both families' talkers (qwen_tts 0.1.1 ``Qwen3TTSTalkerForConditionalGeneration``, transformers
5.x ``Qwen3OmniMoeTalkerForConditionalGeneration``) read rows ``codec part + text_projection(
text table[text id])``: ``text_projection`` a two-layer MLP with biases (``linear_fc1``,
activation, ``linear_fc2``); the text table is Qwen3-TTS's own ``text_embedding`` and
Qwen3-Omni's thinker ``embed_tokens``. The codec part of a generated frame is its G codebook
embeddings summed (``codec_embedding`` for code 0, the predictor's ``codec_embedding[j - 1]``
for code ``j``); a prompt row's codec part is the family's (``_prefill_inputs``).

One unit (PREFILL or AR_TOKEN) = one frame: talker forward -> ``codec_head`` -> sample codebook 0
(the top 1024 ids but EOS suppressed, the row's repetition penalty and EOS mask) -> the code
predictor's G-1 sub-steps, batched over the rows of the step, every draw from the unit's
generator (``omnistep.sampling.sample``: G uniforms per frame, codebook order), so a request's
codes do not depend on its batch. A frame whose code 0 is EOS carries zeros in codebooks 1..G-1
(not sampled; log-probs 0). ``score_logits_batch`` / ``score_batch`` recompute a recorded
trajectory's log-probs (both stages) with autograd.

A family subclasses ``CodecTalker`` and gives ``_prefill_inputs`` (its prompt layout): rows
``[codec part (hidden) | text embedding (text_hidden)]``; AR_TOKEN units carry their text id in
``ARStepInput.extra``. A family with ``text_gate`` (Qwen3-Omni, whose media rows are
``hidden_projection`` of thinker states with no text part) adds one more column, the gate
``g``: the row is ``codec part + g * text_projection(text part)``; its ``_prefill_inputs`` and
``_step_inputs`` append it (1 for ordinary rows, 0 for a row whose whole input is in its
codec part).

Imports torch, ``omnistep.kv``, ``omnistep.layers``, ``omnistep.loops``, ``omnistep.sampling``,
``omnistep.runners.paged_ar``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from omnistep.kv import KVCacheConfig
from omnistep.layers.batch_invariant import map_row_groups
from omnistep.layers.code_predictor import CodePredictor, CodePredictorConfig
from omnistep.layers.linear import linear
from omnistep.layers.llama import LlamaConfigLite
from omnistep.loops.ar_decode import ARPrefillInput, ARStepInput, ARStepOutput
from omnistep.runners.paged_ar import SCORE_MODES, PagedARModel
from omnistep.sampling import (
    SamplingRow,
    policy_distribution,
    processed_logprobs,
    sample,
)
from omnistep.sampling import entropy as entropy_of

NEG_INF = float("-inf")
SUPPRESSED_TOP_IDS = 1024
"""Both upstream ``generate``s suppress the top 1024 talker ids (the control codes) but EOS."""

ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu, "relu": F.relu}
"""``text_projection``'s activation by config name (``hidden_act``)."""


@dataclass(frozen=True)
class CodecTalkerSizes:
    """The widths and ids a ``CodecTalker`` needs.

    Attributes:
        vocab_size: codebook-0 ids (codes, control and speaker ids).
        hidden_size: the talker's width.
        text_vocab_size, text_hidden_size: the text table's rows and width.
        projection_size: ``text_projection``'s inner width (``linear_fc1``'s outputs).
        num_code_groups: G, codebooks per frame.
        eos_id: the codec EOS id.
        hidden_act: ``text_projection``'s activation (``ACTIVATIONS``).
    """

    vocab_size: int
    hidden_size: int
    text_vocab_size: int
    text_hidden_size: int
    projection_size: int
    num_code_groups: int
    eos_id: int
    hidden_act: str = "silu"

    def __post_init__(self) -> None:
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(
                f"text_projection's hidden_act {self.hidden_act!r} is not one of "
                f"{sorted(ACTIVATIONS)}"
            )
        if not 0 <= self.eos_id < self.vocab_size:
            raise ValueError(f"codec eos id {self.eos_id} outside [0, {self.vocab_size})")

    def suppressed_ids(self) -> list[int]:
        """Ids ``generate`` suppresses when sampling codebook 0: the top
        ``SUPPRESSED_TOP_IDS`` of the vocab except EOS."""
        start = max(0, self.vocab_size - SUPPRESSED_TOP_IDS)
        return [i for i in range(start, self.vocab_size) if i != self.eos_id]


@dataclass(frozen=True, slots=True)
class CodecTalkerSampling:
    """One request's sampling rows: ``talker`` for codebook 0, ``predictor`` for 1..G-1."""

    talker: SamplingRow
    predictor: SamplingRow


class CodecTalker(PagedARModel):
    """The shared talker (module docstring). PREFILL payloads are ``ARPrefillInput`` with the
    family's prompt; AR_TOKEN payloads ``ARStepInput`` whose ``extra`` is the step's text id;
    ``sampling`` is a ``CodecTalkerSampling``. Frames are G ids; outputs carry no ``hidden``.

    Attributes:
        sizes: the ``CodecTalkerSizes``. codec_embedding: ``[vocab, hidden]``;
        text_embedding: ``[text_vocab, text_hidden]``; fc1_weight/fc1_bias,
        fc2_weight/fc2_bias: ``text_projection``; codec_head: ``[vocab, hidden]``;
        predictor: the ``CodePredictor``; eos_id: the codec EOS.

    Raises:
        ValueError: the predictor's code groups differ from the talker's.
    """

    def __init__(
        self,
        stack: LlamaConfigLite,
        sizes: CodecTalkerSizes,
        predictor: CodePredictorConfig,
        kv: KVCacheConfig,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        batch_invariant: bool = False,
    ):
        if predictor.num_code_groups != sizes.num_code_groups:
            raise ValueError(
                f"the code predictor has {predictor.num_code_groups} code groups, the "
                f"talker {sizes.num_code_groups}"
            )
        super().__init__(stack, kv, device, dtype, batch_invariant, sizes.num_code_groups)
        self.sizes = sizes
        self.eos_id = sizes.eos_id
        factory = {"device": self.device, "dtype": dtype}
        h, th, inner = sizes.hidden_size, sizes.text_hidden_size, sizes.projection_size
        self.codec_embedding = torch.zeros(sizes.vocab_size, h, **factory)
        self.text_embedding = torch.zeros(sizes.text_vocab_size, th, **factory)
        self.fc1_weight = torch.zeros(inner, th, **factory)
        self.fc1_bias = torch.zeros(inner, **factory)
        self.fc2_weight = torch.zeros(h, inner, **factory)
        self.fc2_bias = torch.zeros(h, **factory)
        self.codec_head = torch.zeros(sizes.vocab_size, h, **factory)
        self.predictor = CodePredictor(predictor, h, self.device, dtype, batch_invariant)
        self._act = ACTIVATIONS[sizes.hidden_act]
        self._suppressed = torch.tensor(sizes.suppressed_ids(), device=self.device)

    def _copy_named(
        self, targets: Mapping[str, torch.Tensor], state: Mapping[str, Any], prefix: str
    ) -> None:
        """Copy ``state``'s tensors whose names start with ``prefix`` into ``targets`` (live
        tensors by official name): every target must be given, nothing else.

        Raises:
            KeyError: a missing tensor (named). ValueError: a mis-shaped or unexpected one.
        """
        given = {k: v for k, v in state.items() if k.startswith(prefix)}
        missing = sorted(set(targets) - set(given))
        if missing:
            raise KeyError(f"missing talker tensors: {missing[:5]}")
        unexpected = sorted(set(given) - set(targets))
        if unexpected:
            raise ValueError(f"unexpected talker tensors: {unexpected[:5]}")
        with torch.no_grad():
            for name, target in targets.items():
                value = torch.as_tensor(given[name])
                if tuple(value.shape) != tuple(target.shape):
                    raise ValueError(
                        f"{name}: shape {tuple(value.shape)}, expected {tuple(target.shape)}"
                    )
                target.copy_(value)

    def _prompt_inputs(
        self, codec: torch.Tensor, text_ids: Sequence[int], unit: ARPrefillInput
    ) -> torch.Tensor:
        """A PREFILL's rows ``[L + n, hidden + text_hidden]``: the prompt's codec parts
        ``codec`` ``[L, hidden]`` and text ids, then one row per frame replayed after a
        preemption (its codebooks summed, with the prompt's ``replay_text`` id).

        Raises:
            ValueError: fewer ``replay_text`` ids than replayed frames, or a bad id.
        """
        replay = tuple(getattr(unit.prompt, "replay_text", ()))
        if len(replay) < len(unit.generated):
            raise ValueError(
                f"replaying {len(unit.generated)} frames needs as many text ids, got {len(replay)}"
            )
        text_ids = list(text_ids)
        if unit.generated:
            codec = torch.cat([codec, self._frame_sums(self._frames(unit.generated))])
            text_ids += replay[: len(unit.generated)]
        return torch.cat([codec, self._text_part(text_ids)], dim=1)

    def _codec_rows(self, codec_ids: Sequence[int]) -> torch.Tensor:
        """``[n, hidden]``: ``codec_embedding`` rows of ids, zeros where an id is negative (a
        row without a codec part).

        Raises:
            ValueError: an id at or past the vocab.
        """
        if any(int(c) >= self.sizes.vocab_size for c in codec_ids):
            raise ValueError(f"prompt codec id outside [0, {self.sizes.vocab_size})")
        ids = torch.tensor([int(c) for c in codec_ids], dtype=torch.long, device=self.device)
        return torch.where((ids >= 0)[:, None], self.codec_embedding[ids.clamp(min=0)], 0.0)

    def _text_part(self, text_ids: Sequence[int]) -> torch.Tensor:
        """``text_embedding`` rows ``[n, text_hidden]`` of text ids (checked on the host)."""
        text_ids = [int(t) for t in text_ids]
        if any(not 0 <= t < self.sizes.text_vocab_size for t in text_ids):
            raise ValueError(f"a text id outside [0, {self.sizes.text_vocab_size})")
        return self.text_embedding[torch.tensor(text_ids, dtype=torch.long, device=self.device)]

    def _frame_sums(self, frames: torch.Tensor) -> torch.Tensor:
        """``[T, hidden]``: the 16 codebook embeddings of frames ``[T, G]`` summed, left to right
        (a fixed elementwise order: each row's sum ignores the batch)."""
        total = self.codec_embedding[frames[:, 0]]
        for j, table in enumerate(self.predictor.codec_embedding):
            total = total + table[frames[:, j + 1]]
        return total

    def _frames(self, frames: Sequence[Sequence[int]]) -> torch.Tensor:
        """LongTensor ``[T, G]`` of frames; raises ValueError for a malformed one."""
        width, vocab_pred = self.sizes.num_code_groups, self.predictor.config.vocab_size
        for frame in frames:
            if len(frame) != width or not 0 <= frame[0] < self.sizes.vocab_size:
                raise ValueError(f"frame {tuple(frame)!r} is not {width} talker/predictor ids")
            if any(not 0 <= c < vocab_pred for c in frame[1:]):
                raise ValueError(f"frame {tuple(frame)!r} has a code outside [0, {vocab_pred})")
        return torch.tensor([tuple(f) for f in frames], dtype=torch.long, device=self.device)

    def _step_inputs(self, units: Sequence[ARStepInput]) -> torch.Tensor:
        codec = self._frame_sums(self._frames([u.last for u in units]))
        return torch.cat([codec, self._text_part([u.extra for u in units])], dim=1)

    text_gate = False
    """Rows carry a last gate column multiplying the projected text part (module docstring)."""

    def _lm_inputs(self, rows: torch.Tensor, query_lens: list[int]) -> torch.Tensor:
        """``codec part + text_projection(text part)`` (times the gate column with
        ``text_gate``), ``[N, hidden]`` (row-chunked by the sequences' query lengths in
        batch-invariant mode, as the stack chunks)."""
        hidden = self.sizes.hidden_size
        end = hidden + self.sizes.text_hidden_size

        def project(x: torch.Tensor) -> torch.Tensor:
            inner = self._act(linear(x[:, hidden:end], self.fc1_weight, self.fc1_bias))
            text = linear(inner, self.fc2_weight, self.fc2_bias)
            return x[:, :hidden] + (text * x[:, end:] if self.text_gate else text)

        rows = rows.to(self.dtype)
        if not self.batch_invariant:
            return project(rows)
        return map_row_groups(project, rows, self.llama.row_chunking.plan(query_lens, rows.device))

    def _head(self, hidden: torch.Tensor, seq_id: str) -> torch.Tensor:
        """Codebook-0 logits ``[B, 1, vocab]``."""
        return self._linear_rows(hidden.to(self.dtype), self.codec_head).unsqueeze(1)

    def _sampling_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """The top 1024 ids but EOS get -inf (upstream ``suppress_tokens``)."""
        return logits.index_fill(-1, self._suppressed, NEG_INF)

    # ------------------------------------------------------------ sampling
    def _sample(
        self, hidden: torch.Tensor, units: Sequence[Any], streams: Sequence[Any]
    ) -> list[ARStepOutput]:
        """Codebook 0 from the talker's logits, then codebooks 1..15 from the predictor, every
        draw from the unit's generator; see the module docstring."""
        batch = len(units)
        logits = self._sampling_logits(self._head(hidden, units[0].seq_id).float())
        history = [self._history(tuple((f[0],) for f in u.history), 1) for u in units]
        num_generated = [
            len(u.generated) if isinstance(u, ARPrefillInput) else u.num_generated for u in units
        ]
        generators = [u.generator for u in units]
        with_policy = any(u.record for u in units)
        first = sample(
            logits,
            [u.sampling.talker for u in units],
            history,
            num_generated,
            generators,
            with_policy,
        )
        code0 = first.tokens[:, 0]
        sub_rows = [u.sampling.predictor for u in units]
        no_history = [torch.zeros(1, 0, dtype=torch.long, device=self.device)] * batch
        codes, logprobs, policy = (
            [code0],
            [first.logprobs[:, 0]],
            [first.policy_logprobs[:, 0] if with_policy else None],
        )

        def choose(_j: int, step_logits: torch.Tensor) -> torch.Tensor:
            out = sample(
                step_logits[:, None], sub_rows, no_history, [0] * batch, generators, with_policy
            )
            codes.append(out.tokens[:, 0])
            logprobs.append(out.logprobs[:, 0])
            policy.append(out.policy_logprobs[:, 0] if with_policy else None)
            return out.tokens[:, 0]

        # every row runs the predictor (no host sync on code 0); an EOS row's codes are dropped
        self.predictor.run(hidden.to(self.dtype), self.codec_embedding[code0], choose)
        frame = torch.stack(codes, dim=1)  # [B, G]
        frame_lp = torch.stack(logprobs, dim=1)
        eos = (code0 == self.eos_id)[:, None]
        keep = torch.zeros_like(eos).expand(-1, frame.shape[1]).clone()
        keep[:, 1:] = eos  # an EOS frame's codebooks 1.. are not part of it
        frame = frame.masked_fill(keep, 0)
        frame_lp = frame_lp.masked_fill(keep, 0.0)
        tokens, lps = frame.tolist(), frame_lp.tolist()
        pols = (
            torch.stack(policy, dim=1).masked_fill(keep, 0.0).tolist()
            if with_policy
            else [()] * batch
        )
        return [
            ARStepOutput(tuple(t), tuple(lp), stream, False, tuple(pl), self.weight_version)
            for t, lp, pl, stream in zip(tokens, lps, pols, streams, strict=True)
        ]

    # ------------------------------------------------------------ scoring
    def score_logits_batch(
        self,
        prompts: Sequence[Any],
        frames: Sequence[Sequence[Sequence[int]]],
        match_serving: bool = True,
        routing: Sequence[Any] | None = None,
    ) -> list[torch.Tensor]:
        """Teacher-forced logits of recorded trajectories, differentiable in the weights:
        the talker as in ``PagedARModel.score_logits_batch`` (one packed forward), then the
        code predictor on every frame's talker hidden state with the frame's own codes fed,
        all trajectories' frames in one batch: serving's ``G - 1`` sub-steps under
        ``batch_invariant`` with ``match_serving`` (equal to the recorded log-probs to the
        bit), else ``CodePredictor.teacher_forced`` (one causal forward of 16 rows per frame;
        within float32 rounding, several times fewer kernel calls).

        Args:
            prompts: the recorded ``Any``s with ``replay_text`` for ``frames[:-1]``.
            frames: per trajectory ``T >= 1`` frames of 16 ids, the last one included (its EOS
                frame too).
            routing: a MoE talker's recorded routing per trajectory, replayed
                (``PagedARModel.score_logits_batch``); None: its router chooses.

        Returns:
            Per trajectory ``[T, 16, vocab]`` float32: codebook 0's raw talker logits, then the
            predictor's raw logits of codebooks 1..15 in columns ``[0, predictor vocab)`` and
            -inf beyond. An EOS frame's predictor rows are meaningless (its codes were not
            sampled).

        Raises:
            ValueError: no frames, a malformed frame or prompt.
        """
        with torch.set_grad_enabled(torch.is_grad_enabled() and not self.serving):
            frames = [tuple(tuple(int(t) for t in f) for f in fs) for fs in frames]
            if any(not fs for fs in frames):
                raise ValueError("score needs at least one frame")
            codes = torch.cat([self._frames(fs) for fs in frames])  # [sum T, 16]
            hidden = torch.cat(
                self.scorer.hidden_batch(prompts, frames, match_serving, routing=routing)
            )
            talker = self._head(hidden, "").float()
            teacher = codes[:, 1:]
            first = self.codec_embedding[codes[:, 0]]
            if self.batch_invariant and match_serving:  # serving's sub-steps, to the bit
                predictor = self.predictor.run(
                    hidden.to(self.dtype), first, lambda j, _logits: teacher[:, j]
                )
            else:  # one causal forward of 16 rows per frame: equal within rounding
                predictor = self.predictor.teacher_forced(hidden, first, teacher)
            pad = talker.shape[-1] - predictor.shape[-1]
            predictor = F.pad(predictor, (0, pad), value=NEG_INF)
            logits = torch.cat([talker, predictor], dim=1)
            return list(logits.split([len(fs) for fs in frames]))

    def score_batch(
        self,
        prompts: Sequence[Any],
        frames: Sequence[Sequence[Sequence[int]]],
        samplings: Sequence[CodecTalkerSampling],
        mode: str = "processed",
        penalty_window: int = 0,
        match_serving: bool = True,
        entropy: bool = False,
        routing: Sequence[Any] | None = None,
    ) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """Log-probs ``[T, 16]`` of recorded trajectories' ids, as serving recorded them:
        codebook 0 with the talker row (suppression, the codebook-0 history's penalty, the EOS
        mask), codebooks 1..15 with the predictor row; an EOS frame's codebooks 1..15 are 0
        (log-prob and entropy: they were not sampled). With ``entropy``, each step's entropy
        per codebook of the scored distribution (nats).

        Args:
            samplings: each trajectory's ``CodecTalkerSampling``.
            penalty_window: the loop's ``ARDecodeConfig.penalty_window`` (0: all frames).
            mode, match_serving, routing: as in ``PagedARModel.score_batch``.

        Raises:
            ValueError: an unknown mode, or what ``score_logits_batch`` raises.
        """
        if mode not in SCORE_MODES:
            raise ValueError(f"mode must be one of {', '.join(SCORE_MODES)}, got {mode!r}")
        logits = torch.cat(self.score_logits_batch(prompts, frames, match_serving, routing))
        tokens = [self._frames(tuple(tuple(int(t) for t in f) for f in fs)) for fs in frames]
        first = self._sampling_logits(logits[:, :1])
        rest = logits[:, 1:, : self.predictor.config.vocab_size]
        talker_rows = [s.talker for s, t in zip(samplings, tokens, strict=True) for _ in t]
        sub_rows = [s.predictor for s, t in zip(samplings, tokens, strict=True) for _ in t]
        if mode == "policy":
            logp0 = policy_distribution(first, talker_rows)
            logp_rest = policy_distribution(rest, sub_rows)
        else:
            history, generated = [], []
            for t in tokens:
                history += [
                    t[max(0, i - penalty_window) if penalty_window else 0 : i, :1].T
                    for i in range(t.shape[0])
                ]
                generated += range(t.shape[0])
            logp0 = processed_logprobs(first, talker_rows, history, generated)[0]
            empty = [tokens[0].new_zeros(rest.shape[1], 0)] * len(sub_rows)
            logp_rest = processed_logprobs(rest, sub_rows, empty, [0] * len(sub_rows))[0]
        ids = torch.cat(tokens)
        lp0 = logp0.gather(-1, ids[:, :1, None]).squeeze(-1)
        lp_rest = logp_rest.gather(-1, ids[:, 1:, None]).squeeze(-1)
        eos = ids[:, :1] == self.eos_id
        logprobs = torch.cat([lp0, lp_rest.masked_fill(eos, 0.0)], dim=1)
        sizes = [t.shape[0] for t in tokens]
        if not entropy:
            return [(lp, None) for lp in logprobs.split(sizes)]
        ent_rest = entropy_of(logp_rest).masked_fill(eos, 0.0)
        ent = torch.cat([entropy_of(logp0), ent_rest], dim=1)
        return list(zip(logprobs.split(sizes), ent.split(sizes), strict=True))
