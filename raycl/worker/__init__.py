"""The Ray Train side of a trial: the worker loop shared by every method.

Modules, each one responsibility; import them directly (this package face imports nothing):

- :mod:`raycl.worker.outcome`: the keys a worker reports when a trial fails, and why.
"""
