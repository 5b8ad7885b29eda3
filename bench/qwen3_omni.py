"""The Qwen3-Omni card on omnistep vs. transformers' ``Qwen3OmniMoeForConditionalGeneration
.generate``, in one run (issue 28, item 7).

A ``Family`` of ``bench/families.py`` (its driver, bursts, reference rounds and report are
used as they are) plus target (d), the MoE layer's step against its expert-GEMM floor
(``bench/moe.py``'s measurement at the thinker's widths).

The folder
----------
Seeded random weights (float32) in the published layout of Qwen3-Omni-30B-A3B-Instruct,
written once into ``--root`` by transformers' own classes (``Qwen3OmniMoeConfig`` ->
``Qwen3OmniMoeForConditionalGeneration(config).save_pretrained``, the weights redrawn as
``omnistep/models/qwen3_omni/tiny.py`` does, its tokenizer files), at the PUBLISHED WIDTHS read
from transformers' config defaults (``Qwen3OmniMoeConfig()``), with REDUCED DEPTH and FEWER
EXPERTS:

* thinker text model: hidden 2048, 4 KV heads, ``moe_intermediate_size`` 768, top 8 of the
  experts, ``norm_topk_prob`` (defaults); 32 query heads of 128 (the published config.json:
  transformers' default 28 heads is Qwen2.5-7B's); every layer an MoE; ``--layers`` layers
  (default 2 of 48) and ``--experts`` routed experts (default 32 of 128: 128 are 604 M
  parameters a layer, 2.4 GB float32, twice over with the reference in the same process);
* talker: hidden 1024, 16 heads / 2 KV heads of 128, ``moe_intermediate_size`` 384, top 8
  (defaults), a gated shared expert of 768 (the published config; transformers has no default),
  ``--talker-layers`` (default 2 of 20), ``--experts`` experts; codec vocabulary 3072;
* code predictor whole: 5 layers, hidden 1024, 16 heads / 8 KV heads of 128, intermediate
  3072, 2048 codes, 16 codebooks (published; the default ``num_code_groups`` is 32);
* code2wav whole: hidden 1024, 8 layers, 16 heads, sliding window 72, decoder 1536 channels,
  upsampling 8 x 5 x 4 x 3 x 2 x 2 = 1920 samples a frame (12.5 Hz at 24 kHz);
* the tiny test tokenizer's vocabulary (a few hundred ids, so the thinker's embedding and
  ``lm_head`` are small: the published 152064 rows would be 1.2 GB each side); the audio and
  vision towers tiny (not run: text prompts).

Work per request: one of the eight ``SENTENCES`` in a user turn, voice ``ethan``, GREEDY in
every stage (thinker argmax, ``Qwen3OmniOptions.talker_greedy`` = ``talker_do_sample=False``),
``--text-tokens`` reply tokens at most, ``--frames`` F talker frames (80 ms each;
``talker_max_new_tokens`` F + 1 on both sides), so the same text ids and codes on both sides
(the work check below). Both sides in this process, float32, ``--threads`` torch threads.

* omnistep: ``AsyncEngine`` on the ``qwen3_omni`` card (its defaults: code2wav chunks 1, 8,
  16... frames, the first chunk the talker's first frame; ``first_audio_alone``); bursts of C
  requests at once; TTFA = ``add_request`` -> first audio; the thinker, talker (with its
  code predictor) and code2wav ``execute`` seconds.
* transformers 5.x: ``generate(speaker="ethan", thinker_do_sample=False,
  talker_do_sample=False, ...)`` of the eight texts one after another; the thinker's
  ``generate``, the talker's ``generate`` (its code predictor's ``generate`` inside every
  frame) and code2wav's ``chunked_decode`` timed. It returns audio only at the end, so its
  time to first audio is its whole call. ``--reference-texts`` N < 8 runs it over the first N
  texts only (on a loaded CPU one call can take minutes); (b) compares rates, audio seconds
  per wall second, so it stays like for like.

Order (``families.run_family``): the reference's warm-up call (TEXTS[0], whole length), then
omnistep's (TEXTS[0] under ``ExecutionProfile.ROLLOUT``: its text ids and codes are the work
check) and a burst of 2, all at the full length; then ``--rounds`` rounds of: the reference
over the 8 texts, an unmeasured burst of 2, omnistep at every ``--concurrency`` level. Then
(d).

Targets (issue 28, item 7)
--------------------------
(a) omnistep TTFA p50 at C=1 / transformers' time to its whole spoken answer (the same text)
<= 0.25; (b) omnistep audio-s/s at C=8 / transformers sequential over the 8 texts >= 4;
(c) omnistep TTFA p99 at C=8 / at C=4 <= 1.5; (d) the MoE layer's step at 16 rows / its
expert-GEMM floor <= 1.3. The floor: the same routing's expert GEMMs (each active expert's
gate/up GEMM on its rows, its down GEMM on rows of its width, the layer's own
``stacked_linear`` kernels) on inputs gathered beforehand: no router, no top-k, no grouping,
no SiLU, no weighted sum. Timed by process CPU time on a CPU (wall time on CUDA), median of
``--moe-reps`` calls, at the thinker's widths with the run's ``--experts`` (and the talker's,
printed as information).

How to run
----------
::

    PYTHONPATH=. .venv/bin/python bench/qwen3_omni.py            # 2+2 layers, 32 experts, C = 1,4,8
    PYTHONPATH=. .venv/bin/python bench/qwen3_omni.py --layers 4 --experts 64 --frames 50
    PYTHONPATH=. .venv/bin/python bench/qwen3_omni.py --device cuda --experts 128 --layers 8
    PYTHONPATH=. .venv/bin/python bench/qwen3_omni.py --quick    # tiny folder (~30 s)

``--quick``: the tiny test folder (``write_tiny_qwen3_omni``), 4 reply tokens, 4 frames, (d) at
the tiny widths (``tests/test_bench_qwen3_omni.py``); its numbers mean nothing. Output: the
table and targets on stdout (``--json``: the whole record too) and
``bench/results/qwen3_omni.json`` (``--out``; ``targets`` in ``bench/compare.py``'s form).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from omnistep.core import (
    ChatMessage,
    ExecutionProfile,
    Modality,
    ModelInstance,
    Request,
    SamplingParams,
)

sys.path.insert(0, str(Path(__file__).resolve().parent))
import moe as moe_bench  # noqa: E402
from common import SENTENCES, jsonable, load_avg, target_row  # noqa: E402
from families import (  # noqa: E402
    Family,
    ensure_checkpoint,
    report,
    run_family,
    work_check,
)

REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO / "bench" / "results" / "qwen3_omni.json"
SEED = 0
SAMPLES_PER_FRAME = 1920
"""code2wav's samples per frame (``CodecDecoderConfig.samples_per_frame``, published and tiny)."""
MOE_TARGET = 1.3
VOICE = "ethan"
PROMPT = "Please read this sentence aloud: {}"
"""The user turn of request ``i`` (``SENTENCES[i % 8]``)."""


