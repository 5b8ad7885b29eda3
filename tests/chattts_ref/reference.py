"""Run UPSTREAM ChatTTS (chattts 0.2.5) on a checkpoint folder and return tensors for parity.

Loading
-------
``Chat.load`` builds every module from ``Chat.config`` (a ``ChatTTS.config.Config`` created in
``Chat.__init__``; no yaml is read) and, for ``source="custom"``, first checks the sha256 of nine
files against ``Chat.sha256_map`` (``ChatTTS/res/sha256_map.json``).  So a non-official checkpoint
is loaded by replacing those two instance attributes between ``Chat()`` and
``Chat.load(source="custom", custom_path=root, device=cpu)``; :func:`load_upstream_chat` does that
with the ``Config`` and map stored in the info file beside ``root`` (``assets.info_path``).
Note: the ``Config`` dataclass defaults are *shared* instances, so never mutate ``Chat().config``
in place.  The GPT's sizes come from ``asset/gpt/config.json`` (``LlamaModel.from_pretrained``),
everything else from the ``Config``.  ``Chat.load`` draws ``torch.rand(100)`` (DVAE ``coef``, then
overwritten from the file) from the global RNG; we load under ``torch.random.fork_rng``.

Upstream pipeline facts (read from the 0.2.5 source; ``H`` = GPT hidden, ``q`` = num_vq = 4)
---------------------------------------------------------------------------------------------
* Code prompt (``Speaker.decorate_code_prompts``): the text is stripped of ``[Stts]``,
  ``[spk_emb]``, ``[empty_spk]`` and whitespace, then ``prompt + text`` (``InferCodeParams.prompt``
  default ``"[speed_5]"``), then ``f"[Stts][spk_emb]{txt_smp}{prompt}{text}[Ptts]"`` with a speaker
  (``txt_smp`` empty unless a sample-audio prompt is used) or ``[Stts][empty_spk]...[Ptts]``
  without one.  So the default prompt is ``[Stts][spk_emb][speed_5]{text}[Ptts]``.
  Refine-text prompt: ``[Sbreak]{text}[Pbreak]{prompt}``.
* Tokenizer: ``BertTokenizerFast`` from ``asset/tokenizer``, ``add_special_tokens=False`` (no
  [CLS]/[SEP]).  Official ids: 50 ChatTTS tokens appended to bert-base-chinese (21128 tokens) in
  the order of ``assets.CHATTTS_SPECIAL_TOKENS``: ``[Stts]`` 21131, ``[Ptts]`` 21132, ``[Sbreak]``
  21134, ``[Pbreak]`` 21135, ``[Ebreak]`` 21136 (refine EOS), ``[uv_break]`` 21137, ``[laugh]``
  21142, ``[spk_emb]`` 21143, ``[empty_spk]`` 21144, ``[break_0]`` 21147 (refine output keeps ids
  < this), ``[laugh_0]`` 21155, ``[oral_0]`` 21158, ``[speed_0]`` 21168 (``[speed_5]`` 21173);
  text vocab 21178.  Tiny checkpoints keep the order, shifted (``read_info(root).token_ids``).
* Batch layout (``Tokenizer.encode``): each text encoded alone, LEFT padded with id 0 / mask 0 to
  the longest; ``input_ids [B, T, q]`` = the text id repeated over the q codebooks;
  ``text_mask = attention_mask.bool()``.
* Prompt embedding (``Embed.forward``): where ``text_mask``: ``emb_text(ids[..., 0])``; elsewhere
  (the left pads in a code prompt): ``sum_i emb_code[i](ids[..., i])`` (= ``sum_i emb_code[i][0]``
  for pads; masked from attention anyway).  Decode steps (``GPT.generate``, ``i > 0``): the new
  frame's embedding is ``sum_i emb_code[i](code_i)`` (fp32 ``stack(...).sum``).
* Speaker: ``spk_emb`` string = ``b14.encode_to_string(lzma.compress(fp16[H].tobytes(),
  FORMAT_RAW, [{"id": FILTER_LZMA2, "preset": 9 | PRESET_EXTREME}]))``; decode reverses it to
  fp16 [H] (768 official).  ``Config.spk_stat`` = b14 of fp16 ``[std(H), mean(H)]`` (std first);
  a random speaker is ``torch.randn(H, dtype=float16) * std + mean`` from the GLOBAL torch RNG,
  computed in fp16, then encoded.  ``Speaker.apply``: ``F.normalize(fp16 vector, p=2, dim=0,
  eps=1e-12)`` (in fp16), written (promoted to fp32) over the whole embedding at every position
  whose id is ``[spk_emb]`` (after ``Embed``, before the GPT).
* GPT: ``transformers.LlamaModel`` (``embed_tokens`` deleted; ``inputs_embeds`` only), eager
  prefill of the whole prompt then one frame per step with a ``DynamicCache``.  ``position_ids =
  cumsum(mask) - 1`` with pads set to 1; ``cache_position`` is absolute (pads included); the
  attention mask is ``[B, prompt + generated]`` (ones for generated frames).  Note upstream casts
  ``attention_mask``, ``position_ids`` and ``cache_position`` to the model dtype (fp32) before the
  call.  Hidden state used everywhere: ``last_hidden_state`` (AFTER the final RMSNorm) at the last
  position.
* Heads (``Embed``): ``weight_norm(Linear(H, V, bias=False))`` -> weight = ``g * v / ||v||`` with
  the norm over the input dim (per output row); stored as ``...parametrizations.weight.original0``
  (g, ``[V, 1]``) and ``original1`` (v, ``[V, H]``).  Code logits ``[B, V_a, q]`` ->
  ``permute -> [B*q, V_a]`` (row ``b*q + i``).
* Sampling per step (``GPT.generate``): ``logits / temperature`` (per codebook, default 0.3) ->
  processors in order: repetition penalty (``CustomRepetitionPenaltyLogitsProcessorRepeat``,
  default 1.05, window 16 past generated frames, ``freq`` one-hot count per codebook, logits < 0
  multiplied / >= 0 divided by ``penalty**freq``) -> ``TopPLogitsWarper(0.7, min_tokens_to_keep=3)``
  -> ``TopKLogitsWarper(20, min_tokens_to_keep=3)`` -> EOS (``num_audio_tokens - 1`` = 625) set to
  ``-inf`` while ``step < min_new_token`` -> softmax -> ``torch.multinomial``.  With
  ``manual_seed`` the shared generator is re-seeded with the SAME seed every step.  The penalty's
  ``max_input_ids`` cut zeroes ROWS (``B*q``), not token ids, so it never applies (EOS is
  penalised like any code); the window counts generated frames only.  ``top_K=1`` is
  NOT greedy (min_tokens_to_keep=3); we get greedy decoding by appending a processor that leaves
  only the argmax finite (first index on ties) -- see :func:`upstream_greedy_codes`.
* Stop rule: a batch item finishes when ANY of its q codebooks samples EOS; that frame is not
  output (``end_idx`` counts frames before it), nor its hidden state; the loop ends when all items
  finished or at ``max_new_token``.  Upstream fault: if any item samples EOS at step 0 the
  generator returns without yielding (``ensure_non_empty`` and no ``manual_seed``: it re-samples).
* Hidden states to audio (default ``use_decoder=True``): hidden ``[T, H]`` -> ``[1, H, T]`` ->
  Decoder (``DVAE`` without VQ): ``view(B, 2, H/2, T).permute(0, 2, 3, 1).flatten(2)`` ->
  ``[B, H/2, 2T]`` (frame 2t = first half of hidden t, 2t+1 = second half) -> ``conv_in``
  (Conv1d k3 -> GELU -> Conv1d k3) -> 12 ConvNeXt blocks (depthwise k7 dilation 2 pad 6, LayerNorm
  eps 1e-6, Linear x4, exact GELU, Linear, layer-scale ``weight``, residual) -> ``conv_out`` (1x1,
  no bias) -> ``out_conv`` (k3, no bias, -> 100) -> ``* coef`` ``[1, 100, 1]`` = log-mel
  ``[B, 100, 2T]``.  Vocos ``decode``: ``embed`` Conv1d k7 -> LayerNorm -> 8 ConvNeXt (k7, no
  dilation, ``gamma``) -> final LayerNorm -> ``head.out`` Linear(dim, n_fft + 2) -> first half
  ``mag = exp(.).clip(max=100)``, second half phase ``p`` -> ``S = mag * (cos p + i sin p)`` ->
  ``torch.istft(S, n_fft=1024, hop=256, win=1024, hann_window (periodic), center=True)`` at 24 kHz.
  Samples for T tokens: ``256 * (2T - 1) = 512 T - 256`` (center=True, no ``length``).
* ``Chat.infer`` (not stream) then drops every sample with ``|x| <= 1e-5`` ANYWHERE in the wave;
  :func:`upstream_decode_wav` returns the wave before that.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omnistep.models.chattts.tiny import info_path, read_info
from tests.chattts_ref.shims import install_shims

DEFAULT_PROMPT = "[speed_5]"

# Torch intra-op threads while upstream runs (restored afterwards).  One thread is ~10x faster
# for the tiny model on a shared 2-core machine and keeps results independent of the core count.
REFERENCE_THREADS = 1

_LOGGER = logging.getLogger("tests.chattts_ref.upstream")
_CHATS: dict[tuple[str, str, str], Any] = {}


@contextlib.contextmanager
def reference_threads(n: int | None = None) -> Iterator[None]:
    """Run torch with ``n`` (default :data:`REFERENCE_THREADS`) intra-op threads, then restore."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(n or REFERENCE_THREADS)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def upstream_config(root: Path) -> Any:
    """A fresh ``ChatTTS.config.Config`` for the checkpoint at ``root`` (no shared defaults)."""
    install_shims()
    from ChatTTS.config import config as C

    d = read_info(Path(root)).upstream_config

    def conv(x: dict) -> Any:
        return C.Decoder(**x)

    vq = dict(d["dvae"]["vq"])
    vq["levels"] = tuple(vq["levels"])
    voc = d["vocos"]
    return C.Config(
        path=C.Path(**d["path"]),
        decoder=conv(d["decoder"]),
        dvae=C.DVAE(
            encoder=conv(d["dvae"]["encoder"]),
            decoder=conv(d["dvae"]["decoder"]),
            vq=C.VQ(**vq),
        ),
        gpt=C.GPT(**d["gpt"]),
        embed=C.Embed(**d["embed"]),
        vocos=C.Vocos(
            feature_extractor=C.FeatureExtractor(
                class_path=voc["feature_extractor"]["class_path"],
                init_args=C.FeatureExtractorInitArgs(**voc["feature_extractor"]["init_args"]),
            ),
            backbone=C.Backbone(
                class_path=voc["backbone"]["class_path"],
                init_args=C.BackboneInitArgs(**voc["backbone"]["init_args"]),
            ),
            head=C.FourierHead(
                class_path=voc["head"]["class_path"],
                init_args=C.FourierHeadInitArgs(**voc["head"]["init_args"]),
            ),
        ),
        # None: the checkpoint has the official hidden size; the package's own statistics apply
        **({} if d["spk_stat"] is None else {"spk_stat": d["spk_stat"]}),
    )


