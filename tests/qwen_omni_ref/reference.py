"""Run TRANSFORMERS' Qwen2.5-Omni on a checkpoint folder and return tensors for parity.

The model is ``transformers.Qwen2_5OmniForConditionalGeneration`` (transformers 5.24), loaded
once per folder (cached), float32, eager attention for the thinker and talker (the token2wav
module always falls back to SDPA: transformers refuses eager there), ``eval()`` (the DiT has
dropout 0.1), offline (``local_files_only``).  Every call runs under ``torch.no_grad``, a forked
global RNG (callers' RNG state is untouched) and ``torch.set_num_threads(THREADS)`` (1: the
shared 2-core machine is often oversubscribed; 2 threads then ran ~10x slower here).  All
tensors returned are float32 on CPU, batch dimension dropped unless stated.

Pipeline facts (read from ``transformers/models/qwen2_5_omni/modeling_qwen2_5_omni.py`` 5.24 and
checked on the tiny folders of :mod:`omnistep.models.qwen2_5_omni.tiny`)
---------------------------------------------------------------------------------------------
* Prompt (chat template, text only): ``<|im_start|>system\\n{system}<|im_end|>\\n<|im_start|>user
  \\n{text}<|im_end|>\\n<|im_start|>assistant\\n``; a system turn "You are a helpful assistant." is
  inserted when the first message is not a system message.  The official model card asks for
  the system prompt ``assets.QWEN_SPEECH_SYSTEM_PROMPT`` for speech output (transformers does
  not enforce it).  No BOS token is prepended.  Media parts become
  ``<|audio_bos|><|AUDIO|><|audio_eos|>`` / ``<|vision_bos|><|IMAGE|><|vision_eos|>`` (the
  processor expands the placeholder; the processor needs torchvision, so tests use the tokenizer).
* Thinker: Qwen2.5 LM with M-RoPE (``mrope_section``; for text all 3 position rows are equal,
  so it is plain RoPE with positions 0..), q/k/v biases, RMSNorm, untied ``lm_head``.  Text
  generation stops at ``thinker_config.eos_token_id`` (``<|im_end|>``); ``model.generate`` uses
  the thinker's own generation config (greedy unless ``thinker_do_sample=True`` etc.),
  ``thinker_max_new_tokens`` default 1024.
* Thinker -> talker hand-off (``model.generate``; ``P`` prompt tokens, thinker tokens
  ``y_0..y_{N-1}``, ``E`` = thinker ``embed_tokens``, ``h(x)`` = thinker LAST-layer hidden state
  after the final RMSNorm (``hidden_states[-1]`` of ``generate``), ``e(x)`` = its input embedding
  (``hidden_states[0]``)).  The talker sees, per thinker position, ``h + e`` (sum, width = thinker
  hidden = talker ``embedding_size``), then ``thinker_to_talker_proj`` (Linear with bias) maps
  every talker input (the sum plus a codec embedding) to the talker width:

  - prefill (``P + 2`` positions): prompt positions ``h(x_i) + e(x_i)`` (multimodal placeholder
    positions get ``e`` zeroed); then ``E(spk["bos_token"])`` (the speaker's text BOS: no hidden
    state); then ``h(y_0) + e(y_0)``.  The codec track is ``[mask]*P + [pad, bos]`` but its ids are
    NOT embedded (``inputs_embeds`` is given); the talker's forward ADDS ``codec_embed(pad)`` at
    position ``P`` and ``codec_embed(bos)`` at ``P + 1`` only when it receives an
    ``attention_mask`` -- and transformers 5.24's ``GenerationMixin`` drops an all-ones mask, so
    ``model.generate`` on an unpadded batch does NOT add them (a padded batch does: the output
    depends on batching).  The drop came with transformers PR #48814 "[generate] Drop attention
    mask early without padding" (after v5.17); before it the default all-ones mask reached the
    talker and the embeddings were added.  :func:`talker_greedy` adds them by default
    (``codec_prompt_embeds=True``, the official behaviour); ``False`` reproduces 5.24's unpadded
    ``generate`` (tested: identical codes).
  - decode step ``j >= 1`` (input = previous code ``c_{j-1}``):
    ``codec_embed(c_{j-1}) + r_{j-1}`` where the reply track ``r`` is
    ``[h(y_1)+e(y_1), ..., h(y_{N-2})+e(y_{N-2}), E(tts_text_end), E(tts_text_pad)]`` and, once
    exhausted, ``E(tts_text_pad)`` forever.  The last thinker token ``y_{N-1}`` (normally
    ``<|im_end|>``) is never fed to the thinker, so it has no hidden state and never reaches the
    talker: ``tts_text_end`` replaces it.  So the talker can start once the thinker has run its
    forward on ``y_0`` (i.e. has produced ``y_1``); it then needs one more thinker token per codec
    step while the text lasts (in practice codes outnumber text tokens, and the talker runs on
    pads after the text).  ``N == 1`` crashes transformers (no ``h(y_0)``).
  - positions: for text-only input plain 0.. over the ``P + 2`` prefill then +1 per step (the
    M-RoPE index from ``input_text_ids`` gives the same).
  - codec ids (config): ``tts_codec_start_token_id`` = BOS (8293 official), ``_end`` = EOS (8294),
    ``_pad`` (8292), ``_mask`` (8296); ``talker_eos_token_id`` of ``generate`` defaults to the
    OFFICIAL [8292, 8294] whatever the config says -- pass the config's ``[pad, eos]``.  The
    codec BOS is suppressed every step (``suppress_tokens=[bos]`` -> logit ``-inf``).
* Talker sampling defaults in ``model.generate``: ``do_sample=True, top_k=40, top_p=0.8,
  temperature=0.9, repetition_penalty=1.05, max_new_tokens=4096``, EOS as above,
  ``pad_token_id`` = codec pad.  Codes up to (excluding) the first EOS go to token2wav.
* Token2wav rates: each codec token -> ``repeats`` = 2 mel frames (the DiT embeds codes with
  ``repeat_interleave``); BigVGAN: 240 samples per frame (``prod(upsample_rates)`` = 5*3*2*2*2*2,
  each ConvTranspose gives exactly x rate); 24 kHz.  So 480 samples per code, 50 codes per second
  of audio; the waveform has exactly ``len(codes) * 480`` samples.
* DiT (``Qwen2_5OmniToken2WavDiTModel.sample``): flow matching from noise (t=0) to mel (t=1).
  Initial noise ``x0 = torch.randn([B, 2T, mel_dim])`` from the GLOBAL torch RNG, float32 (no
  generator argument): after ``torch.manual_seed(s)`` it equals ``torch.randn(1, 2T, 80,
  generator=torch.Generator().manual_seed(s))`` (see :func:`dit_initial_noise`); in
  ``model.generate`` it is whatever the RNG holds after thinker/talker sampling.  Time grid:
  ``t = linspace(0, 1, num_steps=10)`` then sway ``t += s*(cos(pi/2*t) - 1 + t)`` with
  ``s = -1`` (i.e. ``t = 1 - cos(pi/2*t)``).  Solver: RK4 "3/8 rule" per interval, 9 intervals x
  4 evaluations = 36 DiT forwards: ``k1=f(t0,x); k2=f(t0+h/3, x+h*k1/3); k3=f(t0+2h/3,
  x+h*(k2-k1/3)); k4=f(t1, x+h*(k1-k2+k3)); x += h*(k1+3*(k2+k3)+k4)/8``.  Guidance: each ``f``
  runs a batch of 2 -- conditional (speaker ``cond`` [enc_emb_dim] broadcast over frames,
  ``ref_mel`` through the ECAPA-TDNN speaker encoder -> [enc_dim] broadcast, code embeddings)
  and unconditional (``cond`` and ``ref_mel`` ZEROED -- the ECAPA still runs on zeros -- and
  every code replaced by code 0, not a null id) -- and returns ``v_c + 0.5 * (v_c - v_u)``
  (``guidance_scale`` 0.5; below 1e-5 only the conditional pass).  Input per frame:
  ``proj(cat[x, ecapa(ref_mel), code_embed, cond])``; time: sinusoidal(256, scale 1000) -> MLP
  -> AdaLayerNormZero in every block.  Attention is block-local: frames are cut in blocks of
  ``block_size`` (24 official = 12 codes) and a layer attends its own block, plus the previous
  block in ``look_backward_layers`` (0, 20) and the next in ``look_ahead_layers`` (10): one
  forward's output block ``b`` depends on input blocks ``b-2..b+1``.  RoPE (theta 1e4,
  interleaved layout) only on the FIRST head.  But the ODE couples blocks across its 36
  evaluations, so a mel frame depends on every code of the utterance (checked: one changed code
  changes all frames): chunked DiT decoding cannot equal the full decode exactly.
* BigVGAN input: the DiT mel [B, 80, F] (natural-log amplitude), mapped by
  ``dB = 20*log10(max(exp(mel), 10**(-115/20))) - 20; x = clamp(2*(dB+115)/115 - 1, -1, 1)``
  (so mel in about [-10.9, 2.3] is unclamped); conv_pre(7) -> 6 x
  [ConvTranspose1d -> mean of 3 AMP blocks (kernels 3/7/11, dilations 1/3/5, anti-aliased
  SnakeBeta: x2 upsample, snake, x2 downsample, Kaiser-sinc 12 taps, replicate padding)] ->
  anti-aliased snake -> conv_post(7, no bias) -> ``clamp(-1, 1)``.  Receptive field (kernels,
  dilations and rates are the official ones in the tiny folders, so this holds for the real
  model): changing one mel frame changes output samples up to ~26.5 frames (6350 samples) on
  each side; above 1e-6 relative only ~17 frames.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from unittest import mock

import torch

THREADS = 1
_CACHE: dict[tuple[str, int], tuple[Any, Any]] = {}

Messages = Sequence[dict[str, Any]]


@contextlib.contextmanager
def _run() -> Iterator[None]:
    """no_grad + forked global RNG + ``THREADS`` torch threads + transformers logging at ERROR,
    all restored on exit."""
    import transformers

    threads = torch.get_num_threads()
    verbosity = transformers.logging.get_verbosity()
    torch.set_num_threads(THREADS)
    transformers.logging.set_verbosity_error()
    try:
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            yield
    finally:
        torch.set_num_threads(threads)
        transformers.logging.set_verbosity(verbosity)


def load_reference(root: Path) -> tuple[Any, Any]:
    """``(model, tokenizer)`` for ``root``, loaded once (keyed by path and config mtime)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    root = Path(root).resolve()
    key = (str(root), (root / "config.json").stat().st_mtime_ns)
    if key not in _CACHE:
        from transformers import AutoTokenizer, Qwen2_5OmniForConditionalGeneration

        with _run():
            model = Qwen2_5OmniForConditionalGeneration.from_pretrained(
                root,
                dtype=torch.float32,
                attn_implementation="eager",
                local_files_only=True,
            )
            tokenizer = AutoTokenizer.from_pretrained(root, local_files_only=True)
        _CACHE[key] = (model.eval(), tokenizer)
    return _CACHE[key]


