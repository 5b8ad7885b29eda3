"""The toy family: tiny deterministic numpy cards for runtime tests."""
