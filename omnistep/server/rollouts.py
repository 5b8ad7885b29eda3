"""RL over HTTP: ``POST /v1/rollouts`` (groups of samples with their actions and log-probs),
``POST /v1/weights`` (swap weights in place) and ``GET /v1/weights`` (the versions served).

Both sit behind ``--api-key`` when one is set (as every ``/v1`` route). They run the offline
API (``omnistep.offline.AsyncOmniEngine``) on the server's engine, so a rollout over HTTP equals
the same call in Python.

Rollout responses are JSON (``object: "rollout"``), or, when the client asks with ``Accept:
application/x-safetensors``, one safetensors body (JSON floats are large): per sample and loop
the tensors ``g{i}.s{k}.{loop}.tokens`` (int64 ``[T, num_codebooks]``), ``.logprobs`` (float32
``[T, num_codebooks]``), ``.mask`` (bool ``[T, num_codebooks]``: the ids really sampled,
``LoopActions.mask``) and ``.weight_versions`` (int64 ``[T]``), and ``g{i}.s{k}.audio``
(float32 ``[samples]``) when audio was asked for; a denoise loop's SDE steps (cascade cards
with ``flow_noise_level``) as ``g{i}.s{k}.{loop}.logprobs`` (float64 ``[S]``),
``.weight_versions`` (int64 ``[S]``) and ``.{j}.x`` / ``.{j}.mean`` / ``.{j}.x_next`` (float32
``[frames, mel_dim]`` of step ``j``'s window); a MoE loop's (Qwen3-Omni) ``.routing`` (int16
``[T, MoE layers, k]``, ``LoopActions.routing``) and ``.prompt_routing`` (int16 ``[prompt rows
- 1, MoE layers, k]``), JSON ``"routing"`` / ``"prompt_routing"`` (null for a dense loop); an
AR loop whose steps solve a flow for a patch (VoxCPM2's ``decode``, ``LoopActions.flow``) also
as ``g{i}.s{k}.{loop}.flow.states``
(float32 ``[T, S + 1, *patch]``: each step's SDE chain, its patch last), ``.flow.means``
(float32 ``[T, S, *patch]``) and ``.flow.logprobs`` (float64 ``[T, S]``: per AR step, per
SDE step, the Gaussian log-prob of the sampled next latent), with the noise level and the
``stds`` in the loop's JSON ``flow``; everything else (inputs, seeds, stop reasons,
texts, sample rates, each loop's ``prompt_ids``, the request's ``sampling``, each step's ``t``,
``t_next``, ``std`` and window) is the JSON string in the header's ``__metadata__["rollout"]``.
Each loop's ``prompt_ids`` are the token ids it was conditioned on when its prompt is token ids
(the toy, the Qwen thinker), else null (ChatTTS: ids plus a speaker vector; the Qwen talkers:
rows of the thinker): what ``POST /v1/score`` (``omnistep.server.score``) replays.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import tempfile
from collections.abc import Awaitable
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any, Literal, TypeVar

import numpy as np
from fastapi import APIRouter
from fastapi import Request as HttpRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import (
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    ValidationError,
    field_validator,
)

from omnistep.audio import encode_all
from omnistep.core import (
    ChatMessage,
    InvalidRequestError,
    ModelCard,
    RequestAbortedError,
    SamplingParams,
)
from omnistep.core.request import MAX_FLOW_NOISE
from omnistep.engine import AsyncEngine
from omnistep.offline import MAX_GROUP_SIZE, AsyncOmniEngine, RolloutGroup
from omnistep.server.chat import MediaOptions, Message, decode_messages
from omnistep.server.protocol import (
    MAX_VOICE_CHARS,
    OpenAIBody,
    ReferenceVoiceFields,
    ResponseFormat,
    SamplingFields,
    control_characters,
)
from omnistep.server.voice_fields import request_voice

router = APIRouter()
log = logging.getLogger("omnistep.server")
T = TypeVar("T")

SAFETENSORS_MEDIA_TYPE = "application/x-safetensors"
"""The ``Accept`` value that asks for a safetensors rollout body (and the upload type of
``POST /v1/weights``)."""
MAX_ROLLOUT_INPUTS = 64
"""Inputs one ``POST /v1/rollouts`` may carry."""
MAX_ROLLOUT_SAMPLES = 1024
"""Samples (inputs x n) one ``POST /v1/rollouts`` may ask for."""


class RolloutBody(SamplingFields, ReferenceVoiceFields, MediaOptions):
    """Body of ``POST /v1/rollouts``.

    Fields: ``model``; ``inputs`` (1..64 of: a text, a speech input or one user message for a
    chat card; or, for a chat card, a conversation: a ``messages`` list as
    ``/v1/chat/completions`` takes it, text and media parts, parsed and decoded by the same
    code, ``use_audio_in_video`` / ``mm_processor_kwargs`` too); ``n`` (samples per input,
    1..256; inputs x n <= 1024); ``seed`` (sample ``k``
    of every input runs with ``seed + k``); ``voice`` (a saved name too, as on
    ``/v1/audio/speech``); ``ref_audio``, ``ref_text``, ``task_type`` (``ReferenceVoiceFields``:
    an inline cloned voice); sampling fields (``temperature``,
    ``top_p``, ``top_k``, ``repetition_penalty``, ``max_new_tokens``); ``flow_noise_level``
    (0..4: a flow-matching decoder's SDE noise scale, Flow-GRPO; cascade cards asked for
    audio then return each DiT solver step as a policy step under ``denoise``);
    ``logprobs`` (``processed`` or ``policy``); ``audio_format`` (one of the speech formats:
    each sample's audio, base64 in JSON; None: no audio); ``min_new_tokens`` (no end before
    that many steps). Unknown fields are a 400 naming them (a typo such as ``logprob`` must not
    fall back to a default silently).
    """

    model: str = Field(min_length=1, max_length=200)
    inputs: list[str | list[Message]] = Field(min_length=1, max_length=MAX_ROLLOUT_INPUTS)
    n: StrictInt = Field(default=1, ge=1, le=MAX_GROUP_SIZE)
    seed: StrictInt = Field(default=0, ge=0, le=2**62)
    voice: str | None = Field(default=None, min_length=1, max_length=MAX_VOICE_CHARS)
    logprobs: Literal["processed", "policy"] = "processed"
    audio_format: ResponseFormat | None = None
    flow_noise_level: float | None = Field(
        default=None, ge=0, le=MAX_FLOW_NOISE, allow_inf_nan=False, strict=True
    )
    min_new_tokens: int | None = Field(default=None, ge=0, le=8192, strict=True)

    model_config = ConfigDict(extra="forbid")

    def sampling(self) -> SamplingParams:
        """The sampling fields' ``SamplingParams``, with ``flow_noise_level`` and
        ``min_new_tokens``."""
        sampling = replace(super().sampling(), flow_noise_level=self.flow_noise_level)
        if self.min_new_tokens is not None:
            sampling = replace(sampling, min_new_tokens=self.min_new_tokens)
        return sampling

    @field_validator("inputs")
    @classmethod
    def _texts(cls, value: list[str | list[Message]]) -> list[str | list[Message]]:
        for i, text in enumerate(value):
            if not isinstance(text, str):
                if not text:
                    raise ValueError(f"input {i} is an empty conversation")
                continue
            if not 1 <= len(text) <= 4096:
                raise ValueError(f"input {i} must hold 1 to 4096 characters")
            bad = control_characters(text)
            if bad:
                raise ValueError(f"input {i} contains control characters {', '.join(bad[:5])}")
        return value


class WeightsBody(OpenAIBody):
    """JSON body of ``POST /v1/weights``: ``path`` of a safetensors file the server can read,
    ``model`` (default: the first served), ``version`` (above the current one; default: the
    current one + 1; a lower or equal one is a 409), ``mode`` (``pause`` or ``drain``) and
    ``check_finite`` (default true: a NaN or Inf value is a 400; false skips that pass).
    Unknown fields are a 400 naming them."""

    model_config = ConfigDict(extra="forbid")

    path: str = Field(min_length=1, max_length=4096)
    model: str | None = Field(default=None, min_length=1, max_length=200)
    version: StrictInt | None = Field(default=None, ge=0, le=2**62)
    mode: Literal["pause", "drain"] = "pause"
    check_finite: StrictBool = True


def omni_engine(http: HttpRequest) -> AsyncOmniEngine:
    """The offline API over the app's engine (what ``/v1/rollouts``, ``/v1/weights`` and
    ``/v1/score`` run)."""
    return AsyncOmniEngine(http.app.state.engine)


@router.post("/v1/rollouts")
async def create_rollout(body: RolloutBody, http: HttpRequest) -> Response:
    """Sample ``n`` continuations of each input (see ``RolloutBody``); JSON or safetensors
    (``Accept``). Bad input is a 4xx OpenAI error and holds nothing."""
    if len(body.inputs) * body.n > MAX_ROLLOUT_SAMPLES:
        raise InvalidRequestError(
            f"inputs x n must be at most {MAX_ROLLOUT_SAMPLES}, got {len(body.inputs)} x {body.n}",
            param="n",
        )
    low, high = body.min_new_tokens, body.max_new_tokens
    if low is not None and high is not None and low > high:
        raise InvalidRequestError(
            f"min_new_tokens ({low}) must not exceed max_new_tokens ({high})",
            param="min_new_tokens",
        )
    omni = omni_engine(http)
    card = omni.engine.resolve(body.model).card
    inputs = await rollout_inputs(body.inputs, card, http, body.audio_in_video)
    voice = await request_voice(http.app, card, body.voice, body)
    rollout = omni.rollout(
        inputs,
        n=body.n,
        seed=body.seed,
        model=body.model,
        voice=voice,
        sampling=body.sampling(),
        logprobs=body.logprobs,
        audio=body.audio_format is not None,
        progress=False,
    )
    groups = await _unless_client_leaves(http, rollout)
    card_id = omni.card_id(body.model)
    head = {"model": card_id, "weight_version": omni.engine.weight_versions[card_id]}
    if voice is not None:  # what /v1/score rebuilds a prompt that is not token ids from
        head["voice"] = voice
    if wants_safetensors(http.headers.get("accept", "")):
        return Response(_safetensors(head, body, groups), media_type=SAFETENSORS_MEDIA_TYPE)
    return JSONResponse(_json(head, body, groups))


async def rollout_inputs(
    inputs: list[str | list[Message]], card: ModelCard, http: HttpRequest, audio_in_video: bool
) -> list[str | tuple[ChatMessage, ...]]:
    """The rollout's inputs for ``AsyncOmniEngine.rollout``: texts as they are,
    conversations through the chat API's parser (``chat.decode_messages``; a part's errors
    name it ``inputs[k][i].content[j]``)."""
    out: list[str | tuple[ChatMessage, ...]] = []
    for k, item in enumerate(inputs):
        if isinstance(item, str):
            out.append(item)
        else:
            out.append(await decode_messages(item, card, http, audio_in_video, f"inputs[{k}]"))
    return out


def echo_input(item: str | list[Message]) -> str | list[dict]:
    """An input as the answer repeats it: the text, or the messages as sent."""
    if isinstance(item, str):
        return item
    return [m.model_dump(mode="json", exclude_none=True) for m in item]


async def _unless_client_leaves(http: HttpRequest, work: Awaitable[T]) -> T:
    """Await ``work``, cancelling it if the client disconnects first (a rollout of up to 1024
    samples would otherwise run on for nobody; cancelled, it aborts its engine requests).

    Raises:
        RequestAbortedError: the client left (nobody reads the answer).
    """
    task = asyncio.ensure_future(work)
    watcher = asyncio.create_task(_disconnected(http))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
        await asyncio.wait({task, watcher})
    if task.cancelled() and watcher.done() and not watcher.cancelled() and watcher.result():
        log.info("client of a rollout disconnected; aborted its requests")
        raise RequestAbortedError("the client disconnected; the rollout was aborted")
    return task.result()


async def _disconnected(http: HttpRequest) -> bool:
    """True once the client disconnects (the body is read already)."""
    try:
        while (await http.receive())["type"] != "http.disconnect":
            pass
    except Exception:  # noqa: BLE001 - watching is best effort; the work goes on
        await asyncio.Event().wait()  # never: let the work finish
    return True


def wants_safetensors(accept: str) -> bool:
    """Whether an ``Accept`` header prefers safetensors to JSON: listed with a q above 0 and
    not below ``application/json``'s (``application/x-safetensors;q=0`` is a refusal)."""
    quality: dict[str, float] = {}
    for item in accept.split(","):
        media, *params = (part.strip() for part in item.split(";"))
        q = 1.0
        for param in params:
            key, _, value = param.partition("=")
            if key.strip().lower() == "q":
                try:
                    q = float(value)
                except ValueError:
                    q = 0.0
        quality[media.lower()] = max(q, quality.get(media.lower(), 0.0))
    tensors = quality.get(SAFETENSORS_MEDIA_TYPE, 0.0)
    return tensors > 0 and tensors >= quality.get("application/json", 0.0)


