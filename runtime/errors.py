"""Rekindle's error hierarchy.

Every boundary of the engine raises a subclass of :class:`RekindleError`, carrying the data a
caller needs (which object, which operation, where the log is). The NRI handlers catch
``RekindleError`` and fall back to a cold start; anything else is a bug and is logged with its
traceback before the same fallback.
"""

from __future__ import annotations


class RekindleError(Exception):
    """Base class of every error Rekindle raises on purpose."""


class ConfigError(RekindleError):
    """A configuration file or setting is invalid."""


class KeyMissing(ConfigError):
    """There is no HMAC key at ``path`` (``reason`` says more when its directory is missing)."""

    def __init__(self, path: str, reason: str = "") -> None:
        super().__init__(f"no HMAC key at {path}" + (f": {reason}" if reason else ""))
        self.path = path
        self.reason = reason


class AnnotationError(RekindleError):
    """A pod annotation is malformed or names something that cannot be used."""

    def __init__(self, key: str, reason: str) -> None:
        super().__init__(f"annotation {key}: {reason}")
        self.key = key
        self.reason = reason


class StoreError(RekindleError):
    """The artifact store could not be read or written."""


class ArtifactRejected(RekindleError):
    """An artifact exists but must not be used (bad signature, digest, compatibility, privilege)."""

    def __init__(self, name: str, reason: str) -> None:
        super().__init__(f"artifact {name}: {reason}")
        self.name = name
        self.reason = reason


class ArtifactNotFound(StoreError):
    """No artifact of that name in that namespace."""


class OverlayError(RekindleError):
    """Capturing or applying a container's writable layer failed (or an entry was unsafe)."""


class ContainerNotFound(RekindleError):
    """A container, its task or its bundle could not be found."""


class NamespaceError(RekindleError):
    """Entering a container's namespaces failed."""


class ConfinementError(RekindleError):
    """A restored process could not be held to the target container's limits."""


class CriuError(RekindleError):
    """CRIU failed; ``log_path`` names its log."""

    def __init__(self, op: str, message: str, log_path: str | None = None) -> None:
        where = f", log at {log_path}" if log_path else ""
        super().__init__(f"criu {op} failed: {message}{where}")
        self.op = op
        self.log_path = log_path


class CudaError(RekindleError):
    """A CUDA driver checkpoint call failed."""

    def __init__(self, call: str, code: int, name: str) -> None:
        super().__init__(f"{call} failed: {name} ({code})")
        self.call = call
        self.code = code
        self.name = name


class CudaUnavailable(RekindleError):
    """libcuda (or its checkpoint API) is not present on this node."""
