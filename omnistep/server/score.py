"""``POST /v1/score``: the log-probs of a rollout's recorded actions, recomputed on the serving
weights (``omnistep.offline.score_samples``; the server has no trainer).

The body is a rollout answer as ``POST /v1/rollouts`` gave it: its JSON (``object:
"rollout"``), or its safetensors body (``Content-Type: application/x-safetensors``; the
tensors ``g{i}.s{k}.{loop}.tokens`` and the header's ``__metadata__["rollout"]``). Each
sample's AR loops are replayed from their ``prompt_ids`` (loops whose prompt is not token ids
have null there and are a 400 naming them: score those with the Python API), the sample's seed
and the envelope's ``sampling``. A loop whose prompt held media (its ``media`` hashes: the
Qwen thinker over a conversation with audio, images or video) is replayed from its group's
``input``: the conversation is parsed and decoded again (the chat API's parser, the
envelope's ``use_audio_in_video``), its prompt rebuilt by the card's own program
(``AsyncOmniEngine.prompts``), and its media must hash as recorded (else a 400).

Query parameters: ``mode`` (``processed`` or ``policy``;
default: the rollout's ``logprobs``), ``entropy`` (``true``: also each step's entropy per
codebook), ``masked`` (``true``: 0 where the rollout's ``mask`` is false), ``routing_replay``
(``true``: a MoE loop's forward uses the experts the rollout recorded, its ``routing`` and
``prompt_routing``; a loop without them is a 400).

The answer: JSON ``{"object": "score", "model", "weight_version", "mode", "groups": [{"group",
"samples": [{"index", "loops": {name: {"logprobs", "entropy"?}}}]}]}``, or with ``Accept:
application/x-safetensors`` one safetensors body of ``g{i}.s{k}.{loop}.logprobs`` (float32
``[T, num_codebooks]``) and ``.entropy``, the rest as JSON in ``__metadata__["score"]``.
A sample's denoise loops (``denoise``: a cascade card's SDE steps with ``flow_noise_level``)
are scored from their recorded ``x`` and ``x_next`` (JSON, or the ``.{j}.x`` / ``.{j}.x_next``
tensors), step, times, std and window, their conditioning rebuilt by the card's program from
the group's text ``input``, the envelope's ``voice`` and the actions of the AR loop that
feeds them (``offline.with_replayed_conditioning``); the sample's AR loops whose prompt is
not token ids are rebuilt from the same input (Chatterbox's T3). Their log-probs are float64
``[S]`` (``g{i}.s{k}.{loop}.logprobs`` in a safetensors answer).
An AR loop that recorded ``flow`` (VoxCPM2's ``decode``:
its patches' SDE chains, ``.flow.states`` in a safetensors body) has no ``prompt_ids``: its
prompt is rebuilt from the group's text ``input`` and the envelope's ``voice`` by the card's
program, its stop decisions scored as ``logprobs`` and its SDE steps as ``flow`` (float64
``[T, S]``; ``g{i}.s{k}.{loop}.flow`` in a safetensors answer).

Imports fastapi, numpy, safetensors, ``omnistep.core``, ``omnistep.offline`` and the rollout
route's helpers.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
from fastapi import APIRouter
from fastapi import Request as HttpRequest
from fastapi.responses import JSONResponse, Response
from pydantic import TypeAdapter, ValidationError

from omnistep.core import DenoiseStepRecord, FlowPatches, InvalidRequestError, SamplingParams
from omnistep.offline import (
    LOGPROB_MODES,
    AsyncOmniEngine,
    DenoiseSteps,
    LoopActions,
    LoopScore,
    RolloutSample,
    with_replayed_conditioning,
)
from omnistep.server.chat import Message, decode_messages
from omnistep.server.rollouts import (
    SAFETENSORS_MEDIA_TYPE,
    bool_param,
    omni_engine,
    wants_safetensors,
)

router = APIRouter()

MAX_SCORE_BODY_BYTES = 256 << 20
"""The largest rollout answer ``POST /v1/score`` reads."""


@router.post("/v1/score")
async def score(http: HttpRequest) -> Response:
    """Score a rollout answer's AR loops on the serving weights (see the module docstring).
    A malformed answer, a model not served, a loop without ``prompt_ids`` or ids outside the
    vocab are 400s naming the field; nothing is held."""
    query = http.query_params
    unknown = sorted(set(query) - {"mode", "entropy", "masked", "routing_replay"})
    if unknown:
        raise InvalidRequestError(f"unknown query parameter(s) {', '.join(unknown)}", unknown[0])
    content_type = http.headers.get("content-type", "").split(";")[0].strip().lower()
    raw = await http.body()
    if content_type in (SAFETENSORS_MEDIA_TYPE, "application/octet-stream"):
        envelope, tensors = _read_safetensors(raw)
    else:
        envelope, tensors = _read_json(raw), None
    mode = query.get("mode", envelope.get("logprobs", "processed"))
    if mode not in LOGPROB_MODES:
        raise InvalidRequestError(f"mode must be one of {', '.join(LOGPROB_MODES)}", "mode")
    entropy = bool_param(query.get("entropy", "false"), "entropy")
    masked = bool_param(query.get("masked", "false"), "masked")
    replay = bool_param(query.get("routing_replay", "false"), "routing_replay")
    omni = omni_engine(http)
    card_id = omni.card_id(_field(envelope, "model", str))
    samples = _samples(envelope, tensors, card_id)
    samples = await _media_prompts(http, omni, envelope, samples)
    samples = await _input_prompts(omni, envelope, samples)
    try:
        scores = await omni.score(
            [s for group in samples for s in group],
            mode=mode,
            entropy=entropy,
            masked=masked,
            routing_replay=replay,
        )
    except NotImplementedError as exc:  # a loop that cannot score, or give entropies
        raise InvalidRequestError(str(exc), "entropy" if entropy else "groups") from None
    except ValueError as exc:  # a component refusing ids (outside its vocab, too long)
        if isinstance(exc, InvalidRequestError):
            raise
        raise InvalidRequestError(f"the rollout cannot be replayed: {exc}", "groups") from None
    head = {
        "object": "score",
        "model": card_id,
        "weight_version": omni.engine.weight_versions[card_id],
        "mode": mode,
    }
    groups = envelope["groups"]
    if wants_safetensors(http.headers.get("accept", "")):
        return Response(
            _safetensors(head, groups, samples, scores), media_type=SAFETENSORS_MEDIA_TYPE
        )
    return JSONResponse(_json(head, groups, samples, scores))


def _read_json(raw: bytes) -> dict:
    try:
        envelope = json.loads(raw)
    except ValueError:
        raise InvalidRequestError(
            "POST /v1/score takes a rollout answer: its JSON, or its safetensors body "
            f"(Content-Type: {SAFETENSORS_MEDIA_TYPE})",
            "body",
        ) from None
    return _check_envelope(envelope)


def _read_safetensors(raw: bytes) -> tuple[dict, dict[str, np.ndarray]]:
    """The envelope (``__metadata__["rollout"]``) and the tensors of a safetensors body."""
    from safetensors.numpy import load

    try:
        (size,) = struct.unpack("<Q", raw[:8])
        header = json.loads(raw[8 : 8 + size])
        envelope = json.loads(header["__metadata__"]["rollout"])
        tensors = load(raw)
    except Exception:  # noqa: BLE001 - any malformed body is the client's 400
        raise InvalidRequestError(
            "the body is not a rollout's safetensors answer (no __metadata__['rollout'])", "body"
        ) from None
    return _check_envelope(envelope), tensors


def _check_envelope(envelope: Any) -> dict:
    if not isinstance(envelope, dict) or envelope.get("object") != "rollout":
        raise InvalidRequestError("the body is not a rollout answer (object 'rollout')", "object")
    if not isinstance(envelope.get("groups"), list):
        raise InvalidRequestError("the rollout answer has no 'groups' list", "groups")
    return envelope


def _field(obj: Any, name: str, kind: type, where: str = "") -> Any:
    value = obj.get(name) if isinstance(obj, dict) else None
    if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
        raise InvalidRequestError(f"'{where}{name}' must be a {kind.__name__}", where + name)
    return value


def _samples(
    envelope: dict, tensors: dict[str, np.ndarray] | None, card_id: str
) -> list[list[RolloutSample]]:
    """The rollout answer's samples, per group, ready for ``score_samples``."""
    try:
        sampling = SamplingParams(**_field(envelope, "sampling", dict))
    except TypeError as exc:
        raise InvalidRequestError(f"bad 'sampling': {exc}", "sampling") from None
    out = []
    for i, group in enumerate(envelope["groups"]):
        samples = _field(group, "samples", list, f"groups[{i}].")
        out.append([_sample(i, s, tensors, card_id, sampling) for s in samples])
    return out


