"""The P3 families' benchmark (issue 29, item 6): each family's card on omnistep vs. its
reference runtime, in one run.

One entry of ``FAMILIES`` per family (a ``Family``: how to write its folder, build its card,
make a request, and run its reference); the driver and the report are shared. Families now:

* ``higgs_audio_v2``: Higgs Audio v2 against transformers' ``HiggsAudioV2ForConditionalGeneration
  .generate`` + ``HiggsAudioV2Processor.batch_decode``.
* ``chatterbox``: Chatterbox against upstream ``chatterbox-tts`` 0.1.7 (``T3.inference`` +
  ``S3Token2Wav.inference``'s flow, HiFT and fade), see "Chatterbox" below.
* ``voxcpm2``: VoxCPM2 against upstream ``voxcpm`` 2.0.3 (``VoxCPM2Model.generate`` and
  ``generate_streaming``), see "VoxCPM2" below (``bench/voxcpm.py`` runs this entry alone).

What it measures (per family)
-----------------------------
A folder in the published layout with seeded random weights at the PUBLISHED WIDTHS and
REDUCED DEPTH (``--layers``), written once into ``--root`` and reused while its marker names
the same sizes. For Higgs the widths are read from transformers' own config defaults
(``HiggsAudioV2Config()``: the Llama-3.2-3B backbone, hidden 3072, 24 heads / 8 KV heads of
128, intermediate 8192, llama3 rope; ``HiggsAudioV2TokenizerConfig``'s acoustic sub-config
defaults: DAC encoder 64, decoder 1024 channels, hidden 256, codebook dim 64, 1024 codes; its
semantic model ``HubertConfig()``: hidden 768, 12 layers), with what the published folders
fix beside them: upsampling ratios 8, 5, 4, 2, 3 (25 frames/s at 24 kHz; transformers'
default is xcodec's 75 Hz), 8 codebooks (target bandwidths up to 2 kbps), ``codebook_size``
1026 in the LM (ids 0..1023 plus the stream BOS/EOS). The backbone has ``--layers`` DualFFN
layers (default 2 of 28); the audio tokenizer keeps its full size (its decoder has no depth to
cut). The text vocabulary is the tiny test tokenizer's: text ids are only looked up (no text
head runs), so its size costs nothing per step. Weights: ``omnistep/models/higgs_audio_v2/
tiny.py``'s writer (float32), the layout both sides load.

Work per request: one of ``TEXTS`` (eight English sentences, 14-16 words), the model's own
voice (no reference clip), GREEDY, ``--frames`` F audio frames (default 50 = 2 s; such a sentence
takes about 4 s to say, but the reference's 8 sequential calls take ~1 s per frame on the
shared 2-core box): ``max_new_tokens = F + 8`` delayed steps on both sides (the
8-step delay pattern adds 8; random weights rarely draw the EOS, and the frames each side made
are recorded and used). Both sides float32, ``--threads`` torch intra-op threads each.

* omnistep, in-process: ``AsyncEngine([ModelInstance.load(card)])`` with the card's defaults
  (vocoder chunks: first 4 frames, each with 12 frames of left context and look-ahead).
  A burst of C submits C requests at once; TTFA = ``add_request`` -> the first non-empty
  AUDIO chunk; audio-s/s = audio seconds of the burst / its wall time; the LM and codec
  ``execute`` time (``ExecTimer``).
* the reference in ONE long-lived subprocess (``tests.higgs_ref.reference.Session``; it
  waits on a pipe while omnistep runs), the model loaded once; the same prompt ids (built by
  the card's ``PromptBuilder``), ``generate(do_sample=False, max_new_tokens=F + 8)`` then
  ``batch_decode``, timed inside the subprocess. It returns audio only at the end, so its time
  to first audio is its whole call. Eight texts one after another (sequential).

Order (as ``bench/qwen3_tts.py``): warm-ups (reference: ``TEXTS[0]`` at ``--frames``; omnistep:
``TEXTS[0]`` under ``ExecutionProfile.ROLLOUT``, whose greedy codes are the work check, then a
burst of 2 at 4 frames); then ``--rounds`` rounds (default 1) of: reference sequential over
the 8 texts, an unmeasured omnistep burst of 2 at 4 frames, omnistep at every level of
``--concurrency`` back to back. The work check compares omnistep's greedy delayed steps of
``TEXTS[0]`` with the reference's of round 1.

Chatterbox
----------
Folder: ``omnistep/models/chatterbox/tiny.py``'s writer (this family's own modules, seeded
random weights, float32) given the published sizes: T3 is upstream's ``Llama_520M`` (hidden
1024, 16 heads of 64, MLP 4096, Llama 3.1 rope) with ``--layers`` of its 30 layers (default
2); S3Gen's flow and HiFT whole, at ``S3Token2Wav``'s arguments (encoder 512 wide, FF 2048,
6 + 4 blocks; estimator 256 channels, 8 heads, 4 blocks, 12 mid blocks; HiFT 512 base
channels, F0 predictor 512); the voice encoder at its size (not run: the default voice of
``conds.pt``). Text vocabulary: the tiny character tokenizer (ids only looked up).

Work per request: one of ``TEXTS``, the default voice, exaggeration 0.5, T3 with CFG weight 0.5
(a conditional and an unconditional row), GREEDY with repetition penalty 1.0 (upstream's
penalty also counts its start-of-speech id, see docs/models/chatterbox.md), ``--frames`` F T3
tokens (default 50 = 2 s at 25 tokens/s); ids >= 6561 are dropped before the flow on both
sides (random weights draw some); the flow's 10 Euler steps with guidance 0.7; HiFT; the fade.

* omnistep: the ``chatterbox`` card (``ChatterboxOptions(kv_cache_gb=0.25)``), components
  ``t3``, ``s3gen`` and ``hift`` timed. The card's default is its reference setting: the flow
  starts once T3 has finished and HiFT decodes the whole mel, so the first audio is the whole
  utterance; ``flow_chunk_tokens=10`` streams (docs/models/chatterbox.md).
* the reference in one ``tests.chatterbox_ref.bench_ref.Session`` subprocess (the
  ``.ref/chatterbox`` overlay on its path): upstream ``T3`` built from ``Llama_520M`` with the
  folder's depth and its ``T3.inference`` (``torch.multinomial`` replaced by argmax), then
  upstream's ``CausalMaskedDiffWithXvec.inference`` (10 steps) and ``HiFTGenerator.inference``
  with ``trim_fade`` as ``S3Token2Wav.inference`` composes them (``S3Token2Wav`` itself imports
  torchaudio). Same text ids (the card's ``punc_norm`` + ``tokenizer.json``). Work check:
  the greedy T3 tokens of ``TEXTS[0]``.

VoxCPM2
-------
Folder: the published layout (``config.json``, ``tokenizer.json`` / ``tokenizer_config.json``,
``model.safetensors``, ``audiovae.pth``) at the PUBLISHED WIDTHS, each of the four MiniCPM
stacks (base LM, residual LM, LocEnc, LocDiT) at ``--layers`` layers (default 2; published 28,
8, 12, 12). The sizes come from ``voxcpm``'s own config classes, read in the reference
subprocess (``tests/voxcpm_ref/bench_ref.py: published_config``: ``VoxCPMConfig``'s patch 4,
``feat_dim`` 64, quantizer 512 / 9; ``VoxCPMEncoderConfig`` / ``VoxCPMDitConfig``'s width 1024,
FFN 4096, 16 heads; ``AudioVAEConfigV2``'s encoder 128 and decoder 2048 channels, 16 kHz in,
48 kHz out), and for the base LM, whose ``MiniCPM4Config`` has no defaults, the published
``config.json``'s block (hidden 2048, MLP 6144, 16 heads, 2 KV heads of 128, no muP). The
AudioVAE is whole (its decoder has no depth to cut). Text vocabulary: the tiny test tokenizer
(ids only looked up). Weights: upstream's ``VoxCPM2Model`` writes them (seeded, float32), then
the stop head is zeroed: both stop logits are 0 and argmax says "continue", so every request on
both sides runs to its cap of ``--frames`` patches (default 12 = 1.92 s; random weights would
stop at an arbitrary step).

Work per request: one of ``TEXTS``, the zero-shot voice, ``cfg_value`` 2.0, 10 Euler steps per
patch, ``--frames`` F patches (``max_new_tokens`` = F; upstream ``max_len`` = F).

* omnistep: the ``voxcpm2`` card (``VoxCPMOptions(kv_cache_gb=0.25)``), components ``lm`` (both
  LMs, the stop head and the LocDiT solve, one unit per patch) and ``vae`` (the AudioVAE decoder,
  streamed: first chunk one patch) timed.
* the reference in one ``tests.voxcpm_ref.bench_ref.Session`` subprocess (the ``.ref/voxcpm``
  overlay on its path): ``VoxCPM2Model.from_local(optimize=False)``; the sequential throughput
  from ``generate`` (the whole utterance, then one decode; split into ``_inference`` and the
  decode), the first audio from ``generate_streaming``'s first chunk (upstream streams: a
  chunk per patch), one streaming call of ``TEXTS[0]`` per round after the sequential eight.
  Warm-ups at full length on both sides: ``generate`` and ``generate_streaming`` of
  ``TEXTS[0]``; omnistep's ROLLOUT request of ``TEXTS[0]``.
* Work check: the stop decisions (equal step counts), and the waveform: upstream ``generate``
  of ``TEXTS[0]`` with its ``torch.randn`` fed the LocDiT noises omnistep drew from the same
  seed (``VoxCPMFamily.waveform_check``) against omnistep's ROLLOUT waveform (equal lengths;
  the largest sample difference is reported).

Targets (issue 29, item 6; issue 30, item 5 for VoxCPM2)
--------------------------------------------------------
(a) omnistep TTFA p50 at C=1 / the reference's time to its first audio (its whole first
call, the same text; VoxCPM2: its streaming generate's first chunk) <= 0.25; (b) omnistep
audio-s/s at C=8 / the reference sequential over the same 8 texts >= 4; (c) omnistep TTFA p99
at C=8 / at C=4 <= 1.5. Also: RTF, CPU seconds per audio second, the split into LM and codec
seconds on both sides.

How to run
----------
::

    PYTHONPATH=. .venv/bin/python bench/families.py          # every family, 2 layers, F = 50
    PYTHONPATH=. .venv/bin/python bench/families.py --families chatterbox
    PYTHONPATH=. .venv/bin/python bench/families.py --layers 4 --frames 50 --rounds 1
    PYTHONPATH=. .venv/bin/python bench/families.py --quick  # tiny sizes, F = 4 (~30 s)

``--quick``: the family's tiny test folder, F = 4, one round (``tests/test_bench_families.py``,
one family per run); its
numbers mean nothing. Output: a printed table per family and ``bench/results/families.json``
(``--out``; ``targets`` in the form ``bench/compare.py`` reads). Wall-clock numbers depend on
other load on the machine: the load average and CPU seconds go with every measurement.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gc
import json
import os
import platform
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from omnistep.core import ExecutionProfile, Modality, ModelInstance, Request, SamplingParams
from omnistep.engine import AsyncEngine

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    SENTENCES,
    ExecTimer,
    fmt,
    jsonable,
    load_avg,
    median,
    parse_levels,
    percentile,
    target_row,
    timed_streams,
)

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # the references live in tests/
    sys.path.insert(0, str(REPO))

DEFAULT_OUT = REPO / "bench" / "results" / "families.json"
MARKER = "families-bench-sizes.json"
SEED = 0
WARM_FRAMES = 4
"""Audio frames of the unmeasured warm-up bursts."""
TARGETS = {"ttfa_c1": 0.25, "audio_per_s": 4.0, "ttfa_p99_cliff": 1.5}
TEXTS = SENTENCES


# ----------------------------------------------------------------------------- families


class Family:
    """One family's part of the benchmark. Subclasses set the class attributes and implement
    the methods; ``FAMILIES`` lists one instance per family."""

    name = ""
    card_id = ""
    sample_rate = 24000
    default_layers = 2
    default_frames = 50
    quick_frames = 4
    warm_reference_frames: int | None = None
    """Audio frames of the reference's warm-up call (None: the run's ``--frames``, the
    default: after a 4-token warm-up, upstream Chatterbox's first 50-token call took 14.5 s
    against 3.1-4.3 s for the next seven on a quiet box, so every family's reference warms up
    at the measured length; omnistep's warm-up is the work-check request at ``--frames``)."""
    components = ("lm", "codec")
    """Components whose ``execute`` is timed, in the order of the printed split."""
    ar_component: str | None = None
    """The AR component whose calls before the first audio are counted (None: the first of
    ``components``)."""

    def sizes(self, quick: bool, layers: int) -> dict[str, Any]:
        """The folder's sizes (JSON; the marker compares them)."""
        raise NotImplementedError

    def write(self, root: Path, sizes: dict[str, Any]) -> None:
        """Write the folder of ``sizes`` at ``root`` (seed ``SEED``)."""
        raise NotImplementedError

    def parameter_counts(self, root: Path) -> dict[str, int]:
        """Parameters per part, from the files."""
        raise NotImplementedError

    def load(self, root: Path) -> ModelInstance:
        """omnistep's model instance of the folder (its card, loaded on the CPU)."""
        raise NotImplementedError

    def request(self, i: int, seed: int, frames: int, rollout: bool = False) -> Request:
        """Greedy request ``i`` (``TEXTS[i]``) for ``frames`` audio frames."""
        raise NotImplementedError

    def reference(self, root: Path, threads: int) -> Any:
        """The reference runtime: ``.info`` (dict), ``.one(i, frames)`` -> dict with
        ``seconds`` (the whole call), ``frames`` (audio frames made), ``audio_s``,
        ``split_s`` (per part) and ``codes`` (comparable with ``codes_of``), ``.close()``."""
        raise NotImplementedError

    def codes_of(self, stream: Any) -> Any:
        """The codes a ROLLOUT request recorded (comparable with the reference's)."""
        return np.array([r.tokens for r in stream.trajectories["decode"]], dtype=np.int64)

    def work_check(self, ours: Any, theirs: Any) -> dict[str, Any]:
        """Compare ``codes_of`` with the reference's ``codes`` (default: ``work_check``)."""
        return work_check(ours, theirs)

    def frames_of(self, stream: Any, samples: int) -> int:
        """The frames a finished request made (default: its usage's ``output_tokens``)."""
        return int(stream.usage.get("output_tokens", 0))