def load_state_dict_info(root: Path) -> dict[str, list[str]]:
    """transformers' loading report (``missing_keys``, ``unexpected_keys``, ``mismatched_keys``,
    ``error_msgs``) for ``root``.  ``Qwen2_5OmniForConditionalGeneration.from_pretrained``
    breaks on ``output_loading_info=True`` (its override calls ``load_speakers`` on the returned
    tuple), so this calls the base ``PreTrainedModel.from_pretrained`` (no speakers)."""
    from transformers import Qwen2_5OmniForConditionalGeneration as Cls

    with _run():
        _, info = super(Cls, Cls).from_pretrained(
            Path(root), output_loading_info=True, dtype=torch.float32, local_files_only=True
        )
    return {k: sorted(map(str, v)) for k, v in info.items()}


def prompt_ids(root: Path, messages: Messages) -> torch.Tensor:
    """Chat-templated prompt ids ``[P]`` (``add_generation_prompt=True``), long."""
    _, tok = load_reference(root)
    enc = tok.apply_chat_template(
        list(messages), add_generation_prompt=True, tokenize=True, return_dict=True
    )
    return torch.tensor(enc["input_ids"], dtype=torch.long)


def thinker_prefill_logits(root: Path, messages: Messages) -> torch.Tensor:
    """Thinker logits ``[text_vocab]`` at the LAST prompt position after one prefill forward of
    the chat-templated prompt (no cache, no attention mask, positions 0..P-1)."""
    model, _ = load_reference(root)
    ids = prompt_ids(root, messages)[None]
    with _run():
        out = model.thinker(input_ids=ids, use_cache=False)
    return out.logits[0, -1].float().clone()