def _sample_meta(sample) -> dict:
    """A sample's JSON fields; ``weight_version`` is the version its last step ran under (a
    sample that crossed an update in ``pause`` mode has earlier steps at lower versions: its
    loops' ``weight_versions`` say which)."""
    versions = [int(a.weight_versions[-1]) for a in sample.loops.values() if len(a.weight_versions)]
    versions += [
        int(d.weight_versions[-1]) for d in sample.denoise.values() if len(d.weight_versions)
    ]
    meta = {
        "index": sample.index,
        "seed": sample.seed,
        "text": sample.text,
        "sample_rate": sample.sample_rate,
        "weight_version": max(versions, default=None),
        "loops": {
            name: {
                "stop_reason": a.stop_reason,
                "seed": a.seed,
                "num_steps": len(a.tokens),
                "prompt_ids": a.prompt_ids,
                "media": list(a.media),
            }
            for name, a in sample.loops.items()
        },
    }
    for name, a in sample.loops.items():
        if a.flow is not None:
            meta["loops"][name]["flow"] = {
                "noise_level": a.flow.noise_level,
                "num_sde_steps": int(a.flow.logprobs.shape[1]),
                "stds": a.flow.stds.tolist(),
            }
    if sample.denoise:
        meta["denoise"] = {
            name: {
                "noise_level": d.noise_level,
                "seed": d.seed,
                "num_steps": len(d.steps),
                "step": [r.step for r in d.steps],
                "t": [r.t for r in d.steps],
                "t_next": [r.t_next for r in d.steps],
                "std": [r.std for r in d.steps],
                "window": [list(r.window) for r in d.steps],
            }
            for name, d in sample.denoise.items()
        }
    return meta