def _sample(
    i: int, sample: Any, tensors: dict | None, card_id: str, sampling: SamplingParams
) -> RolloutSample:
    where = f"groups[{i}].samples[?]."
    index = _field(sample, "index", int, where)
    where = f"groups[{i}].samples[{index}]."
    seed = _field(sample, "seed", int, where)
    recorded = sample.get("denoise") or {}
    if not isinstance(recorded, dict):
        raise InvalidRequestError(f"'{where}denoise' must be an object", where + "denoise")
    denoise = {
        name: _denoise(steps, tensors, f"g{i}.s{index}.{name}.", f"{where}denoise.{name}.")
        for name, steps in recorded.items()
    }
    loops = {}
    for name, loop in _field(sample, "loops", dict, where).items():
        at = f"{where}loops.{name}."
        prompt = loop.get("prompt_ids") if isinstance(loop, dict) else None
        media = loop.get("media") if isinstance(loop, dict) else None
        flow = loop.get("flow") if isinstance(loop, dict) else None
        if prompt is None and isinstance(media, list) and media:
            prompt = MediaPrompt(tuple(str(h) for h in media))  # rebuilt from the input
        elif prompt is None and (isinstance(flow, dict) or denoise) and not media:
            # VoxCPM2, Chatterbox's T3 beside its flow: rebuilt from the text input and voice
            prompt = InputPrompt()
        elif not isinstance(prompt, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt
        ):
            raise InvalidRequestError(
                f"loop '{name}' has no prompt_ids (its prompt is not token ids): score it with "
                "the Python API (OmniEngine.score)",
                at + "prompt_ids",
            )
        if tensors is None:
            tokens = _json_tokens(_field(loop, "tokens", list, at), at + "tokens")
            mask = loop.get("mask")
        else:
            tokens = tensors.get(f"g{i}.s{index}.{name}.tokens")
            mask = tensors.get(f"g{i}.s{index}.{name}.mask")
        if (
            tokens is None
            or tokens.ndim != 2
            or tokens.shape[0] < 1
            or tokens.dtype.kind not in "iu"
        ):
            raise InvalidRequestError(
                f"'{at}tokens' must be integers [T >= 1, num_codebooks]", at + "tokens"
            )
        tokens = tokens.astype(np.int64, copy=False)
        mask = None if mask is None else _rows_like(mask, tokens.shape, bool, at + "mask")
        if tensors is None:  # a rollout answer's per-step fields have one row per frame
            for key, shape in (("logprobs", tokens.shape), ("weight_versions", tokens.shape[:1])):
                if loop.get(key) is not None:
                    _rows_like(loop[key], shape, float, at + key)
        routing = {
            key: _routing(loop, tensors, f"g{i}.s{index}.{name}.{key}", key, at)
            for key in ("routing", "prompt_routing")
        }
        if isinstance(prompt, InputPrompt) and isinstance(flow, dict):
            flow = _flow(flow, tensors, f"g{i}.s{index}.{name}.flow.", at + "flow.")
        else:
            flow = None
        if isinstance(prompt, tuple | list):
            prompt = tuple(prompt)
        loops[name] = LoopActions(
            **routing,
            tokens=tokens,
            logprobs=np.zeros(tokens.shape, np.float32),  # not read by score
            mode="processed",
            weight_versions=np.zeros(tokens.shape[0], np.int64),
            stop_reason=str(loop.get("stop_reason", "length")),
            seed=int(loop.get("seed", seed)),
            prompt=prompt,
            mask=mask,
            flow=flow,
        )
    return RolloutSample(index, seed, loops, "", None, 0, sampling, card_id, denoise)


