"""Server voice activity detection of ``/v1/realtime`` (``turn_detection: server_vad``).

Energy-based: the input (float32 mono at 24 kHz, OpenAI's pcm16 rate) is cut into
``FRAME_MS`` frames; a frame is speech when its RMS level is above the threshold
(``level_dbfs(threshold)``: OpenAI's ``threshold`` in [0, 1] maps linearly onto -70..-10 dBFS,
0.5 -> -40 dBFS). Speech starts after ``MIN_SPEECH_MS`` of consecutive speech frames (a click
does not start a turn) and stops after ``silence_duration_ms`` of consecutive quiet frames;
the turn then spans from ``prefix_padding_ms`` before its first speech frame to the end of its
last one. Times are in milliseconds of input audio since the session's first sample, as OpenAI's
``audio_start_ms`` / ``audio_end_ms``.

Why energy and not a model: no VAD model package (silero-vad, webrtcvad, pyannote) is installed
in this environment, and a model fetched at run time would break offline serving; energy gating
is what OpenAI's ``server_vad`` describes (a level threshold with padding and a silence
duration), and it is exact and cheap for the tests' synthetic speech. Its weakness is noise: a
loud steady background reads as speech (raise ``threshold`` then).

numpy only.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

SAMPLE_RATE = 24_000
FRAME_MS = 20
MIN_SPEECH_MS = 60
FRAME_SAMPLES = SAMPLE_RATE * FRAME_MS // 1000


def level_dbfs(threshold: float) -> float:
    """The RMS level (dBFS, full scale = 1.0) above which a frame is speech, for OpenAI's
    ``threshold`` in [0, 1]: ``-70 + 60 * threshold``."""
    return -70.0 + 60.0 * threshold


@dataclass(frozen=True, slots=True)
class VadSettings:
    """``turn_detection`` of type ``server_vad`` (OpenAI's fields and defaults).

    Attributes:
        threshold: in [0, 1]; higher needs louder speech (``level_dbfs``).
        prefix_padding_ms: audio kept before the first speech frame.
        silence_duration_ms: quiet time that ends a turn.
        create_response: answer each committed turn (``response.create``) at once.
        interrupt_response: speech that starts while a response runs cancels it (barge-in).

    Raises:
        ValueError: a value out of range (the field is named).
    """

    threshold: float = 0.5
    prefix_padding_ms: int = 300
    silence_duration_ms: int = 500
    create_response: bool = True
    interrupt_response: bool = True

    def __post_init__(self) -> None:
        if not 0.0 <= self.threshold <= 1.0:
            raise ValueError(f"threshold must be in [0, 1], got {self.threshold}")
        if not 0 <= self.prefix_padding_ms <= 10_000:
            raise ValueError(
                f"prefix_padding_ms must be in [0, 10000], got {self.prefix_padding_ms}"
            )
        if not FRAME_MS <= self.silence_duration_ms <= 10_000:
            got = self.silence_duration_ms
            raise ValueError(f"silence_duration_ms must be in [{FRAME_MS}, 10000], got {got}")


@dataclass(frozen=True, slots=True)
class SpeechStarted:
    """Speech began at ``start_ms`` (its first speech frame)."""

    start_ms: int


@dataclass(frozen=True, slots=True)
class SpeechStopped:
    """Speech that began at ``start_ms`` ended at ``end_ms`` (the end of its last speech frame);
    the turn is ``[max(0, start_ms - prefix_padding_ms), end_ms]``."""

    start_ms: int
    end_ms: int


class EnergyVad:
    """Streaming energy VAD over 24 kHz float32 input (see the module docstring)."""

    def __init__(self, settings: VadSettings, origin: int = 0):
        """``origin``: the session sample index of the first sample ``feed`` will get (a VAD
        turned on mid-session reports times on the session's time line)."""
        self.settings = settings
        self.origin = origin
        self.level = 10 ** (level_dbfs(settings.threshold) / 20)  # RMS amplitude
        self.pending = np.zeros(0, dtype=np.float32)  # samples short of a whole frame
        self.frames = 0  # whole frames seen
        self.run = 0  # consecutive speech frames (before a start) or quiet ones (during speech)
        self.start_frame: int | None = None  # first frame of the speech in progress

    @property
    def speaking(self) -> bool:
        """Speech has started and not yet stopped."""
        return self.start_frame is not None

    def feed(self, samples: np.ndarray) -> list[SpeechStarted | SpeechStopped]:
        """Consume float32 ``[n]`` samples; returns the events they complete, in order."""
        data = np.concatenate([self.pending, np.asarray(samples, dtype=np.float32)])
        whole = len(data) // FRAME_SAMPLES * FRAME_SAMPLES
        frames = data[:whole].reshape(-1, FRAME_SAMPLES).astype(np.float64)
        self.pending = data[whole:]
        loud = np.sqrt(np.mean(frames**2, axis=1)) > self.level  # [num_frames]
        events: list[SpeechStarted | SpeechStopped] = []
        for is_speech in loud:
            event = self._step(bool(is_speech))
            if event is not None:
                events.append(event)
        return events

    def _step(self, is_speech: bool) -> SpeechStarted | SpeechStopped | None:
        frame, self.frames = self.frames, self.frames + 1
        if self.start_frame is None:
            self.run = self.run + 1 if is_speech else 0
            if self.run * FRAME_MS >= MIN_SPEECH_MS:
                self.start_frame, self.run = frame + 1 - self.run, 0
                return SpeechStarted(self._ms(self.start_frame))
            return None
        self.run = 0 if is_speech else self.run + 1
        if self.run * FRAME_MS >= self.settings.silence_duration_ms:
            start = self._ms(self.start_frame)
            end = self._ms(frame + 1 - self.run)
            self.start_frame, self.run = None, 0
            return SpeechStopped(start, end)
        return None

    def _ms(self, frame: int) -> int:
        """The session time (ms) of the start of ``frame``."""
        return (self.origin + frame * FRAME_SAMPLES) * 1000 // SAMPLE_RATE

    def reset(self) -> None:
        """Forget any speech in progress (the input buffer was cleared or committed by hand);
        the time line goes on."""
        self.run = 0
        self.start_frame = None