def published_config(layers: int, talker_layers: int, experts: int) -> dict[str, Any]:
    """``Qwen3OmniMoeConfig`` keyword arguments at the published widths (module docstring),
    ``layers`` thinker and ``talker_layers`` talker layers, ``experts`` routed experts in
    each; the token ids of the tiny tokenizer (``tiny.tokenizer_files``)."""
    from transformers import Qwen3OmniMoeConfig

    from omnistep.models.qwen3_omni.tiny import Qwen3OmniSizes, config_dict, tokenizer_files

    defaults = Qwen3OmniMoeConfig()
    text = defaults.thinker_config.text_config
    talker = defaults.talker_config.text_config
    predictor = defaults.talker_config.code_predictor_config
    wav = defaults.code2wav_config
    sizes = Qwen3OmniSizes(
        hidden=text.hidden_size,
        layers=layers,
        heads=32,  # published; the default 28 is Qwen2.5-7B's
        head_dim=128,
        experts=experts,
        top_k=text.num_experts_per_tok,
        moe_intermediate=text.moe_intermediate_size,
        talker_hidden=talker.hidden_size,
        talker_layers=talker_layers,
        shared_expert_intermediate=768,  # published; no default
        codebook_size=predictor.vocab_size,
        num_code_groups=16,  # published; the default is 32
        code2wav_hidden=wav.hidden_size,
        code2wav_layers=wav.num_hidden_layers,
        sliding_window=wav.sliding_window,
        decoder_dim=wav.decoder_dim,
    )
    cfg = config_dict(sizes, tokenizer_files()[1])
    cfg["thinker_config"]["text_config"].update(
        num_key_value_heads=text.num_key_value_heads, intermediate_size=text.moe_intermediate_size
    )
    cfg["talker_config"]["text_config"].update(
        num_attention_heads=talker.num_attention_heads,
        num_key_value_heads=talker.num_key_value_heads,
        head_dim=128,
        moe_intermediate_size=talker.moe_intermediate_size,
        num_experts_per_tok=talker.num_experts_per_tok,
        intermediate_size=talker.intermediate_size,
    )
    cfg["talker_config"]["code_predictor_config"].update(
        hidden_size=predictor.hidden_size,
        intermediate_size=predictor.intermediate_size,
        num_hidden_layers=predictor.num_hidden_layers,
        num_attention_heads=predictor.num_attention_heads,
        num_key_value_heads=predictor.num_key_value_heads,
        head_dim=predictor.head_dim,
    )
    cfg["code2wav_config"].update(
        num_attention_heads=wav.num_attention_heads,
        num_key_value_heads=wav.num_key_value_heads,
        intermediate_size=wav.intermediate_size,
        upsample_rates=list(wav.upsample_rates),
        upsampling_ratios=list(wav.upsampling_ratios),
    )
    return cfg