@dataclass
class ThinkerGreedy:
    """Greedy thinker decode (``thinker.generate(do_sample=False)``, stops after EOS).

    ``token_ids[i]`` = argmax of ``logits[i]``; ``logits[0]`` is the prefill's last position,
    ``logits[i]`` the forward on ``token_ids[i-1]``.  ``prompt_embeds``/``prompt_hidden``: input
    embedding and last-layer (post-norm) hidden state of every prompt position; ``token_embeds``/
    ``token_hidden``: the same for ``token_ids[0..N-2]`` (the tokens fed back; the last generated
    token is never fed).  These four are exactly what ``model.generate`` hands to the talker."""

    prompt_ids: torch.Tensor  # [P] long
    token_ids: torch.Tensor  # [N] long
    logits: torch.Tensor  # [N, text_vocab]
    prompt_embeds: torch.Tensor  # [P, H]
    prompt_hidden: torch.Tensor  # [P, H]
    token_embeds: torch.Tensor  # [N-1, H]
    token_hidden: torch.Tensor  # [N-1, H]
    eos_token_id: int | list[int] | None = None

    @property
    def eos_reached(self) -> bool:
        eos = self.eos_token_id
        eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
        return bool(len(self.token_ids)) and int(self.token_ids[-1]) in eos_ids


def thinker_greedy(root: Path, messages: Messages, steps: int) -> ThinkerGreedy:
    """Greedy decode of at most ``steps`` thinker tokens (fewer when ``<|im_end|>`` comes first)."""
    model, _ = load_reference(root)
    ids = prompt_ids(root, messages)[None]
    with _run():
        res = model.thinker.generate(
            input_ids=ids,
            max_new_tokens=steps,
            do_sample=False,
            output_hidden_states=True,
            output_logits=True,
            return_dict_in_generate=True,
            use_audio_in_video=False,
        )
    hs = res.hidden_states
    n = res.sequences.shape[1] - ids.shape[1]

    def cat(layer: int) -> torch.Tensor:
        if len(hs) < 2:
            return torch.zeros(0, hs[0][layer].shape[-1])
        return torch.cat([step[layer][0] for step in hs[1:]], dim=0).float().clone()

    return ThinkerGreedy(
        prompt_ids=ids[0].clone(),
        token_ids=res.sequences[0, ids.shape[1] :].clone(),
        logits=torch.stack([lg[0] for lg in res.logits[:n]]).float().clone(),
        prompt_embeds=hs[0][0][0].float().clone(),
        prompt_hidden=hs[0][-1][0].float().clone(),
        token_embeds=cat(0),
        token_hidden=cat(-1),
        eos_token_id=model.thinker.generation_config.eos_token_id,
    )


@dataclass
class TalkerInputs:
    """What ``model.generate`` passes to ``talker.generate`` (batch dim kept, as passed)."""

    input_ids: torch.Tensor  # [1, P+2] codec track: [mask]*P + [pad, bos] (not embedded)
    input_text_ids: torch.Tensor  # [1, P+2] prompt + [speaker bos, y_0] (M-RoPE index only)
    inputs_embeds: torch.Tensor  # [1, P+2, H] before the codec pad/bos embeddings
    thinker_reply_part: torch.Tensor  # [1, N, H] r_0.. = h+e of y_1..y_{N-2}, E(end), E(pad)
    codec_prompt_embeds: torch.Tensor  # [2, H] codec_embed(pad), codec_embed(bos)
    suppress_tokens: list[int] = field(default_factory=list)


