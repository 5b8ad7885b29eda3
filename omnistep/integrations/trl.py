"""TRL's ``GRPOTrainer`` with omnistep as the rollout engine (TRL >= 1.16, ``rollout_func``).

``grpo_trainer(omni, ...)`` returns TRL's own ``GRPOTrainer``, wired so that its three hooks
land on the offline API:

- completions: TRL calls ``rollout_func(prompts, trainer)`` with each prompt repeated
  ``num_generations`` times in a row; ``OmniRollout`` sends each run of equal prompts as one
  omnistep group (``OmniEngine.rollout(n=num_generations)``: one prefill, shared KV blocks)
  and answers TRL's ``prompt_ids`` / ``completion_ids`` / ``logprobs``, plus the frames
  (``frames``, int64 ``[T, num_codebooks]``), the weight version each sample ran under
  (``weight_version``) and, when asked, the audio for the reward functions.
- log-probs: TRL calls the policy as a causal LM with its fused-head convention
  (``model(input_ids, attention_mask, labels, fused_lm_head=True)`` -> ``log_probs`` and
  ``entropy`` per label position). ``OmniPolicy`` finds the recorded sample each row came
  from and answers ``OmniEngine.score(samples, mode="policy", trainer=...)``: the
  teacher-forced forward of the same component code on the ``Trainer``'s own weights, with a
  graph to them (train = serve: equal to the recorded log-probs before any step).
- weights: the policy's parameters are the ``Trainer``'s tensors (``trainer.weights(names)``),
  so TRL's optimizer, gradient clipping and scheduler step them; the next ``rollout_func``
  call after an optimizer step sends them to serving with ``update_weights(trainer)`` (a new
  weight version), as TRL's vLLM path syncs before generating.

Rows are matched to samples by prompt ids and completion tokens: give a fixed ``voice`` where
a card draws a speaker per seed (ChatTTS), so equal ids mean an equal prompt. TRL's
entropies (its ``entropy`` log, ``top_entropy_quantile``) come from a second teacher-forced
forward (``score_logits``) without a graph. TRL marks ``rollout_func`` experimental: the
pinned TRL (1.16.0) is the one tested.

A multi-codebook frame (ChatTTS: 4 codes) is TRL ``num_codebooks`` tokens: code ``c`` of
codebook ``q`` is token ``q * codebook_size + c`` (``frame_tokens``); the per-token log-prob
of that token is the codebook's log-prob at the frame, so a completion's summed log-prob is
its frames' joint log-prob (the codebooks are drawn independently given the step's hidden
state). ``frame_tokenizer`` is the matching ``PreTrainedTokenizerFast`` (TRL requires one).

Not mapped (refused by ``grpo_trainer`` with the field named): a KL term (``beta`` != 0;
TRL would load a reference model by path), vLLM, bf16/fp16 autocast (the scores would no
longer equal the recorded log-probs), gradient checkpointing, an entropy bonus (entropies
are computed without a graph), ``mask_truncated_completions`` (frames carry no EOS token in
TRL's sense).

A product-plane module: imports the offline API, core, torch, transformers and trl.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from transformers import (
    GenerationConfig,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerFast,
)
from trl import GRPOConfig, GRPOTrainer
from trl.trainer.utils import FusedCausalLMOutput

from omnistep.core import ExecutionProfile, Request, SamplingParams
from omnistep.offline import MAX_GROUP_SIZE, OmniEngine, RolloutSample, Trainer

PAD_TOKEN = "<pad>"
EOS_TOKEN = "<eos>"


def frame_tokens(frames: np.ndarray, codebook_size: int) -> list[int]:
    """TRL token ids of ``frames`` (int ``[T, num_codebooks]``): frame by frame, codebook by
    codebook, code ``c`` of codebook ``q`` as ``q * codebook_size + c``.

    Raises:
        ValueError: ``frames`` is not 2-D, or a code outside ``[0, codebook_size)``.
    """
    frames = np.asarray(frames)
    if frames.ndim != 2:
        raise ValueError(f"frames must be [T, num_codebooks], got shape {frames.shape}")
    if frames.size and (frames.min() < 0 or frames.max() >= codebook_size):
        raise ValueError(f"a code outside [0, {codebook_size})")
    offsets = np.arange(frames.shape[1]) * codebook_size
    return (frames + offsets).reshape(-1).astype(np.int64).tolist()


def token_frames(ids: Sequence[int], num_codebooks: int, codebook_size: int) -> np.ndarray:
    """The inverse of ``frame_tokens``: int64 ``[T, num_codebooks]``.

    Raises:
        ValueError: a length that is not a multiple of ``num_codebooks``, or a token that is
            not a code of the codebook its position belongs to.
    """
    flat = np.asarray(ids, dtype=np.int64)
    if flat.size % num_codebooks:
        raise ValueError(f"{flat.size} tokens are not whole frames of {num_codebooks} codes")
    frames = flat.reshape(-1, num_codebooks) - np.arange(num_codebooks) * codebook_size
    if frames.size and (frames.min() < 0 or frames.max() >= codebook_size):
        raise ValueError("a token is not a code of its position's codebook")
    return frames


def frame_tokenizer(num_codebooks: int, codebook_size: int) -> PreTrainedTokenizerFast:
    """A word-level tokenizer over the ``frame_tokens`` ids: token ``q * codebook_size + c`` is
    ``<cq_c>``; ``<pad>`` and ``<eos>`` follow the codes (they never appear in a frame). TRL
    decodes completions with it (the text its reward functions and logs see)."""
    vocab = {
        f"<c{q}_{c}>": q * codebook_size + c
        for q in range(num_codebooks)
        for c in range(codebook_size)
    }
    vocab[PAD_TOKEN] = len(vocab)
    vocab[EOS_TOKEN] = len(vocab)
    backend = Tokenizer(WordLevel(vocab, unk_token=PAD_TOKEN))
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token=PAD_TOKEN, eos_token=EOS_TOKEN, unk_token=PAD_TOKEN
    )


class OmniPolicyConfig(PretrainedConfig):
    """The ``PretrainedConfig`` TRL reads from the policy: the frame token layout.

    Attributes:
        card_id: the served model the policy trains.
        loop: the AR loop whose actions are the completions (ChatTTS: ``"decode"``).
        num_codebooks: codes per frame.
        codebook_size: ids per codebook.
    """

    model_type = "omnistep_policy"

    def __init__(
        self,
        card_id: str = "",
        loop: str = "decode",
        num_codebooks: int = 1,
        codebook_size: int = 1,
        **kwargs: Any,
    ):
        self.card_id = card_id
        self.loop = loop
        self.num_codebooks = num_codebooks
        self.codebook_size = codebook_size
        kwargs.setdefault("vocab_size", num_codebooks * codebook_size + 2)
        kwargs.setdefault("pad_token_id", num_codebooks * codebook_size)
        kwargs.setdefault("eos_token_id", num_codebooks * codebook_size + 1)
        super().__init__(**kwargs)


class OmniPolicy(PreTrainedModel):
    """TRL's view of an omnistep ``Trainer``: a model whose forward answers TRL's fused-head
    call with the log-probs ``OmniEngine.score`` computes on the trainer's copy, and whose
    parameters are the trainer's tensors ``trainable`` names.

    Rows are matched to recorded samples by their prompt ids and completion tokens
    (``remember`` is called by ``OmniRollout`` for every sample it hands TRL); a row no
    rollout produced raises ``KeyError``. The module holds no ``nn.Module`` of its own: the
    weights live in the ``Trainer`` (never re-initialized or moved by transformers).

    Args:
        omni: the engine that rolls out and scores.
        trainer: ``omni.trainer()``, the copy TRL optimizes.
        config: the frame layout (``OmniPolicyConfig``).
        trainable: checkpoint names of the tensors to train (None: all of the copy's).
    """

    config_class = OmniPolicyConfig
    base_model_prefix = "omnistep"
    main_input_name = "input_ids"
    supports_gradient_checkpointing = False

    def __init__(
        self,
        omni: OmniEngine,
        trainer: Trainer,
        config: OmniPolicyConfig,
        trainable: Sequence[str] | None = None,
    ):
        super().__init__(config)
        self.omni = omni
        self.trainer = trainer
        self._weights = trainer.weights(trainable)
        self._samples: dict[str, dict[tuple[tuple[int, ...], tuple[int, ...]], Any]] = {}
        self.post_init()
        # TRL reads and sets the pad and EOS ids here (omnistep samples; it never generates)
        self.generation_config = GenerationConfig(
            pad_token_id=config.pad_token_id, eos_token_id=config.eos_token_id
        )

    def _init_weights(self, module: torch.nn.Module) -> None:
        """Nothing to initialize: the weights are the served checkpoint's (the trainer's)."""

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate=True):
        """The trainer's trainable tensors by checkpoint name: what TRL's optimizer takes."""
        for name, tensor in self._weights.items():
            yield prefix + name, tensor

    def remember(self, key: str, prompt_ids: list[int], completion_ids: list[int], sample) -> None:
        """Record that ``sample`` (a ``RolloutSample``) is TRL's row ``prompt_ids`` +
        ``completion_ids``; ``key`` names the batch it belongs to (``"train"``/``"eval"``), and
        a new batch of a key replaces the last one."""
        self._samples.setdefault(key, {})[(tuple(prompt_ids), tuple(completion_ids))] = sample

    def forget(self, key: str) -> None:
        """Drop the samples remembered under ``key``."""
        self._samples.pop(key, None)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        fused_lm_head: bool = False,
        **kwargs: Any,
    ) -> FusedCausalLMOutput:
        """TRL's fused-head call: per label position, the log-prob of the label and the
        entropy of its distribution.

        Args:
            input_ids: int64 ``[B, L]``: left-padded prompt ids then right-padded completion
                tokens (``frame_tokens``).
            attention_mask: ``[B, L]``, 1 on real tokens.
            labels: ``[B, L]``, the completion tokens and -100 elsewhere.
            fused_lm_head: must be True (this policy has no logits over one vocabulary).

        Returns:
            ``FusedCausalLMOutput`` with ``log_probs`` and ``entropy`` float32 ``[B, L - 1]``
            (position ``j`` scores label ``j + 1``; zero where the label is -100), ``loss``
            their mean negative log-likelihood, ``label_mask``.

        Raises:
            NotImplementedError: called without ``fused_lm_head`` and ``labels``.
            KeyError: a row that no rollout of this policy produced.
        """
        if not fused_lm_head or labels is None:
            raise NotImplementedError(
                "OmniPolicy answers TRL's fused-head calls only (labels, fused_lm_head=True): "
                "a multi-codebook frame has no logits over one vocabulary"
            )
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        rows, samples = self._rows(input_ids, attention_mask, labels)
        loop = self.config.loop
        scores = self.omni.score(samples, mode="policy", loops=loop, trainer=self.trainer)
        batch, length = input_ids.shape
        b_idx = torch.cat([torch.full_like(cols, b) for b, cols in rows]) if rows else None
        p_idx = torch.cat([cols - 1 for _, cols in rows]) if rows else None
        # on TRL's device (the accelerator's): its loss combines them with its advantages
        device = input_ids.device
        zeros = torch.zeros(batch, length - 1, dtype=torch.float32, device=device)
        # a batch with no labelled row still hands TRL a loss with a graph (of zeros)
        log_probs = zeros + sum(0.0 * w.sum() for w in self._weights.values())
        entropy = zeros.clone()
        if rows:
            values = torch.cat([s[loop].reshape(-1).to(zeros.device) for s in scores])
            log_probs = zeros.index_put((b_idx, p_idx), values)
            with torch.no_grad():
                ent = torch.cat([self._entropy(s).reshape(-1).to(device) for s in samples])
            entropy = entropy.index_put((b_idx, p_idx), ent)
        mask = labels[:, 1:] != -100
        loss = -log_probs.sum() / mask.sum().clamp(min=1)
        return FusedCausalLMOutput(loss=loss, log_probs=log_probs, entropy=entropy, label_mask=mask)

    def _rows(self, input_ids, attention_mask, labels) -> tuple[list, list[RolloutSample]]:
        """Per row with labels: ``(row, label columns)`` and its recorded sample."""
        remembered: dict = {}
        for batch in self._samples.values():
            remembered.update(batch)
        rows, samples = [], []
        for b in range(input_ids.shape[0]):
            cols = (labels[b] != -100).nonzero().squeeze(-1)
            if cols.numel() == 0:
                continue
            start = int(cols[0])
            keep = attention_mask[b, :start].bool()
            prompt = tuple(int(t) for t in input_ids[b, :start][keep])
            completion = tuple(int(t) for t in input_ids[b, cols])
            sample = remembered.get((prompt, completion))
            if sample is None:
                raise KeyError(
                    f"row {b} ({len(prompt)} prompt ids, {len(completion)} completion tokens) "
                    "is no sample this policy's rollout_func produced"
                )
            rows.append((b, cols))
            samples.append(sample)
        return rows, samples

    def _entropy(self, sample: RolloutSample) -> torch.Tensor:
        """Entropy ``[T, num_codebooks]`` of the policy distribution (``log_softmax(logits /
        temperature)``, the distribution ``mode="policy"`` scores) of each recorded step, from
        the trainer copy's teacher-forced logits (``score_logits``)."""
        policy = self.trainer.policy
        node = next(n for n in policy.card.program.nodes if n.name == self.config.loop)
        loop = policy.loops[node.loop_id]
        component = policy.components[loop.config.component]
        actions = sample.loops[self.config.loop]
        logits = component.score_logits(actions.prompt, actions.tokens.tolist())
        request = Request(
            sample.model, seed=sample.seed, sampling=sample.sampling,
            profile=ExecutionProfile.ROLLOUT,
        )  # fmt: skip
        row = loop.config.make_sampling(request)
        temps = [t if t > 0 else 1.0 for t in row.temperatures(logits.shape[1])]
        divisor = torch.tensor(temps, dtype=torch.float32, device=logits.device).unsqueeze(-1)
        logp = torch.log_softmax(logits.float() / divisor, dim=-1)
        return -(logp.exp() * logp).sum(-1)


