"""Clients of containerd's gRPC socket: its Containers service (client.py) and CRI (cri.py).

Both dial with ``RECONNECT_OPTIONS``: containerd restarts (a node's upgrade, a crash) must not
leave a long-lived client failing fast for the reconnect backoff gRPC grows by default (1 s
times 1.6 per failed attempt, up to 2 minutes). A restore's entrypoint swap and image id are
asked of containerd in the seconds right after it comes back; the socket is local, so trying
again every second costs nothing.
"""

RECONNECT_OPTIONS = [("grpc.initial_reconnect_backoff_ms", 100), ("grpc.min_reconnect_backoff_ms", 100),
                     ("grpc.max_reconnect_backoff_ms", 1000)]