def talker_inputs(root: Path, thinker: ThinkerGreedy, speaker: str) -> TalkerInputs:
    """Re-derivation of ``model.generate``'s talker inputs (text-only, batch 1); the tests check
    it against what ``model.generate`` really passes (:func:`capture_generate_handoff`)."""
    model, _ = load_reference(root)
    if len(thinker.token_ids) < 2:
        raise ValueError("the talker needs >= 2 thinker tokens (transformers crashes on 1)")
    talker = model.talker
    spk = model.speaker_map[speaker]
    emb = model.thinker.get_input_embeddings()
    with _run():
        bos = int(spk["bos_token"])
        p = len(thinker.prompt_ids)
        reply = thinker.token_hidden + thinker.token_embeds  # [N-1, H]
        inputs_embeds = torch.cat(
            [
                thinker.prompt_hidden + thinker.prompt_embeds,
                emb(torch.tensor([bos])),
                reply[:1],
            ]
        )
        eos_e = emb(torch.tensor([talker.text_eos_token]))
        pad_e = emb(torch.tensor([talker.text_pad_token]))
        tail = torch.cat([reply[1:], eos_e, pad_e])
        # transformers' per-row EOS rewrite (a no-op for batch 1, kept for fidelity)
        eos = thinker.eos_token_id
        eos_ids = torch.as_tensor([eos] if isinstance(eos, int) else list(eos or []))
        n = len(thinker.token_ids)
        is_eos = (thinker.token_ids[:, None] == eos_ids[None]).any(-1)
        first = int(torch.where(is_eos, torch.arange(n), torch.tensor(n)).min().clamp(1, n - 1))
        pos = torch.arange(len(tail))
        tail = torch.where((pos >= first)[:, None], pad_e, tail)
        tail = torch.where((pos == first - 1)[:, None], eos_e, tail)
        codec = talker.get_input_embeddings()(
            torch.tensor([talker.codec_pad_token, talker.codec_bos_token])
        )
    return TalkerInputs(
        input_ids=torch.tensor(
            [[talker.codec_mask_token] * p + [talker.codec_pad_token, talker.codec_bos_token]]
        ),
        input_text_ids=torch.cat([thinker.prompt_ids, torch.tensor([bos]), thinker.token_ids[:1]])[
            None
        ],
        inputs_embeds=inputs_embeds[None].float(),
        thinker_reply_part=tail[None].float(),
        codec_prompt_embeds=codec.float(),
        suppress_tokens=[talker.codec_bos_token],
    )


def talker_eos_token_ids(root: Path) -> list[int]:
    """The config's codec ``[pad, eos]`` (what to pass as ``talker_eos_token_id``)."""
    model, _ = load_reference(root)
    return [model.talker.codec_pad_token, model.talker.codec_eos_token]


@dataclass
class TalkerGreedy:
    """Greedy talker decode: ``codes[i] = argmax(logits[i])`` with the codec BOS at ``-inf``.

    ``logits`` are raw (``output_logits``); ``codes`` include the EOS when one was produced;
    ``audio_codes`` are the codes before the first EOS (what token2wav decodes).
    ``proj_inputs``: the inputs of ``thinker_to_talker_proj`` as transformers computed them:
    ``[P+2, H]`` prefill rows, then one row per decode step (``codec_embed(prev) + r_j``)."""

    codes: torch.Tensor  # [n] long
    logits: torch.Tensor  # [n, codec_vocab]
    audio_codes: torch.Tensor  # [m] long, m <= n
    eos_reached: bool
    inputs: TalkerInputs
    prefill_inputs: torch.Tensor  # [P+2, H]
    step_inputs: torch.Tensor  # [n-1, H]


def talker_greedy(
    root: Path,
    thinker: ThinkerGreedy,
    speaker: str,
    steps: int,
    codec_prompt_embeds: bool = True,
) -> TalkerGreedy:
    """Greedy ``talker.generate`` on the hand-off of ``thinker`` for ``speaker``, at most
    ``steps`` codes, stopping at the config's ``[pad, eos]``.  ``codec_prompt_embeds``: add
    ``codec_embed(pad)``/``codec_embed(bos)`` to the last two prefill rows (official behaviour;
    ``False`` = what transformers 5.24 ``model.generate`` does on an unpadded batch)."""
    model, _ = load_reference(root)
    inp = talker_inputs(root, thinker, speaker)
    talker = model.talker
    embeds = inp.inputs_embeds.clone()  # the talker's forward edits inputs_embeds in place
    if codec_prompt_embeds:
        embeds[0, -2:] += inp.codec_prompt_embeds
    seen: list[torch.Tensor] = []
    hook = talker.thinker_to_talker_proj.register_forward_pre_hook(
        lambda _m, args: seen.append(args[0][0].detach().float().clone())
    )
    eos_ids = talker_eos_token_ids(root)
    try:
        with _run():
            talker.rope_deltas = None
            res = talker.generate(
                input_ids=inp.input_ids,
                input_text_ids=inp.input_text_ids,
                thinker_reply_part=inp.thinker_reply_part.clone(),
                inputs_embeds=embeds,
                suppress_tokens=inp.suppress_tokens,
                max_new_tokens=steps,
                do_sample=False,
                repetition_penalty=1.0,
                eos_token_id=eos_ids,
                pad_token_id=talker.codec_pad_token,
                output_logits=True,
                return_dict_in_generate=True,
                use_audio_in_video=False,
            )
    finally:
        hook.remove()
    codes = res.sequences[0, inp.input_ids.shape[1] :].clone()
    is_eos = torch.isin(codes, torch.tensor(eos_ids))
    m = int(torch.nonzero(is_eos)[0, 0]) if bool(is_eos.any()) else len(codes)
    return TalkerGreedy(
        codes=codes,
        logits=torch.stack([lg[0] for lg in res.logits]).float().clone(),
        audio_codes=codes[:m].clone(),
        eos_reached=bool(is_eos.any()),
        inputs=inp,
        prefill_inputs=seen[0],
        step_inputs=torch.cat(seen[1:]) if len(seen) > 1 else torch.zeros(0, embeds.shape[-1]),
    )


def capture_generate_handoff(
    root: Path, messages: Messages, speaker: str, thinker_max_new_tokens: int
) -> dict[str, Any]:
    """The keyword arguments ``model.generate`` (greedy thinker) passes to ``talker.generate``,
    captured before the talker runs (tensors cloned)."""
    model, _ = load_reference(root)
    ids = prompt_ids(root, messages)[None]
    captured: dict[str, Any] = {}

    class _Stop(Exception):
        pass

    def fake_generate(**kwargs: Any) -> Any:
        captured.update({k: (v.clone() if torch.is_tensor(v) else v) for k, v in kwargs.items()})
        raise _Stop

    eos_ids = talker_eos_token_ids(root)
    with (
        _run(),
        mock.patch.object(model.talker, "generate", fake_generate),
        contextlib.suppress(_Stop),
    ):
        model.generate(
            input_ids=ids,
            speaker=speaker,
            thinker_max_new_tokens=thinker_max_new_tokens,
            thinker_do_sample=False,
            talker_eos_token_id=eos_ids,
        )
    return captured


