"""The Ray wiring of expertmesh: a controller actor and worker actors on a (local) Ray cluster.

An entry-level package: it imports :mod:`expertmesh.controller` (the decision core and
its surfaces) and :mod:`expertmesh.workers` (the data plane), neither of which imports
the other or Ray. Every Ray call lives in :mod:`expertmesh.runtime.cluster`.
"""
