"""A container's plumbing: its namespaces, OCI spec, mounts, device rules and host view."""