# ----------------------------------------------------------------------------- token2wav


def _speaker(model: Any, speaker: str) -> tuple[torch.Tensor, torch.Tensor]:
    spk = model.speaker_map[speaker]
    return spk["cond"].float(), spk["ref_mel"].float()


def _codes(codes: Any) -> torch.Tensor:
    c = torch.as_tensor(codes, dtype=torch.long)
    return c.reshape(1, -1)


def dit_initial_noise(num_codes: int, seed: int, mel_dim: int = 80, repeats: int = 2):  # noqa: ANN201
    """The DiT's initial state ``[1, repeats*num_codes, mel_dim]`` for ``seed``: what
    ``torch.manual_seed(seed); torch.randn(...)`` draws first, from a private generator."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, repeats * num_codes, mel_dim, generator=g, dtype=torch.float32)


def dit_time_grid(num_steps: int = 10, sway_coefficient: float | None = -1.0) -> torch.Tensor:
    """The ODE time points ``[num_steps]`` of ``sample`` (float32, like transformers)."""
    t = torch.linspace(0, 1, num_steps, dtype=torch.float32)
    if sway_coefficient is not None:
        t = t + sway_coefficient * (torch.cos(torch.pi / 2 * t) - 1 + t)
    return t


def dit_velocity(
    root: Path,
    x: torch.Tensor,
    t: float | torch.Tensor,
    codes: Any,
    speaker: str,
    guidance_scale: float = 0.5,
) -> torch.Tensor:
    """One guided velocity evaluation ``f(t, x)`` of the ODE, ``[1, 2T, mel]``: the DiT forward
    with CFG (batch of conditional and unconditional) combined ``v_c + g * (v_c - v_u)``,
    exactly as ``sample``'s ``ode_function`` (``g < 1e-5``: conditional pass only)."""
    model, _ = load_reference(root)
    dit = model.token2wav.code2wav_dit_model
    cond, ref_mel = _speaker(model, speaker)
    code = _codes(codes)
    cond_frames = cond.unsqueeze(1).repeat(1, x.shape[1], 1)
    ts = torch.as_tensor(t, dtype=torch.float32)
    with _run():
        if guidance_scale < 1e-5:
            return dit(
                hidden_states=x,
                speaker_embedding=cond_frames,
                condition_vector=ref_mel,
                quantized_code=code,
                time_step=ts,
                drop_audio_conditioning=False,
                drop_code=False,
                apply_cfg=False,
            ).float()
        out = dit(
            hidden_states=x,
            quantized_code=code,
            speaker_embedding=cond_frames,
            condition_vector=ref_mel,
            time_step=ts,
            apply_cfg=True,
        )
        v_c, v_u = torch.chunk(out, 2, dim=0)
        return (v_c + (v_c - v_u) * guidance_scale).float()


