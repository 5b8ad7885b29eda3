"""Typed exceptions. The server maps them to OpenAI-style error JSON."""


class OmnistepError(Exception):
    """Base of every error omnistep raises on purpose. Pickles with its attributes (subclasses
    whose ``__init__`` takes other arguments than the message included), so an error raised
    in another process (a Ray actor) arrives as itself."""

    def __reduce__(self) -> tuple:
        return _restore, (type(self), self.args, self.__dict__)


def _restore(cls: type, args: tuple, state: dict) -> OmnistepError:
    """An unpickled ``OmnistepError``: made without calling ``__init__``."""
    exc = cls.__new__(cls, *args)
    exc.args = args
    exc.__dict__.update(state)
    return exc


class InvalidRequestError(OmnistepError, ValueError):
    """The request is malformed or names something unsupported.

    Attributes:
        param: the offending request field, or None.
        code: a short machine-readable code, or None.
    """

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.param = param
        self.code = code


class ModelNotFoundError(InvalidRequestError):
    """No served card answers to the requested model id.

    Args:
        model: the id asked for (quoted in the message, cut to 200 characters).
        served: the ids that are served, listed in the message when given.
    """

    def __init__(self, model: str, served: tuple[str, ...] = ()):
        message = f"The model '{model[:200]}' does not exist"
        message += f"; this server serves: {', '.join(served)}." if served else "."
        super().__init__(message, param="model", code="model_not_found")
        self.served = served


class WeightUpdateError(InvalidRequestError):
    """A weight update names a tensor the model does not have (or does not let change), or
    gives one with the wrong shape or dtype. Nothing was changed.

    Attributes:
        problems: one line per offending tensor.
    """

    def __init__(self, model: str, problems: list[str]):
        shown = "; ".join(problems[:5])
        more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
        super().__init__(
            f"weight update for '{model}' refused, nothing changed: {shown}{more}",
            param="weights",
            code="invalid_weights",
        )
        self.problems = problems


class WeightVersionError(InvalidRequestError):
    """A weight update asked for a version that is not above the one served: versions only go
    up (the server answers 409 Conflict). Nothing was changed.

    Attributes:
        requested: the version asked for.
        current: the version the model runs.
    """

    def __init__(self, model: str, requested: int, current: int):
        super().__init__(
            f"weight version {requested} for '{model}' refused: the model runs version "
            f"{current} and versions only go up (ask for {current + 1} or more, or leave "
            "version out)",
            param="version",
            code="version_conflict",
        )
        self.requested = requested
        self.current = current


class ModelFilesError(OmnistepError, FileNotFoundError):
    """A model's weights (a folder or a file given to ``--model family=PATH``) are missing or
    not laid out as expected; the message names the path and the files expected there."""


class MissingDependencyError(OmnistepError, ImportError):
    """A model family needs a package that is not installed; the message names the package and
    the ``pip install`` extra that brings it."""


class DeviceUnavailableError(OmnistepError, RuntimeError):
    """The device a model was asked to run on (``--device``) is not usable here (e.g. CUDA on
    a machine or torch build without it)."""


class CardValidationError(OmnistepError, ValueError):
    """A ModelCard is inconsistent (loops naming unknown components, dangling slots)."""


class RequestFailedError(OmnistepError, RuntimeError):
    """A request failed inside the engine (a step raised); other requests are unaffected."""


class EngineOverloadedError(OmnistepError):
    """The engine already runs its limit of unfinished requests; the client should retry later.

    Attributes:
        retry_after: seconds a client should wait before retrying (for ``Retry-After``).
    """

    def __init__(self, message: str, retry_after: int = 1):
        super().__init__(message)
        self.retry_after = retry_after


class RequestAbortedError(OmnistepError):
    """The request was aborted (client gone, timeout, shutdown) before it finished."""


class RequestTimeoutError(RequestAbortedError):
    """The request ran longer than the engine's ``request_timeout`` and was aborted.

    Attributes:
        timeout: the limit, in seconds.
    """

    def __init__(self, message: str, timeout: float):
        super().__init__(message)
        self.timeout = timeout