class HiggsFamily(Family):
    """Higgs Audio v2 (``omnistep.models.higgs_audio_v2``) against transformers 5.x."""

    name = "higgs_audio_v2"
    card_id = "higgs-audio-v2"
    delay = 8  # steps the codebook delay pattern adds (num_codebooks)

    def sizes(self, quick: bool, layers: int) -> dict[str, Any]:
        """Tiny test sizes (``quick``), or the published widths (transformers' config
        defaults, module docstring) with ``layers`` backbone layers."""
        if quick:
            return {"lm": {}, "codec": None}
        from transformers import HiggsAudioV2Config, HiggsAudioV2TokenizerConfig, HubertConfig

        lm = HiggsAudioV2Config()
        keys = (
            "hidden_size",
            "intermediate_size",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "max_position_embeddings",
            "rms_norm_eps",
            "rope_parameters",
        )
        lm_sizes = {k: getattr(lm, k) for k in keys}
        lm_sizes["rope_parameters"] = dict(lm_sizes["rope_parameters"])
        lm_sizes["num_hidden_layers"] = layers
        tok = HiggsAudioV2TokenizerConfig
        acoustic = dict(tok.sub_configs_defaults["acoustic_model_config"].init_kwargs)
        acoustic.update(
            model_type="dac", downsampling_ratios=[8, 5, 4, 2, 3], upsampling_ratios=[8, 5, 4, 2, 3]
        )
        defaults = tok()
        codec = {
            "model_type": "higgs_audio_v2_tokenizer",
            "target_bandwidths": [0.5, 1, 1.5, 2],
            "sample_rate": defaults.sample_rate,
            "codebook_size": defaults.codebook_size,
            "codebook_dim": defaults.codebook_dim,
            "semantic_sample_rate": defaults.semantic_sample_rate,
            "downsample_factor": defaults.downsample_factor,
            "acoustic_model_config": acoustic,
            "semantic_model_config": {
                "model_type": "hubert",
                "hidden_size": HubertConfig().hidden_size,
                "mask_time_prob": 0.0,
            },
        }
        return {"lm": lm_sizes, "codec": codec}

    def write(self, root: Path, sizes: dict[str, Any]) -> None:
        from omnistep.models.higgs_audio_v2.tiny import write_folder

        write_folder(root, seed=SEED, lm_sizes=sizes["lm"], codec_config=sizes["codec"])

    def parameter_counts(self, root: Path) -> dict[str, int]:
        from safetensors import safe_open

        counts = {"lm": 0, "codec_decoder": 0, "codec_encoder": 0}
        for path, tag in ((root / "model.safetensors", "lm"), (root / "audio_tokenizer" /
                          "model.safetensors", "codec")):  # fmt: skip
            with safe_open(str(path), "pt") as sf:
                for name in sf.keys():  # noqa: SIM118 - safe_open has no __iter__
                    n = int(np.prod(sf.get_slice(name).get_shape()))
                    if tag == "lm":
                        counts["lm"] += n
                    elif name.startswith(("semantic_model.", "encoder_semantic.", "acoustic_enc")):
                        counts["codec_encoder"] += n
                    elif "project_in" not in name and ".fc1." not in f".{name}":
                        counts["codec_decoder"] += n
        return counts

    def load(self, root: Path) -> ModelInstance:
        from omnistep.models.higgs_audio_v2.card import HiggsOptions, build_card

        return ModelInstance.load(build_card(str(root), HiggsOptions(kv_cache_gb=0.25)))

    def request(self, i: int, seed: int, frames: int, rollout: bool = False) -> Request:
        return Request(
            self.card_id,
            text=TEXTS[i % len(TEXTS)],
            seed=seed,
            sampling=SamplingParams(temperature=0, max_new_tokens=frames + self.delay),
            profile=ExecutionProfile.ROLLOUT if rollout else ExecutionProfile.SERVE,
        )

    def reference(self, root: Path, threads: int) -> HiggsReference:
        return HiggsReference(root, threads, self.delay)


