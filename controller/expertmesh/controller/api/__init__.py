"""The REST API (FastAPI): ``create_app(core, telemetry, store, settings)``."""

from expertmesh.controller.api.app import create_app

__all__ = ["create_app"]