DENOISE_TENSORS = ("x", "mean", "x_next")
"""Per recorded SDE step, the float32 ``[frames, mel_dim]`` arrays a rollout returns."""
FLOW_TENSORS = ("states", "means", "logprobs")
"""An AR loop's ``FlowPatches`` arrays a rollout returns (VoxCPM2's ``decode``): float32
``states`` ``[T, S + 1, *patch]``, ``means`` ``[T, S, *patch]``, float64 ``logprobs`` ``[T,
S]``."""


def _json(head: dict, body: RolloutBody, groups: list[RolloutGroup]) -> dict:
    out = []
    for item, group in zip(body.inputs, groups, strict=True):
        samples = []
        for sample in group.samples:
            entry = _sample_meta(sample)
            for name, actions in sample.loops.items():
                entry["loops"][name].update(
                    tokens=actions.tokens.tolist(),
                    logprobs=actions.logprobs.tolist(),
                    weight_versions=actions.weight_versions.tolist(),
                    mask=actions.sampled().tolist(),
                    routing=_listed(actions.routing),
                    prompt_routing=_listed(actions.prompt_routing),
                )
                if actions.flow is not None:
                    entry["loops"][name]["flow"].update(
                        {k: getattr(actions.flow, k).tolist() for k in FLOW_TENSORS}
                    )
            for name, steps in sample.denoise.items():
                entry["denoise"][name].update(
                    logprobs=steps.logprobs.tolist(),
                    weight_versions=steps.weight_versions.tolist(),
                    **{k: [getattr(r, k).tolist() for r in steps.steps] for k in DENOISE_TENSORS},
                )
            entry["audio"] = (
                base64.b64encode(
                    encode_all(body.audio_format, [sample.audio], sample.sample_rate, True)
                ).decode()
                if body.audio_format is not None and sample.audio is not None
                else None
            )
            samples.append(entry)
        out.append({"input": echo_input(item), "group": group.group, "samples": samples})
    return _envelope(head, body, out)


