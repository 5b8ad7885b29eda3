"""The piper family: Piper VITS voices (ONNX) with the espeak-ng phonemizer of piper-tts."""