def load_upstream_chat(root: Path, *, cached: bool = True, device: Any = "cpu") -> Any:
    """``ChatTTS.Chat`` loaded from ``root`` through ``Chat.load(source="custom")`` on
    ``device`` (default the CPU, as every parity test; ``cuda`` for the benchmarks: upstream
    puts its GPT, embeddings, decoder and Vocos there)."""
    import torch

    install_shims()
    import ChatTTS

    root = Path(root).resolve()
    device = torch.device(device)
    key = (str(root), hashlib.sha256(info_path(root).read_bytes()).hexdigest(), str(device))
    if cached and key in _CHATS:
        return _CHATS[key]
    info = read_info(root)
    chat = ChatTTS.Chat(_LOGGER)
    chat.config = upstream_config(root)
    chat.sha256_map = dict(info.sha256_map)
    with torch.random.fork_rng(devices=[]):
        ok = chat.load(source="custom", custom_path=str(root), device=device, compile=False)
    if not ok:
        raise RuntimeError(f"upstream Chat.load failed for {root}")
    if cached:
        _CHATS[key] = chat
    return chat


def clear_cache() -> None:
    """Forget loaded ``Chat`` objects."""
    _CHATS.clear()


def upstream_random_speaker(root: Path, seed: int) -> str:
    """``Chat.sample_random_speaker()`` after ``torch.manual_seed(seed)`` (global RNG restored)."""
    import torch

    chat = load_upstream_chat(root)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return chat.sample_random_speaker()


