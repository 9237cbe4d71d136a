"""What the bench scripts share, by job: a bench script imports these (and ``bench.drill``,
``bench.workloads``), never another bench script.

- ``units``: GB and GiB;
- ``disk``: the page cache dropped, files read on threads, a scratch dir with room;
- ``h2d``: host-to-device copy rates, measured in a child Python with torch;
- ``model``: the Qwen2-7B-shaped test model, made once;
- ``results``: the machine's facts for a result document, and writing it;
- ``targets``: a child process holding a fresh region to fill, and a bulk file for it;
- ``workload``: the restore benches' workloads (start, readiness, the same answer);
- ``plugin``: the plugin's side of a restore bench (its timings, restarts, node cache);
- ``restore_rig``: the restore benches' source pod, restores awaited, clean-up.
"""
