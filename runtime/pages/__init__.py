"""The bulk pages: split out of CRIU's images at checkpoint and written into the restored tree
(``bulk``: fill, verified piece by piece; ``chunks``: the one read that checks each chunk's
digest), served through userfaultfd while the CUDA restore runs (``stream``, one restore's
session; ``serve``, the server; ``source`` and ``sink``, where its pieces come from and go;
``uffd``; and ``holder``, the second holder that kills the tree if the server dies),
or mapped from the node cache (``nodecache``: verified copies on node-local storage; ``entry``: the
one streamed restores make as they run; ``mapping``: which ranges map and the images rewritten for
it).

Nothing is imported here: the holder (``python -m runtime.pages.holder``, started for each
streamed restore while its tree waits) loads only what it runs."""
