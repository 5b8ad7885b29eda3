"""Train = serve figures: max and mean |score() - recorded log-prob| over a rollout group.

For ChatTTS (n=8, 64 frames of 4 codes), the Qwen2.5-Omni thinker and talker (n=8, sampled)
and the Qwen3-Omni MoE thinker and talker (n=8, sampled; tiny, a wider reduced config and, with
``--qwen3-configs published``, the published widths at reduced depth, as
``bench/qwen3_omni.py`` writes them; with and without Rollout Routing Replay), in
batch-invariant and default mode, both log-prob modes, with ``match_serving`` on (serving's own
attention calls) and off (one causal attention call), plus the time of one ``score`` call over
the group with autograd on. ``--dtype bfloat16`` loads the cards in bfloat16 (rollout and
score alike: verl-omni's bf16 trainer vs bf16 rollout setting). Only sampled values count
(``LoopActions.sampled``); a token the rollout sampled but the scored processed distribution
gives no mass (outside its top-k / top-p support after rounding moved the logits) is counted
in ``outside_support`` and left out of max and mean. Checkpoints are the tests' tiny ones
(random weights; ChatTTS at its official width 768), or the full-size ChatTTS with
``--full-size`` (~1.2 GB written to ``--workdir``). Prints a table and writes ``--out``
(default ``bench/results/score_parity.json``).

    PYTHONPATH=. .venv/bin/python bench/score_parity.py [--full-size] [--families qwen3_omni]
    PYTHONPATH=. .venv/bin/python bench/score_parity.py --families qwen3_omni --dtype bfloat16 \
        --qwen3-configs tiny,wide,published --batch-invariant off
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from pathlib import Path

import numpy as np
import torch

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


def _deltas(scores, group, loop) -> tuple[np.ndarray, int]:
    """|score - recorded| of every sampled value of ``loop`` over the group (finite ones), and
    how many sampled values the score puts outside the distribution's support (-inf)."""
    finite, outside = [], 0
    for scored, sample in zip(scores, group.samples, strict=True):
        actions = sample.loops[loop]
        got = scored[loop].detach().float().cpu().numpy()[actions.sampled()]
        d = np.abs(got - actions.logprobs[actions.sampled()])
        outside += int((~np.isfinite(d)).sum())
        finite.append(d[np.isfinite(d)])
    return np.concatenate(finite), outside


MOE_COMPONENTS = {"think": "thinker", "talk": "talker"}
"""The component of each Qwen3-Omni loop (whose MoE routing ``_routing_flips`` compares)."""


def _routing_flips(engine, group, loop: str) -> tuple[int, int]:
    """``(changed, total)`` (token, MoE layer) pairs of ``loop`` over the group whose expert
    set in ``score``'s own forward (no replay, one sample per call) differs from the one the
    rollout recorded."""
    model = next(iter(engine.engine.models.values()))
    stack = model.components[MOE_COMPONENTS[loop]].llama
    layers = [layer.mlp for layer in stack.layers if layer.sparse]
    seen: list[torch.Tensor] = []
    hooks = [
        m.register_forward_hook(lambda _m, _i, out: seen.append(out.expert_ids.cpu()))
        for m in layers
    ]
    changed = total = 0
    try:
        for sample in group.samples:
            seen.clear()
            engine.score(sample, loops=loop, batch_size=1)
            chosen = np.sort(torch.stack(seen, dim=1).numpy(), axis=-1)
            recorded = np.sort(sample.loops[loop].replay_routing(), axis=-1)
            changed += int((chosen != recorded).any(-1).sum())
            total += recorded.shape[0] * recorded.shape[1]
    finally:
        for h in hooks:
            h.remove()
    return changed, total


