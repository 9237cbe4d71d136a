"""Processes as /proc and the kernel show them: stat fields, task trees, limits, sockets."""
