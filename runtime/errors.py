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