def _json_tokens(rows: list, param: str) -> np.ndarray:
    """A loop's JSON ``tokens`` as int64 ``[T, num_codebooks]``.

    Raises:
        InvalidRequestError: no frame, or frames that are not equal-length lists of
            integers in [0, 2**63) (a bool, a float, a string, a ragged or huge id), naming
            ``param``.
    """
    ok = bool(rows) and all(
        isinstance(row, list)
        and all(type(t) is int and 0 <= t < 2**63 for t in row)
        and len(row) == len(rows[0]) >= 1
        for row in rows
    )
    if not ok:
        raise InvalidRequestError(
            f"'{param}' must be [T >= 1, num_codebooks]: a list of frames, equal-length lists "
            "of integers >= 0",
            param,
        )
    return np.array(rows, dtype=np.int64).reshape(len(rows), -1)


def _rows_like(value: Any, shape: tuple[int, ...], kind: type, param: str) -> np.ndarray:
    """``value`` (JSON lists or an array) as a ``kind`` array of ``shape``.

    Raises:
        InvalidRequestError: another shape, or values that are not ``kind`` (param ``param``).
    """
    try:
        array = np.asarray(value, dtype=kind)
    except (TypeError, ValueError, OverflowError):
        array = None
    if array is None or array.shape != shape:
        raise InvalidRequestError(
            f"'{param}' must be {list(shape)}: one row per frame of the loop's tokens",
            param,
        )
    return array


