"""The shared store: versions of an artifact published atomically and read through one fd
(``volume``), one open version verified against its signed manifest (``artifact``), the node's
signing key (``keys``), read-ahead into the page cache before a restore (``readahead``), and the
sweep and pruning of what writers left (``gc``). Everything in the store is untrusted until its
digest matched; nothing in it is followed.

The flows and the plugin use the names below, ``runtime.store.gc`` and ``runtime.store.readahead``."""

from runtime.store.artifact import Artifact
from runtime.store.keys import load_key, read_key
from runtime.store.volume import ArtifactStore

__all__ = ["Artifact", "ArtifactStore", "load_key", "read_key"]