class HiggsReference:
    """transformers' Higgs Audio v2 in one ``Session`` subprocess, loaded once; prompts built
    by the card's ``PromptBuilder`` (the ids omnistep's frontend makes)."""

    def __init__(self, root: Path, threads: int, delay: int):
        from omnistep.models.higgs_audio_v2.loader import HiggsCheckpoint
        from omnistep.models.higgs_audio_v2.prompt import PromptBuilder
        from omnistep.sampling.delay import DelayPattern
        from tests.higgs_ref.reference import Session

        ckpt = HiggsCheckpoint.open(root)
        cfg = ckpt.lm
        pattern = DelayPattern(cfg.num_codebooks, cfg.audio_stream_bos_id, cfg.audio_stream_eos_id)
        builder = PromptBuilder(ckpt.tokenizer(), pattern)
        self.prompts = [builder.build(t, ()) for t in TEXTS]
        self.delay = delay
        self.session = Session()
        start = time.perf_counter()
        self.info = self.session.call("bench_load", root=str(root), threads=threads)
        self.info["start_and_load_s"] = round(time.perf_counter() - start, 2)
        self.info["runtime"] = (
            "transformers HiggsAudioV2ForConditionalGeneration.generate(do_sample=False) + "
            "HiggsAudioV2Processor.batch_decode"
        )
        self.info["prompt_tokens"] = [len(p.ids) for p in self.prompts]
        print(f"reference: started and loaded in {self.info['start_and_load_s']:.1f}s", flush=True)

    def one(self, i: int, frames: int) -> dict[str, Any]:
        prompt = self.prompts[i % len(TEXTS)]
        out = self.session.call(
            "bench_generate",
            ids=list(prompt.ids),
            audio=[list(a) for a in prompt.audio],
            max_new_tokens=frames + self.delay,
        )
        return {
            "text": i % len(TEXTS),
            "seconds": out["seconds"],
            "frames": out["samples"] // 960,  # decoded audio frames (960 samples each)
            "audio_s": out["samples"] / 24000,
            "split_s": {"lm": out["generate_s"], "codec": out["decode_s"]},
            "codes": out["frames"],
        }

    def close(self) -> None:
        self.session.close()


