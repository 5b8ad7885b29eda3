"""The ``kokoro`` family: Kokoro-82M v1.0 (ONNX) on the folder Kokoro-FastAPI and kokoro-onnx
users have (``kokoro-v1.0.onnx`` or ``kokoro-v1.0.int8.onnx`` + ``voices-v1.0.bin``).

``loader`` finds and checks the files; ``voices`` reads voice packs by name and Kokoro-FastAPI's
blend syntax; ``voice`` is the ONNX component (one sentence per AUDIO_CHUNK unit); ``card`` the
card. Nothing is imported here, so that the registry can list the family without importing
onnxruntime.
"""