def rk4_step(f: Any, t0: torch.Tensor, t1: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """transformers' ``RungeKutta4ODESolver`` step (3/8 rule) from ``t0`` to ``t1``."""
    h = t1 - t0
    k1 = f(t0, x)
    k2 = f(t0 + h * (1 / 3), x + h * k1 * (1 / 3))
    k3 = f(t0 + h * (2 / 3), x + h * (k2 - k1 * (1 / 3)))
    k4 = f(t1, x + h * (k1 - k2 + k3))
    return x + (k1 + 3 * (k2 + k3) + k4) * h / 8


@contextlib.contextmanager
def _patched_sample(noise: torch.Tensor | None, trajectory: list[torch.Tensor]) -> Iterator[None]:
    """Feed ``noise`` as ``sample``'s initial ``torch.randn`` and record the ODE solution."""
    from transformers.models.qwen2_5_omni import modeling_qwen2_5_omni as mod

    base = mod.RungeKutta4ODESolver

    class Recording(base):  # type: ignore[misc, valid-type]
        def integrate(self, time_points):  # noqa: ANN001, ANN202
            sol = super().integrate(time_points)
            trajectory.append(sol.detach().float().clone())
            return sol

    real_randn = torch.randn
    used = []

    def randn(*args: Any, **kwargs: Any) -> torch.Tensor:
        shape = tuple(args[0]) if len(args) == 1 and isinstance(args[0], list | tuple) else args
        if noise is not None and not used and tuple(shape) == tuple(noise.shape):
            used.append(True)
            return noise.to(kwargs.get("dtype") or noise.dtype).clone()
        return real_randn(*args, **kwargs)

    with mock.patch.object(mod, "RungeKutta4ODESolver", Recording):
        if noise is None:
            yield
        else:
            with mock.patch.object(torch, "randn", randn):
                yield
            if not used:
                raise AssertionError("the DiT did not draw noise of the given shape")


def token2wav_mel(
    root: Path,
    codes: Any,
    speaker: str,
    seed: int = 0,
    noise: torch.Tensor | None = None,
    num_steps: int = 10,
    guidance_scale: float = 0.5,
    sway_coefficient: float = -1.0,
    return_trajectory: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The DiT output mel ``[mel_dim, 2T]`` (log amplitude, what BigVGAN gets) for ``codes`` [T].

    Initial noise: ``noise`` [1, 2T, mel_dim] when given, else ``torch.manual_seed(seed)`` then
    ``sample``'s own ``torch.randn`` (= :func:`dit_initial_noise`).  ``return_trajectory``: also
    the ODE solution at every time point, ``[num_steps, 2T, mel_dim]`` (``[0]`` = the noise,
    ``[-1]`` = the mel transposed)."""
    model, _ = load_reference(root)
    cond, ref_mel = _speaker(model, speaker)
    traj: list[torch.Tensor] = []
    with _run(), _patched_sample(noise, traj):
        torch.manual_seed(seed)
        mel = model.token2wav.code2wav_dit_model.sample(
            cond,
            ref_mel,
            _codes(codes),
            num_steps=num_steps,
            guidance_scale=guidance_scale,
            sway_coefficient=sway_coefficient,
        )
    mel = mel[0].float().clone()
    if return_trajectory:
        return mel, traj[0][:, 0]
    return mel


def bigvgan(root: Path, mel: torch.Tensor) -> torch.Tensor:
    """BigVGAN waveform ``[F * 240]`` in [-1, 1] for a log-amplitude mel ``[mel_dim, F]`` (or
    ``[1, mel_dim, F]``)."""
    model, _ = load_reference(root)
    m = mel if mel.dim() == 3 else mel[None]
    with _run():
        wav = model.token2wav.code2wav_bigvgan_model(m.float())
    return wav.reshape(-1).float().clone()


def token2wav(
    root: Path,
    codes: Any,
    speaker: str,
    seed: int = 0,
    noise: torch.Tensor | None = None,
    num_steps: int = 10,
    guidance_scale: float = 0.5,
    sway_coefficient: float = -1.0,
) -> torch.Tensor:
    """``model.token2wav(codes, cond, ref_mel)`` waveform ``[T * 480]`` (DiT then BigVGAN), with
    the initial noise of :func:`token2wav_mel` (seeded global RNG, or ``noise``)."""
    model, _ = load_reference(root)
    cond, ref_mel = _speaker(model, speaker)
    with _run(), _patched_sample(noise, []):
        torch.manual_seed(seed)
        wav = model.token2wav(
            _codes(codes),
            conditioning=cond,
            reference_mel=ref_mel,
            num_steps=num_steps,
            guidance_scale=guidance_scale,
            sway_coefficient=sway_coefficient,
        )
    return wav.reshape(-1).float().clone()


def generate_audio(
    root: Path,
    messages: Messages,
    speaker: str = "Chelsie",
    seed: int = 0,
    thinker_max_new_tokens: int = 16,
    talker_max_new_tokens: int = 64,
    return_codes: bool = False,
    **generate_kwargs: Any,
) -> tuple[torch.Tensor, ...]:
    """Whole pipeline ``model.generate`` after ``torch.manual_seed(seed)``, with the config's
    ``talker_eos_token_id`` (REFERENCE: the default is the official ids).  Returns ``(text_ids,
    waveform)``: ``text_ids`` [P + N] = prompt + thinker tokens (``generate``'s ``sequences``),
    ``waveform`` [m * 480]; with ``return_codes`` also the talker's codes (all generated, EOS
    included).  Defaults are transformers' (greedy thinker, sampled talker); pass e.g.
    ``talker_do_sample=False`` through ``generate_kwargs``."""
    model, _ = load_reference(root)
    ids = prompt_ids(root, messages)[None]
    kwargs = {"talker_eos_token_id": talker_eos_token_ids(root), **generate_kwargs}
    recorded: list[torch.Tensor] = []
    real = model.talker.generate

    def recording_generate(*args: Any, **kw: Any) -> Any:
        out = real(*args, **kw)
        recorded.append(out[0, kw["input_ids"].shape[1] :].clone())
        return out

    with _run(), mock.patch.object(model.talker, "generate", recording_generate):
        torch.manual_seed(seed)
        model.talker.rope_deltas = None
        text_ids, wav = model.generate(
            input_ids=ids,
            speaker=speaker,
            thinker_max_new_tokens=thinker_max_new_tokens,
            talker_max_new_tokens=talker_max_new_tokens,
            **kwargs,
        )
    out = (text_ids[0].clone(), wav.reshape(-1).float().clone())
    if return_codes:
        return (*out, recorded[0])
    return out


def samples_per_code(root: Path) -> int:
    """``dit repeats * prod(bigvgan upsample_rates)`` (480 for the official config)."""
    model, _ = load_reference(root)
    cfg = model.config.token2wav_config
    return int(cfg.dit_config.repeats * math.prod(cfg.bigvgan_config.upsample_rates))


# ----------------------------------------------------------------------------- media inputs
def mel_features(
    clips: Sequence[Any], sample_rate: int = 16000
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_features [n, 128, frames], feature_attention_mask [n, frames])`` of float32 16 kHz
    clips as ``Qwen2_5OmniProcessor`` makes them (its ``WhisperFeatureExtractor`` with the
    published Qwen2.5-Omni-7B settings, ``padding="max_length"`` to ``n_samples``; the processor
    itself needs torchvision, which does not load here)."""
    from transformers import WhisperFeatureExtractor

    fe = WhisperFeatureExtractor(
        feature_size=128, sampling_rate=16000, hop_length=160, n_fft=400, chunk_length=300
    )
    out = fe(
        list(clips),
        sampling_rate=sample_rate,
        padding="max_length",
        return_attention_mask=True,
        return_tensors="pt",
    )
    return out["input_features"], out["attention_mask"]


def image_inputs(images: Sequence[Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(pixel_values [patches, 1176], image_grid_thw [n, 3])`` of RGB uint8 images as the
    processor makes them (``Qwen2VLImageProcessorPil``, the published min/max pixels)."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    proc = Qwen2VLImageProcessorPil(min_pixels=3136, max_pixels=12845056)
    out = proc(images=list(images), return_tensors="pt")
    return out["pixel_values"], out["image_grid_thw"]


def audio_features(root: Path, clips: Sequence[Any]) -> list[torch.Tensor]:
    """The thinker's ``get_audio_features`` rows per clip (``[tokens, hidden]`` each)."""
    model, _ = load_reference(root)
    features, mask = mel_features(clips)
    with _run():
        rows = model.thinker.model.get_audio_features(features, mask).last_hidden_state
    counts = [((int(n) - 1) // 2 + 1 - 2) // 2 + 1 for n in mask.sum(-1)]
    return [r.float().clone() for r in rows.split(counts)]


def image_features(root: Path, images: Sequence[Any]) -> list[torch.Tensor]:
    """The thinker's ``get_image_features`` rows per image (``pooler_output``)."""
    model, _ = load_reference(root)
    pixels, grids = image_inputs(images)
    with _run():
        rows = model.thinker.model.get_image_features(pixels, grids).pooler_output
    return [r.float().clone() for r in rows]


def rope_index(
    root: Path,
    input_ids: Sequence[int],
    image_grid_thw: Any = None,
    video_grid_thw: Any = None,
    audio_seqlens: Any = None,
    second_per_grids: Any = None,
    use_audio_in_video: bool = False,
) -> tuple[torch.Tensor, int]:
    """``get_rope_index`` of one unpadded prompt: positions ``[3, L]`` and the delta
    (``audio_seqlens``: mel frames per audio, the videos' tracks included in prompt order)."""
    model, _ = load_reference(root)
    ids = torch.tensor([list(input_ids)], dtype=torch.long)

    def tensor(x: Any, dtype: torch.dtype) -> torch.Tensor | None:
        return None if x is None else torch.tensor(x, dtype=dtype)

    with _run():
        positions, delta = model.thinker.model.get_rope_index(
            ids,
            tensor(image_grid_thw, torch.long),
            tensor(video_grid_thw, torch.long),
            torch.ones_like(ids),
            use_audio_in_video,
            tensor(audio_seqlens, torch.long),
            tensor(second_per_grids, torch.float),
        )
    return positions[:, 0], int(delta.reshape(-1)[0])


def video_features(root: Path, patches: Any, grids: Any) -> list[torch.Tensor]:
    """The thinker's ``get_video_features`` rows per video, of given pixel patches
    ``[num_patches, 1176]`` and grids ``[n, 3]`` (the video processor needs torchvision)."""
    model, _ = load_reference(root)
    with _run():
        out = model.thinker.model.get_video_features(
            torch.as_tensor(patches), torch.as_tensor(grids, dtype=torch.long)
        )
    return [r.float().clone() for r in out.pooler_output]


def thinker_media_logits(
    root: Path,
    input_ids: Sequence[int],
    clips: Sequence[Any] = (),
    images: Sequence[Any] = (),
    video: tuple[Any, Any, Any] | None = None,
) -> torch.Tensor:
    """Thinker logits ``[L, text_vocab]`` of one forward over an expanded prompt (one
    placeholder token per encoder row) holding ``clips`` (16 kHz), ``images`` and ``video``
    (``(patches, grids, seconds_per_grid)``); positions from ``get_rope_index`` (an attention
    mask is passed, as ``generate`` does)."""
    model, _ = load_reference(root)
    ids = torch.tensor([list(input_ids)], dtype=torch.long)
    kwargs: dict[str, Any] = {}
    if clips:
        kwargs["input_features"], kwargs["feature_attention_mask"] = mel_features(clips)
    if images:
        kwargs["pixel_values"], kwargs["image_grid_thw"] = image_inputs(images)
    if video is not None:
        patches, grids, seconds = video
        kwargs["pixel_values_videos"] = torch.as_tensor(patches)
        kwargs["video_grid_thw"] = torch.as_tensor(grids, dtype=torch.long)
        kwargs["video_second_per_grid"] = torch.as_tensor(seconds, dtype=torch.float)
    with _run():
        out = model.thinker(
            input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False, **kwargs
        )
    return out.logits[0].float().clone()


def _media_kwargs(
    clips: Sequence[Any] = (), images: Sequence[Any] = (), video: tuple[Any, Any, Any] | None = None
) -> dict[str, Any]:
    """The thinker's media inputs as the processor makes them (see ``thinker_media_logits``)."""
    kwargs: dict[str, Any] = {}
    if clips:
        kwargs["input_features"], kwargs["feature_attention_mask"] = mel_features(clips)
    if images:
        kwargs["pixel_values"], kwargs["image_grid_thw"] = image_inputs(images)
    if video is not None:
        patches, grids, seconds = video
        kwargs["pixel_values_videos"] = torch.as_tensor(patches)
        kwargs["video_grid_thw"] = torch.as_tensor(grids, dtype=torch.long)
        kwargs["video_second_per_grid"] = torch.as_tensor(seconds, dtype=torch.float)
    return kwargs


def thinker_media_greedy(
    root: Path,
    input_ids: Sequence[int],
    steps: int,
    clips: Sequence[Any] = (),
    images: Sequence[Any] = (),
    video: tuple[Any, Any, Any] | None = None,
    use_audio_in_video: bool = False,
) -> ThinkerGreedy:
    """``thinker_greedy`` of an expanded media prompt (one placeholder per encoder row) with
    its media (as ``thinker_media_logits``), an all-ones attention mask passed (so the
    thinker computes its TMRoPE index). ``prompt_embeds`` are zero at the placeholders, as
    ``model.generate`` hands them to the talker. With ``use_audio_in_video`` the video's
    track is among ``clips`` (in prompt order) and the prompt holds its interleaved block
    (``audio_in_video_placeholder``)."""
    model, _ = load_reference(root)
    ids = torch.tensor([list(input_ids)], dtype=torch.long)
    with _run():
        res = model.thinker.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=steps,
            do_sample=False,
            output_hidden_states=True,
            output_logits=True,
            return_dict_in_generate=True,
            use_audio_in_video=use_audio_in_video,
            **_media_kwargs(clips, images, video),
        )
    hs = res.hidden_states
    n = res.sequences.shape[1] - ids.shape[1]
    cfg = model.config.thinker_config
    placeholders = torch.tensor(
        [cfg.audio_token_index, cfg.image_token_index, cfg.video_token_index]
    )
    embeds = hs[0][0][0].float().clone()
    embeds[torch.isin(ids[0], placeholders)] = 0.0

    def cat(layer: int) -> torch.Tensor:
        if len(hs) < 2:
            return torch.zeros(0, hs[0][layer].shape[-1])
        return torch.cat([step[layer][0] for step in hs[1:]], dim=0).float().clone()

    return ThinkerGreedy(
        prompt_ids=ids[0].clone(),
        token_ids=res.sequences[0, ids.shape[1] :].clone(),
        logits=torch.stack([lg[0] for lg in res.logits[:n]]).float().clone(),
        prompt_embeds=embeds,
        prompt_hidden=hs[0][-1][0].float().clone(),
        token_embeds=cat(0),
        token_hidden=cat(-1),
        eos_token_id=model.thinker.generation_config.eos_token_id,
    )


def talker_media_prefill_logits(
    root: Path, thinker: ThinkerGreedy, speaker: str, **rope_kwargs: Any
) -> torch.Tensor:
    """Codec logits ``[codec_vocab]`` of the talker's prefill on ``model.generate``'s hand-off
    of a media prompt, by one talker forward WITH an attention mask (so it computes its TMRoPE
    index from ``input_text_ids`` and ``rope_kwargs``, e.g. ``image_grid_thw``, and adds the
    codec pad/bos embeddings: upstream's intent; ``generate`` drops an all-ones mask)."""
    model, _ = load_reference(root)
    inp = talker_inputs(root, thinker, speaker)
    talker = model.talker
    rope_kwargs = dict(rope_kwargs)
    use_audio_in_video = bool(rope_kwargs.pop("use_audio_in_video", False))
    tensors = {
        k: torch.as_tensor(v, dtype=torch.float if "second" in k else torch.long)
        for k, v in rope_kwargs.items()
    }
    with _run():
        talker.rope_deltas = None
        out = talker(
            input_ids=inp.input_ids,
            input_text_ids=inp.input_text_ids,
            inputs_embeds=inp.inputs_embeds.clone(),
            attention_mask=torch.ones_like(inp.input_ids),
            thinker_reply_part=inp.thinker_reply_part.clone(),
            use_cache=False,
            use_audio_in_video=use_audio_in_video,
            **tensors,
        )
        talker.rope_deltas = None
    return out.logits[0, -1].float().clone()


def audio_chat_text_greedy(root: Path, messages: Messages, clips: Sequence[Any], steps: int) -> str:
    """The thinker's greedy text answer (``skip_special_tokens``, at most ``steps`` tokens) to
    a chat whose messages hold audio parts (``{"type": "audio"}``, one per clip of ``clips``
    in order, 16 kHz float32): the tokenizer's chat template, each ``<|AUDIO|>`` repeated as
    many times as the audio tower gives rows for its clip (the processor's expansion: 2 mel
    frames per step of the conv stem, then the 2x pooling), then ``thinker_media_greedy``."""
    model, tok = load_reference(root)
    ids = prompt_ids(root, messages).tolist()
    _, mask = mel_features(clips)
    counts = iter([((int(n) - 1) // 2 + 1 - 2) // 2 + 1 for n in mask.sum(-1)])
    audio = model.config.thinker_config.audio_token_index
    expanded: list[int] = []
    for i in ids:
        expanded.extend([i] * next(counts) if i == audio else [i])
    out = thinker_media_greedy(root, expanded, steps, clips)
    return tok.decode(out.token_ids.tolist(), skip_special_tokens=True)


def audio_in_video_placeholder(
    root: Path, grid: Sequence[int], seconds_per_grid: float, num_audio_tokens: int
) -> list[int]:
    """The ids ``Qwen2_5OmniProcessor`` puts in place of one ``<|VIDEO|>`` read with
    ``use_audio_in_video`` (its ``replace_video_with_audio_token``: ``<|audio_bos|>``, the
    frames' and the track's tokens interleaved in ``seconds_per_chunk`` chunks,
    ``<|audio_eos|>``), tokenized. The processor itself needs torchvision (its video
    processor), so its method runs on a stand-in holding what it reads."""
    from types import SimpleNamespace

    import numpy as np
    from transformers import Qwen2_5OmniProcessor

    model, tok = load_reference(root)
    cfg = model.config.thinker_config
    stub = SimpleNamespace(
        video_processor=SimpleNamespace(merge_size=cfg.vision_config.spatial_merge_size),
        audio_bos_token="<|audio_bos|>",
        audio_eos_token="<|audio_eos|>",
        video_token="<|VIDEO|>",
        audio_token="<|AUDIO|>",
    )
    stub.get_chunked_index = lambda *a: Qwen2_5OmniProcessor.get_chunked_index(stub, *a)
    text = Qwen2_5OmniProcessor.replace_video_with_audio_token(
        stub,
        {"video_grid_thw": [np.array(grid)], "video_second_per_grid": [seconds_per_grid]},
        0,
        {"num_audio_tokens": [num_audio_tokens]},
        0,
        position_id_per_seconds=cfg.position_id_per_seconds,
        seconds_per_chunk=cfg.seconds_per_chunk,
    )
    return list(tok(text, add_special_tokens=False)["input_ids"])