@dataclass
class OmniRollout:
    """TRL's ``rollout_func``: completions from ``OmniEngine.rollout`` (see the module
    docstring); before rolling out after an optimizer step it sends the policy's weights to
    serving (``update_weights``).

    Attributes:
        omni: the engine.
        policy: the ``OmniPolicy`` TRL trains (its trainer's weights are what syncs).
        voice: the voice of every rollout (give one where the card would draw a random
            speaker per seed).
        sampling: the rollout's ``SamplingParams``; None: TRL's ``temperature``, ``top_p``,
            ``top_k``, ``repetition_penalty`` and ``max_completion_length`` (in tokens:
            ``max_completion_length // num_codebooks`` frames).
        audio: also decode audio, handed to the reward functions as ``audio`` (float32
            arrays) and ``sample_rate``.
        seed: the first rollout's base seed; each call moves on by ``MAX_GROUP_SIZE`` (sample
            ``k`` runs with ``base + k``), so no two calls repeat a sample's seed.
        synced_step: TRL's ``global_step`` whose weights serving last received.
        num_calls: rollouts made so far.
    """

    omni: OmniEngine
    policy: OmniPolicy
    voice: str | None = None
    sampling: SamplingParams | None = None
    audio: bool = False
    seed: int = 0
    synced_step: int = 0
    num_calls: int = 0

    def __call__(self, prompts: list, trainer: GRPOTrainer) -> dict[str, list]:
        """TRL's hook: one completion per entry of ``prompts`` (each prompt repeated
        ``num_generations`` times in a row).

        Raises:
            TypeError: a prompt that is not a string (the text to speak).
            ValueError: runs of equal prompts that are not ``num_generations`` long.
        """
        self._sync(trainer)
        mode = "train" if trainer.model.training else "eval"
        n = trainer.num_generations if mode == "train" else trainer.num_generations_eval
        texts = _group_texts(prompts, n)
        groups = self.omni.rollout(
            texts, n=n, seed=self.seed + self.num_calls * MAX_GROUP_SIZE,
            model=self.policy.trainer.card_id, voice=self.voice,
            sampling=self.sampling or _sampling(trainer.args, self.policy.config),
            logprobs="policy", audio=self.audio, progress=False,
        )  # fmt: skip
        self.num_calls += 1
        self.policy.forget(mode)
        return self._output(mode, [s for g in groups for s in g.samples])

    def _sync(self, trainer: GRPOTrainer) -> None:
        """Send the trainer's weights to serving once per optimizer step (TRL's
        ``global_step``), before the rollout that should run on them."""
        step = trainer.state.global_step
        if step != self.synced_step:
            self.omni.update_weights(self.policy.trainer)
            self.synced_step = step

    def _output(self, mode: str, samples: list[RolloutSample]) -> dict[str, list]:
        config = self.policy.config
        out: dict[str, list] = {
            "prompt_ids": [], "completion_ids": [], "logprobs": [], "frames": [],
            "weight_version": [],
        }  # fmt: skip
        for sample in samples:
            actions = sample.loops[config.loop]
            prompt_ids = _prompt_ids(actions.prompt)
            completion_ids = frame_tokens(actions.tokens, config.codebook_size)
            self.policy.remember(mode, prompt_ids, completion_ids, sample)
            out["prompt_ids"].append(prompt_ids)
            out["completion_ids"].append(completion_ids)
            out["logprobs"].append(actions.logprobs.reshape(-1).tolist())
            out["frames"].append(actions.tokens)
            out["weight_version"].append(int(actions.weight_versions.max()))
        if self.audio:
            out["audio"] = [s.audio for s in samples]
            out["sample_rate"] = [s.sample_rate for s in samples]
        return out


