"""The trainer's own weights (``OmniEngine.trainer``): an optimizer step never changes what
serves, running rollouts included; serving changes only through ``update_weights`` (a new
version); a frozen reference copy scores the starting policy for a KL term."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from omnistep.core import InvalidRequestError, SamplingParams
from omnistep.models.chattts.tiny import write_servable_tiny_chattts
from omnistep.offline import OmniEngine, RolloutGroup

SAMPLING = SamplingParams(temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=40, min_new_tokens=40)


@pytest.fixture(scope="module")
def chattts(tmp_path_factory):
    root = write_servable_tiny_chattts(tmp_path_factory.mktemp("trainer") / "chattts")
    with OmniEngine(f"chattts={root}", kv_cache_gb=0.05, batch_invariant=True) as engine:
        yield engine


def _roll(engine: OmniEngine, seed: int = 11) -> RolloutGroup:
    [group] = engine.rollout(
        ["Train me gently."], n=2, seed=seed, voice="alloy", sampling=SAMPLING,
        logprobs="policy", audio=True, progress=False,
    )  # fmt: skip
    return group


def _same(a: RolloutGroup, b: RolloutGroup) -> bool:
    return all(
        np.array_equal(x.loops["decode"].tokens, y.loops["decode"].tokens)
        and np.array_equal(x.loops["decode"].logprobs, y.loops["decode"].logprobs)
        and np.array_equal(x.audio, y.audio)
        for x, y in zip(a.samples, b.samples, strict=True)
    )


def _step(weights: dict[str, torch.Tensor], scale: float) -> None:
    """A large in-place optimizer-like step on every trained tensor."""
    with torch.no_grad():
        for tensor in weights.values():
            tensor.add_(torch.randn_like(tensor) * scale)


def test_optimizer_steps_change_no_rollout_until_update_weights(chattts):
    before = _roll(chattts)
    trainer = chattts.trainer(reference=True)
    weights = trainer.weights()
    assert trainer.version == 0
    # steps taken while a rollout runs: it must equal the undisturbed one, frame for frame
    during: list[RolloutGroup] = []
    thread = threading.Thread(target=lambda: during.append(_roll(chattts)))
    thread.start()
    while thread.is_alive():
        _step(weights, 0.5)
    thread.join()
    _step(weights, 0.5)
    after = _roll(chattts)
    assert _same(before, during[0]) and _same(before, after)
    for group in (during[0], after):
        assert all((s.loops["decode"].weight_versions == 0).all() for s in group.samples)
    # the trainer's copy scores differently now; serving and the reference copy do not
    served = chattts.score(before)
    reference = chattts.score(before, trainer=trainer, reference=True)
    trained = chattts.score(before, trainer=trainer)
    for s, r, t, sample in zip(served, reference, trained, before.samples, strict=True):
        recorded = torch.from_numpy(sample.loops["decode"].logprobs)
        assert torch.equal(s["decode"], recorded) and torch.equal(r["decode"], recorded)
        assert (t["decode"].detach() - recorded).abs().max() > 1e-2
    # update_weights(trainer) is what changes serving: a new version, other frames
    assert chattts.update_weights(trainer) == 1 and trainer.version == 1
    updated = _roll(chattts)
    assert not _same(before, updated)
    assert all((s.loops["decode"].weight_versions == 1).all() for s in updated.samples)
    # the trainer's copy now matches serving: its scores equal the recorded ones again
    rescored = chattts.score(updated, trainer=trainer)
    for scored, sample in zip(rescored, updated.samples, strict=True):
        recorded = torch.from_numpy(sample.loops["decode"].logprobs)
        assert torch.equal(scored["decode"].detach(), recorded)
    # the reference stays at the weights the trainer was made from
    again = chattts.score(before, trainer=trainer, reference=True)
    for r, sample in zip(again, before.samples, strict=True):
        assert torch.equal(r["decode"], torch.from_numpy(sample.loops["decode"].logprobs))


def test_a_trainer_says_what_it_cannot_do(chattts):
    trainer = chattts.trainer()
    group = _roll(chattts, seed=3)
    with pytest.raises(InvalidRequestError, match="reference"):
        chattts.score(group, trainer=trainer, reference=True)  # made without one
    with pytest.raises(InvalidRequestError, match="weights"):
        chattts.update_weights(trainer)  # nothing handed out yet
    with pytest.raises(KeyError, match="no.such"):
        trainer.weights(["no.such.weight"])
    gpt = trainer.policy.components["gpt"]
    with pytest.raises(RuntimeError, match="does not serve"):
        gpt.execute(None, [])