class Qwen3OmniFamily(Family):
    """Qwen3-Omni (``omnistep.models.qwen3_omni``) against transformers 5.x ``generate``.
    Set ``text_tokens``, ``frames`` and ``device`` before ``load`` / ``reference``."""

    name = "qwen3_omni"
    card_id = "qwen3-omni"
    components = ("thinker", "talker", "code2wav")
    ar_component = "talker"
    warm_reference_frames = None  # the reference warms up at the whole length
    default_frames = 24
    quick_frames = 4
    text_tokens = 16
    frames = 24
    device = "cpu"

    def sizes(self, quick: bool, layers: int, talker_layers: int = 2, experts: int = 32) -> dict:
        """``{}`` for the tiny test folder (``quick``), else ``published_config``'s."""
        return {} if quick else published_config(layers, talker_layers, experts)

    def write(self, root: Path, sizes: dict[str, Any]) -> None:
        """The tiny folder, or ``sizes``' model from transformers' classes, redrawn from
        ``SEED`` as ``tiny.py`` redraws, saved in 2 GB shards with the tiny tokenizer."""
        from omnistep.models.qwen3_omni.tiny import (
            _redraw,
            tokenizer_files,
            write_tiny_qwen3_omni,
        )

        if not sizes:
            write_tiny_qwen3_omni(root, SEED)
            return
        from transformers import Qwen3OmniMoeConfig, Qwen3OmniMoeForConditionalGeneration

        root.mkdir(parents=True, exist_ok=True)
        config = Qwen3OmniMoeConfig(**sizes, enable_audio_output=True)
        with torch.device("cpu"):
            model = Qwen3OmniMoeForConditionalGeneration(config)
        _redraw(model, SEED)
        model.save_pretrained(root, max_shard_size="2GB")
        del model
        for name, text in tokenizer_files()[0].items():
            (root / name).write_text(text, encoding="utf-8")

    def parameter_counts(self, root: Path) -> dict[str, int]:
        """Parameters per part, from the files' tensor shapes."""
        from safetensors import safe_open

        parts = (
            ("thinker_text", "thinker.model."),
            ("thinker_lm_head", "thinker.lm_head."),
            ("encoders_not_run", "thinker."),
            ("code_predictor", "talker.code_predictor."),
            ("talker", "talker."),
            ("code2wav", "code2wav."),
        )
        counts = {p: 0 for p, _ in parts}
        for path in sorted(root.glob("*.safetensors")):
            with safe_open(str(path), "pt") as sf:
                for name in sf.keys():  # noqa: SIM118 - safe_open has no __iter__
                    n = int(np.prod(sf.get_slice(name).get_shape()))
                    counts[next(p for p, prefix in parts if name.startswith(prefix))] += n
        return counts

    def load(self, root: Path) -> ModelInstance:
        from omnistep.models.qwen3_omni.card import Qwen3OmniOptions, build_card

        opts = Qwen3OmniOptions(
            kv_cache_gb=0.25, talker_max_new_tokens=self.frames + 1, talker_greedy=True
        )
        return ModelInstance.load(build_card(str(root), opts), self.device)

    def request(self, i: int, seed: int, frames: int, rollout: bool = False) -> Request:
        """Request ``i``; ``frames`` is not per request here: the talker's cap is the card's
        (``self.frames``), so warm-ups run at the whole length."""
        return Request(
            self.card_id,
            messages=(ChatMessage("user", PROMPT.format(SENTENCES[i % len(SENTENCES)])),),
            seed=seed,
            sampling=SamplingParams(temperature=0, max_new_tokens=self.text_tokens),
            profile=ExecutionProfile.ROLLOUT if rollout else ExecutionProfile.SERVE,
            output_modalities=frozenset({Modality.TEXT, Modality.AUDIO}),
            voice=VOICE,
        )

    def reference(self, root: Path, threads: int) -> Qwen3OmniReference:
        return Qwen3OmniReference(self, root, threads)

    def codes_of(self, stream: Any) -> dict[str, Any]:
        """The reply's text ids and the talker's 16-codebook frames of a ROLLOUT request."""
        return {
            "text": [int(r.tokens[0]) for r in stream.trajectories["think"]],
            "codes": np.array([r.tokens for r in stream.trajectories["talk"]], dtype=np.int64),
        }

    def work_check(self, ours: dict[str, Any], theirs: dict[str, Any]) -> dict[str, Any]:
        """Text ids equal, and ``families.work_check`` of the frames (steps = frames)."""
        return {
            "text_tokens": [len(ours["text"]), len(theirs["text"])],
            "text_equal": ours["text"] == theirs["text"],
            **work_check(ours["codes"], theirs["codes"]),
        }

    def frames_of(self, stream: Any, samples: int) -> int:
        """Talker frames heard: a stream of T frames is ``T * 1920 - 555`` samples."""
        return math.ceil(samples / SAMPLES_PER_FRAME)


