"""The audio plane: encoders decode to the right audio, bytes are deterministic, helpers behave."""

import io
import struct
import subprocess
import sys

import av
import numpy as np
import pytest
import soundfile as sf

from omnistep.audio import (
    FORMATS,
    MEDIA_TYPES,
    OUTPUT_SAMPLE_RATE,
    Resampler,
    encode_all,
    float_to_s16le,
    make_encoder,
    trim_silence,
)

IN_RATE = 22050
DURATION_S = 1.5
TONE_HZ = 440.0
CUTS = [5000, 17000]  # three uneven chunks
# Samples decoders put before the audio because the container cannot signal the encoder delay:
# LAME's 576 + 529 without a Xing/LAME tag, AAC's 1024 priming samples in ADTS.
LEADING_SAMPLES = {"mp3": 1105, "aac": 1024}


def sine(rate: int = IN_RATE, seconds: float = DURATION_S, hz: float = TONE_HZ) -> np.ndarray:
    t = np.arange(round(rate * seconds)) / rate
    return (0.5 * np.sin(2 * np.pi * hz * t)).astype(np.float32)


def chunked(signal: np.ndarray, cuts: list[int] = CUTS) -> list[np.ndarray]:
    return np.split(signal, cuts)


def decode_av(data: bytes) -> tuple[np.ndarray, int]:
    """Decode with FFmpeg; returns float [n] mono and its rate."""
    with av.open(io.BytesIO(data)) as container:
        rate = container.streams.audio[0].codec_context.sample_rate
        frames = [f.to_ndarray() for f in container.decode(audio=0)]
    samples = np.concatenate([f.reshape(-1) for f in frames]).astype(np.float64)
    if np.issubdtype(frames[0].dtype, np.integer):
        samples /= 32768.0  # s16 decoders (wav, flac), scaled as libsndfile does
    return samples, rate


def decode_sf(data: bytes, fmt: str) -> tuple[np.ndarray, int]:
    """Decode with libsndfile; pcm is read as headerless 24 kHz s16le mono."""
    if fmt == "pcm":
        raw = {"format": "RAW", "subtype": "PCM_16", "endian": "LITTLE", "channels": 1}
        return sf.read(io.BytesIO(data), samplerate=OUTPUT_SAMPLE_RATE, **raw)
    return sf.read(io.BytesIO(data))


def decode(fmt: str, data: bytes) -> tuple[np.ndarray, int]:
    if fmt in ("wav", "pcm"):
        return decode_sf(data, fmt)
    return decode_av(data)  # flac streams say "length unknown", which libsndfile cannot read


def dominant_hz(samples: np.ndarray, rate: int) -> float:
    spectrum = np.abs(np.fft.rfft(samples * np.hanning(samples.shape[0])))
    return float(np.fft.rfftfreq(samples.shape[0], 1 / rate)[np.argmax(spectrum)])


@pytest.mark.parametrize("fmt", FORMATS)
def test_encoded_sine_decodes_to_the_same_tone(fmt):
    data = encode_all(fmt, chunked(sine()), IN_RATE)
    samples, rate = decode(fmt, data)
    # libopus decodes at 48 kHz
    assert rate == (48000 if fmt in ("opus", "ogg") else OUTPUT_SAMPLE_RATE)
    audio = samples[LEADING_SAMPLES.get(fmt, 0) :]
    assert abs(audio.shape[0] / rate - DURATION_S) <= 0.05 * DURATION_S
    assert abs(dominant_hz(audio, rate) - TONE_HZ) <= 5.0
    rms = float(np.sqrt(np.mean(audio[: int(1.4 * rate)] ** 2)))
    assert rms == pytest.approx(0.5 / np.sqrt(2), rel=0.1)


@pytest.mark.parametrize("fmt", ["wav", "flac"])
def test_lossless_formats_round_trip_the_samples(fmt):
    source = sine()
    data = encode_all(fmt, chunked(source), IN_RATE)
    reference = np.frombuffer(encode_all("pcm", [source], IN_RATE), "<i2") / 32768.0
    samples, _ = decode_av(data)
    np.testing.assert_array_equal(samples, reference)


