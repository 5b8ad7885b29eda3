"""Train = serve figures: max and mean |score() - recorded log-prob| over a rollout group.

For ChatTTS (n=8, 64 frames of 4 codes) and the Qwen2.5-Omni thinker and talker (n=8, sampled),
in batch-invariant and default mode, both log-prob modes, with ``match_serving`` on (serving's
own attention calls) and off (one causal attention call), plus the time of one ``score`` call
over the group with autograd on. Checkpoints are the tests' tiny ones (random weights; ChatTTS
at its official width 768), or the full-size ChatTTS with ``--full-size`` (~1.2 GB written to
``--workdir``). Prints a table and writes ``bench/results/score_parity.json``.

    PYTHONPATH=. .venv/bin/python bench/score_parity.py [--full-size] [--families chattts,qwen]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from omnistep.core import SamplingParams
from omnistep.offline import OmniEngine


def _deltas(scores, group, loop) -> np.ndarray:
    return np.concatenate(
        [
            np.abs(scored[loop].detach().cpu().numpy() - sample.loops[loop].logprobs).ravel()
            for scored, sample in zip(scores, group.samples, strict=True)
        ]
    )


def _measure(spec: str, rollout_kwargs: dict, loops: list[str], label: str, **engine_kwargs):
    rows = []
    for batch_invariant in (True, False):
        with OmniEngine(spec, batch_invariant=batch_invariant, **engine_kwargs) as engine:
            for mode in ("processed", "policy"):
                [group] = engine.rollout(logprobs=mode, progress=False, **rollout_kwargs)
                for match_serving in (True, False):
                    start = time.perf_counter()
                    scores = engine.score(group, match_serving=match_serving)
                    seconds = time.perf_counter() - start
                    for loop in loops:
                        d = _deltas(scores, group, loop)
                        rows.append(
                            {
                                "model": label,
                                "loop": loop,
                                "batch_invariant": batch_invariant,
                                "mode": mode,
                                "match_serving": match_serving,
                                "max": float(d.max()),
                                "mean": float(d.mean()),
                                "values": int(d.size),
                                "score_s": round(seconds, 3),
                            }
                        )
                        print(
                            f"{label:8s} {loop:6s} bi={batch_invariant!s:5s} {mode:9s} "
                            f"match={match_serving!s:5s} max {d.max():.3g} mean {d.mean():.3g} "
                            f"({d.size} values, score {seconds:.2f} s)",
                            flush=True,
                        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--families", default="chattts,qwen")
    parser.add_argument("--full-size", action="store_true", help="full-size ChatTTS GPT")
    parser.add_argument("--workdir", default="/tmp/omnistep-score-parity")
    args = parser.parse_args()
    work = Path(args.workdir)
    rows = []
    if "chattts" in args.families:
        from omnistep.models.chattts.tiny import (
            write_full_size_chattts,
            write_servable_tiny_chattts,
        )

        root = work / ("chattts-full" if args.full_size else "chattts")
        if not root.exists():
            (write_full_size_chattts if args.full_size else write_servable_tiny_chattts)(root)
        rollout = {
            "inputs": ["score me, every frame of me"],
            "n": 8,
            "seed": 11,
            "voice": "alloy",
            "sampling": SamplingParams(max_new_tokens=64, min_new_tokens=64),
        }
        label = "chattts-full" if args.full_size else "chattts"
        rows += _measure(f"chattts={root}", rollout, ["decode"], label, kv_cache_gb=0.1)
    if "qwen" in args.families:
        from omnistep.models.qwen2_5_omni.tiny import write_tiny_qwen_omni

        root = work / "qwen"
        if not root.exists():
            write_tiny_qwen_omni(root)
        rollout = {
            "inputs": ["tell me about the sea"],
            "n": 8,
            "seed": 5,
            "voice": "Chelsie",
            "audio": True,
            "sampling": SamplingParams(
                max_new_tokens=48, temperature=0.8, top_p=0.9, top_k=50, repetition_penalty=1.1
            ),
        }
        rows += _measure(
            f"qwen2_5_omni={root}",
            rollout,
            ["think", "talk"],
            "qwen",
            kv_cache_gb=0.05,
            talker_max_new_tokens=64,
        )
    out = Path(__file__).parent / "results" / "score_parity.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(rows, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
