"""omnistep: a step-level serving and rollout runtime for speech and omni models.

Every step a model takes (a token, a denoise step, a vocoder chunk) is a WorkUnit that one
scheduler sees, batches across requests, streams and can cancel.
"""

__version__ = "0.1.0"