def _listed(array: np.ndarray | None) -> list | None:
    """A routing array as nested lists (None stays None)."""
    return None if array is None else array.tolist()


def _envelope(head: dict, body: RolloutBody, groups: list) -> dict:
    """The answer's top level; ``head`` holds ``model`` and ``weight_version`` (the version
    the model runs as the answer is made)."""
    return {
        "object": "rollout",
        **head,
        "n": body.n,
        "logprobs": body.logprobs,
        "sampling": {k: v for k, v in asdict(body.sampling()).items() if v is not None},
        "audio_format": body.audio_format,
        "use_audio_in_video": body.audio_in_video,
        "groups": groups,
    }


def _safetensors(head: dict, body: RolloutBody, groups: list[RolloutGroup]) -> bytes:
    from safetensors.numpy import save

    tensors: dict[str, np.ndarray] = {}
    meta_groups = []
    for i, group in enumerate(groups):
        samples = []
        for sample in group.samples:
            prefix = f"g{i}.s{sample.index}"
            for name, actions in sample.loops.items():
                tensors[f"{prefix}.{name}.tokens"] = actions.tokens
                tensors[f"{prefix}.{name}.logprobs"] = actions.logprobs
                tensors[f"{prefix}.{name}.weight_versions"] = actions.weight_versions
                tensors[f"{prefix}.{name}.mask"] = np.ascontiguousarray(actions.sampled())
                for key in ("routing", "prompt_routing"):
                    value = getattr(actions, key)
                    if value is not None:
                        tensors[f"{prefix}.{name}.{key}"] = np.ascontiguousarray(value, np.int16)
                if actions.flow is not None:
                    for key in FLOW_TENSORS:
                        array = np.ascontiguousarray(getattr(actions.flow, key))
                        tensors[f"{prefix}.{name}.flow.{key}"] = array
            for name, steps in sample.denoise.items():
                tensors[f"{prefix}.{name}.logprobs"] = steps.logprobs
                tensors[f"{prefix}.{name}.weight_versions"] = steps.weight_versions
                for j, record in enumerate(steps.steps):
                    for key in DENOISE_TENSORS:
                        array = np.ascontiguousarray(getattr(record, key), np.float32)
                        tensors[f"{prefix}.{name}.{j}.{key}"] = array
            if sample.audio is not None:
                tensors[f"{prefix}.audio"] = np.ascontiguousarray(sample.audio, np.float32)
            samples.append(_sample_meta(sample))
        echo = echo_input(body.inputs[i])
        meta_groups.append({"input": echo, "group": group.group, "samples": samples})
    meta = json.dumps(_envelope(head, body, meta_groups))
    return save(tensors, metadata={"rollout": meta})


