"""Contracts shared by every plane: enums, requests, loop protocol, card and program types.

Imports nothing else of omnistep and never imports torch (stdlib and numpy only).
"""

from omnistep.core.card import ComponentSpec, LoopSpec, ModelCard, ModelInstance
from omnistep.core.contracts import (
    Component,
    Done,
    Loop,
    LoopResult,
    LoopState,
    Pending,
    ResourceRequest,
    ShapeSignature,
    StepResult,
    StreamChunk,
    WorkPlan,
)
from omnistep.core.enums import (
    OPENAI_TTS_MODELS,
    OPENAI_VOICES,
    Capability,
    ExecutionProfile,
    LoopKind,
    Modality,
    WorkUnitKind,
)
from omnistep.core.errors import (
    CardValidationError,
    DeviceUnavailableError,
    EngineOverloadedError,
    InvalidRequestError,
    MissingDependencyError,
    ModelFilesError,
    ModelNotFoundError,
    OmnistepError,
    RequestAbortedError,
    RequestFailedError,
    RequestTimeoutError,
)
from omnistep.core.program import Channel, KernelNode, LoopNode, Program, ProgramContext
from omnistep.core.request import ChatMessage, Request, SamplingParams

__all__ = [
    "OPENAI_TTS_MODELS",
    "OPENAI_VOICES",
    "Capability",
    "CardValidationError",
    "ChatMessage",
    "Channel",
    "Component",
    "ComponentSpec",
    "DeviceUnavailableError",
    "Done",
    "EngineOverloadedError",
    "ExecutionProfile",
    "InvalidRequestError",
    "KernelNode",
    "Loop",
    "LoopKind",
    "LoopNode",
    "LoopResult",
    "LoopSpec",
    "LoopState",
    "MissingDependencyError",
    "Modality",
    "ModelCard",
    "ModelInstance",
    "ModelFilesError",
    "ModelNotFoundError",
    "OmnistepError",
    "Pending",
    "Program",
    "ProgramContext",
    "Request",
    "RequestAbortedError",
    "RequestFailedError",
    "RequestTimeoutError",
    "ResourceRequest",
    "SamplingParams",
    "ShapeSignature",
    "StepResult",
    "StreamChunk",
    "WorkPlan",
    "WorkUnitKind",
]
