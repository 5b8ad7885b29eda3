"""Error at chunk joins of ChatTTS's streamed vocoder against the whole-utterance decode.

Runs the full-size GPT (random weights, as written by ``bench/ar_decode.py``) over 160 random
code frames to get realistic hidden states, decodes them whole with Decoder + Vocos, then
chunked with several (first chunk, chunk, left context, look-ahead) schedules, and prints the
largest error in the 4 tokens on each side of every join against the largest elsewhere, the
near-join error energy relative to the signal, and the worst extra step at a join.

    .venv/bin/python bench/vocoder_joins.py [/tmp/omnistep-chattts-full]
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch

from omnistep.core import ModelInstance
from omnistep.loops.ar_decode import ARPrefillInput
from omnistep.models.chattts.card import ChatTTSOptions, build_card
from omnistep.models.chattts.gpt import ChatTTSPromptInput
from omnistep.models.chattts.vocoder import load_vocoder

SCHEDULES = [(4, 48, 52, 12), (12, 48, 52, 12), (8, 48, 52, 16), (8, 48, 52, 24), (8, 48, 52, 8)]
SAMPLES_PER_TOKEN = 512


def hidden_states(root: str, num_frames: int = 160) -> torch.Tensor:
    """``[num_frames, hidden]`` GPT hidden states for random code frames after a prompt."""
    model = ModelInstance.load(build_card(root, ChatTTSOptions(kv_cache_gb=0.2)))
    gpt = model.components["gpt"]
    tokenizer = model.card.program.nodes[0].fn.tokenizer
    ids = tokenizer.code_prompt("this is a test of the chunked vocoder joins", 1.0, False)
    rng = np.random.default_rng(0)
    frames = tuple(tuple(int(x) for x in rng.integers(0, 625, 4)) for _ in range(num_frames))
    n = len(ids.input_ids) + num_frames
    gpt.blocks.allocate("bench", n)
    gpt.lengths["bench"] = n
    unit = ARPrefillInput("bench", ChatTTSPromptInput(ids.input_ids), frames, (), None, None)
    with torch.inference_mode():
        hidden = gpt._forward(gpt._prompt_embeds(unit), torch.arange(n), ["bench"], [n])
    gpt.free_sequence("bench")
    return hidden[len(ids.input_ids) - 1 : -1].float()


def chunked(vocoder, hidden: torch.Tensor, schedule: tuple[int, int, int, int]):
    """Samples decoded with the card's chunk schedule, and the token indices of the joins."""
    first, chunk, left, lookahead = schedule
    total, done, out, joins = hidden.shape[0], 0, [], []
    while done < total:
        end = min(done + (first if done == 0 else chunk), total)
        start, window_end = max(0, done - left), min(end + lookahead, total)
        with torch.inference_mode():
            piece = vocoder.decode_chunk(hidden[None, start:window_end], done - start, end - done)
        out.append(piece[0].numpy())
        done = end
        joins.append(done)
    return np.concatenate(out), joins[:-1]


def main() -> None:
    root = sys.argv[1] if len(sys.argv) > 1 else "/tmp/omnistep-chattts-full"
    torch.set_num_threads(2)
    hidden = hidden_states(root)
    vocoder = load_vocoder(Path(root) / "asset")
    with torch.inference_mode():
        whole = vocoder.decode(hidden[None])[0].numpy()
    total, rms = hidden.shape[0], float(np.sqrt(np.mean(whole**2)))
    print(f"{total} tokens, signal rms {rms:.3f}, peak {np.abs(whole).max():.3f}")
    for schedule in SCHEDULES:
        audio, joins = chunked(vocoder, hidden, schedule)
        err = np.abs(audio - whole).reshape(total, SAMPLES_PER_TOKEN)
        near = np.zeros(total, bool)
        for j in joins:
            near[max(0, j - 4) : j + 4] = True
        db = 20 * np.log10(np.sqrt(np.mean(err[near] ** 2)) / rms)
        s = SAMPLES_PER_TOKEN
        jump = max(
            abs((audio[j * s] - audio[j * s - 1]) - (whole[j * s] - whole[j * s - 1]))
            for j in joins
        )
        print(
            f"first/chunk/left/lookahead {schedule}: max error near joins "
            f"{err[near].max():.1e}, elsewhere {err[~near].max():.1e}; near-join error "
            f"{db:.1f} dB of the signal; worst extra step at a join {jump:.1e}"
        )


if __name__ == "__main__":
    main()