@router.post("/v1/weights")
async def update_weights(http: HttpRequest) -> dict:
    """Swap a model's weights in place: a JSON ``WeightsBody`` naming a safetensors file the
    server can read, or the file itself as the body (``Content-Type:
    application/x-safetensors`` or ``application/octet-stream``; ``model``, ``version`` and
    ``mode`` then come as query parameters). Returns the model and its new version. An unknown
    tensor name, a wrong shape or dtype is a 400 and nothing changes."""
    content_type = http.headers.get("content-type", "").split(";")[0].strip().lower()
    upload = content_type in (SAFETENSORS_MEDIA_TYPE, "application/octet-stream")
    _check_weights_query(http.query_params, upload)
    if upload:
        query = http.query_params
        fields = {"path": "(upload)", "version": _int_param(query.get("version"), "version")}
        fields.update({k: query[k] for k in ("model", "mode") if k in query})
        if "check_finite" in query:
            fields["check_finite"] = bool_param(query["check_finite"], "check_finite")
        body = _weights_body(fields, loc=())
        with tempfile.TemporaryDirectory(prefix="omnistep-weights-") as folder:
            path = Path(folder) / "weights.safetensors"
            with path.open("wb") as file:
                async for part in http.stream():
                    file.write(part)
            try:
                return await _apply(http, body, path)
            except InvalidRequestError as exc:
                if str(path) not in str(exc):
                    raise
                # the message names the server's temporary file: name the upload instead
                message = str(exc).replace(str(path), "the uploaded body")
                raise InvalidRequestError(message, param=exc.param, code=exc.code) from None
    raw = await http.body()
    if not raw.strip() or (content_type and "json" not in content_type):
        raise InvalidRequestError(
            "POST /v1/weights takes JSON with a 'path' (Content-Type: application/json), or "
            f"the safetensors file itself (Content-Type: {SAFETENSORS_MEDIA_TYPE})",
            param="body",
        )
    body = _weights_body(raw, loc=("body",))
    path = Path(body.path)
    if not path.is_file():
        raise InvalidRequestError(f"no weights file at {body.path}", param="path")
    return await _apply(http, body, path)


