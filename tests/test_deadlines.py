"""Playback clocks and the admission rule of deadline-aware scheduling."""

import pytest

from omnistep.engine.deadlines import AdmissionPolicy, CapacityMeter, PlaybackClock, UnitCostMeter


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


def test_capacity_meter_measures_audio_per_worker_second():
    meter = CapacityMeter(half_life_s=1e9, min_busy_s=0.5)
    assert meter.rate() is None
    meter.batch_started(0.0)
    meter.batch_started(0.1)  # overlapping batches: 0.5 + 0.9 worker-seconds
    meter.batch_finished(0.5)
    meter.on_audio(0.5, 4.0)
    meter.batch_finished(1.0)
    meter.on_audio(1.0, 3.0)
    meter.on_audio(5.0, 0.0)  # idle time is not busy time
    assert meter.rate() == pytest.approx(5.0)  # 7 audio-s in 1.4 worker-s
    # 1.4 batches ran at once on average (1.4 worker-s in 1 busy s): 7 audio-s/s measured, and
    # the 0.6 of a worker never seen beside them is credited 0.6 of a worker's 5 audio-s/s
    assert meter.rate(parallel=2) == pytest.approx(5.0 * (1.4 + 0.6 * 0.6))


def test_capacity_of_a_lone_batch_credits_the_other_workers_in_part():
    """A burst's first batch runs alone: a second worker is credited ``unseen_credit`` of what
    the first made (two batches at once slow each other down); once two have run together,
    what they made is the rate."""
    meter = CapacityMeter(half_life_s=1e9, min_busy_s=0.1, unseen_credit=0.6)
    meter.batch_started(0.0)
    meter.on_audio(0.5, 3.0)
    meter.batch_finished(0.5)
    assert meter.rate(parallel=2) == pytest.approx(6.0 * 1.6)
    assert CapacityMeter(unseen_credit=1.0).unseen_credit == 1.0
    together = CapacityMeter(half_life_s=1e9, min_busy_s=0.1, unseen_credit=0.6)
    together.batch_started(0.0)
    together.batch_started(0.0)
    together.on_audio(1.0, 5.0)
    together.batch_finished(1.0)
    together.batch_finished(1.0)
    assert together.rate(parallel=2) == pytest.approx(5.0)  # 5 audio-s in 1 s, two at once
    for bad in (0.0, 1.5):
        with pytest.raises(ValueError):
            CapacityMeter(unseen_credit=bad)


def test_capacity_meter_forgets_old_figures():
    meter = CapacityMeter(half_life_s=1.0, min_busy_s=0.1)
    meter.batch_started(0.0)
    meter.on_audio(1.0, 10.0)  # 10 audio-s/s
    meter.batch_finished(1.0)
    meter.batch_started(11.0)
    meter.on_audio(12.0, 2.0)  # now 2 audio-s/s
    meter.batch_finished(12.0)
    assert 1.9 < meter.rate() < 3.0  # the old 10 audio-s/s has faded


def test_admission_by_measured_rate():
    policy = AdmissionPolicy(guard_s=0.0, utilization=1.0)
    playing = [PlaybackClock(0.0, 1.0) for _ in range(3)]
    for clock in playing:
        clock.on_audio(0.1, 10.0)
    assert policy.may_admit(1.0, 1.0, playing, rate=4.0)  # a 4th stream fits
    assert not policy.may_admit(1.0, 1.0, playing, rate=3.5)
    assert policy.may_admit(1.0, 1.0, [], rate=0.1)  # a lone request always starts
    assert policy.may_admit(1.0, 1.0, playing, rate=None)


def test_unit_cost_meter_learns_seconds_per_token():
    meter = UnitCostMeter(alpha=0.5)
    key = ("piper", "voice", "audio_chunk")
    assert meter.estimate(key, 100) == 0.0  # nothing observed yet
    meter.observe(key, 100, 0.5)  # 5 ms per token
    assert meter.estimate(key, 40) == pytest.approx(0.2)
    meter.observe(key, 50, 0.5)  # 10 ms per token: the average moves half-way
    assert meter.estimate(key, 10) == pytest.approx(0.075)
    meter.observe(key, 0, 9.0)  # units that count no tokens teach nothing
    assert meter.estimate(key, 10) == pytest.approx(0.075)
    assert meter.estimate(("other",), 10) == 0.0


def test_admission_counts_each_streams_next_unit_on_top_of_the_guard():
    """A stream must hold the guard plus its next unit's expected run time (a Kokoro sentence
    takes seconds): with 2 s buffered and a 1.8 s unit next, a newcomer waits."""
    policy = AdmissionPolicy(guard_s=0.5, max_wait_s=100.0)
    stream = PlaybackClock(0.0, 0.5)
    stream.on_audio(0.0, 2.0)  # dry at 2.0
    assert policy.may_admit(0.0, 0.0, [stream])
    assert policy.may_admit(0.0, 0.0, [stream], leads=[1.5])  # 2.0 >= 0.5 + 1.5
    assert not policy.may_admit(0.0, 0.0, [stream], leads=[1.8])
    assert policy.may_admit(100.0, 0.0, [stream], leads=[1.8])  # waited max_wait_s
    with pytest.raises(ValueError):
        policy.may_admit(0.0, 0.0, [stream], leads=[])  # one lead per stream
