"""The ``piper`` family: the embedded default voice (a VITS ONNX voice shipped on PyPI).

``frontend`` turns text into sentences of phoneme ids (piper-tts's espeak-ng phonemizer);
``voice`` runs one sentence per AUDIO_CHUNK unit with seeded, request-local noise. Nothing is
imported here, so that the registry can list the family without importing piper-tts/onnxruntime.
"""
