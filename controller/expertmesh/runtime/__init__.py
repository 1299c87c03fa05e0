"""The Ray wiring of expertmesh: a controller actor and worker actors on a (local) Ray cluster.

An entry-level package: it imports :mod:`expertmesh.controller` (the decision core and
its surfaces) and :mod:`expertmesh.workers` (the data plane), neither of which imports
the other or Ray. Every Ray call of expertmesh lives in this package: the driver
(:mod:`~expertmesh.runtime.spmd`), the worker and controller actors, and their fault paths.
"""
