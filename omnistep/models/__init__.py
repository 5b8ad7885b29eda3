"""Model families: each builds a ``ModelCard`` (data) with a factory, found by family name."""
