"""The product plane: OpenAI-compatible HTTP server. Imports engine, audio and core, never models.

The server validates a body, builds a ``Request``, subscribes to its stream and encodes it; it
never reaches into a model.
"""

from omnistep.server.app import ServerConfig, build_app

__all__ = ["ServerConfig", "build_app"]
