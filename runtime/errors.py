"""The runtime's named errors. The server maps them to HTTP codes; the CLI prints their message."""

from __future__ import annotations


class KubeinferError(Exception):
    """Base of every error the runtime raises on purpose."""


class ModelLoadError(KubeinferError):
    """The model cannot be built or its weights cannot be loaded.

    The message names the file and, where there is one, the tensor that is wrong.
    """


class UnsupportedModelError(ModelLoadError):
    """The config asks for an architecture or a setting that kubeinfer does not implement."""


class InvalidRequestError(KubeinferError, ValueError):
    """A request the engine can never serve as given (the server answers 400).

    `param` names the request field at fault ("prompt", "stop_token_ids", "max_tokens"), or is
    None when no single field is. A ValueError too, so callers that catch ValueError still do.
    """

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param
