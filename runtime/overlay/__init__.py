"""The container's writable layer: captured at checkpoint into a tar with its deletions
(``capture``, ``tar``, ``check``), applied onto the restored container's rootfs (``rootfs``), and
undone if the restore fails or the plugin dies midway (``undo``, and the journal in ``pending``);
``fs`` holds the fd-relative file operations they share. Every path is walked through directory
fds, nothing followed out of the rootfs.

The flows use :func:`capture`, :func:`apply` and ``runtime.overlay.pending``."""

from runtime.overlay.rootfs import DEFAULT_EXCLUDES, DEFAULT_MAX_LAYER_BYTES, apply, capture

__all__ = ["DEFAULT_EXCLUDES", "DEFAULT_MAX_LAYER_BYTES", "apply", "capture"]
