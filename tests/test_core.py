"""Core contracts: validation of requests, sampling params, cards and programs (parity C0)."""

import math

import pytest

from omnistep.core import (
    CardValidationError,
    ComponentSpec,
    InvalidRequestError,
    KernelNode,
    LoopNode,
    Program,
    Request,
    SamplingParams,
)
from omnistep.models.registry import build_card, parse_model_spec
from omnistep.models.toy.card import build_card as build_toy


@pytest.mark.parametrize("speed", [0, -1, 0.1, 4.5, math.nan, math.inf])
def test_request_rejects_bad_speed(speed):
    with pytest.raises(InvalidRequestError) as info:
        Request("toy", text="hi", speed=speed)
    assert info.value.param == "speed"


@pytest.mark.parametrize("seed", [-1, 2**63, 1.5, "7"])
def test_request_rejects_bad_seed(seed):
    with pytest.raises(InvalidRequestError) as info:
        Request("toy", text="hi", seed=seed)
    assert info.value.param == "seed"


def test_request_ids_are_unique():
    assert Request("toy").request_id != Request("toy").request_id


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", -0.1),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", -1),
        ("repetition_penalty", 0.9),
        ("max_new_tokens", 0),
        ("min_new_tokens", -2),
        ("flow_noise_level", -1.0),
        ("flow_noise_level", 4.01),
        ("flow_noise_level", float("nan")),
        ("flow_noise_level", True),  # not a noise level of 1.0
        ("flow_noise_level", "0.7"),  # was a TypeError from math.isfinite
        ("temperature", "1"),
        ("max_new_tokens", 8.5),  # was accepted, then broke the card's int() uses
    ],
)
def test_sampling_params_name_the_bad_field(field, value):
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**{field: value})
    assert info.value.param == field


def test_sampling_params_refuse_a_minimum_above_the_maximum():
    # accepted in Python (POST /v1/rollouts refused it): the EOS mask then never lifted
    with pytest.raises(InvalidRequestError, match="must not exceed") as info:
        SamplingParams(min_new_tokens=9, max_new_tokens=8)
    assert info.value.param == "min_new_tokens"
    assert SamplingParams(min_new_tokens=8, max_new_tokens=8).min_new_tokens == 8
    assert SamplingParams(min_new_tokens=9).max_new_tokens is None


def test_toy_card_validates_and_lists_ids():
    card = build_toy()
    assert card.validate() is card
    assert card.model_ids == ("toy", "toy-tts")


def test_card_rejects_loop_on_unknown_component():
    card = build_toy()
    bad = card.__class__(**{**card.__dict__, "components": card.components[:1]})
    with pytest.raises(CardValidationError, match="unknown components"):
        bad.validate()


def test_card_rejects_duplicate_components_and_bad_batch():
    card = build_toy()
    dup = card.__class__(**{**card.__dict__, "components": card.components * 2})
    with pytest.raises(CardValidationError, match="duplicate component"):
        dup.validate()
    zero = (ComponentSpec("lm", object, max_batch_size=0), card.components[1])
    with pytest.raises(CardValidationError, match="max_batch_size"):
        card.__class__(**{**card.__dict__, "components": zero}).validate()


def test_program_rejects_unbound_slot_and_unknown_loop():
    noop = KernelNode("k", lambda ctx: None, needs=("request",), binds=("a",))
    with pytest.raises(CardValidationError, match="needs slots"):
        Program(nodes=(LoopNode("l", "tokens", needs=("b",)),), inputs=("request",)).validate(
            {"tokens"}
        )
    with pytest.raises(CardValidationError, match="unknown loop"):
        Program(nodes=(noop, LoopNode("l", "nope", needs=("a",))), inputs=("request",)).validate(
            {"tokens"}
        )
    with pytest.raises(CardValidationError, match="duplicate"):
        Program(nodes=(noop, noop), inputs=("request",)).validate(set())


def test_registry_parses_specs_and_rejects_unknown_family():
    assert parse_model_spec("chattts=/w/x") == ("chattts", "/w/x")
    assert parse_model_spec("piper") == ("piper", None)
    assert build_card("toy").card_id == "toy"
    with pytest.raises(InvalidRequestError, match="unknown model family 'nope'"):
        build_card("nope")