def _denoise(entry: Any, tensors: dict | None, key: str, where: str) -> DenoiseSteps:
    """A denoise loop's recorded steps (their means and log-probs are recomputed, not read;
    the conditioning is rebuilt later) from the JSON entry and, in a safetensors body, the
    ``{key}{j}.x`` / ``{key}{j}.x_next`` tensors.

    Raises:
        InvalidRequestError: a missing or malformed field (named).
    """
    if not isinstance(entry, dict):
        raise InvalidRequestError(f"'{where[:-1]}' must be an object", where[:-1])
    meta = {k: _field(entry, k, list, where) for k in ("step", "t", "t_next", "std", "window")}
    level = entry.get("noise_level")
    if not isinstance(level, int | float) or isinstance(level, bool) or level <= 0:
        raise InvalidRequestError(
            f"'{where}noise_level' must be a number > 0", where + "noise_level"
        )
    num = len(meta["step"])
    if num < 1 or any(len(v) != num for v in meta.values()):
        raise InvalidRequestError(
            f"'{where}step', 't', 't_next', 'std' and 'window' must have one entry per step",
            where + "step",
        )
    arrays = {name: _step_arrays(entry, tensors, key, where, name, num) for name in ("x", "x_next")}
    records = []
    for j in range(num):
        window, std = meta["window"][j], meta["std"][j]
        shape = arrays["x"][j].shape
        ok = isinstance(window, list) and len(window) == 4 and all(type(w) is int for w in window)
        if not ok or len(shape) != 2 or arrays["x_next"][j].shape != shape:
            raise InvalidRequestError(
                f"'{where}window' and step {j}'s x and x_next must agree ([frames, dim])",
                where + "window",
            )
        if not isinstance(std, int | float) or isinstance(std, bool) or not std > 0:
            raise InvalidRequestError(f"'{where}std' must hold numbers > 0", where + "std")
        records.append(
            DenoiseStepRecord(
                step=int(meta["step"][j]),
                t=float(meta["t"][j]),
                t_next=float(meta["t_next"][j]),
                x=arrays["x"][j],
                mean=None,  # recomputed by the score
                std=float(std),
                x_next=arrays["x_next"][j],
                logprob=0.0,  # not read by score
                window=tuple(window),
            )
        )
    return DenoiseSteps(tuple(records), float(level), int(entry.get("seed", 0)))


def _step_arrays(
    entry: dict, tensors: dict | None, key: str, where: str, name: str, num: int
) -> list[np.ndarray]:
    """Step ``j``'s float32 ``name`` array for every ``j`` < ``num``."""
    try:
        if tensors is None:
            values = entry[name]
            if not isinstance(values, list) or len(values) != num:
                raise ValueError
            return [np.asarray(v, dtype=np.float32) for v in values]
        return [np.asarray(tensors[f"{key}{j}.{name}"], dtype=np.float32) for j in range(num)]
    except (KeyError, ValueError, TypeError):
        raise InvalidRequestError(
            f"'{where}{name}' must hold each step's float [frames, dim] array", where + name
        ) from None


