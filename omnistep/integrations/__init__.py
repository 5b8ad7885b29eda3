"""Adapters that let existing RL frameworks use omnistep as their rollout engine.

Each module maps one framework's trainer hooks (how it asks for completions, log-probs and
weight syncs) onto the offline API (``omnistep.offline``: ``rollout``, ``score``,
``update_weights`` with a ``Trainer`` copy). A product-plane package: it imports the offline
API, core and the framework; never a model family, the engine's internals or the server.
"""
