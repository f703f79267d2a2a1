"""Python exceptions for attnforge::Error, one class per ErrorKind, carrying the C++ message unchanged.

Every class derives from ``attnforge.Error`` and from the built-in exception that fits, so code written for
FlashInfer (which raises ``ValueError`` for bad arguments) keeps working.
"""
from . import _C


class Error(Exception):
    """Base of every error attnforge raises."""


class InvalidArgumentError(Error, ValueError):
    """A value, shape, dtype or stride the caller passed is wrong (ErrorKind::kInvalidArgument)."""


class UnsupportedError(Error, NotImplementedError):
    """Valid input this build or device cannot run (ErrorKind::kUnsupported)."""


class WorkspaceError(Error, ValueError):
    """The workspace buffer is smaller than the plan needs (ErrorKind::kWorkspace)."""


class PlanMismatchError(Error, ValueError):
    """run() got data of another batch than the one planned (ErrorKind::kPlanMismatch)."""


class BackendError(Error, RuntimeError):
    """A device runtime call failed (ErrorKind::kBackend)."""


# Order of attnforge::ErrorKind.
_C._set_error_types((InvalidArgumentError, UnsupportedError, WorkspaceError, PlanMismatchError, BackendError))


def invalid(message):
    """An InvalidArgumentError raised by the Python layer, worded like the C++ ones (argument, value, accepted)."""
    return InvalidArgumentError(message)