def _routing(
    loop: dict, tensors: dict | None, tensor_name: str, key: str, at: str
) -> np.ndarray | None:
    """A loop's recorded ``routing`` / ``prompt_routing`` (int16 ``[rows, MoE layers, k]``)
    from the JSON field or the safetensors tensor; None when absent or null.

    Raises:
        InvalidRequestError: not a 3-D array of non-negative integers.
    """
    value = loop.get(key) if tensors is None else tensors.get(tensor_name)
    if value is None:
        return None
    try:
        array = np.asarray(value)
        ok = array.ndim == 3 and array.dtype.kind in "iu" and (array.size == 0 or array.min() >= 0)
    except (ValueError, TypeError):
        ok = False
    if not ok:
        raise InvalidRequestError(
            f"'{at}{key}' must be [rows, MoE layers, k] non-negative integers", at + key
        )
    return array.astype(np.int16)


def _flow(flow: dict, tensors: dict | None, key: str, where: str) -> FlowPatches:
    """A loop's recorded ``FlowPatches`` (its SDE chains; the means and log-probs are
    recomputed, not read) from the JSON ``flow`` or the ``{key}states`` tensor."""
    if tensors is None:
        states = np.asarray(flow.get("states", []), dtype=np.float32)
    else:
        states = tensors.get(key + "states")
    if states is None or states.ndim != 4 or states.shape[1] < 1:
        raise InvalidRequestError(f"'{where}states' must be [T, S + 1, P, C]", where + "states")
    level = flow.get("noise_level", 0.0)
    if not isinstance(level, int | float) or isinstance(level, bool):
        raise InvalidRequestError(f"'{where}noise_level' must be a number", where + "noise_level")
    num = states.shape[1] - 1
    empty = np.zeros((states.shape[0], num), np.float64)
    return FlowPatches(states, states[:, :num], np.zeros(num), empty, float(level))


@dataclass(frozen=True)
class InputPrompt:
    """A loop's prompt that is neither token ids nor media (VoxCPM2's prompt rows), rebuilt
    from its group's text input and the envelope's ``voice``."""


@dataclass(frozen=True)
class MediaPrompt:
    """A loop's recorded media hashes, standing for a prompt to rebuild from the input."""

    media: tuple[str, ...]


async def _media_prompts(
    http: HttpRequest, omni: AsyncOmniEngine, envelope: dict, samples: list[list[RolloutSample]]
) -> list[list[RolloutSample]]:
    """``samples`` with every ``MediaPrompt`` replaced by the prompt rebuilt from its group's
    input (see the module docstring).

    Raises:
        InvalidRequestError: a group input that is not a conversation, media that do not
            decode, or media that do not hash as recorded (param ``groups[i].input``).
    """
    audio_in_video = envelope.get("use_audio_in_video") is True
    out = []
    for i, members in enumerate(samples):
        if not any(isinstance(a.prompt, MediaPrompt) for s in members for a in s.loops.values()):
            out.append(members)
            continue
        where = f"groups[{i}].input"
        try:
            messages = _CONVERSATION.validate_python(envelope["groups"][i].get("input"))
        except ValidationError:
            raise InvalidRequestError(f"'{where}' must be the conversation sent", where) from None
        card = omni.engine.resolve(members[0].model).card
        decoded = await decode_messages(messages, card, http, audio_in_video, where)
        rebuilt = []
        for sample in members:
            prompts = await omni.prompts(
                decoded, seed=sample.seed, model=sample.model, sampling=sample.sampling
            )
            loops = {}
            for name, actions in sample.loops.items():
                if isinstance(actions.prompt, MediaPrompt):
                    prompt = prompts.get(name)
                    if tuple(getattr(prompt, "media", ())) != actions.prompt.media:
                        raise InvalidRequestError(
                            f"the media of '{where}' do not hash as loop '{name}' recorded",
                            where,
                        )
                    actions = replace(actions, prompt=prompt)
                loops[name] = actions
            rebuilt.append(replace(sample, loops=loops))
        out.append(rebuilt)
    return out


_CONVERSATION = TypeAdapter(list[Message])


