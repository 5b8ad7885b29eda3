"""The Chatterbox reference (``chatterbox-tts`` 0.1.7) as one long-lived subprocess for
``bench/families.py``: loaded once, then timed text -> waveform calls.

``Session`` starts the venv's python with the ``.ref/chatterbox`` overlay first on its path and
``chatterbox`` registered as a bare package, as ``env.call_reference`` does, but keeps the
process for many calls (``tests.ref_overlay.ReferenceSession``).

- ``bench_load(root, threads, t3_sizes, s3gen_sizes)``: upstream ``T3`` (the ``Llama_520M``
  config with ``t3_sizes``' layers and MLP width) and upstream's flow + HiFT
  (``upstream_s3gen._modules`` with ``s3gen_sizes``) loaded from the folder's
  ``t3_cfg.safetensors`` / ``s3gen.safetensors``, and ``conds.pt``'s voice; float32. A folder
  of omnistep's writer has no ``tfmr.embed_tokens`` / ``text_head`` (T3 feeds embeddings and
  never runs the text head): those two stay at their random init, nothing else may be missing.
- ``bench_generate(text_ids, max_new_tokens, cfg_weight, exaggeration, seed)``: upstream
  ``T3.inference`` (its CFG loop; ``torch.multinomial`` replaced by argmax, repetition penalty
  1.0, temperature 1, min-p 0.05, top-p 1), the special ids dropped as ``ChatterboxTTS.generate``
  drops them, then ``upstream_s3gen._token2wav`` (flow 10 steps with guidance 0.7, HiFT,
  ``trim_fade``: ``S3Token2Wav.inference``). Timed inside the subprocess.
"""

from __future__ import annotations

from typing import Any

from tests.chatterbox_ref.env import OVERLAY
from tests.ref_overlay import ReferenceSession

_LOADED: dict[str, Any] = {}
BENCH_CONFIG = "omnistep_bench"


def _t3(t3_sizes: dict[str, int]):
    from chatterbox.models.t3 import t3 as t3_module
    from chatterbox.models.t3.llama_configs import LLAMA_CONFIGS
    from chatterbox.models.t3.modules.t3_config import T3Config

    config = dict(LLAMA_CONFIGS["Llama_520M"])
    config.update(t3_sizes, torch_dtype="float32")
    LLAMA_CONFIGS[BENCH_CONFIG] = config
    hp = T3Config()
    hp.llama_config_name = BENCH_CONFIG
    return t3_module.T3(hp)


def bench_load(
    root: str, threads: int, t3_sizes: dict[str, int], s3gen_sizes: dict[str, int]
) -> dict[str, Any]:
    """Load T3, the flow, HiFT and the default voice of ``root`` once (float32, ``threads``
    torch intra-op threads); returns the load seconds and versions."""
    import time
    from pathlib import Path

    import torch
    import transformers
    from chatterbox.models.t3.modules.cond_enc import T3Cond
    from safetensors.torch import load_file

    from tests.chatterbox_ref import upstream_s3gen

    torch.set_num_threads(threads)
    start = time.perf_counter()
    t3 = _t3(t3_sizes)
    missing, unexpected = t3.load_state_dict(
        load_file(Path(root) / "t3_cfg.safetensors"), strict=False
    )
    unused = {"tfmr.embed_tokens.weight", "text_head.weight"}  # never run by T3.inference
    if unexpected or not set(missing) <= unused:
        raise RuntimeError(f"t3_cfg.safetensors: missing {missing}, unexpected {unexpected}")
    flow, hift = upstream_s3gen._load(root, s3gen_sizes)
    conds = torch.load(Path(root) / "conds.pt", map_location="cpu", weights_only=True)
    _LOADED.update(
        t3=t3.float().eval(),
        flow=flow.float(),
        hift=hift.float(),
        t3_cond=conds["t3"],
        gen=conds["gen"],
    )
    _LOADED["t3_cond_class"] = T3Cond
    return {
        "load_s": round(time.perf_counter() - start, 2),
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "dtype": str(next(t3.parameters()).dtype),
    }


def bench_generate(
    text_ids: list[int], max_new_tokens: int, cfg_weight: float, exaggeration: float, seed: int
) -> dict[str, Any]:
    """One greedy text -> waveform call on what ``bench_load`` loaded.

    Returns: ``seconds`` (the whole call: upstream returns audio only at its end), ``t3_s``,
    ``s3gen_s`` (the flow), ``hift_s`` (HiFT and the fade), ``tokens`` (T3's ids, the stop id
    included when drawn), ``samples`` (24 kHz waveform length).
    """
    import time

    import torch

    from tests.chatterbox_ref.upstream_s3gen import _token2wav

    t3 = _LOADED["t3"]
    hp = t3.hp
    stored = _LOADED["t3_cond"]
    cond = _LOADED["t3_cond_class"](
        speaker_emb=stored["speaker_emb"],
        cond_prompt_speech_tokens=stored["cond_prompt_speech_tokens"],
        emotion_adv=exaggeration * torch.ones(1, 1, 1),
    )
    text = torch.tensor([[hp.start_text_token, *text_ids, hp.stop_text_token]] * 2)
    torch.multinomial = lambda probs, num_samples: probs.argmax(dim=-1, keepdim=True)
    times: dict[str, float] = {}

    class Timed:  # splits _token2wav's flow and HiFT calls
        def __init__(self, module, name):
            self.module, self.name = module, name

        def inference(self, **kw):
            t0 = time.perf_counter()
            out = self.module.inference(**kw)
            times[self.name] = time.perf_counter() - t0
            return out

    start = time.perf_counter()
    with torch.inference_mode():
        tokens = t3.inference(
            t3_cond=cond,
            text_tokens=text,
            max_new_tokens=max_new_tokens,
            temperature=1.0,
            cfg_weight=cfg_weight,
            repetition_penalty=1.0,
            min_p=0.05,
            top_p=1.0,
        )[0]
        mid = time.perf_counter()
        speech = [int(t) for t in tokens.tolist() if t < 6561]  # drop_invalid_tokens
        flow, hift = Timed(_LOADED["flow"], "flow"), Timed(_LOADED["hift"], "hift")
        wav = _token2wav(flow, hift, _LOADED["gen"], speech, seed, seed + 1)
    end = time.perf_counter()
    return {
        "seconds": end - start,
        "t3_s": mid - start,
        "s3gen_s": times["flow"],
        "hift_s": end - mid - times["flow"],
        "tokens": tokens.tolist(),
        "samples": int(wav.size),
    }


class Session(ReferenceSession):
    """One long-lived reference subprocess running this module's functions (``call``), with
    the overlay on its path (``tests.ref_overlay.ReferenceSession`` of ``env.OVERLAY``).

    Raises (constructor):
        FileNotFoundError: the overlay is not installed (``make install-test``).
    """

    def __init__(self) -> None:
        super().__init__(OVERLAY, module="tests.chatterbox_ref.bench_ref")
