"""Stand-ins that let upstream ``ChatTTS`` (chattts 0.2.5) import in this venv.

Upstream imports at module level four packages that are absent here and that the parity paths
(Tokenizer -> Embed -> GPT -> Decoder -> Vocos on hidden states) never *call*:

* ``torchaudio`` -- imported by ``ChatTTS/model/dvae.py`` and ``vocos/feature_extractors.py``
  (``import torchaudio``) and ``vocos/heads.py`` (``from torchaudio.functional.functional import
  _hz_to_mel, _mel_to_hz``).  Stand-in: ``transforms.MelSpectrogram``, an ``nn.Module`` with the
  same two persistent buffers as torchaudio's (``spectrogram.window`` [n_fft], periodic Hann;
  ``mel_scale.fb`` [n_fft // 2 + 1, n_mels], HTK, no norm), so the official ``DVAE`` and
  ``Vocos`` state dicts load strictly; its ``forward`` RAISES.  It is only called by the DVAE
  *encoder* (``Chat.sample_audio_speaker``, reference-audio speakers) and by
  ``Vocos.forward(audio)``; ChatTTS synthesis uses ``Vocos.decode(mel)``.
  ``functional.functional._hz_to_mel`` / ``_mel_to_hz``: the HTK formulas (used only by vocos'
  ``IMDCTCosHead``, not by ChatTTS).
* ``encodec`` -- imported by ``vocos/feature_extractors.py``.  Stand-in: ``EncodecModel`` whose
  constructors RAISE (only ``EncodecFeatures`` uses it; ChatTTS uses ``MelSpectrogramFeatures``).
* ``scipy`` -- ``import scipy`` in ``vocos/spectral_ops.py``.  Stand-in: ``signal.cosine`` that
  RAISES (MDCT / IMDCT windows only; ChatTTS uses ``ISTFT``).
* ``requests`` -- imported by ``ChatTTS/utils/dl.py``.  Stand-in: ``get`` that RAISES (asset
  download only).

A stand-in is inserted only when the real module cannot be found.  Everything else is the real
upstream code: ``vocos.Vocos``, ``vocos.models.VocosBackbone``, ``vocos.heads.ISTFTHead``,
``vocos.spectral_ops.ISTFT``, and all of ``ChatTTS``.

By default :func:`install_shims` imports ``ChatTTS`` and ``vocos`` with the stand-ins present and
then takes the stand-ins out of ``sys.modules`` again: the imported upstream modules keep their
references, while other code in the same process (``importlib.util.find_spec("torchaudio")``,
``transformers``' availability checks, optional ``import scipy``) still sees the packages as
absent.  Pass ``keep=True`` to leave them registered.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
from collections.abc import Callable

from omnistep.models.chattts.tiny import hz_to_mel_htk, mel_filterbank_htk, mel_to_hz_htk

STUB_MARKER = "__omnistep_test_stub__"


class ShimNotImplementedError(NotImplementedError):
    """Raised when upstream code reaches a stand-in that only exists to satisfy an import."""


def _raiser(what: str) -> Callable[..., object]:
    def _raise(*_args: object, **_kwargs: object) -> object:
        raise ShimNotImplementedError(
            f"{what} is a test stand-in (tests/chattts_ref/shims.py); this code path is not "
            "part of the ChatTTS parity reference"
        )

    return _raise


def _module(name: str, doc: str) -> types.ModuleType:
    mod = types.ModuleType(name, doc)
    setattr(mod, STUB_MARKER, True)
    # A spec keeps importlib.util.find_spec() from raising on a registered stub.
    mod.__spec__ = importlib.util.spec_from_loader(name, loader=None)
    return mod


def _make_torchaudio() -> dict[str, types.ModuleType]:
    import torch
    from torch import nn

    class _Spectrogram(nn.Module):
        def __init__(self, n_fft: int, win_length: int, hop_length: int) -> None:
            super().__init__()
            self.n_fft, self.win_length, self.hop_length = n_fft, win_length, hop_length
            self.register_buffer("window", torch.hann_window(win_length))

        forward = _raiser("torchaudio.transforms.Spectrogram.forward")

    class _MelScale(nn.Module):
        def __init__(self, n_mels: int, sample_rate: int, n_stft: int) -> None:
            super().__init__()
            self.n_mels, self.sample_rate = n_mels, sample_rate
            self.register_buffer("fb", mel_filterbank_htk(n_stft, n_mels, sample_rate))

        forward = _raiser("torchaudio.transforms.MelScale.forward")

    class MelSpectrogram(nn.Module):
        """Shape-faithful stand-in for ``torchaudio.transforms.MelSpectrogram`` (no forward)."""

        def __init__(
            self,
            sample_rate: int = 16000,
            n_fft: int = 400,
            win_length: int | None = None,
            hop_length: int | None = None,
            f_min: float = 0.0,
            f_max: float | None = None,
            pad: int = 0,
            n_mels: int = 128,
            power: float = 2.0,
            center: bool = True,
            **_kwargs: object,
        ) -> None:
            super().__init__()
            self.sample_rate, self.n_fft, self.n_mels = sample_rate, n_fft, n_mels
            self.win_length = win_length if win_length is not None else n_fft
            self.hop_length = hop_length if hop_length is not None else self.win_length // 2
            self.f_min, self.f_max, self.pad, self.power, self.center = (
                f_min,
                f_max,
                pad,
                power,
                center,
            )
            self.spectrogram = _Spectrogram(n_fft, self.win_length, self.hop_length)
            self.mel_scale = _MelScale(n_mels, sample_rate, n_fft // 2 + 1)

        forward = _raiser("torchaudio.transforms.MelSpectrogram.forward")

    doc = "test stand-in for torchaudio (tests/chattts_ref/shims.py)"
    root = _module("torchaudio", doc)
    root.__path__ = []  # a package, so "torchaudio.transforms" imports resolve
    transforms = _module("torchaudio.transforms", doc)
    transforms.MelSpectrogram = MelSpectrogram
    functional = _module("torchaudio.functional", doc)
    functional.__path__ = []
    functional_functional = _module("torchaudio.functional.functional", doc)
    functional_functional._hz_to_mel = hz_to_mel_htk
    functional_functional._mel_to_hz = mel_to_hz_htk
    functional.functional = functional_functional
    root.transforms = transforms
    root.functional = functional
    root.load = _raiser("torchaudio.load")
    return {
        "torchaudio": root,
        "torchaudio.transforms": transforms,
        "torchaudio.functional": functional,
        "torchaudio.functional.functional": functional_functional,
    }


def _make_encodec() -> dict[str, types.ModuleType]:
    mod = _module("encodec", "test stand-in for encodec (tests/chattts_ref/shims.py)")

    class EncodecModel:
        encodec_model_24khz = staticmethod(_raiser("encodec.EncodecModel.encodec_model_24khz"))
        encodec_model_48khz = staticmethod(_raiser("encodec.EncodecModel.encodec_model_48khz"))

    mod.EncodecModel = EncodecModel
    return {"encodec": mod}


def _make_scipy() -> dict[str, types.ModuleType]:
    doc = "test stand-in for scipy (tests/chattts_ref/shims.py)"
    root = _module("scipy", doc)
    root.__path__ = []
    signal = _module("scipy.signal", doc)
    signal.cosine = _raiser("scipy.signal.cosine")
    root.signal = signal
    return {"scipy": root, "scipy.signal": signal}


def _make_requests() -> dict[str, types.ModuleType]:
    mod = _module("requests", "test stand-in for requests (tests/chattts_ref/shims.py)")
    mod.get = _raiser("requests.get")
    return {"requests": mod}


_FACTORIES: dict[str, Callable[[], dict[str, types.ModuleType]]] = {
    "torchaudio": _make_torchaudio,
    "encodec": _make_encodec,
    "scipy": _make_scipy,
    "requests": _make_requests,
}


def _is_missing(name: str) -> bool:
    if name in sys.modules:
        return False
    try:
        return importlib.util.find_spec(name) is None
    except (ImportError, ValueError):
        return True


def missing_modules() -> list[str]:
    """The top-level modules that :func:`install_shims` would stand in for right now."""
    return [name for name in _FACTORIES if _is_missing(name)]


# Real modules upstream needs, imported before any stand-in is registered.
_REAL_DEPENDENCIES = (
    "torch",
    "numpy",
    "transformers",
    "transformers.models.llama.modeling_llama",
    "transformers.models.bert.tokenization_bert",
    "transformers.cache_utils",
    "transformers.modeling_outputs",
    "transformers.generation",
    "safetensors",
    "huggingface_hub",
    "vector_quantize_pytorch",
    "pybase16384",
    "numba",
    "tqdm",
    "yaml",
)

_STATE: dict[str, object] = {"done": False, "stubbed": ()}


def install_shims(keep: bool = False) -> tuple[str, ...]:
    """Make ``import ChatTTS`` (and ``from vocos import Vocos``) work; idempotent.

    Returns the names of the top-level modules that were stood in for.  With ``keep=False``
    (default) the stand-ins are removed from ``sys.modules`` once ``ChatTTS`` and ``vocos`` are
    imported; with ``keep=True`` they stay registered (only honoured on the first call).
    """
    if _STATE["done"]:
        return _STATE["stubbed"]  # type: ignore[return-value]
    # Import the real dependencies first, with no stand-in registered: libraries such as
    # transformers probe optional packages (``find_spec("scipy")``) at import time and cache it.
    for real in _REAL_DEPENDENCIES:
        importlib.import_module(real)
    stubbed = tuple(missing_modules())
    added: dict[str, types.ModuleType] = {}
    for name in stubbed:
        for mod_name, mod in _FACTORIES[name]().items():
            if mod_name not in sys.modules:
                sys.modules[mod_name] = mod
                added[mod_name] = mod
    before = set(sys.modules)
    try:
        importlib.import_module("vocos")
        importlib.import_module("vocos.feature_extractors")
        importlib.import_module("vocos.models")
        importlib.import_module("vocos.heads")
        importlib.import_module("ChatTTS")
    except BaseException:
        # Do not leave half-imported upstream modules behind.
        for mod_name in set(sys.modules) - before:
            if mod_name.startswith(("ChatTTS", "vocos")):
                sys.modules.pop(mod_name, None)
        _remove(added)
        raise
    if not keep:
        _remove(added)
    _STATE["done"] = True
    _STATE["stubbed"] = stubbed
    return stubbed


def _remove(added: dict[str, types.ModuleType]) -> None:
    for mod_name, mod in added.items():
        if sys.modules.get(mod_name) is mod:
            del sys.modules[mod_name]


def is_stub(module: object) -> bool:
    """True for a module object created by this file."""
    return bool(getattr(module, STUB_MARKER, False))
