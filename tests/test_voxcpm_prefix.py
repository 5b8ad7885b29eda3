"""Cross-request prefix sharing of a cloned VoxCPM2 voice's rows (``VoxCPMAR._prompt_prefix``
on ``PagedARModel``'s kept prefixes), end to end on the tiny folder ``omnistep weights voxcpm``
writes, under ``--batch-invariant``: the first request of a voice computes the voice's rows
(``ref_audio_start``, the clip's patches, ``ref_audio_end``) once, a second request of the voice
prefills only its own rows and its audio equals the first-time result bit for bit; the kept
prefix is found by the rows' bytes (the clip's latent patches), so a different clip of the same
length computes its own."""

from __future__ import annotations

import numpy as np
import pytest

from omnistep.core import ModelInstance, Request
from omnistep.models.voxcpm.card import VoxCPMOptions, build_card
from omnistep.models.voxcpm.tiny import write_folder
from omnistep.parity import collect


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_folder(tmp_path_factory.mktemp("voxcpm_prefix"))


async def test_second_request_of_a_voice_prefills_only_its_own_rows(folder):
    from omnistep.engine import AsyncEngine

    opts = VoxCPMOptions(kv_cache_gb=0.01, max_len=5, batch_invariant=True)
    model = ModelInstance.load(build_card(str(folder), opts))
    lm = model.components["lm"]
    frontend = model.card.program.nodes[0].fn
    engine = AsyncEngine([model])
    clip = np.sin(np.arange(16000) * 0.05).astype(np.float32)  # 1 s: 25 frames, 7 patches
    try:
        spec = await engine.clone_voice("voxcpm2", clip, 16000, "x")
        other = await engine.clone_voice("voxcpm2", clip * 0.5, 16000, "x")  # same length
        prompt = frontend.prompt("the cat", spec)
        voice_rows, total = prompt.voice_rows, prompt.rows.text_ids.shape[0]
        assert voice_rows == 9 and total == voice_rows + len(frontend.tokenizer("the cat")) + 1

        async def run(text: str, voice: str, seed: int = 1):
            before = (lm.num_prefill_rows, lm.num_kept_prefixes)
            got = await collect(engine, Request("voxcpm2", text=text, seed=seed, voice=voice))
            assert len(got.audio) > 0
            return got.audio, lm.num_prefill_rows - before[0], lm.num_kept_prefixes - before[1]

        first, rows, kept = await run("the cat", spec)
        assert (rows, kept) == (total, 1)  # the voice's rows alone, then the rest
        again, rows, kept = await run("the cat", spec)
        assert (rows, kept) == (total - voice_rows, 0)  # only its own rows
        assert np.array_equal(again, first)  # bit for bit, first time or not
        new_text, rows, kept = await run("a hat in the", spec, seed=2)
        assert (rows, kept) == (len(frontend.tokenizer("a hat in the")) + 1, 0)
        # a clip of the same length (ids equal row for row) is another voice: its own prefix
        _, rows, kept = await run("the cat", other)
        assert (rows, kept) == (total, 1)
        # zero-shot prompts keep nothing
        _, rows, kept = await run("the cat", "default")
        assert (rows, kept) == (total - voice_rows, 0)
    finally:
        await engine.shutdown()

    # a fresh engine (nothing kept) gives the same audio for the request that shared
    model = ModelInstance.load(build_card(str(folder), opts))
    engine = AsyncEngine([model])
    try:
        spec2 = await engine.clone_voice("voxcpm2", clip, 16000, "x")
        assert spec2 == spec
        alone = await collect(engine, Request("voxcpm2", text="a hat in the", seed=2, voice=spec))
        assert np.array_equal(alone.audio, new_text)
    finally:
        await engine.shutdown()