class ChatterboxFamily(Family):
    """Chatterbox (``omnistep.models.chatterbox``) against upstream ``chatterbox-tts`` 0.1.7
    (``T3.inference`` + ``S3Token2Wav.inference``'s flow, HiFT and fade)."""

    name = "chatterbox"
    card_id = "chatterbox"
    components = ("t3", "s3gen", "hift")
    cfg_weight = 0.5
    exaggeration = 0.5
    flow_chunk_tokens = 0  # ChatterboxOptions.flow_chunk_tokens (--chatterbox-flow-chunk)

    def sizes(self, quick: bool, layers: int) -> dict[str, Any]:
        """Tiny test sizes (``quick``: ``tiny.py``'s), or the published widths: T3 upstream's
        ``Llama_520M`` (hidden 1024, 16 heads of 64, MLP 4096) with ``layers`` of its 30
        layers; S3Gen and HiFT whole, at ``S3Token2Wav``'s sizes (encoder 512 wide, FF 2048,
        6 + 4 blocks; estimator 256 channels, 8 heads, 4 blocks, 12 mid blocks; HiFT 512
        base channels, F0 predictor 512)."""
        if quick:
            return {"t3": {"num_hidden_layers": 2, "intermediate_size": 256}, "s3gen": {}}
        from omnistep.models.chatterbox.t3 import T3Config

        t3 = T3Config()
        return {
            "t3": {"num_hidden_layers": layers, "intermediate_size": t3.intermediate_size},
            "s3gen": {
                "linear_units": 2048,
                "num_blocks": 6,
                "channels": 256,
                "n_blocks": 4,
                "num_mid_blocks": 12,
                "num_heads": 8,
                "base_channels": 512,
                "f0_channels": 512,
            },
        }

    def write(self, root: Path, sizes: dict[str, Any]) -> None:
        from omnistep.models.chatterbox.hift import HiFTConfig
        from omnistep.models.chatterbox.s3gen import FlowConfig
        from omnistep.models.chatterbox.s3gen_encoder import EncoderConfig
        from omnistep.models.chatterbox.s3gen_estimator import EstimatorConfig
        from omnistep.models.chatterbox.t3 import T3Config
        from omnistep.models.chatterbox.tiny import write_folder

        if not sizes["s3gen"]:  # quick: tiny.py's own sizes
            write_folder(root, seed=SEED)
            return
        z = sizes["s3gen"]
        flow = FlowConfig(
            encoder=EncoderConfig(ffn_dim=z["linear_units"], num_blocks=z["num_blocks"]),
            estimator=EstimatorConfig(
                channels=z["channels"],
                num_heads=z["num_heads"],
                num_blocks=z["n_blocks"],
                num_mid_blocks=z["num_mid_blocks"],
            ),
        )
        write_folder(
            root,
            seed=SEED,
            t3_config=T3Config(**sizes["t3"]),
            flow_config=flow,
            hift_config=HiFTConfig(base_channels=z["base_channels"], f0_channels=z["f0_channels"]),
        )

    def parameter_counts(self, root: Path) -> dict[str, int]:
        from safetensors import safe_open

        counts = {"t3": 0, "s3gen_flow": 0, "hift": 0}
        for file in ("t3_cfg.safetensors", "s3gen.safetensors"):
            with safe_open(str(root / file), "pt") as sf:
                for name in sf.keys():  # noqa: SIM118 - safe_open has no __iter__
                    n = int(np.prod(sf.get_slice(name).get_shape()))
                    part = "t3" if file.startswith("t3") else "s3gen_flow"
                    counts["hift" if name.startswith("mel2wav.") else part] += n
        return counts

    def load(self, root: Path) -> ModelInstance:
        from omnistep.models.chatterbox.card import ChatterboxOptions, build_card

        options = ChatterboxOptions(kv_cache_gb=0.25, flow_chunk_tokens=self.flow_chunk_tokens)
        return ModelInstance.load(build_card(str(root), options))

    def request(self, i: int, seed: int, frames: int, rollout: bool = False) -> Request:
        return Request(
            self.card_id,
            text=TEXTS[i % len(TEXTS)],
            seed=seed,
            sampling=SamplingParams(
                temperature=0,
                repetition_penalty=1.0,
                max_new_tokens=frames,
                cfg_weight=self.cfg_weight,
                exaggeration=self.exaggeration,
            ),
            profile=ExecutionProfile.ROLLOUT if rollout else ExecutionProfile.SERVE,
        )

    def reference(self, root: Path, threads: int) -> ChatterboxReference:
        return ChatterboxReference(self, root, threads)

    def codes_of(self, stream: Any) -> np.ndarray:
        tokens = [np.ravel(r.tokens) for r in stream.trajectories["decode"]]
        return np.array(tokens, dtype=np.int64).reshape(len(tokens), -1)


class ChatterboxReference:
    """Upstream Chatterbox in one ``tests.chatterbox_ref.bench_ref.Session`` subprocess, loaded
    once; the text ids made by the card's own front end (``punc_norm`` + ``tokenizer.json``)."""

    def __init__(self, family: ChatterboxFamily, root: Path, threads: int):
        from omnistep.models.chatterbox.frontend import TextTokenizer, punc_norm
        from tests.chatterbox_ref.bench_ref import Session

        sizes = json.loads((root / MARKER).read_text())["sizes"]
        tokenizer = TextTokenizer(root / "tokenizer.json")
        self.ids = [tokenizer.encode(punc_norm(t)) for t in TEXTS]
        self.family = family
        self.session = Session()
        start = time.perf_counter()
        self.info = self.session.call(
            "bench_load", root=str(root), threads=threads, t3_sizes=sizes["t3"],
            s3gen_sizes=sizes["s3gen"],
        )  # fmt: skip
        self.info["start_and_load_s"] = round(time.perf_counter() - start, 2)
        self.info["runtime"] = (
            "chatterbox-tts 0.1.7 T3.inference (CFG 0.5, argmax) + S3Token2Wav.inference's "
            "flow (10 Euler steps, CFG 0.7), HiFT and trim_fade"
        )
        self.info["prompt_tokens"] = [len(i) + 2 for i in self.ids]
        print(f"reference: started and loaded in {self.info['start_and_load_s']:.1f}s", flush=True)

    def one(self, i: int, frames: int) -> dict[str, Any]:
        out = self.session.call(
            "bench_generate",
            text_ids=self.ids[i % len(TEXTS)],
            max_new_tokens=frames,
            cfg_weight=self.family.cfg_weight,
            exaggeration=self.family.exaggeration,
            seed=SEED + i,
        )
        return {
            "text": i % len(TEXTS),
            "seconds": out["seconds"],
            "frames": len(out["tokens"]),  # T3's tokens, as omnistep's usage counts them
            "audio_s": out["samples"] / 24000,
            "split_s": {"t3": out["t3_s"], "s3gen": out["s3gen_s"], "hift": out["hift_s"]},
            "codes": np.asarray(out["tokens"], dtype=np.int64).reshape(-1, 1),
        }

    def close(self) -> None:
        self.session.close()


