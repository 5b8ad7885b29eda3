"""``GET /v1/models`` and ``GET /v1/models/{model}``, and the check that a model can serve an
endpoint.

A model answers to every id in its card's ``model_ids``: the card id (or the name given with
``--served-model-name``), the family name given to ``--model``, and the card's own aliases (the
embedded voice's ``tts-1``...); see ``omnistep.models.registry.public_names``. Both routes list
or find exactly the ids ``AsyncEngine.resolve`` accepts.
"""

from __future__ import annotations

from fastapi import APIRouter
from fastapi import Request as HttpRequest

from omnistep.core import Capability, InvalidRequestError, ModelInstance
from omnistep.engine import AsyncEngine

router = APIRouter()


def model_object(model_id: str, model: ModelInstance, created: int) -> dict:
    """OpenAI's model object for ``model_id`` (``id``, ``object``, ``created``, ``owned_by``),
    plus ``root``: the card id it routes to (vLLM's field), and ``capabilities``: what it
    serves, sorted (``Capability`` values: ``transcription`` for the models
    ``/v1/audio/transcriptions`` takes, ``audio_input`` for those that hear chat audio and
    ``/v1/realtime`` sessions, ``text_to_speech``...)."""
    return {
        "id": model_id,
        "object": "model",
        "created": created,
        "owned_by": "omnistep",
        "root": model.card.card_id,
        "capabilities": sorted(c.value for c in model.card.capabilities),
    }


@router.get("/v1/models")
async def list_models(http: HttpRequest) -> dict:
    """Every model id a request may name (card ids and their aliases), OpenAI's list shape."""
    engine: AsyncEngine = http.app.state.engine
    created = http.app.state.started
    data = [
        model_object(model_id, model, created)
        for model in engine.models.values()
        for model_id in model.card.model_ids
    ]
    return {"object": "list", "data": data}


@router.get("/v1/models/{model:path}")
async def retrieve_model(model: str, http: HttpRequest) -> dict:
    """The model object of ``model`` (any id ``/v1/models`` lists; ids may hold ``/``, as
    ``Qwen/Qwen2.5-Omni-7B``). An unknown id is a 404 ``model_not_found`` error listing the
    served ids."""
    engine: AsyncEngine = http.app.state.engine
    return model_object(model, engine.resolve(model), http.app.state.started)


def _able(engine: AsyncEngine, capability: Capability) -> list[str]:
    return [m.card.card_id for m in engine.models.values() if capability in m.card.capabilities]


def require_capability(engine: AsyncEngine, model_id: str, capability: Capability) -> ModelInstance:
    """The model serving ``model_id``, checked to be able to do ``capability``.

    Raises:
        ModelNotFoundError: no model answers to ``model_id`` (404; the message lists the ids).
        InvalidRequestError: (code ``unsupported_model``) the model cannot do it; the message
            says what it can do instead, where, and which served models can do what was asked.
    """
    model = engine.resolve(model_id)
    caps = model.card.capabilities
    if capability in caps:
        return model
    if capability is Capability.CHAT_AUDIO and Capability.CHAT_TEXT not in caps:
        capability = Capability.CHAT_TEXT  # it cannot chat at all: say that
    able = _able(engine, capability)
    param = "model"
    if capability is Capability.TEXT_TO_SPEECH:
        message = f"Model '{model_id}' cannot read text aloud on /v1/audio/speech"
        if Capability.CHAT_AUDIO in caps:
            message += (
                '; it is a chat model: ask POST /v1/chat/completions with modalities ["text", '
                '"audio"] for a spoken reply'
            )
        others = "speech models served here"
    elif capability is Capability.CHAT_TEXT:
        message = f"Model '{model_id}' cannot chat"
        if Capability.TEXT_TO_SPEECH in caps:
            message += (
                ": it only turns text into speech; send the text to POST /v1/audio/speech instead"
            )
        others = "chat models served here"
    elif capability in (Capability.TRANSCRIPTION, Capability.AUDIO_INPUT):
        what = "transcribe audio" if capability is Capability.TRANSCRIPTION else "hear audio"
        message = f"Model '{model_id}' cannot {what}"
        others = f"models served here that {what}"
    else:  # CHAT_AUDIO
        param = "modalities"
        message = f"Model '{model_id}' can chat but not answer with audio"
        if Capability.CHAT_TEXT in caps:
            message += '; ask for modalities ["text"] only'
        others = "models served here that answer with audio"
    message += f" ({others}: {', '.join(able)})." if able else f" (no {others})."
    raise InvalidRequestError(message, param=param, code="unsupported_model")