class Qwen3OmniReference:
    """transformers' ``Qwen3OmniMoeForConditionalGeneration`` in this process (float32, the
    family's device), loaded once; the prompt ids from the folder's tokenizer and chat
    template, as omnistep's front end renders them."""

    def __init__(self, family: Qwen3OmniFamily, root: Path, threads: int):
        import transformers
        from transformers import AutoTokenizer, Qwen3OmniMoeForConditionalGeneration

        from omnistep.models.qwen3_omni.tiny import tokenizer_files

        self.family, self.pid = family, os.getpid()
        self.device = torch.device(family.device)
        start = time.perf_counter()
        tok = AutoTokenizer.from_pretrained(root)
        model = Qwen3OmniMoeForConditionalGeneration.from_pretrained(root, dtype=torch.float32)
        self.model = model.eval().to(self.device)
        self.eos = tokenizer_files()[1].im_end
        self.prompts = []
        for text in SENTENCES:
            chat = [{"role": "user", "content": PROMPT.format(text)}]
            prompt = tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
            self.prompts.append(tok(prompt)["input_ids"])
        self.split: dict[str, float] = {}
        self.seen: dict[str, Any] = {}
        self._time("thinker", model.thinker, "generate")
        self._time("talker", model.talker, "generate")
        self._time("code2wav", model.code2wav, "chunked_decode", keep="codes")
        self.info = {
            "start_and_load_s": round(time.perf_counter() - start, 2),
            "runtime": "transformers Qwen3OmniMoeForConditionalGeneration.generate (greedy "
            "thinker and talker, speaker ethan; code2wav.chunked_decode)",
            "transformers": transformers.__version__,
            "torch": torch.__version__,
            "torch_threads": threads,
            "dtype": str(next(model.parameters()).dtype),
            "device": str(self.device),
            "prompt_tokens": [len(p) for p in self.prompts],
        }
        print(f"reference: loaded in {self.info['start_and_load_s']:.1f}s", flush=True)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _time(self, part: str, module: Any, method: str, keep: str | None = None) -> None:
        """Wrap ``module.method`` (an instance attribute) to add its seconds to ``split``
        and, with ``keep``, remember its first argument under that name."""
        inner = getattr(module, method)

        def timed(*args: Any, **kwargs: Any) -> Any:
            if keep is not None:
                self.seen[keep] = args[0].detach().cpu()
            start = time.perf_counter()
            try:
                out = inner(*args, **kwargs)
                self._sync()
                return out
            finally:
                self.split[part] = self.split.get(part, 0.0) + time.perf_counter() - start

        setattr(module, method, timed)

    def one(self, i: int, frames: int) -> dict[str, Any]:
        """One greedy ``generate`` of text ``i`` (``frames`` is the family's)."""
        ids = torch.tensor([self.prompts[i % len(SENTENCES)]], device=self.device)
        self.split = {k: 0.0 for k in self.family.components}
        self._sync()
        start = time.perf_counter()
        with torch.inference_mode():
            sequences, wave = self.model.generate(
                ids,
                speaker=VOICE,
                thinker_max_new_tokens=self.family.text_tokens,
                thinker_do_sample=False,
                thinker_eos_token_id=self.eos,
                talker_do_sample=False,
                talker_max_new_tokens=self.family.frames + 1,
            )
        self._sync()
        seconds = time.perf_counter() - start
        codes = self.seen["codes"][0].T.numpy().astype(np.int64)  # [frames, 16]
        return {
            "text": i % len(SENTENCES),
            "seconds": seconds,
            "frames": int(codes.shape[0]),
            "audio_s": wave.numel() / 24000,
            "split_s": dict(self.split),
            "codes": {"text": sequences[0, ids.shape[1] :].tolist(), "codes": codes},
        }

    def close(self) -> None:
        del self.model


