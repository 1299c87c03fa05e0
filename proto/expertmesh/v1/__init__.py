"""The ``expertmesh.v1`` wire contract: generated protobuf/gRPC code (``make proto``) and
the converters between messages and domain types (:mod:`expertmesh.v1.convert`)."""