def grpo_trainer(
    omni: OmniEngine,
    reward_funcs: Callable | list[Callable],
    train_dataset: Any,
    args: GRPOConfig,
    *,
    model: str | None = None,
    loop: str = "decode",
    trainable: Sequence[str] | None = None,
    voice: str | None = None,
    sampling: SamplingParams | None = None,
    audio: bool = False,
    **kwargs: Any,
) -> GRPOTrainer:
    """TRL's ``GRPOTrainer`` training ``model`` (a model ``omni`` serves; None: its first)
    with ``omni`` as the rollout engine (see the module docstring). ``trainable``: the
    checkpoint names TRL's optimizer steps (None: every tensor of the trainer copy).
    ``reward_funcs`` get TRL's usual arguments plus ``frames``, ``weight_version`` and, with
    ``audio``, ``audio`` and ``sample_rate``. ``kwargs`` go to ``GRPOTrainer``.

    Builds a ``Trainer`` (``omni.trainer(model)``) and probes the loop's codebook layout with
    one single-frame rollout of the dataset's first prompt.

    Raises:
        ValueError: a ``GRPOConfig`` setting this adapter does not map (named), or a card
            whose ``loop`` recorded nothing.
        KeyError: a ``trainable`` name the model does not have.
    """
    _check_args(args)
    trainer = omni.trainer(model)
    num_codebooks, codebook_size = _layout(omni, trainer, loop, train_dataset[0]["prompt"], voice)
    config = OmniPolicyConfig(trainer.card_id, loop, num_codebooks, codebook_size)
    policy = OmniPolicy(omni, trainer, config, trainable)
    rollout = OmniRollout(omni, policy, voice, sampling, audio, seed=args.seed)
    grpo = GRPOTrainer(
        model=policy,
        reward_funcs=reward_funcs,
        args=args,
        train_dataset=train_dataset,
        processing_class=frame_tokenizer(num_codebooks, codebook_size),
        rollout_func=rollout,
        **kwargs,
    )
    # GRPOTrainer patches the instance's forward with a fused LM head over
    # `get_output_embeddings()`; a multi-codebook frame has none: the class forward answers
    # the same call (fused_lm_head=True -> log_probs, entropy).
    vars(policy).pop("forward", None)
    return grpo