def decode_speaker(spk_emb: str) -> Any:
    """Upstream ``Speaker._decode``: the fp16 vector ``[H]`` (a numpy array) of a spk string."""
    install_shims()
    from ChatTTS.model.speaker import Speaker

    return Speaker._decode(spk_emb)


def _spk_string(root: Path, spk: str | int | None) -> str | None:
    if spk is None or isinstance(spk, str):
        return spk
    return upstream_random_speaker(root, int(spk))


@dataclass
class PromptInputs:
    """The GPT's prefill inputs as upstream builds them (batch-first)."""

    texts: list[str]  # decorated prompt strings
    input_ids: Any  # LongTensor [B, T, num_vq]
    attention_mask: Any  # LongTensor [B, T] (left padding)
    text_mask: Any  # BoolTensor [B, T]
    emb: Any  # FloatTensor [B, T, H], speaker applied


def upstream_prompt_inputs(
    root: Path, text: str | Sequence[str], spk: str | int | None = 0, prompt: str = DEFAULT_PROMPT
) -> PromptInputs:
    """Tokenizer -> Embed -> Speaker.apply exactly as ``Chat._infer_code`` does."""
    chat = load_upstream_chat(root)
    texts = [text] if isinstance(text, str) else list(text)
    spk_emb = _spk_string(root, spk)
    decorated = chat.speaker.decorate_code_prompts(list(texts), prompt, None, spk_emb)
    input_ids, attention_mask, text_mask = chat.tokenizer.encode(
        decorated, chat.config.gpt.num_vq, prompt=None, device=chat.device_gpt
    )
    with reference_threads():
        emb = chat.embed(input_ids, text_mask).clone()
        if spk_emb is not None:
            chat.speaker.apply(
                emb, spk_emb, input_ids, chat.tokenizer.spk_emb_ids, chat.gpt.device_gpt
            )
    return PromptInputs(
        decorated, input_ids.clone(), attention_mask.clone(), text_mask.clone(), emb
    )


