"""Playback clocks and the admission rule of deadline-aware scheduling."""

import pytest

from omnistep.engine.deadlines import AdmissionPolicy, PlaybackClock


def test_clock_deadline_before_and_after_first_audio():
    clock = PlaybackClock(arrival=10.0, first_audio_s=0.5)
    assert not clock.started and clock.deadline() == 10.5 and clock.buffered(11.0) == 0.0
    clock.on_audio(10.2, 0.0)  # an empty chunk starts nothing
    assert not clock.started
    clock.on_audio(10.3, 2.0)  # playback starts at 10.3 with 2 s of audio
    assert clock.started and clock.deadline() == pytest.approx(12.3)
    clock.on_audio(11.0, 1.5)
    assert clock.deadline() == pytest.approx(13.8)
    assert clock.buffered(12.8) == pytest.approx(1.0)
    assert clock.buffered(14.0) == pytest.approx(-0.2)  # ran dry 0.2 s ago


def test_new_request_outranks_a_stream_with_buffered_audio():
    stream = PlaybackClock(arrival=0.0, first_audio_s=0.5)
    stream.on_audio(0.4, 3.0)  # plays until 3.4
    newcomer = PlaybackClock(arrival=1.0, first_audio_s=0.5)  # due at 1.5
    assert newcomer.deadline() < stream.deadline()
    late = PlaybackClock(arrival=3.2, first_audio_s=0.5)  # due at 3.7: the stream goes first
    assert stream.deadline() < late.deadline()


def test_admission_waits_while_a_started_stream_is_short_of_audio():
    policy = AdmissionPolicy(guard_s=0.5, max_wait_s=2.0)
    rich = PlaybackClock(0.0, 0.5)
    rich.on_audio(0.1, 5.0)
    poor = PlaybackClock(0.0, 0.5)
    poor.on_audio(0.1, 1.0)  # dry at 1.1
    unstarted = PlaybackClock(0.0, 0.5)
    assert policy.may_admit(0.2, 0.2, [])
    assert policy.may_admit(0.2, 0.2, [rich, unstarted])
    assert policy.may_admit(0.5, 0.5, [rich, poor])  # poor holds 0.6 s
    assert not policy.may_admit(0.7, 0.5, [rich, poor])  # poor holds 0.4 s
    assert policy.may_admit(2.5, 0.5, [rich, poor])  # waited max_wait_s
    # where the card sets max_starting, a burst starts that many at a time
    starting = [rich, unstarted, PlaybackClock(0.0, 0.5)]
    assert policy.may_admit(0.2, 0.2, starting)
    assert policy.may_admit(0.2, 0.2, starting, max_starting=3)
    assert not policy.may_admit(0.2, 0.2, starting, max_starting=2)
    assert policy.may_admit(2.2, 0.2, starting, max_starting=2)
    with pytest.raises(ValueError):
        AdmissionPolicy(guard_s=-1.0)