def _check_args(args: GRPOConfig) -> None:
    """Raises ValueError naming a setting the adapter does not map."""
    refused = {
        "beta": (args.beta != 0.0, "no KL term: TRL would load a reference model by path"),
        "use_vllm": (args.use_vllm, "omnistep is the rollout engine"),
        "bf16": (bool(args.bf16), "autocast changes the scores (set bf16=False)"),
        "fp16": (bool(args.fp16), "autocast changes the scores"),
        "gradient_checkpointing": (args.gradient_checkpointing, "set it False"),
        "entropy_coef": (
            args.entropy_coef != 0.0 or args.use_adaptive_entropy,
            "entropies carry no graph",
        ),
        "mask_truncated_completions": (
            args.mask_truncated_completions,
            "frames end without a TRL EOS token: every completion would be masked",
        ),
    }
    for name, (bad, why) in refused.items():
        if bad:
            raise ValueError(f"GRPOConfig.{name}: not supported by the omnistep adapter ({why})")


def _layout(omni, trainer, loop, prompt, voice) -> tuple[int, int]:
    """``(num_codebooks, codebook_size)`` of ``loop``: one single-frame rollout of
    ``prompt`` scored to logits on the trainer's copy."""
    probe = SamplingParams(max_new_tokens=1, min_new_tokens=1)
    (group,) = omni.rollout(
        [prompt], n=1, voice=voice, sampling=probe, model=trainer.card_id, progress=False
    )
    actions = group.samples[0].loops.get(loop)
    if actions is None:
        raise ValueError(f"'{trainer.card_id}' recorded no loop '{loop}'")
    policy = trainer.policy
    node = next(n for n in policy.card.program.nodes if n.name == loop)
    component = policy.components[policy.loops[node.loop_id].config.component]
    with torch.no_grad():
        logits = component.score_logits(actions.prompt, actions.tokens.tolist())
    return int(logits.shape[1]), int(logits.shape[2])


