"""Test-only helpers for ChatTTS reference parity (upstream ``chattts`` 0.2.5).

* :mod:`tests.chattts_ref.shims` makes ``import ChatTTS`` work without torchaudio / encodec /
  scipy / requests (stand-ins only for code our parity paths never run).
* :mod:`omnistep.models.chattts.tiny` writes a checkpoint folder in the official layout, tiny
  or full size, with seeded random weights.
* :mod:`tests.chattts_ref.reference` runs the upstream code on such a folder and returns tensors
  to compare against; its docstring lists the upstream pipeline facts.

Nothing here imports torch or ChatTTS at package import time.
"""