def _measure(
    spec: str,
    rollout_kwargs: dict,
    loops: list[str],
    label: str,
    replays: tuple[bool, ...] = (False,),
    invariants: tuple[bool, ...] = (True, False),
    matches: tuple[bool, ...] = (True, False),
    **engine_kwargs,
):
    rows = []
    dtype = str(engine_kwargs.get("dtype", torch.float32)).removeprefix("torch.")
    for batch_invariant in invariants:
        with OmniEngine(spec, batch_invariant=batch_invariant, **engine_kwargs) as engine:
            for mode in ("processed", "policy"):
                [group] = engine.rollout(logprobs=mode, progress=False, **rollout_kwargs)
                flips = {}
                if True in replays:  # a MoE card: how often score's router picks otherwise
                    flips = {loop: _routing_flips(engine, group, loop) for loop in loops}
                for match_serving, replay in itertools.product(matches, replays):
                    start = time.perf_counter()
                    scores = engine.score(group, match_serving=match_serving, routing_replay=replay)
                    seconds = time.perf_counter() - start
                    for loop in loops:
                        d, outside = _deltas(scores, group, loop)
                        rows.append(
                            {
                                "model": label,
                                "dtype": dtype,
                                "loop": loop,
                                "batch_invariant": batch_invariant,
                                "mode": mode,
                                "match_serving": match_serving,
                                "routing_replay": replay,
                                "max": float(d.max()),
                                "mean": float(d.mean()),
                                "values": int(d.size),
                                "outside_support": outside,
                                "routing_changed": flips.get(loop),
                                "score_s": round(seconds, 3),
                            }
                        )
                        print(
                            f"{label:8s} {dtype} {loop:6s} bi={batch_invariant!s:5s} {mode:9s} "
                            f"match={match_serving!s:5s} replay={replay!s:5s} "
                            f"max {d.max():.3g} mean {d.mean():.3g} "
                            f"({d.size} values, {outside} outside support, "
                            f"routing changed {flips.get(loop, '-')}, "
                            f"score {seconds:.2f} s)",
                            flush=True,
                        )
    return rows


def _published_qwen3_omni(work: Path, layers: int, talker_layers: int, experts: int) -> Path:
    """The published widths at reduced depth (``bench/qwen3_omni.py``'s ``published_config``:
    thinker hidden 2048, 32 heads, top-8 of ``experts``, MoE width 768; talker 1024, shared
    expert 768; the whole code predictor and code2wav), written once under ``work``."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import qwen3_omni as bench_q3
    from families import ensure_checkpoint

    root = work / f"q3omni-published-{layers}-{talker_layers}-{experts}"
    sizes = bench_q3.published_config(layers, talker_layers, experts)
    ensure_checkpoint(bench_q3.Qwen3OmniFamily(), root, sizes)
    return root


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--families", default="chattts,qwen")
    parser.add_argument("--full-size", action="store_true", help="full-size ChatTTS GPT")
    parser.add_argument("--workdir", default="/tmp/omnistep-score-parity")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--batch-invariant", choices=("both", "on", "off"), default="both")
    parser.add_argument("--match-serving", choices=("both", "on"), default="both")
    parser.add_argument(
        "--qwen3-configs", default="tiny,wide", help="of tiny, wide, published (reduced depth)"
    )
    parser.add_argument("--published-layers", type=int, default=2, help="thinker (of 48)")
    parser.add_argument("--published-talker-layers", type=int, default=2, help="talker (of 20)")
    parser.add_argument("--published-experts", type=int, default=32, help="routed (of 128)")
    parser.add_argument(
        "--out", type=Path, default=Path(__file__).parent / "results" / "score_parity.json"
    )
    args = parser.parse_args()
    work = Path(args.workdir)
    families = set(args.families.split(","))
    common = {
        "dtype": getattr(torch, args.dtype),
        "invariants": {"both": (True, False), "on": (True,), "off": (False,)}[args.batch_invariant],
        "matches": (True, False) if args.match_serving == "both" else (True,),
    }
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
        rows += _measure(f"chattts={root}", rollout, ["decode"], label, kv_cache_gb=0.1, **common)
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
            **common,
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
        configs = args.qwen3_configs.split(",")
        for label in configs:
            if label == "published":
                root = _published_qwen3_omni(
                    work,
                    args.published_layers,
                    args.published_talker_layers,
                    args.published_experts,
                )
                label = f"q3omni-published-{args.published_layers}L-{args.published_experts}e"
            else:
                sizes = {"tiny": Qwen3OmniSizes(), "wide": _wide_qwen3_omni()}[label]
                label = "q3omni" if label == "tiny" else "q3omni-wide"
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
                **common,
            )
    out = args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rows, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