def _sampling(args: GRPOConfig, config: OmniPolicyConfig) -> SamplingParams:
    """TRL's sampling settings as omnistep's (frames, not tokens)."""
    return SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k or 0,
        repetition_penalty=args.repetition_penalty,
        max_new_tokens=max(1, (args.max_completion_length or 0) // config.num_codebooks),
    )


def _group_texts(prompts: list, n: int) -> list[str]:
    """The distinct texts of ``prompts``, each of which repeats ``n`` times in a row."""
    for prompt in prompts:
        if not isinstance(prompt, str):
            raise TypeError(
                "omnistep rollouts take text prompts (the text to speak), got "
                f"{type(prompt).__name__}"
            )
    if len(prompts) % n or any(
        len(set(prompts[i : i + n])) != 1 for i in range(0, len(prompts), n)
    ):
        raise ValueError(f"prompts must come in runs of num_generations={n} equal texts")
    return prompts[::n]


def _prompt_ids(prompt: Any) -> list[int]:
    """The token ids of a recorded prompt (``input_ids`` of a ChatTTS prompt, or the ids
    themselves).

    Raises:
        NotImplementedError: a prompt with no token ids (e.g. a talker's hidden states).
    """
    ids = getattr(prompt, "input_ids", prompt)
    if isinstance(ids, Sequence | np.ndarray) and all(isinstance(i, int | np.integer) for i in ids):
        return [int(i) for i in ids]
    raise NotImplementedError(f"a {type(prompt).__name__} prompt has no token ids for TRL")