async def _input_prompts(
    omni: AsyncOmniEngine, envelope: dict, samples: list[list[RolloutSample]]
) -> list[list[RolloutSample]]:
    """``samples`` with every ``InputPrompt`` replaced by the prompt the card's program
    builds from the group's text input, the envelope's ``voice`` and the sample's seed and
    sampling (``AsyncOmniEngine.prompts``).

    Raises:
        InvalidRequestError: a group input that is not a text (param ``groups[i].input``).
    """
    voice = envelope.get("voice")
    if voice is not None and not isinstance(voice, str):
        raise InvalidRequestError("'voice' must be a string", "voice")
    out = []
    for i, members in enumerate(samples):
        rebuilt_loops = (
            isinstance(a.prompt, InputPrompt) for s in members for a in s.loops.values()
        )
        if not any(rebuilt_loops) and not any(s.denoise for s in members):
            out.append(members)
            continue
        where = f"groups[{i}].input"
        text = envelope["groups"][i].get("input")
        if not isinstance(text, str) or not text:
            raise InvalidRequestError(f"'{where}' must be the text sent", where)
        rebuilt = []
        for sample in members:
            prompts = await omni.prompts(
                text, seed=sample.seed, model=sample.model, voice=voice, sampling=sample.sampling
            )
            loops = {}
            for name, a in sample.loops.items():
                if isinstance(a.prompt, InputPrompt):
                    if prompts.get(name) is None:
                        raise InvalidRequestError(
                            f"the prompt of loop '{name}' cannot be rebuilt from '{where}'", where
                        )
                    a = replace(a, prompt=prompts[name])
                loops[name] = a
            sample = replace(sample, loops=loops)
            if sample.denoise:
                sample = with_replayed_conditioning(omni.engine, sample, prompts)
            rebuilt.append(sample)
        out.append(rebuilt)
    return out


def _values(value: Any) -> np.ndarray:
    """A score (torch tensor or numpy array) as float32 numpy."""
    if hasattr(value, "detach"):
        value = value.detach().cpu().numpy()
    return np.ascontiguousarray(value, dtype=np.float32)


def _loop_values(scored: Any, denoise: bool = False) -> dict[str, np.ndarray]:
    """A loop's score as named float arrays (a denoise loop's: float64, as recorded)."""
    if denoise:
        values = scored.detach().cpu().numpy() if hasattr(scored, "detach") else scored
        return {"logprobs": np.ascontiguousarray(values, dtype=np.float64)}
    if isinstance(scored, LoopScore):
        out = {"logprobs": _values(scored.logprobs)}
        if scored.entropy is not None:
            out["entropy"] = _values(scored.entropy)
        if scored.flow is not None:  # float64: the SDE steps' sums need it (1e-6 of ~1e2)
            flow = scored.flow
            flow = flow.detach().cpu().numpy() if hasattr(flow, "detach") else flow
            out["flow"] = np.ascontiguousarray(flow, dtype=np.float64)
        return out
    return {"logprobs": _values(scored)}


def _json(head: dict, groups: list, samples: list, scores: list) -> dict:
    flat = iter(scores)
    out = []
    for group, members in zip(groups, samples, strict=True):
        entries = []
        for sample in members:
            scored = next(flat)
            loops = {
                name: {
                    k: v.tolist() for k, v in _loop_values(value, name in sample.denoise).items()
                }
                for name, value in scored.items()
            }
            entries.append({"index": sample.index, "loops": loops})
        out.append({"group": group.get("group"), "samples": entries})
    return {**head, "groups": out}


def _safetensors(head: dict, groups: list, samples: list, scores: list) -> bytes:
    from safetensors.numpy import save

    flat = iter(scores)
    tensors: dict[str, np.ndarray] = {}
    meta = []
    for i, (group, members) in enumerate(zip(groups, samples, strict=True)):
        for sample in members:
            for name, value in next(flat).items():
                for key, array in _loop_values(value, name in sample.denoise).items():
                    tensors[f"g{i}.s{sample.index}.{name}.{key}"] = array
        meta.append({"group": group.get("group"), "samples": [s.index for s in members]})
    return save(tensors, metadata={"score": json.dumps({**head, "groups": meta})})