class VoxCPMFamily(Family):
    """VoxCPM2 (``omnistep.models.voxcpm``) against upstream ``voxcpm`` 2.0.3's
    ``VoxCPM2Model.generate`` / ``generate_streaming`` (see "VoxCPM2" in the module docstring)."""

    name = "voxcpm2"
    card_id = "voxcpm2"
    sample_rate = 48000
    default_frames = 12
    components = ("lm", "vae")
    warm_reference_frames = None
    """Warm-ups at full length on both sides (the brief's rule; upstream's first call pays its
    allocator's and the AudioVAE's first-shape costs)."""
    patch_samples = 7680
    """48 kHz samples per patch (4 latent frames of 1920)."""

    def sizes(self, quick: bool, layers: int) -> dict[str, Any]:
        """``quick``: the tiny test config (``omnistep.models.voxcpm.tiny``); else the
        published widths read in the reference subprocess
        (``tests.voxcpm_ref.bench_ref.published_config``: ``voxcpm``'s config classes and the
        published LM block) with ``layers`` layers per MiniCPM stack."""
        if quick:
            return {"config": {}}
        from omnistep.models.voxcpm.tiny import tiny_config
        from tests.voxcpm_ref.env import call_reference

        vocab = tiny_config()["lm_config"]["vocab_size"]
        config = call_reference(
            "tests.voxcpm_ref.bench_ref:published_config", layers=layers, vocab_size=vocab
        )
        return {"config": config}

    def write(self, root: Path, sizes: dict[str, Any]) -> None:
        """``config.json`` and the tiny tokenizer (``tiny.write_tiny_voxcpm``), then the
        weights written by upstream's own ``VoxCPM2Model`` with the stop head zeroed
        (``bench_ref.write_bench_weights``): the published files ``model.safetensors`` and
        ``audiovae.pth``."""
        from omnistep.models.voxcpm.tiny import write_tiny_voxcpm
        from tests.voxcpm_ref.env import call_reference

        write_tiny_voxcpm(root, **sizes["config"])
        counts = call_reference(
            "tests.voxcpm_ref.bench_ref:write_bench_weights", timeout=1800, root=str(root),
            seed=SEED,
        )  # fmt: skip
        (root / "parameters.json").write_text(json.dumps(counts))

    def parameter_counts(self, root: Path) -> dict[str, int]:
        return json.loads((root / "parameters.json").read_text())

    def load(self, root: Path) -> ModelInstance:
        from omnistep.models.voxcpm.card import VoxCPMOptions, build_card

        return ModelInstance.load(build_card(str(root), VoxCPMOptions(kv_cache_gb=0.25)))

    def request(self, i: int, seed: int, frames: int, rollout: bool = False) -> Request:
        """``TEXTS[i]``, the zero-shot voice, ``frames`` patches (the stop head never stops:
        the cap ends it), the LocDiT noise from ``seed``."""
        return Request(
            self.card_id,
            text=TEXTS[i % len(TEXTS)],
            seed=seed,
            sampling=SamplingParams(max_new_tokens=frames),
            profile=ExecutionProfile.ROLLOUT if rollout else ExecutionProfile.SERVE,
        )

    def reference(self, root: Path, threads: int) -> VoxCPMReference:
        return VoxCPMReference(self, root, threads)

    def waveform_check(
        self, ref: VoxCPMReference, ours: np.ndarray, seed: int, frames: int
    ) -> dict[str, Any]:
        """The work check beyond the stop step: upstream ``generate`` of ``TEXTS[0]`` given the
        LocDiT noises omnistep drew for ``seed`` (``VoxCPMAR._noise``: per step the stop
        sampler's uniform, then ``[C, P]`` normals) against omnistep's waveform of that
        request."""
        from omnistep.sampling.sampler import make_generator

        config = json.loads((ref.root / "config.json").read_text())
        feat, patch = config["feat_dim"], config["patch_size"]
        gen = make_generator(seed, "cpu")
        noises = []
        for _ in range(frames):
            torch.rand(1, generator=gen)
            noises.append(torch.randn(feat, patch, generator=gen).numpy())
        out = ref.session.call("bench_noise", text=TEXTS[0], max_len=frames, noises=noises)
        theirs = out["waveform"]
        n = min(len(theirs), len(ours))
        diff = float(np.abs(theirs[:n] - ours[:n]).max()) if n else float("nan")
        scale = float(np.abs(theirs).max()) if len(theirs) else float("nan")
        return {
            "samples": [int(len(ours)), int(len(theirs))],
            "max_abs_diff": diff,
            "reference_peak": scale,
            "noises_left": out["noises_left"],
        }


class VoxCPMReference:
    """Upstream VoxCPM2 in one ``tests.voxcpm_ref.bench_ref.Session`` subprocess (the
    ``.ref/voxcpm`` overlay on its path), loaded once; the same texts (its own tokenizer
    wrapper makes the same ids as the card's, tests/test_voxcpm_serving.py)."""

    def __init__(self, family: VoxCPMFamily, root: Path, threads: int):
        from tests.voxcpm_ref.bench_ref import Session

        self.family, self.root = family, root
        self.session = Session()
        start = time.perf_counter()
        self.info = self.session.call("bench_load", root=str(root), threads=threads)
        self.info["start_and_load_s"] = round(time.perf_counter() - start, 2)
        self.info["runtime"] = (
            "voxcpm 2.0.3 VoxCPM2Model.generate (sequential) and generate_streaming (first "
            "audio), float32, optimize=False"
        )
        print(f"reference: started and loaded in {self.info['start_and_load_s']:.1f}s", flush=True)

    def one(self, i: int, frames: int) -> dict[str, Any]:
        out = self.session.call("bench_generate", text=TEXTS[i % len(TEXTS)], max_len=frames)
        made = out["samples"] // self.family.patch_samples
        return {
            "text": i % len(TEXTS),
            "seconds": out["seconds"],
            "frames": made,
            "audio_s": out["samples"] / self.family.sample_rate,
            "split_s": {"lm": out["lm_s"], "vae": out["vae_s"]},
            "codes": np.zeros((made, 1), dtype=np.int64),  # "continue" at every step
        }

    def first_audio(self, i: int, frames: int) -> dict[str, Any]:
        """Upstream's streaming generate of ``TEXTS[i]``: its first chunk's seconds."""
        return self.session.call("bench_first_audio", text=TEXTS[i % len(TEXTS)], max_len=frames)

    def close(self) -> None:
        self.session.close()


FAMILIES: dict[str, Family] = {
    f.name: f for f in (HiggsFamily(), ChatterboxFamily(), VoxCPMFamily())
}
"""One entry per family."""


