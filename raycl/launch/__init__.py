"""Everything a launch does before the first trial: load a search YAML with ``--set``, check it
against the methods, the data, the models and the cluster, and decide where the sweep's state
lives.

- :mod:`raycl.launch.load`: ``load_search``: the YAML, ``--set``, pins, renames, then the checks;
- :mod:`raycl.launch.checks`: everything knowable before launch, one convention;
- :mod:`raycl.launch.feasibility`: which trials can train, and the feasible joint domain of the
  searched keys that decide it;
- :mod:`raycl.launch.placement`: what a trial asks of the cluster, and whether it fits;
- :mod:`raycl.launch.identity` and :mod:`raycl.launch.data_identity`: what a sweep's state was
  launched with, so that a changed setting or dataset never resumes it silently;
- :mod:`raycl.launch.sweep_plan`: where a sweep's state lives and what a launch does with it.

It stands above :mod:`raycl.config` (the schema, which imports nothing else of raycl) and beside
the rooms it asks (:mod:`raycl.methods`, :mod:`raycl.data`, :mod:`raycl.models`).
"""
