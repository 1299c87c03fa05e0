"""expertmesh.engines: the serving engines' own files, in and out.

- :func:`~expertmesh.engines.load.import_trace`: expert-load statistics recorded by
  TensorRT-LLM, SGLang or a per-token routing table, as a trace ``load`` [T, L, R, E].
- :func:`~expertmesh.engines.files.write_export` / :func:`~expertmesh.engines.files.read_export`:
  a placement (``phy2log`` [L, R, S]) as SGLang's ``--init-expert-location`` map,
  TensorRT-LLM's MoE load balancer config or vLLM's EPLB maps, and back.
- :mod:`~expertmesh.engines.placement`: the pure conversions and what cannot be expressed.

Files are read as hostile, like :mod:`expertmesh.formats`: size limits, headers checked
before tensors are read, ``torch.load(weights_only=True)``, ``yaml.safe_load``.
docs/engines.md walks through it and names the engine versions these formats follow.
"""
