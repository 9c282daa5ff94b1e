"""The S3 server for tests: ``weed mini`` as ``tools.lib.seaweed`` starts it (the object-store benchmark uses it too)."""

from tools.lib.seaweed import ACCESS_KEY, SECRET_KEY, Seaweed, running_seaweed

__all__ = ["ACCESS_KEY", "SECRET_KEY", "Seaweed", "running_seaweed"]