@dataclass
class GreedyResult:
    """One batch item of :func:`upstream_greedy_codes`."""

    codes: Any  # LongTensor [n, num_vq]: frames before EOS (n <= steps)
    hiddens: Any  # FloatTensor [n, H]: hidden state that produced frame t (decoder input)
    logits: Any  # FloatTensor [m, num_vq, V_a]: raw head logits per step run (m = n, or n + 1
    #              when the item stopped on EOS: the last row is the step that sampled EOS)
    eos: bool  # stopped on EOS (else: hit ``steps``)
    prompt: str  # decorated prompt string


class _Recorder:
    """First processor: sees ``logits / temperature`` (= raw logits at temperature 1)."""

    def __init__(self) -> None:
        self.steps: list[Any] = []

    def __call__(self, input_ids: Any, scores: Any) -> Any:
        self.steps.append(scores.detach().clone())
        return scores


class _Greedy:
    """Last warper: leaves only the argmax finite (EOS excluded before ``min_new_token``)."""

    def __init__(self, eos: int, min_new_token: int) -> None:
        self.eos, self.min_new_token, self.step = eos, min_new_token, 0

    def __call__(self, input_ids: Any, scores: Any) -> Any:
        import torch

        s = scores.clone()
        if self.step < self.min_new_token:
            s[:, self.eos] = -torch.inf
        self.step += 1
        out = torch.full_like(s, -torch.inf)
        out.scatter_(1, s.argmax(dim=-1, keepdim=True), 0.0)
        return out


@contextlib.contextmanager
def _patched_gen_logits(recorder: _Recorder, greedy: _Greedy) -> Iterator[None]:
    import ChatTTS.core as core

    real = core.gen_logits

    def gen_logits(*args: Any, **kwargs: Any) -> tuple[list, list]:
        warpers, processors = real(*args, **kwargs)
        return [*warpers, greedy], [recorder, *processors]

    core.gen_logits = gen_logits
    try:
        yield
    finally:
        core.gen_logits = real


