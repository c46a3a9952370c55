"""Checkpoint I/O: tensor layout (``layout``), validating lazy reader (``reader``), random-weight writer
(``writer``), sha256 manifests / shard fingerprints (``verify``) and the embedded default (``embedded``).

Import the module that holds a name (``from k3rocm.checkpoint.reader import open_checkpoint``): this package
re-exports nothing, because the reader and the writer import torch (measured ~1.0 s) and ``layout`` /
``verify`` users such as ``k3rocm plan`` need neither.
"""