def moe_step(
    args: argparse.Namespace, hidden: int, inner: int, experts: int, top_k: int, shared: int
) -> dict[str, Any]:
    """``bench/moe.py``'s step / floor at these widths (16 rows), on the run's device."""
    argv = ["--rows", "16", "--hidden", str(hidden), "--inner", str(inner)]
    argv += ["--experts", str(experts), "--top-k", str(top_k), "--shared", str(shared)]
    argv += ["--reps", str(args.moe_reps), "--threads", str(args.threads)]
    argv += ["--device", args.device]
    return moe_bench.run(moe_bench.parse_args(argv))


def moe_targets(args: argparse.Namespace, sizes: dict[str, Any]) -> dict[str, Any]:
    """(d) at the thinker's widths (the target) and the talker's (information)."""
    if sizes:
        text = sizes["thinker_config"]["text_config"]
        talker = sizes["talker_config"]["text_config"]
    else:  # the tiny folder's
        from omnistep.models.qwen3_omni.tiny import TINY_SIZES, config_dict, tokenizer_files

        cfg = config_dict(TINY_SIZES, tokenizer_files()[1])
        text, talker = cfg["thinker_config"]["text_config"], cfg["talker_config"]["text_config"]
    out = {}
    for part, c in (("thinker", text), ("talker", talker)):
        print(f"(d) MoE layer at the {part}'s widths, 16 rows:", flush=True)
        out[part] = moe_step(
            args,
            c["hidden_size"],
            c["moe_intermediate_size"],
            c["num_experts"],
            c["num_experts_per_tok"],
            c.get("shared_expert_intermediate_size") or 0,
        )
    return out


