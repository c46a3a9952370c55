"""Runtime: placement plan, streaming load, process groups, TP/EP forward, caches, engine, scheduler.

* :mod:`k3rocm.runtime.plan` — ``plan(cfg, profile, tp, ep, ...) -> Placement``: per-rank tensor slices,
  bytes by part, memory budget, cache capacity, roofline.
* :mod:`k3rocm.runtime.load` — ``load(index, placement, ranks, device) -> LoadResult``: each rank streams
  exactly its byte ranges from the shard files and proves they landed.
* :mod:`k3rocm.runtime.dist` — env:// process groups (``nccl`` = RCCL on ROCm, ``gloo`` on CPU), a local
  launcher with a watchdog, and the torchrun entry.
* :mod:`k3rocm.runtime.tp` — the tensor/expert-parallel forward of the oracle model.

Submodules are imported on demand (``from k3rocm.runtime.plan import plan``); importing this package
loads nothing heavy.
"""
