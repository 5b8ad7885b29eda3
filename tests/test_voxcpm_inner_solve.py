"""VoxCPM2's LocDiT solve as WorkUnits of its own (``VoxCPMOptions(inner_solve="units")``)
against the default in-step solve, on a folder ``omnistep weights voxcpm`` writes: the same
audio bit for bit (``batch_invariant``, three requests interleaved and alone; C1 seed), every
Euler step a DENOISE_STEP unit the scheduler ran, the component's steps at different points of
different solves in one batch equal to ``LocDiT.solve`` row by row, and the option's errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from omnistep.core import InvalidRequestError, ModelInstance, Request, SamplingParams
from omnistep.core import WorkUnitKind as K
from omnistep.loops.denoise import DenoiseInput
from omnistep.models.voxcpm.card import VoxCPMOptions, build_card
from omnistep.models.voxcpm.locdit import sde_steps
from omnistep.models.voxcpm.solve import LocDiTSolver, SolveStart
from omnistep.models.voxcpm.tiny import write_folder
from omnistep.parity import collect, run_interleaved

TEXTS = (("the cat", 1), ("a hat", 2), ("in the", 3))


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_folder(tmp_path_factory.mktemp("voxcpm_units"))


async def _run(folder, form: str) -> tuple[list[np.ndarray], list[np.ndarray], dict]:
    """Three requests interleaved, then each alone, then the first again (C1)."""
    from omnistep.engine import AsyncEngine

    options = VoxCPMOptions(kv_cache_gb=0.01, max_len=5, batch_invariant=True, inner_solve=form)
    engine = AsyncEngine([ModelInstance.load(build_card(str(folder), options))])
    try:
        reqs = [Request("voxcpm2", text=t, seed=s) for t, s in TEXTS]
        busy = [r.audio for r in await run_interleaved(engine, reqs)]
        units = dict(engine.units_by_kind)
        alone = [
            (await collect(engine, Request("voxcpm2", text=t, seed=s))).audio for t, s in TEXTS
        ]
        alone.append((await collect(engine, Request("voxcpm2", text="the cat", seed=1))).audio)
        return busy, alone, units
    finally:
        await engine.shutdown()


async def test_units_form_is_bit_equal_to_the_in_step_form(folder):
    in_step, in_step_alone, in_step_units = await _run(folder, "in_step")
    units, units_alone, unit_counts = await _run(folder, "units")
    for a, b in zip(in_step + in_step_alone, units + units_alone, strict=True):
        assert len(a) > 0 and np.array_equal(a, b)
    assert np.array_equal(units_alone[0], units[0])  # C3: alone == interleaved
    assert np.array_equal(units_alone[3], units_alone[0])  # C1: the same seed twice
    # every AR step's patch (prefills included) was solved by 9 units (10 steps, the first
    # zeroed by CFG-Zero*), none by the in-step form
    patches = in_step_units["prefill"] + in_step_units["ar_token"]
    assert "denoise_step" not in in_step_units
    assert unit_counts["denoise_step"] == 9 * patches


def test_solver_batches_steps_of_different_solves(folder):
    """Two solves, the second started after the first's third step, stepped in one batch:
    each row's patch equals ``LocDiT.solve`` of its own (bit for bit in 16-row chunks)."""
    card = build_card(str(folder), VoxCPMOptions(kv_cache_gb=0.01, inner_solve="units"))
    model = ModelInstance.load(card)
    solver: LocDiTSolver = model.components["dit"]
    solver.batch_invariant = True
    backbone, h = solver.backbone, solver.width
    c, p = solver.feat, solver.patch
    gen = torch.Generator().manual_seed(0)
    rows = [torch.randn(2 * h + 2 * c * p, generator=gen) for _ in range(2)]
    rows = [torch.cat([r, torch.tensor([2.0])]) for r in rows]
    starts = [SolveStart(r, 10) for r in rows]
    first = solver.execute(K.DENOISE_STEP, [DenoiseInput(start=starts[0])])[0]
    for _ in range(2):
        first = solver.execute(K.DENOISE_STEP, [DenoiseInput(state=first.state)])[0]
    pending = [DenoiseInput(state=first.state), DenoiseInput(start=starts[1])]
    done: dict[int, torch.Tensor] = {}
    while len(done) < 2:
        outs = solver.execute(K.DENOISE_STEP, pending)
        assert len({o.state.step for o in outs}) == len(outs)  # different steps, one batch
        pending = []
        for i, out in zip([k for k in (0, 1) if k not in done], outs, strict=True):
            if out.done:
                done[i] = out.result
            else:
                pending.append(DenoiseInput(state=out.state))
    with torch.no_grad():
        for i, row in enumerate(rows):
            r = row[None]
            mu = backbone.dit_condition(r[:, :h], r[:, h : 2 * h])
            cond = r[:, 2 * h : 2 * h + p * c].reshape(1, p, c).transpose(1, 2)
            noise = r[:, 2 * h + p * c : -1].reshape(1, c, p)
            want = backbone.estimator.solve(mu, cond, noise, 10, r[:, -1])[0].T
            assert done[i].shape == (p, c)
            assert torch.allclose(done[i], want, atol=1e-5), i
    assert sde_steps(10) == 9


async def test_option_errors(folder):
    from omnistep.engine import AsyncEngine

    with pytest.raises(ValueError, match="inner_solve"):
        VoxCPMOptions(inner_solve="dit")
    card = build_card(str(folder), VoxCPMOptions(kv_cache_gb=0.01, inner_solve="units"))
    assert [s.name for s in card.components] == ["lm", "vae", "encoder", "dit"]
    engine = AsyncEngine([ModelInstance.load(card)])
    try:
        sde = SamplingParams(flow_noise_level=0.5)
        with pytest.raises(InvalidRequestError) as err:
            await collect(engine, Request("voxcpm2", text="the cat", seed=1, sampling=sde))
        assert err.value.param == "flow_noise_level"
    finally:
        await engine.shutdown()