def main(argv: list[str] | None = None) -> int:
    from common import parse_levels

    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--concurrency", type=parse_levels, default=[1, 4, 8], help="e.g. 1,4,8")
    ap.add_argument("--layers", type=int, default=2, help="thinker layers (published 48)")
    ap.add_argument("--talker-layers", type=int, default=2, help="talker layers (published 20)")
    ap.add_argument("--experts", type=int, default=32, help="routed experts (published 128)")
    ap.add_argument("--text-tokens", type=int, help="reply tokens at most (default 16)")
    ap.add_argument("--frames", type=int, help="talker frames, 80 ms each (default 24)")
    ap.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    ap.add_argument("--rounds", type=int, default=1, help="rounds of the paired comparisons")
    ap.add_argument("--reference-texts", type=int, default=8,
                    help="texts the reference runs per round (1-8; (b) uses its rate)")  # fmt: skip
    ap.add_argument("--moe-reps", type=int, default=10, help="timed calls of (d) per mode")
    ap.add_argument("--device", default="cpu", help="cpu or cuda (both sides and (d))")
    ap.add_argument("--root", type=Path, default=Path("/tmp"), help="folder of the checkpoint")
    ap.add_argument("--quick", action="store_true", help="tiny folder, 4 tokens and frames")
    ap.add_argument("--json", action="store_true", help="print the whole record as JSON too")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = ap.parse_args(argv)
    counts = (args.layers, args.talker_layers, args.experts, args.threads, args.rounds)
    if min(*counts, args.moe_reps, args.text_tokens or 1, args.frames or 1) < 1:
        ap.error("--layers, --talker-layers, --experts, --text-tokens, --frames, --threads, "
                 "--rounds and --moe-reps must be >= 1")  # fmt: skip
    if not 1 <= args.reference_texts <= len(SENTENCES):
        ap.error("--reference-texts must be 1..8")
    if args.experts < 8 and not args.quick:
        ap.error("--experts must be >= 8 (top 8 per token)")
    if args.device != "cpu" and not torch.cuda.is_available():
        ap.error(f"--device {args.device}: torch sees no GPU")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    torch.set_num_threads(args.threads)
    t_start, load_start = time.perf_counter(), load_avg()
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, load {load_start}")

    family = Qwen3OmniFamily()
    family.device = args.device
    family.frames = args.frames = args.frames or (4 if args.quick else family.default_frames)
    family.text_tokens = args.text_tokens = args.text_tokens or (4 if args.quick else 16)
    sizes = family.sizes(args.quick, args.layers, args.talker_layers, args.experts)
    root = args.root / f"omnistep-bench-qwen3_omni{'-quick' if args.quick else ''}"
    ckpt = ensure_checkpoint(family, root, sizes)
    ckpt.update(root=str(root), parameters=family.parameter_counts(root))
    print(f"checkpoint {root}: written {ckpt['written']} ({ckpt['seconds']}s), "
          f"parameters {ckpt['parameters']}", flush=True)  # fmt: skip

    res = run_family(family, root, args)
    summary = report(family, args.concurrency, res)
    moe = moe_targets(args, sizes)
    thinker = moe["thinker"]
    d = target_row(
        f"{family.name} (d) MoE step at 16 rows / expert-GEMM floor (thinker widths)",
        thinker["ratio"],
        "<=",
        MOE_TARGET,
        [thinker["ratio"]],
    )
    summary["targets"].append(d)
    summary["figures"]["moe_step_floor_ratio"] = d["value"]
    summary["figures"]["moe_talker_step_floor_ratio"] = moe["talker"]["ratio"]
    print(f"  {d['name']:<66} {d['value']:7.3f} (target <= {MOE_TARGET}) "
          f"{'MET   ' if d['met'] else 'MISSED'}  ({thinker['ratio_basis']}; "
          f"talker widths {moe['talker']['ratio']:.3f})")  # fmt: skip

    elapsed, load_end = time.perf_counter() - t_start, load_avg()
    print(f"load average: start {load_start}, end {load_end}; bench took {elapsed:.0f}s")
    result = {
        "machine": {
            "platform": platform.platform(),
            "python": sys.version.split()[0],
            "torch": torch.__version__,
            "cpus": os.cpu_count(),
            "torch_threads": args.threads,
            "device": torch.cuda.get_device_name() if args.device != "cpu" else "cpu",
        },
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "settings": {
            "texts": [PROMPT.format(t) for t in SENTENCES],
            "sampling": "greedy (thinker and talker)",
            "voice": VOICE,
        },
        "checkpoint": {**ckpt, "sizes": sizes or "tiny"},
        **summary,
        "moe": moe,
        "raw": res,
        "seconds": round(elapsed, 1),
        "loadavg": {"start": load_start, "end": load_end},
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    text = json.dumps(jsonable(result), indent=1)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    if args.json:
        print(text)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