def upstream_greedy_codes(
    root: Path,
    text: str | Sequence[str],
    spk: str | int | None = 0,
    steps: int = 32,
    *,
    prompt: str = DEFAULT_PROMPT,
    min_new_token: int = 0,
    repetition_penalty: float | None = None,
) -> GreedyResult | list[GreedyResult]:
    """Greedy ``Chat._infer_code`` (the real method) for up to ``steps`` frames.

    Runs with temperature 1, no top-p/top-k, ``manual_seed=0`` (never touches the global RNG),
    ``ensure_non_empty=False``, the optional upstream repetition penalty, and a final processor
    that keeps only the argmax, so ``torch.multinomial`` picks it.  ``spk``: a spk_emb string, a
    seed for :func:`upstream_random_speaker`, or None (``[empty_spk]`` prompt).  A list of texts
    runs as one left-padded batch and returns a list.
    """
    import torch

    chat = load_upstream_chat(root)
    texts = [text] if isinstance(text, str) else list(text)
    spk_emb = _spk_string(root, spk)
    num_vq = chat.config.gpt.num_vq
    eos = chat.config.gpt.num_audio_tokens - 1
    params = chat.InferCodeParams(
        prompt=prompt,
        spk_emb=spk_emb,
        top_P=None,
        top_K=None,
        temperature=1.0,
        repetition_penalty=repetition_penalty,
        max_new_token=steps,
        min_new_token=min_new_token,
        show_tqdm=False,
        ensure_non_empty=False,
        manual_seed=0,
    )
    decorated = chat.speaker.decorate_code_prompts(list(texts), prompt, None, spk_emb)
    recorder, greedy = _Recorder(), _Greedy(eos, min_new_token)
    with _patched_gen_logits(recorder, greedy), torch.no_grad(), reference_threads():
        gen = chat._infer_code(list(texts), False, chat.device, True, params)
        out = next(gen, None)  # None: upstream yielded nothing (EOS at step 0)
    b = len(texts)
    logits = torch.stack(recorder.steps).view(len(recorder.steps), b, num_vq, -1)
    hidden = chat.config.gpt.hidden_size
    results = []
    for i in range(b):
        if out is None:
            codes = torch.zeros(0, num_vq, dtype=torch.long)
            hid = torch.zeros(0, hidden)
        else:
            codes = out.ids[i].to(torch.long).clone()
            hid = out.hiddens[i].clone()
        n = codes.shape[0]
        stopped = out is None or n < steps
        m = n + 1 if stopped else n
        results.append(GreedyResult(codes, hid, logits[:m, i].clone(), stopped, decorated[i]))
    return results[0] if isinstance(text, str) else results


def upstream_prefill_logits(
    root: Path,
    text: str | Sequence[str],
    spk: str | int | None = 0,
    prompt: str = DEFAULT_PROMPT,
) -> Any:
    """Raw code logits after prefill of the code prompt: ``[num_vq, V_a]`` (``[B, q, V_a]``)."""
    res = upstream_greedy_codes(root, text, spk, steps=1, prompt=prompt)
    if isinstance(res, list):
        import torch

        return torch.stack([r.logits[0] for r in res])
    return res.logits[0]


def upstream_decode_mel(root: Path, hidden_states: Any) -> Any:
    """Upstream Decoder on hidden states ``[T, H]`` -> log-mel ``[100, 2T]`` (``coef`` applied)."""
    import torch

    chat = load_upstream_chat(root)
    h = torch.as_tensor(hidden_states, dtype=torch.float32)
    with torch.inference_mode(), reference_threads():
        return chat.decoder(h.t().unsqueeze(0).contiguous())[0].clone()


def upstream_decode_wav(root: Path, hidden_states: Any) -> Any:
    """``Chat._decode_to_wavs([hidden], use_decoder=True)``: float32 numpy ``[512 T - 256]``."""
    import torch

    chat = load_upstream_chat(root)
    h = torch.as_tensor(hidden_states, dtype=torch.float32).clone()
    with reference_threads():
        wavs = chat._decode_to_wavs([h], True)
    return wavs[0]


def upstream_decode_codes_wav(root: Path, codes: Any) -> Any:
    """``Chat._decode_to_wavs([codes], use_decoder=False)``: codes ``[T, q]`` -> DVAE (GFSQ
    ``get_output_from_indices``) -> mel -> Vocos; float32 numpy ``[512 T - 256]``.  Not the
    default upstream path (that decodes hidden states) but what ``use_decoder=False`` does."""
    import torch

    chat = load_upstream_chat(root)
    c = torch.as_tensor(codes, dtype=torch.long).clone()
    with reference_threads():
        wavs = chat._decode_to_wavs([c], False)
    return wavs[0]


def upstream_vocos_wav(root: Path, mel: Any) -> Any:
    """Upstream ``Vocos.decode`` on a log-mel ``[100, F]`` -> float32 numpy ``[256 (F - 1)]``."""
    import torch

    chat = load_upstream_chat(root)
    m = torch.as_tensor(mel, dtype=torch.float32)
    with reference_threads():
        return chat._vocos_decode(m.unsqueeze(0))[0]