@pytest.mark.parametrize("fmt", FORMATS)
def test_same_chunks_give_identical_bytes(fmt):
    first = encode_all(fmt, chunked(sine()), IN_RATE)
    second = encode_all(fmt, chunked(sine()), IN_RATE)
    assert first == second


@pytest.mark.parametrize("fmt", FORMATS)
def test_bytes_do_not_depend_on_chunking(fmt):
    signal = sine()
    one_shot = encode_all(fmt, [signal], IN_RATE)
    assert encode_all(fmt, chunked(signal), IN_RATE) == one_shot
    assert encode_all(fmt, np.array_split(signal, 97), IN_RATE) == one_shot


@pytest.mark.parametrize("fmt", FORMATS)
def test_encoder_streams_bytes_before_flush(fmt):
    encoder = make_encoder(fmt, IN_RATE)
    assert encoder.fmt == fmt
    streamed = [encoder.encode(chunk) for chunk in chunked(sine())]
    tail = encoder.flush()
    assert sum(map(len, streamed)) > len(tail)


def test_pcm_length_follows_the_rate_ratio():
    signal = sine()
    data = encode_all("pcm", chunked(signal), IN_RATE)
    expected = round(signal.shape[0] * OUTPUT_SAMPLE_RATE / IN_RATE)
    assert abs(len(data) // 2 - expected) <= 2
    assert len(data) % 2 == 0


def test_streamed_wav_header_has_unknown_sizes_and_both_readers_accept_it():
    data = encode_all("wav", chunked(sine()), IN_RATE)
    assert data[:4] == b"RIFF" and data[8:16] == b"WAVEfmt "
    assert struct.unpack("<I", data[4:8])[0] == 0xFFFFFFFF
    assert struct.unpack("<I", data[40:44])[0] == 0xFFFFFFFF
    num_samples = (len(data) - 44) // 2
    assert decode_sf(data, "wav")[0].shape[0] == num_samples
    assert decode_av(data)[0].shape[0] == num_samples


def test_exact_lengths_fill_in_wav_sizes():
    data = encode_all("wav", chunked(sine()), IN_RATE, exact_lengths=True)
    assert struct.unpack("<I", data[4:8])[0] == len(data) - 8
    assert struct.unpack("<I", data[40:44])[0] == len(data) - 44
    assert data[44:] == encode_all("wav", chunked(sine()), IN_RATE)[44:]


def test_exact_lengths_make_flac_readable_by_soundfile():
    streamed = encode_all("flac", chunked(sine()), IN_RATE)
    exact = encode_all("flac", chunked(sine()), IN_RATE, exact_lengths=True)
    samples, rate = decode_sf(exact, "flac")
    assert rate == OUTPUT_SAMPLE_RATE
    np.testing.assert_allclose(samples, decode_av(streamed)[0], atol=0)
    assert len(exact) == len(streamed)


def test_media_types_cover_every_format():
    assert set(MEDIA_TYPES) == set(FORMATS)
    assert MEDIA_TYPES["opus"] == "audio/ogg" and MEDIA_TYPES["mp3"] == "audio/mpeg"


def test_unknown_format_is_a_value_error_naming_it():
    with pytest.raises(ValueError, match="'ogg-vorbis'"):
        make_encoder("ogg-vorbis", IN_RATE)


@pytest.mark.parametrize("fmt", FORMATS)
def test_flush_ends_the_encoder(fmt):
    encoder = make_encoder(fmt, IN_RATE)
    encoder.encode(sine()[:1000])
    with pytest.raises(RuntimeError):
        encoder.with_lengths(b"")
    encoder.flush()
    with pytest.raises(RuntimeError):
        encoder.encode(sine()[:1000])
    with pytest.raises(RuntimeError):
        encoder.flush()


def test_bad_inputs_are_value_errors():
    with pytest.raises(ValueError):
        make_encoder("wav", 0)
    with pytest.raises(ValueError, match="mono"):
        make_encoder("pcm", IN_RATE).encode(np.zeros((100, 2), dtype=np.float32))


def test_empty_input_gives_header_only_or_nothing():
    assert encode_all("pcm", [], IN_RATE) == b""
    assert encode_all("mp3", [], IN_RATE) == b""
    assert decode_sf(encode_all("wav", [], IN_RATE), "wav")[0].shape[0] == 0
    assert encode_all("flac", [], IN_RATE)[:4] == b"fLaC"
    assert encode_all("opus", [], IN_RATE)[:4] == b"OggS"


def test_ogg_names_the_ogg_opus_bytes():
    data = encode_all("ogg", chunked(sine()), IN_RATE)
    assert data[:4] == b"OggS" and data == encode_all("opus", [sine()], IN_RATE)
    assert MEDIA_TYPES["ogg"] == MEDIA_TYPES["opus"] == "audio/ogg"


@pytest.mark.parametrize(
    ("in_rate", "quality"), [(22050, "HQ"), (16000, "HQ"), (44100, "VHQ"), (48000, "HQ")]
)
def test_resampler_chunked_equals_one_shot_exactly(in_rate, quality):
    signal = sine(rate=in_rate)
    whole = Resampler(in_rate, OUTPUT_SAMPLE_RATE, quality)
    one_shot = np.concatenate([whole.process(signal), whole.flush()])
    parts = Resampler(in_rate, OUTPUT_SAMPLE_RATE, quality)
    pieces = [parts.process(c) for c in np.split(signal, [1, 700, 701, 9000, 20011])]
    chunked_out = np.concatenate([*pieces, parts.flush()])
    assert one_shot.dtype == np.float32
    np.testing.assert_array_equal(chunked_out, one_shot)  # bit-exact, not just close
    expected = signal.shape[0] * OUTPUT_SAMPLE_RATE / in_rate
    assert abs(one_shot.shape[0] - expected) <= 1


def test_resampler_is_identity_at_equal_rates_and_single_use():
    signal = sine(rate=OUTPUT_SAMPLE_RATE)
    resampler = Resampler(OUTPUT_SAMPLE_RATE, OUTPUT_SAMPLE_RATE)
    np.testing.assert_array_equal(resampler.process(signal), signal)
    assert resampler.flush().shape == (0,)
    with pytest.raises(RuntimeError):
        resampler.process(signal)
    with pytest.raises(ValueError):
        Resampler(-1, OUTPUT_SAMPLE_RATE)


def test_float_to_s16le_clips_scales_and_rounds():
    data = float_to_s16le(np.array([0.0, 1.0, -1.0, 2.0, -2.0, 0.5, 1e-5], dtype=np.float32))
    values = struct.unpack("<7h", data)
    assert values == (0, 32767, -32767, 32767, -32767, 16384, 0)


def test_trim_silence_drops_only_the_edges():
    loud = np.full(10, 0.5, dtype=np.float32)
    quiet = np.zeros(5, dtype=np.float32)
    signal = np.concatenate([quiet, loud, quiet, loud, quiet])
    trimmed = trim_silence(signal)
    np.testing.assert_array_equal(trimmed, signal[5:30])  # interior zeros kept
    np.testing.assert_array_equal(trim_silence(signal, pad=2), signal[3:32])
    np.testing.assert_array_equal(trim_silence(signal, pad=100), signal)


def test_trim_silence_threshold_and_all_silent_input():
    signal = np.array([1e-3, -1e-3, 0.2, 1e-3], dtype=np.float32)
    np.testing.assert_array_equal(trim_silence(signal, threshold=1e-3), signal[2:3])
    assert trim_silence(np.zeros(100, dtype=np.float32)).shape == (0,)
    assert trim_silence(np.zeros(0, dtype=np.float32)).shape == (0,)
    with pytest.raises(ValueError):
        trim_silence(signal, pad=-1)


def test_audio_plane_imports_no_torch_and_no_other_plane():
    code = (
        "import sys, omnistep.audio;"
        "bad = [m for m in sys.modules if m == 'torch' or m.startswith('torch.')"
        " or (m.startswith('omnistep.') and not m.startswith(('omnistep.audio',"
        " 'omnistep.core.errors')))];"
        "print(bad); sys.exit(1 if bad else 0)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
