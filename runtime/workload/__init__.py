"""Files that ship into workload images (each self-contained: nothing from Rekindle is imported)."""
