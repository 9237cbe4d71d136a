"""Node set-up: containerd's config with NRI turned on (``containerd_config``, or a drop-in file
where the node's config imports them: ``dropin``), refused where something else manages
containerd (``host``), and ``rekindle nri-toggle``, the command the chart's init container runs
(``toggle``). Not the engine: it runs once per node, before any pod."""
