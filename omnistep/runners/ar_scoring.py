"""Teacher-forced scoring of a ``PagedARModel`` (train = serve): recorded trajectories run
through the model's own hooks and layers with no paged cache and autograd on
(``LlamaModel.forward_packed``), so a trainer's loss backpropagates into the model's weights;
and ``teacher_forced``, a prefill plus decode steps on a temporary paged sequence (the
families' ``teacher_forced_logits``). ``omnistep.runners.paged_ar``'s module docstring ("Train
= serve") says what matches serving and how closely.

Imports torch, ``omnistep.sampling``, the AR loop's payload types and ``ar_prefix``'s pure
helpers.
"""

from __future__ import annotations

import itertools
from collections.abc import Hashable, Sequence
from typing import Any

import torch

from omnistep.loops.ar_decode import ARPrefillInput
from omnistep.runners.ar_prefix import content_hashes, prefix_split
from omnistep.sampling import entropy, policy_distribution, processed_logprobs

SCORE_MODES = ("processed", "policy")
"""``score_logprobs`` modes: the distribution sampled, or ``log_softmax(logits / T)``."""


class TeacherForcedScorer:
    """The scoring collaborator of a ``PagedARModel`` (``model.scorer``); the model's public
    ``score_logits``, ``score_logits_batch``, ``score_logprobs`` and ``score_batch`` call it.

    Args:
        model: the owner; its hooks (``_prefill_inputs``, ``_unconditional_inputs``,
            ``_lm_inputs``, ``_after_layer``, ``_score_head``, ``_score_head_key``, ``_guidance``,
            ``_sampling_logits``, ``_head``, ``_step_inputs``), ``llama``, ``positions``,
            ``moe_routing``, ``batch_invariant`` and ``serving`` are used.
    """

    def __init__(self, model: Any):
        self.model = model
        self._teacher_ids = itertools.count()

    # ------------------------------------------------------------ logits
    def logits_batch(
        self,
        prompts: Sequence[Any],
        frames: Sequence[Sequence[Sequence[int]]],
        match_serving: bool = True,
        routing: Sequence[Any] | None = None,
    ) -> list[torch.Tensor]:
        """``PagedARModel.score_logits_batch`` (its docstring says what it returns and
        raises)."""
        model = self.model
        with torch.set_grad_enabled(torch.is_grad_enabled() and not model.serving):
            hidden = self.hidden_batch(prompts, frames, match_serving, routing=routing)
            logits = self.heads(hidden, prompts)
            guided = [i for i, p in enumerate(prompts) if model._guidance(p) is not None]
            if not guided:
                return logits
            if routing is not None:
                raise ValueError("routing replay of a guided (CFG) prompt is not supported")
            picked = [prompts[i] for i in guided]
            hidden = self.hidden_batch(
                picked, [frames[i] for i in guided], match_serving, unconditional=True
            )
            for i, uncond in zip(guided, self.heads(hidden, picked), strict=True):
                weight = float(model._guidance(prompts[i]))
                logits[i] = logits[i] + weight * (logits[i] - uncond)
            return logits

    def heads(self, hidden: list[torch.Tensor], prompts: Sequence[Any]) -> list[torch.Tensor]:
        """``_score_head`` of each trajectory's hidden states ``[T_i, hidden]``, one call per
        group of prompts with equal ``_score_head_key``: float32 logits per trajectory."""
        model = self.model
        groups: dict[Hashable, list[int]] = {}
        for i, prompt in enumerate(prompts):
            groups.setdefault(model._score_head_key(prompt), []).append(i)
        out: list[torch.Tensor] = [hidden[0]] * len(hidden)
        for members in groups.values():
            packed = torch.cat([hidden[i] for i in members])
            logits = model._score_head(packed, prompts[members[0]]).float()
            sizes = [hidden[i].shape[0] for i in members]
            for i, part in zip(members, logits.split(sizes), strict=True):
                out[i] = part
        return out

    def hidden_batch(
        self,
        prompts: Sequence[Any],
        frames_of: Sequence[Sequence[Sequence[int]]],
        match_serving: bool,
        unconditional: bool = False,
        routing: Sequence[Any] | None = None,
    ) -> list[torch.Tensor]:
        """The final hidden states ``[T_i, hidden]`` the head scores, per trajectory, in one
        ``forward_packed`` (row ``i`` is the state frame ``i`` was drawn from); with
        ``unconditional``, of their guided prompts' unconditional rows; with ``routing``
        (``logits_batch``), replaying each trajectory's experts.

        Raises:
            ValueError: no frames, a frame of another width, a malformed prompt, counts that
                differ, a malformed routing.
        """
        model = self.model
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
            unit = ARPrefillInput(self._seq_id(), prompt, frames[:-1], (), None, None)
            inputs = model._unconditional_inputs if unconditional else model._prefill_inputs
            try:
                x = inputs(unit)  # [prompt_len + T - 1, in_dim]
            except (IndexError, TypeError, AttributeError, KeyError) as exc:
                # recorded data, not ours: a prompt of another component's kind, frames of
                # another width, ids outside an embedding (a tampered or foreign sample)
                raise ValueError(
                    f"trajectory {i}: its prompt or frames do not fit {type(model).__name__} "
                    f"({type(exc).__name__}: {exc})"
                ) from exc
            num_rows = x.shape[0]
            prompt_len = num_rows - (len(frames) - 1)
            prompt_lens.append(prompt_len)
            experts = (
                None if routing is None else model.moe_routing.replay_rows(routing[i], num_rows, i)
            )
            first = self._shared_prompt(firsts, x[:prompt_len], i, num_rows)
            if first is not None and experts is not None:
                experts = experts[prompt_len:]
            if experts is not None:
                replay.append(experts)
            if first is not None:  # a group's prompt computed once: only the frames' rows
                shared.append((first, prompt_len))
                positions.append(model.positions.rows(prompt, prompt_len, num_rows))
                rows.append(x[prompt_len:])
                lens.append(num_rows - prompt_len)
                query_lens += [1] * (num_rows - prompt_len)
                pieces_of.append(None)
                continue
            shared.append(None)
            if match_serving:  # the prompt as serving prefilled it: whole, or prefix then rest
                split = prefix_split(model, prompt, prompt_len)
                pieces = [prompt_len] if split is None else [split[1], prompt_len - split[1]]
                query_lens += pieces + [1] * (len(frames) - 1)
                pieces_of.append(pieces)
            else:
                query_lens.append(num_rows)
                pieces_of.append(None)
            rows.append(x)
            lens.append(num_rows)
            positions.append(model.positions.rows(prompt, 0, num_rows))
        packed = torch.cat(rows) if len(rows) > 1 else rows[0]
        embeds = model._lm_inputs(packed, query_lens)
        after = model._after_layer(packed)  # as serving runs it (Qwen3-Omni's deepstack)
        hidden = model.llama.forward_packed(
            embeds,
            lens,
            pieces_of,
            model.batch_invariant,
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

    def _shared_prompt(
        self, firsts: dict[Hashable, int], prompt_rows: torch.Tensor, index: int, num_rows: int
    ) -> int | None:
        """The earlier trajectory whose prompt rows trajectory ``index`` reuses (equal rows
        ``[prompt_len, in_dim]``, by content hash), else None (then it is the first of its
        rows). Only in the default mode (within rounding: under ``batch_invariant`` the
        reused rows differed from a trajectory's own in the last bits, ~1e-6, measured on
        ChatTTS; not yet explained), and not for a trajectory with no frame rows."""
        if self.model.batch_invariant:
            return None
        prompt_len = prompt_rows.shape[0]
        key = content_hashes(prompt_rows, max(1, prompt_len))[-1]  # a copy has no pool
        if key not in firsts:
            firsts[key] = index
            return None
        return firsts[key] if num_rows > prompt_len else None

    # ------------------------------------------------------------ log-probs
    def batch(
        self,
        prompts: Sequence[Any],
        frames: Sequence[Sequence[Sequence[int]]],
        samplings: Sequence[Any],
        mode: str = "processed",
        penalty_window: int = 16,
        match_serving: bool = True,
        with_entropy: bool = False,
        routing: Sequence[Any] | None = None,
    ) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """``PagedARModel.score_batch`` (its docstring says what it returns and raises),
        through the model's ``score_logits_batch`` (which a family may override)."""
        model = self.model
        if mode not in SCORE_MODES:
            raise ValueError(f"mode must be one of {', '.join(SCORE_MODES)}, got {mode!r}")
        logits = model.score_logits_batch(prompts, frames, match_serving, routing)
        tokens = [self.frame_tensor(f) for f in frames]
        check_frames(logits, tokens)
        logits = model._sampling_logits(torch.cat(logits) if len(logits) > 1 else logits[0])
        logp = self.distribution(logits, tokens, samplings, mode, penalty_window)
        return self.gather(logp, tokens, with_entropy)

    def frame_tensor(self, frames: Sequence[Sequence[int]]) -> torch.Tensor:
        """LongTensor ``[T, width]`` of recorded frames on the device."""
        return torch.tensor([tuple(f) for f in frames], dtype=torch.long, device=self.model.device)

    @staticmethod
    def distribution(
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
    def gather(
        logp: torch.Tensor, tokens: Sequence[torch.Tensor], with_entropy: bool
    ) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """Split packed log-probs ``[sum T_i, C, V]`` into each trajectory's recorded ids'
        ``[T_i, C]`` and, asked, its entropies."""
        ids = torch.cat(tokens) if len(tokens) > 1 else tokens[0]
        picked = logp.gather(-1, ids.to(logp.device).unsqueeze(-1)).squeeze(-1)
        sizes = [t.shape[0] for t in tokens]
        ent = entropy(logp).split(sizes) if with_entropy else [None] * len(sizes)
        return list(zip(picked.split(sizes), ent, strict=True))

    def _seq_id(self) -> str:
        return f"score/{type(self.model).__name__}"

    # ------------------------------------------------------------ on the paged cache
    def teacher_seq_id(self) -> str:
        """A fresh sequence id for ``teacher_forced``."""
        return f"teacher-forced/{type(self.model).__name__}/{next(self._teacher_ids)}"

    def teacher_forced(self, first: ARPrefillInput, steps: Sequence[Any]) -> torch.Tensor:
        """Raw logits ``[len(first.generated) + len(steps) + 1, num_codebooks, V]`` float32 of
        a prefill followed by decode steps, on a temporary sequence (freed after): row ``i`` is
        the distribution frame ``i`` after the prompt was drawn from.

        Raises:
            KVCacheFullError: the sequence does not fit the KV pool.
        """
        model = self.model
        inputs = model._prefill_inputs(first)
        num_tokens = inputs.shape[0]
        num_prompt = num_tokens - len(first.generated)
        seq_id = first.seq_id
        try:
            model.blocks.allocate(seq_id, num_tokens)
            model.lengths[seq_id] = num_tokens
            model.positions.note(first)
            model._on_admit(first)
            positions = model.positions.rows(first.prompt, 0, num_tokens)
            hidden = model._forward(inputs, positions, [seq_id], [num_tokens])
            # the head per forward, as generation applies it (the GEMM shape changes the last
            # bits)
            logits = [model._head(hidden[num_prompt - 1 :], seq_id)]
            for unit in steps:
                model.lengths[seq_id] += 1
                model.blocks.allocate(seq_id, model.lengths[seq_id])
                position = model.positions.step([seq_id])
                hidden = model._forward(model._step_inputs([unit]), position, [seq_id], [1])
                logits.append(model._head(hidden, seq_id))
        finally:
            model.free_sequence(seq_id)
        return torch.cat(logits).float()


def check_frames(logits: Sequence[torch.Tensor], tokens: Sequence[torch.Tensor]) -> None:
    """Check recorded frames against the distributions that score them: trajectory ``i``'s
    ids ``[T_i, width]`` against its logits ``[T_i, num_codebooks, V]``.

    Raises:
        ValueError: another width than the component samples, or an id outside
            ``[0, V)`` (a tampered sample, or one of another model).
    """
    for i, (lg, ids) in enumerate(zip(logits, tokens, strict=True)):
        width, vocab = lg.shape[-2], lg.shape[-1]
        if ids.shape[-1] != width:
            raise ValueError(
                f"trajectory {i}: frames of {ids.shape[-1]} codebook(s), the component "
                f"samples {width}"
            )
        if ids.numel() and not 0 <= int(ids.min()) <= int(ids.max()) < vocab:
            raise ValueError(f"trajectory {i}: token ids must be in [0, {vocab})")
