"""Train = serve figures: max and mean |score() - recorded log-prob| over a rollout group.

For ChatTTS (n=8, 64 frames of 4 codes), the Qwen2.5-Omni thinker and talker (n=8, sampled)
and the Qwen3-Omni MoE thinker and talker (n=8, sampled; tiny and a wider reduced config, with
and without Rollout Routing Replay), in batch-invariant and default mode, both log-prob modes,
with ``match_serving`` on (serving's own attention calls) and off (one causal attention
call), plus the time of one ``score`` call over the group with autograd on. Checkpoints are
the tests' tiny ones (random weights; ChatTTS at its official width 768), or the full-size
ChatTTS with ``--full-size`` (~1.2 GB written to ``--workdir``). Prints a table and writes
``bench/results/score_parity.json``.

    PYTHONPATH=. .venv/bin/python bench/score_parity.py [--full-size] [--families qwen3_omni]
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from pathlib import Path

import numpy as np

from omnistep.core import SamplingParams
from omnistep.offline import OmniEngine


def _wide_qwen3_omni():
    """A wider reduced Qwen3-Omni (published widths in ``Qwen3OmniSizes``' field docs): 8x
    the tiny thinker width, 32 experts, top-4."""
    from omnistep.models.qwen3_omni.tiny import Qwen3OmniSizes

    return Qwen3OmniSizes(
        hidden=256,
        layers=4,
        heads=8,
        head_dim=32,
        experts=32,
        top_k=4,
        moe_intermediate=128,
        talker_hidden=128,
        talker_layers=2,
        shared_expert_intermediate=128,
    )


def _deltas(scores, group, loop) -> np.ndarray:
    return np.concatenate(
        [
            np.abs(scored[loop].detach().cpu().numpy() - sample.loops[loop].logprobs).ravel()
            for scored, sample in zip(scores, group.samples, strict=True)
        ]
    )


def _measure(
    spec: str,
    rollout_kwargs: dict,
    loops: list[str],
    label: str,
    replays: tuple[bool, ...] = (False,),
    **engine_kwargs,
):
    rows = []
    for batch_invariant in (True, False):
        with OmniEngine(spec, batch_invariant=batch_invariant, **engine_kwargs) as engine:
            for mode in ("processed", "policy"):
                [group] = engine.rollout(logprobs=mode, progress=False, **rollout_kwargs)
                for match_serving, replay in itertools.product((True, False), replays):
                    start = time.perf_counter()
                    scores = engine.score(group, match_serving=match_serving, routing_replay=replay)
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
                                "routing_replay": replay,
                                "max": float(d.max()),
                                "mean": float(d.mean()),
                                "values": int(d.size),
                                "score_s": round(seconds, 3),
                            }
                        )
                        print(
                            f"{label:8s} {loop:6s} bi={batch_invariant!s:5s} {mode:9s} "
                            f"match={match_serving!s:5s} replay={replay!s:5s} "
                            f"max {d.max():.3g} mean {d.mean():.3g} "
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
    families = set(args.families.split(","))
    rows = []
    if "chattts" in families:
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
    if "qwen" in families:
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
    if "qwen3_omni" in families:
        from omnistep.models.qwen3_omni.tiny import Qwen3OmniSizes, write_tiny_qwen3_omni

        rollout = {
            "inputs": ["tell me about the sea"],
            "n": 8,
            "seed": 5,
            "audio": True,
            "sampling": SamplingParams(max_new_tokens=32, temperature=0.9),
        }
        for label, sizes in (("q3omni", Qwen3OmniSizes()), ("q3omni-wide", _wide_qwen3_omni())):
            root = work / label
            if not root.exists():
                write_tiny_qwen3_omni(root, sizes=sizes)
            rows += _measure(
                f"qwen3_omni={root}",
                rollout,
                ["think", "talk"],
                label,
                replays=(False, True),
                kv_cache_gb=0.05,
                talker_max_new_tokens=32,
            )
    out = Path(__file__).parent / "results" / "score_parity.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(rows, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