def ensure_checkpoint(family: Family, root: Path, sizes: dict[str, Any]) -> dict[str, Any]:
    """The family's folder of ``sizes`` at ``root``: written once, reused while its marker
    names the same sizes; written into a sibling folder and renamed (no half folder left)."""
    want = json.dumps({"family": family.name, "seed": SEED, "sizes": sizes}, sort_keys=True)
    marker = root / MARKER
    if marker.exists() and marker.read_text() == want:
        return {"written": False, "seconds": 0.0}
    start = time.perf_counter()
    tmp = root.with_name(f"{root.name}.partial-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    family.write(tmp, sizes)
    (tmp / MARKER).write_text(want)
    if root.exists():
        shutil.rmtree(root)
    tmp.rename(root)
    return {"written": True, "seconds": round(time.perf_counter() - start, 1)}


# ----------------------------------------------------------------------------- omnistep


class Ours:
    """A family's card loaded in one in-process ``AsyncEngine`` (all bursts on one loop)."""

    def __init__(self, family: Family, root: Path, frames: int):
        self.family, self.frames = family, frames
        start = time.perf_counter()
        self.model = family.load(root)
        self.load_s = time.perf_counter() - start
        self.timers = {n: ExecTimer(self.model.components[n]) for n in family.components}
        self.engine = AsyncEngine([self.model])
        self.seed = 1000
        print(f"omnistep: loaded in {self.load_s:.1f}s", flush=True)

    def info(self) -> dict[str, Any]:
        return {
            "load_s": round(self.load_s, 2),
            "engine": "in-process AsyncEngine",
            "engine_config": dataclasses.asdict(self.engine.config),
        }

    async def close(self) -> None:
        await self.engine.shutdown()
        leftovers = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in leftovers:  # the step loop's pending waiter outlives shutdown
            task.cancel()
        await asyncio.gather(*leftovers, return_exceptions=True)
        del self.engine, self.model, self.timers
        gc.collect()

    async def codes(self, i: int) -> np.ndarray:
        """Greedy codes of ``TEXTS[i]``, recorded under ROLLOUT."""
        stream = self.engine.add_request(self.family.request(i, 1, self.frames, rollout=True))
        audio = []
        async for chunk in stream:
            if chunk.modality is Modality.AUDIO and chunk.audio is not None:
                audio.append(np.asarray(chunk.audio, dtype=np.float32).ravel())
        self.codes_audio = np.concatenate(audio) if audio else np.zeros(0, np.float32)
        return self.family.codes_of(stream)

    async def burst(
        self, c: int, tag: str = "", quiet: bool = False, frames: int | None = None
    ) -> dict[str, Any]:
        """C requests at once (``frames`` audio frames each, default the run's), streamed to
        their ends."""
        for t in self.timers.values():
            t.log.clear()
        load = load_avg()
        cpu0 = time.process_time()
        seed0, self.seed = self.seed, self.seed + c
        reqs = [self.family.request(i, seed0 + i, frames or self.frames) for i in range(c)]
        start, timed = await timed_streams(self.engine, reqs)
        per = [
            {
                "text": i % len(TEXTS),
                "ttfa_s": t.ttfa_s,
                "total_s": t.total_s,
                "frames": self.family.frames_of(t.stream, t.samples),
                "audio_s": t.samples / self.family.sample_rate,
            }
            for i, t in enumerate(timed)
        ]
        wall = time.perf_counter() - start
        cpu = time.process_time() - cpu0
        audio = sum(p["audio_s"] for p in per)
        ttfa = [p["ttfa_s"] for p in per if p["ttfa_s"] is not None]
        res = {
            "concurrency": c,
            "tag": tag,
            "wall_s": wall,
            "frames": sum(p["frames"] for p in per),
            "audio_s": audio,
            "audio_s_per_s": audio / wall,
            "rtf": wall / audio if audio else float("nan"),
            "ttfa_p50_s": percentile(ttfa, 50),
            "ttfa_p99_s": percentile(ttfa, 99),
            "total_p50_s": median([p["total_s"] for p in per]),
            "cpu_s": cpu,
            "cpu_s_per_audio_s": cpu / audio if audio else float("nan"),
            "split_s": {n: sum(t.seconds().values()) for n, t in self.timers.items()},
            "exec": {n: t.summary() for n, t in self.timers.items()},
            "before_first_audio": self.before_first_audio(start),
            "loadavg_before": load,
            "loadavg": load_avg(),
            "requests": per,
        }
        if not quiet:
            print(
                f"  omnistep {tag:<8} C={c:<2} wall {wall:6.2f}s  {res['audio_s_per_s']:6.3f} "
                f"audio-s/s  TTFA p50 {res['ttfa_p50_s']:6.3f}s p99 {res['ttfa_p99_s']:6.3f}s  "
                f"load {res['loadavg'][0]}",
                flush=True,
            )
        return res

    def before_first_audio(self, start: float) -> dict[str, float] | None:
        """What ran before the burst's first audio: the AR component's calls (``ar_calls``,
        ``ar_s``: prefill and steps) ending before the vocoder's first call starts, that call's
        seconds (``first_vocoder_s``) and when it ended (``first_audio_s``, from the burst's
        start). None without a vocoder call."""
        ar = self.family.ar_component or self.family.components[0]
        voc = self.family.components[-1]
        vocoder = self.timers[voc].log
        if not vocoder:
            return None
        _, _, v0, v1 = min(vocoder, key=lambda x: x[2])
        calls = [(s, e) for _, _, s, e in self.timers[ar].log if e <= v0]
        return {
            "ar_calls": len(calls),
            "ar_s": round(sum(e - s for s, e in calls), 3),
            "first_vocoder_s": round(v1 - v0, 3),
            "first_audio_s": round(v1 - start, 3),
        }


def reference_sequential(ref: Any, frames: int, tag: str, texts: int = len(TEXTS)) -> dict:
    """The reference over the first ``texts`` of the 8 texts, one after another."""
    load = load_avg()
    cpu0 = ref_cpu(ref)
    per = [ref.one(i, frames) for i in range(texts)]
    cpu = ref_cpu(ref) - cpu0 if cpu0 is not None else float("nan")
    seconds = sum(r["seconds"] for r in per)
    audio = sum(r["audio_s"] for r in per)
    res = {
        "wall_s": seconds,
        "frames": sum(r["frames"] for r in per),
        "audio_s": audio,
        "audio_s_per_s": audio / seconds,
        "rtf": seconds / audio if audio else float("nan"),
        "first_call_s": per[0]["seconds"],
        "cpu_s": cpu,
        "cpu_s_per_audio_s": cpu / audio if audio else float("nan"),
        "split_s": {k: sum(r["split_s"][k] for r in per) for k in per[0]["split_s"]},
        "loadavg_before": load,
        "loadavg": load_avg(),
        "requests": [{k: v for k, v in r.items() if k != "codes"} for r in per],
        "codes_text0": per[0]["codes"],
    }
    print(
        f"  reference {tag:<8} seq x{texts} wall {seconds:6.2f}s  "
        f"{res['audio_s_per_s']:6.3f} audio-s/s  first call {res['first_call_s']:6.3f}s  "
        f"load {res['loadavg'][0]}",
        flush=True,
    )
    return res


def ref_cpu(ref: Any) -> float | None:
    from common import process_cpu_seconds

    pid = getattr(ref, "pid", None) or getattr(getattr(ref, "session", None), "pid", None)
    return process_cpu_seconds(pid)


def work_check(ours: np.ndarray, theirs: np.ndarray) -> dict[str, Any]:
    """Greedy codes of the same text on both sides: step counts and how many leading steps
    agree in every codebook (float differences may flip a near-tie later on)."""
    n = min(len(ours), len(theirs))
    same = np.all(ours[:n] == theirs[:n], axis=1) if n else np.zeros(0, bool)
    agree = int(n if same.all() else np.argmin(same))
    return {"steps": [int(len(ours)), int(len(theirs))], "leading_steps_equal": agree}


def run_family(family: Family, root: Path, args: argparse.Namespace) -> dict[str, Any]:
    levels: list[int] = args.concurrency
    ref = family.reference(root, args.threads)
    loop = asyncio.new_event_loop()
    try:
        warm_ref = ref.one(0, family.warm_reference_frames or args.frames)
        streaming = hasattr(ref, "first_audio")  # the reference streams: time its first chunk
        if streaming:
            ref.first_audio(0, args.frames)  # warm its streaming path too
        ours = Ours(family, root, args.frames)
        ours_codes = loop.run_until_complete(ours.codes(0))
        waveform = None
        if hasattr(family, "waveform_check"):
            waveform = family.waveform_check(ref, ours.codes_audio, 1, args.frames)
            print(f"  waveform work check on TEXTS[0] (same noise): {waveform}", flush=True)
        warm = min(2, levels[-1])
        loop.run_until_complete(ours.burst(warm, quiet=True, frames=WARM_FRAMES))
        rounds, work = [], None
        for r in range(1, args.rounds + 1):
            print(f"{family.name}: round {r}/{args.rounds}", flush=True)
            rnd: dict[str, Any] = {"ours": {}}
            texts = getattr(args, "reference_texts", None) or len(TEXTS)
            rnd["reference"] = reference_sequential(ref, args.frames, f"round {r}", texts)
            if streaming:
                first = ref.first_audio(0, args.frames)
                rnd["reference"]["first_audio_s"] = first["first_s"]
                rnd["reference"]["streaming_call"] = first
                print(f"  reference streaming first chunk {first['first_s']:.3f}s", flush=True)
            codes0 = rnd["reference"].pop("codes_text0")
            if work is None:
                work = family.work_check(ours_codes, codes0)
                if waveform is not None:
                    work["waveform"] = waveform
                print(f"  greedy work check on TEXTS[0]: {work}", flush=True)
            loop.run_until_complete(ours.burst(warm, quiet=True, frames=WARM_FRAMES))
            for c in levels:
                rnd["ours"][str(c)] = loop.run_until_complete(ours.burst(c, f"round {r}"))
            rounds.append(rnd)
        info = ours.info()
        loop.run_until_complete(ours.close())
    finally:
        loop.close()
        ref.close()
    return {
        "rounds": rounds,
        "omnistep": info,
        "reference": ref.info,
        "work_check": work,
        "warmup_reference_s": round(warm_ref["seconds"], 3),
    }


# ----------------------------------------------------------------------------- report


def report(family: Family, levels: list[int], res: dict[str, Any]) -> dict[str, Any]:
    lo, hi = levels[0], levels[-1]
    mid = 4 if 4 in levels else levels[-2]
    rounds = res["rounds"]
    ours = {c: [r["ours"][str(c)] for r in rounds] for c in levels}
    ref = [r["reference"] for r in rounds]

    def pooled_ttfa(c: int) -> list[float]:
        return [q["ttfa_s"] for b in ours[c] for q in b["requests"] if q["ttfa_s"] is not None]

    table = []
    for c in levels:
        runs, ttfa = ours[c], pooled_ttfa(c)
        table.append(
            {
                "side": "omnistep",
                "C": c,
                "ttfa_p50_s": percentile(ttfa, 50),
                "ttfa_p99_s": percentile(ttfa, 99),
                "total_p50_s": median([r["total_p50_s"] for r in runs]),
                "wall_s": median([r["wall_s"] for r in runs]),
                "frames": runs[0]["frames"],
                "audio_s_per_s": median([r["audio_s_per_s"] for r in runs]),
                "rtf": median([r["rtf"] for r in runs]),
                "cpu_s_per_audio_s": median([r["cpu_s_per_audio_s"] for r in runs]),
                "split_s": {k: median([r["split_s"][k] for r in runs]) for k in runs[0]["split_s"]},
                "load1_max": max(r["loadavg"][0] for r in runs),
            }
        )
    table.append(
        {
            "side": "reference",
            "C": f"seq {len(ref[0]['requests'])}",
            "ttfa_p50_s": median([_ref_first_audio(r) for r in ref]),
            "ttfa_p99_s": float("nan"),
            "total_p50_s": median([q["seconds"] for r in ref for q in r["requests"]]),
            "wall_s": median([r["wall_s"] for r in ref]),
            "frames": ref[0]["frames"],
            "audio_s_per_s": median([r["audio_s_per_s"] for r in ref]),
            "rtf": median([r["rtf"] for r in ref]),
            "cpu_s_per_audio_s": median([r["cpu_s_per_audio_s"] for r in ref]),
            "split_s": {k: median([r["split_s"][k] for r in ref]) for k in ref[0]["split_s"]},
            "load1_max": max(r["loadavg"][0] for r in ref),
        }
    )
    print(f"\n{family.name}")
    head = (
        f"{'side':<9} {'C':>5} {'TTFA p50':>8} {'p99':>7} {'total p50':>9} {'wall':>7} "
        f"{'frames':>6} {'audio-s/s':>9} {'RTF':>6} {'cpu s/audio s':>13}  "
        f"{'seconds: ' + ' / '.join(family.components):<22} {'load1':>5}"
    )
    print(head)
    print("-" * len(head))
    for row in table:
        parts = " / ".join(f"{row['split_s'][k]:.2f}" for k in family.components)
        print(
            f"{row['side']:<9} {row['C']!s:>5} {fmt(row['ttfa_p50_s'], '8.3f')} "
            f"{fmt(row['ttfa_p99_s'], '7.3f')} {row['total_p50_s']:9.3f} {row['wall_s']:7.2f} "
            f"{row['frames']:>6} {row['audio_s_per_s']:9.3f} {row['rtf']:6.2f} "
            f"{fmt(row['cpu_s_per_audio_s'], '13.2f')}  {parts:<22} {row['load1_max']:>5}"
        )
    streamed = "first_audio_s" in ref[0]
    print(
        "(TTFA: omnistep = first streamed audio; reference = "
        + ("its streaming generate's first chunk" if streamed else "its whole first call")
        + ", the same text. omnistep's LM and codec run on separate threads and overlap.)"
    )

    def paired(fn: Any) -> list[float]:
        return [fn(i) for i in range(len(rounds))]

    idx = {c: levels.index(c) for c in levels}
    targets = [
        target_row(
            f"{family.name} (a) TTFA p50 C={lo}: omnistep / reference's first audio",
            table[0]["ttfa_p50_s"] / table[-1]["ttfa_p50_s"],
            "<=",
            TARGETS["ttfa_c1"],
            paired(lambda i: ours[lo][i]["ttfa_p50_s"] / _ref_first_audio(ref[i])),
        ),
        target_row(
            f"{family.name} (b) audio-s/s C={hi}: omnistep / reference sequential",
            table[idx[hi]]["audio_s_per_s"] / table[-1]["audio_s_per_s"],
            ">=",
            TARGETS["audio_per_s"],
            paired(lambda i: ours[hi][i]["audio_s_per_s"] / ref[i]["audio_s_per_s"]),
        ),
        target_row(
            f"{family.name} (c) TTFA p99 C={hi} / C={mid} (omnistep)",
            table[idx[hi]]["ttfa_p99_s"] / table[idx[mid]]["ttfa_p99_s"],
            "<=",
            TARGETS["ttfa_p99_cliff"],
            paired(lambda i: ours[hi][i]["ttfa_p99_s"] / ours[mid][i]["ttfa_p99_s"]),
        ),
    ]
    print("targets (medians over rounds; TTFA percentiles over the pooled requests):")
    for t in targets:
        pair = ", ".join("-" if p is None else f"{p:.3f}" for p in t["paired"])
        print(
            f"  {t['name']:<66} {fmt(t['value'], '7.3f')} (target {t['op']} {t['target']:<4}) "
            f"{'MET   ' if t['met'] else 'MISSED'}  paired: {pair}"
        )
    cpu_ratio = table[-1]["cpu_s_per_audio_s"] / table[idx[hi]]["cpu_s_per_audio_s"]
    print(f"  (info) CPU s per audio s, reference / omnistep C={hi}: {cpu_ratio:.3f}")
    print(f"  (info) greedy work check on TEXTS[0]: {res['work_check']}")
    first = [b["before_first_audio"] for b in ours[lo]]
    print(f"  (info) before the first audio at C={lo} (per round): {first}")
    figures = {
        "ttfa_c1_ratio": targets[0]["value"],
        "audio_per_s_ratio": targets[1]["value"],
        "ttfa_p99_cliff_ratio": targets[2]["value"],
        "cpu_per_audio_s_ratio": round(cpu_ratio, 4),
        "omnistep_ttfa_c1_s": table[0]["ttfa_p50_s"],
        "reference_first_audio_s": table[-1]["ttfa_p50_s"],
        "omnistep_audio_s_per_s": {str(r["C"]): r["audio_s_per_s"] for r in table[:-1]},
        "reference_audio_s_per_s": table[-1]["audio_s_per_s"],
        "omnistep_ttfa_p99_s": {str(r["C"]): r["ttfa_p99_s"] for r in table[:-1]},
        "omnistep_rtf": {str(r["C"]): r["rtf"] for r in table[:-1]},
        "reference_rtf": table[-1]["rtf"],
        "omnistep_before_first_audio_c1": first[0],
    }
    return {"table": table, "targets": targets, "figures": figures}


def _ref_first_audio(rnd: dict[str, Any]) -> float:
    """The reference's time to first audio in a round: its streaming call's first chunk when
    it streams (``first_audio_s``), else its whole first sequential call."""
    return rnd.get("first_audio_s", rnd["first_call_s"])


def parse_families(text: str) -> list[str]:
    names = [x.strip() for x in text.split(",") if x.strip()]
    unknown = [n for n in names if n not in FAMILIES]
    if not names or unknown:
        raise argparse.ArgumentTypeError(f"--families: choose from {sorted(FAMILIES)}")
    return names


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--families", type=parse_families, default=sorted(FAMILIES))
    ap.add_argument("--concurrency", type=parse_levels, default=[1, 4, 8], help="e.g. 1,4,8")
    ap.add_argument("--layers", type=int, help="backbone layers (default: the family's, 2)")
    ap.add_argument(
        "--frames", type=int, help="audio frames per request (default 50; VoxCPM2: 12 patches)"
    )
    ap.add_argument("--threads", type=int, default=2, help="torch intra-op threads, both sides")
    ap.add_argument("--rounds", type=int, default=1, help="rounds of the paired comparisons")
    ap.add_argument("--root", type=Path, default=Path("/tmp"), help="folder of the checkpoints")
    ap.add_argument("--quick", action="store_true", help="tiny sizes, 4 frames, 1 round")
    ap.add_argument(
        "--chatterbox-flow-chunk",
        type=int,
        default=0,
        help="Chatterbox's ChatterboxOptions.flow_chunk_tokens (0: one flow window, the "
        "default card; N: the streamed form, first chunk N tokens)",
    )
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = ap.parse_args(argv)
    if args.chatterbox_flow_chunk < 0:
        ap.error("--chatterbox-flow-chunk must be >= 0")
    FAMILIES["chatterbox"].flow_chunk_tokens = args.chatterbox_flow_chunk
    if min(args.rounds, args.threads, args.frames or 1, args.layers or 1) < 1:
        ap.error("--frames, --layers, --rounds and --threads must be >= 1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    torch.set_num_threads(args.threads)
    t_start, load_start = time.perf_counter(), load_avg()
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, load {load_start}")
    frames_arg = args.frames
    families: dict[str, Any] = {}
    targets: list[dict] = []
    for name in args.families:
        family = FAMILIES[name]
        layers = args.layers or family.default_layers
        args.frames = frames_arg or (family.quick_frames if args.quick else family.default_frames)
        sizes = family.sizes(args.quick, layers)
        root = args.root / f"omnistep-bench-{name}{'-quick' if args.quick else ''}"
        ckpt = ensure_checkpoint(family, root, sizes)
        ckpt.update(root=str(root), parameters=family.parameter_counts(root), sizes=sizes)
        print(f"{name}: checkpoint {root}: written {ckpt['written']} ({ckpt['seconds']}s), "
              f"parameters {ckpt['parameters']}", flush=True)  # fmt: skip
        res = run_family(family, root, args)
        summary = report(family, args.concurrency, res)
        targets += summary["targets"]
        families[name] = {
            "checkpoint": ckpt,
            "layers": None if args.quick else layers,
            "frames": args.frames,
            "max_new_tokens": args.frames + getattr(family, "delay", 0),
            **summary,
            "raw": res,
        }
    elapsed, load_end = time.perf_counter() - t_start, load_avg()
    print(f"load average: start {load_start}, end {load_end}; bench took {elapsed:.0f}s")
    args.frames = frames_arg
    result = {
        "machine": {
            "platform": platform.platform(),
            "python": sys.version.split()[0],
            "torch": torch.__version__,
            "cpus": os.cpu_count(),
            "torch_threads": args.threads,
        },
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "settings": {"texts": list(TEXTS), "sampling": "greedy", "voice": "the model's own"},
        "families": families,
        "targets": targets,
        "seconds": round(elapsed, 1),
        "loadavg": {"start": load_start, "end": load_end},
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(jsonable(result), indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