WEIGHTS_QUERY = ("model", "version", "mode", "check_finite")
"""The query parameters of ``POST /v1/weights`` with the file as the body."""


def _check_weights_query(query: Any, upload: bool) -> None:
    """Refuse query parameters ``POST /v1/weights`` would not read (a typo such as
    ``verison=7`` would otherwise apply the update under the default version): with the file
    as the body only ``WEIGHTS_QUERY``; with a JSON body none (its fields say everything).

    Raises:
        InvalidRequestError: naming the first such parameter.
    """
    unknown = sorted(set(query) - set(WEIGHTS_QUERY)) if upload else sorted(query)
    if unknown:
        where = (
            f"with the file as the body it takes {', '.join(WEIGHTS_QUERY)}"
            if upload
            else "with a JSON body, give the fields in the body"
        )
        raise InvalidRequestError(
            f"unknown query parameter(s) {', '.join(unknown)}: {where}", param=unknown[0]
        )


def _weights_body(fields: dict | bytes, loc: tuple[str, ...]) -> WeightsBody:
    """A ``WeightsBody`` from JSON bytes or query fields; a validation error is raised as
    FastAPI's, so it gets the same OpenAI-style 400 as a typed body (``param`` the field)."""
    try:
        if isinstance(fields, bytes):
            return WeightsBody.model_validate_json(fields)
        return WeightsBody.model_validate(fields)
    except ValidationError as exc:
        errors = [{**e, "loc": (*loc, *e["loc"])} for e in exc.errors(include_url=False)]
        raise RequestValidationError(errors) from None


async def _apply(http: HttpRequest, body: WeightsBody, path: Path) -> dict:
    done = await omni_engine(http).apply_weights(
        path, model=body.model, version=body.version, mode=body.mode, check_finite=body.check_finite
    )
    answer = {"object": "weights", "model": done.model, "version": done.version}
    if done.casts:  # a published checkpoint's dtype (bf16) into the serving one (float32)
        answer["cast"] = list(done.casts)
    return answer


def _int_param(value: str | None, name: str) -> int | None:
    if value is None:
        return None
    if not (value.isascii() and value.isdigit()):  # "²".isdigit(), but int("²") fails
        raise InvalidRequestError(f"'{name}' must be a non-negative integer", param=name)
    return int(value)


def bool_param(value: str, name: str) -> bool:
    """A query parameter's boolean (``true``/``false``/``1``/``0``); raises
    InvalidRequestError naming ``name`` otherwise."""
    if value.lower() not in ("true", "false", "1", "0"):
        raise InvalidRequestError(f"'{name}' must be true or false", param=name)
    return value.lower() in ("true", "1")


@router.get("/v1/weights")
async def weight_versions(http: HttpRequest) -> dict:
    """The weight version each served model runs (0: as loaded)."""
    engine: AsyncEngine = http.app.state.engine
    return {
        "object": "list",
        "data": [
            {"object": "weights", "model": card_id, "version": version}
            for card_id, version in engine.weight_versions.items()
        ],
    }
