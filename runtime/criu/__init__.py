"""CRIU: the binary and its options (``command``), a dump or a restore of a container's tree run
in its namespaces and confined (``executor``), the image files it reads and writes (``image_files``,
their protobuf types in ``proto``), its log (``log``), and its lazy-pages hand-off of each restored
task's userfaultfd (``lazy_pages``).

The flows use the names below; the page and restore modules read images through
``runtime.criu.image_files``. Nothing here imports a flow or another wing."""

from runtime.criu.command import (
    CRIU,
    MIN_VERSION,
    DumpOptions,
    RestoreOptions,
    criu_version,
    parse_version,
    version_tuple,
)
from runtime.criu.executor import DumpResult, dump_workload, restore_into

__all__ = ["CRIU", "MIN_VERSION", "DumpOptions", "DumpResult", "RestoreOptions", "criu_version", "dump_workload",
           "parse_version", "restore_into", "version_tuple"]
