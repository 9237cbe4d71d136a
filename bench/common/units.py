"""The byte units the bench scripts report in: rates in decimal GB/s, sizes in GiB."""

from __future__ import annotations

GB = 1e9
GIB = 1 << 30
