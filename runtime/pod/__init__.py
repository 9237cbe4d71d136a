"""Calls made inside a pod's network namespace: readiness probes and the engine's hooks."""
