"""HiFT, S3Gen's vocoder: 80-bin mel at 50 Hz -> 24 kHz waveform.

HiFTNet (Li et al., arXiv 2309.09493) as CosyVoice 2 / Chatterbox configure it (upstream
``chatterbox/models/s3gen/hifigan.py: HiFTGenerator`` with ``S3Token2Wav``'s arguments and
``f0_predictor.py: ConvRNNF0Predictor``): a neural source-filter vocoder whose generator
predicts an inverse-STFT (n_fft 16, hop 4) after three transposed-conv upsamplings (8, 5, 3):

1. F0 per mel frame from 5 convs (ELU) and a linear head, ``|.|`` (``f0_predictor``);
2. the F0 held for 480 samples a frame, a sine source of the fundamental and 8 harmonics
   (``SineGen``: phase ``2 pi cumsum(f0 k / sr) mod 1``, harmonics' start phases uniform in
   ``[-pi, pi)``, amplitude 0.1 where voiced (F0 > 10 Hz), Gaussian noise 0.003 voiced /
   0.1/3 unvoiced), merged by a linear layer and tanh;
3. the source's STFT, downsampled to each stage's rate, added to the upsampled mel features;
   each stage averages 3 Snake ResBlocks; the output's first 9 channels are the log-magnitude,
   the other 9 pass through ``sin`` as the phase; ``istft``, clamped to +-0.99.

The source's random numbers are an input (``SourceNoise``): ``SourceNoise.draw`` draws them as
upstream's ``SineGen`` does from the global generator (``torch.rand`` of the phases, then
``torch.randn_like`` of the noise), so a generator seeded like upstream's gives the same
waveform. Weight norm is folded at load. Module names follow ``mel2wav.*`` of the published
``s3gen.safetensors``.

The streamed form (``decode_window``) decodes a window of frames with the phase carried in
float64 and noise drawn per frame (``stream_noise``), so chunks do not depend on the schedule.

Imports torch only (and ``omnistep.layers``, ``omnistep.runners.flow_matching``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrize
from torch.nn.utils.parametrizations import weight_norm

from omnistep.layers.snake import Snake
from omnistep.layers.weight_norm import PARAMETRIZED_V, fold_weight_norm
from omnistep.runners.flow_matching import frame_noise

SAMPLE_RATE = 24000
UPSAMPLE_RATES = (8, 5, 3)
"""Upstream ``S3Token2Wav``'s ``upsample_rates`` (strides: the tensors do not show them)."""
N_FFT, HOP = 16, 4
"""Upstream ``istft_params``."""
SINE_AMP, NOISE_STD, VOICED_THRESHOLD = 0.1, 0.003, 10.0
"""Upstream ``nsf_alpha``, ``nsf_sigma``, ``nsf_voiced_threshold``."""
RESBLOCK_DILATIONS = (1, 3, 5)


@dataclass(frozen=True)
class HiFTConfig:
    """HiFT sizes (published values as defaults)."""

    mel_dim: int = 80
    base_channels: int = 512
    f0_channels: int = 512
    """Width of the F0 predictor's convs (``cond_channels``)."""
    num_harmonics: int = 8
    upsample_kernels: tuple[int, ...] = (16, 11, 7)
    resblock_kernels: tuple[int, ...] = (3, 7, 11)
    source_kernels: tuple[int, ...] = (7, 7, 11)

    @property
    def samples_per_frame(self) -> int:
        """Output samples per mel frame (480: 8 * 5 * 3 * hop 4)."""
        return math.prod(UPSAMPLE_RATES) * HOP

    @classmethod
    def from_state_dict(
        cls, state: dict[str, torch.Tensor], prefix: str = "mel2wav."
    ) -> HiFTConfig:
        """Sizes read from the tensors under ``prefix``.

        Raises:
            KeyError: a tensor the layout needs is missing (its name).
        """
        v = ".parametrizations.weight.original1"
        kernels = len({k.split(".")[2] for k in state if k.startswith(prefix + "resblocks.")})
        kernels //= len(UPSAMPLE_RATES)
        return cls(
            mel_dim=state[prefix + "conv_pre" + v].shape[1],
            base_channels=state[prefix + "conv_pre" + v].shape[0],
            f0_channels=state[prefix + "f0_predictor.condnet.0" + v].shape[0],
            num_harmonics=state[prefix + "m_source.l_linear.weight"].shape[1] - 1,
            upsample_kernels=tuple(
                state[f"{prefix}ups.{i}{v}"].shape[-1] for i in range(len(UPSAMPLE_RATES))
            ),
            resblock_kernels=tuple(
                state[f"{prefix}resblocks.{j}.convs1.0{v}"].shape[-1] for j in range(kernels)
            ),
            source_kernels=tuple(
                state[f"{prefix}source_resblocks.{i}.convs1.0{v}"].shape[-1]
                for i in range(len(UPSAMPLE_RATES))
            ),
        )


@dataclass(frozen=True, eq=False)
class SourceNoise:
    """The sine source's random numbers for ``[B]`` utterances of ``L`` samples.

    Attributes:
        phases: ``[B, harmonics + 1]`` start phases in ``[-pi, pi)`` (the fundamental's is 0).
        noise: ``[B, harmonics + 1, L]`` standard Gaussian noise.
    """

    phases: torch.Tensor
    noise: torch.Tensor

    @classmethod
    def draw(
        cls, batch: int, num_sines: int, samples: int, generator: torch.Generator | None = None
    ) -> SourceNoise:
        """Drawn in upstream ``SineGen.forward``'s order and form (CPU, float32) for
        ``num_sines`` sines (harmonics + 1): ``Uniform(-pi, pi).sample((B, S, 1))`` is ``-pi +
        rand * 2 pi``, then ``randn_like([B, S, L])``; ``generator`` None uses the global one,
        as upstream."""
        low, high = torch.tensor(-math.pi), torch.tensor(math.pi)
        phases = low + torch.rand((batch, num_sines, 1), generator=generator) * (high - low)
        phases[:, 0] = 0
        noise = torch.randn((batch, num_sines, samples), generator=generator)
        return cls(phases[..., 0], noise)


def _conv(*args, **kwargs) -> nn.Conv1d:
    return weight_norm(nn.Conv1d(*args, **kwargs))


class ResBlock(nn.Module):
    """HiFi-GAN ResBlock with Snake: per dilation ``x += conv2(snake(conv1_d(snake(x))))``."""

    def __init__(self, channels: int, kernel: int):
        super().__init__()
        self.convs1 = nn.ModuleList(
            _conv(channels, channels, kernel, dilation=d, padding=(kernel * d - d) // 2)
            for d in RESBLOCK_DILATIONS
        )
        self.convs2 = nn.ModuleList(
            _conv(channels, channels, kernel, padding=(kernel - 1) // 2) for _ in RESBLOCK_DILATIONS
        )
        self.activations1 = nn.ModuleList(Snake(channels) for _ in RESBLOCK_DILATIONS)
        self.activations2 = nn.ModuleList(Snake(channels) for _ in RESBLOCK_DILATIONS)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for conv1, conv2, act1, act2 in zip(
            self.convs1, self.convs2, self.activations1, self.activations2, strict=True
        ):
            x = conv2(act2(conv1(act1(x)))) + x
        return x


class F0Predictor(nn.Module):
    """``|linear(elu(conv(...elu(conv(mel)))))|``: F0 in Hz per mel frame (5 convs, k=3)."""

    def __init__(self, mel_dim: int, channels: int):
        super().__init__()
        layers: list[nn.Module] = []
        for i in range(5):
            layers += [_conv(mel_dim if i == 0 else channels, channels, 3, padding=1), nn.ELU()]
        self.condnet = nn.Sequential(*layers)
        self.classifier = nn.Linear(channels, 1)

    def forward(self, mel: torch.Tensor) -> torch.Tensor:
        """``[B, mel_dim, T]`` -> ``[B, T]``."""
        return torch.abs(self.classifier(self.condnet(mel).transpose(1, 2)).squeeze(-1))


class SineSource(nn.Module):
    """The harmonic sine source merged to one channel (upstream ``SourceModuleHnNSF``; its
    ``l_linear`` is the only parameter)."""

    def __init__(self, num_harmonics: int):
        super().__init__()
        self.num_harmonics = num_harmonics
        self.l_linear = nn.Linear(num_harmonics + 1, 1)

    def forward(
        self, f0: torch.Tensor, noise: SourceNoise, cycles: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``f0`` ``[B, L]`` Hz per sample -> source ``[B, 1, L]``.

        ``cycles`` None: the phase is upstream's float32 ``cumsum`` from the first sample.
        Else ``cycles`` ``[B]`` float64 is the fundamental's phase (in cycles) accumulated
        before the first sample (a streamed chunk's window), and the sum runs in float64, so a
        window's phase does not depend on where the window starts (to ~1e-12 cycles)."""
        harmonics = torch.arange(1, self.num_harmonics + 2, device=f0.device, dtype=f0.dtype)
        if cycles is None:
            freq = f0[:, None, :] * harmonics[None, :, None] / SAMPLE_RATE  # [B, H, L]
            phase = torch.cumsum(freq, dim=-1) % 1
        else:
            k = harmonics.double()[None, :, None]
            cum = torch.cumsum(f0.double()[:, None, :] * k / SAMPLE_RATE, dim=-1)
            phase = ((cycles.double()[:, None, None] * k + cum) % 1).to(f0.dtype)
        theta = 2 * math.pi * phase
        sine = SINE_AMP * torch.sin(theta + noise.phases.to(f0)[:, :, None])
        voiced = (f0 > VOICED_THRESHOLD).to(f0)[:, None, :]
        amp = voiced * NOISE_STD + (1 - voiced) * SINE_AMP / 3
        sine = sine * voiced + amp * noise.noise.to(f0)
        return torch.tanh(self.l_linear(sine.transpose(1, 2))).transpose(1, 2)


class HiFT(nn.Module):
    """The HiFT vocoder; tensors under ``mel2wav.`` of ``s3gen.safetensors``.

    Args:
        config: sizes (``HiFTConfig.from_state_dict``).
    """

    def __init__(self, config: HiFTConfig):
        super().__init__()
        self.config = config
        base, rates = config.base_channels, UPSAMPLE_RATES
        self.f0_predictor = F0Predictor(config.mel_dim, config.f0_channels)
        self.m_source = SineSource(config.num_harmonics)
        self.conv_pre = _conv(config.mel_dim, base, 7, padding=3)
        self.ups = nn.ModuleList(
            weight_norm(nn.ConvTranspose1d(base >> i, base >> (i + 1), k, u, padding=(k - u) // 2))
            for i, (u, k) in enumerate(zip(rates, config.upsample_kernels, strict=True))
        )
        # the source joins stage i at that stage's rate: downsampled by the later stages' strides
        strides = [math.prod(rates[i + 1 :]) for i in range(len(rates))]
        self.source_downs = nn.ModuleList(
            nn.Conv1d(N_FFT + 2, base >> (i + 1), 1)
            if u == 1
            else nn.Conv1d(N_FFT + 2, base >> (i + 1), 2 * u, u, padding=u // 2)
            for i, u in enumerate(strides)
        )
        self.source_resblocks = nn.ModuleList(
            ResBlock(base >> (i + 1), k) for i, k in enumerate(config.source_kernels)
        )
        self.resblocks = nn.ModuleList(
            ResBlock(base >> (i + 1), k) for i in range(len(rates)) for k in config.resblock_kernels
        )
        self.conv_post = _conv(base >> len(rates), N_FFT + 2, 7, padding=3)
        window = torch.hann_window(N_FFT, periodic=True, dtype=torch.float64).float()
        self.register_buffer("window", window, persistent=False)

    @torch.no_grad()
    def fold_weight_norm(self, prefix: str = "mel2wav.") -> None:
        """Replace every weight-normed weight by ``g v / ||v||`` computed once (after loading;
        ``layers.weight_norm.fold_weight_norm``, the kernel of torch's parametrization, so the
        values are the ones it computed). Every weight is folded before any module changes.

        Raises:
            WeightNormError: a ``v`` (``original1``, named as published under ``prefix``) with
                an output channel of norm 0.
        """
        folded = {}
        for name, module in self.named_modules():
            if parametrize.is_parametrized(module, "weight"):
                parts = module.parametrizations.weight
                v_name = f"{prefix}{name}{PARAMETRIZED_V}"
                folded[name] = (
                    module,
                    fold_weight_norm(parts.original0, parts.original1, 0, v_name),
                )
        for module, weight in folded.values():
            # torch leaves its own fold (the same kernel); the checked fold replaces it
            parametrize.remove_parametrizations(module, "weight", leave_parametrized=True)
            module.weight.copy_(weight)

    def draw_noise(self, frames: int, generator: torch.Generator | None = None) -> SourceNoise:
        """``SourceNoise.draw`` for one utterance of ``frames`` mel frames."""
        samples = frames * self.config.samples_per_frame
        return SourceNoise.draw(1, self.config.num_harmonics + 1, samples, generator)

    def source(self, mel: torch.Tensor, noise: SourceNoise) -> torch.Tensor:
        """The excitation ``[B, 1, L]`` of mel ``[B, mel_dim, T]`` (L = 480 T)."""
        f0 = self.f0_predictor(mel)
        f0 = f0.repeat_interleave(self.config.samples_per_frame, dim=-1)  # nearest upsampling
        return self.m_source(f0, noise)

    def stream_noise(self, seed: int, start: int, end: int) -> SourceNoise:
        """The streamed form's source noise of frames ``[start, end)`` of one utterance:
        start phases ``SourceNoise.draw``'s (a generator seeded ``seed``), the Gaussian noise
        ``frame_noise(seed + 1)`` rows of ``480 x (harmonics + 1)`` values per frame (whole
        16-value Box-Muller groups: frame ``f``'s noise depends on ``seed`` and ``f`` only,
        not on the chunk schedule)."""
        sines, hop = self.config.num_harmonics + 1, self.config.samples_per_frame
        phases = SourceNoise.draw(1, sines, 0, torch.Generator().manual_seed(int(seed))).phases
        rows = frame_noise(int(seed) + 1, end, hop * sines)[start:]  # [frames, hop * sines]
        noise = rows.reshape(1, -1, sines).transpose(1, 2)  # [1, sines, frames * hop]
        return SourceNoise(phases, noise)

    @torch.inference_mode()
    def decode_window(
        self, mel: torch.Tensor, start: int, end: int, noise: SourceNoise
    ) -> torch.Tensor:
        """The streamed form: the waveform ``[1, 480 (end - start)]`` of frames ``[start,
        end)`` of an utterance whose mel up to ``end`` (at least) is ``mel`` ``[1, mel_dim,
        T]`` (``T >= end``), with the source noise of those frames (``stream_noise``).

        F0 is predicted over all of ``mel`` (a small conv stack), so the fundamental's phase at
        ``start`` is the float64 sum of the F0 of every frame before it (upstream carries it
        as ``cache_source``, the previous chunk's source over the overlap); the generator
        runs on the window only. Frames near the window's edges differ from a decode of the
        whole utterance by the generator's receptive field: the caller keeps context frames
        on both sides (``HiFTVocoder``)."""
        hop = self.config.samples_per_frame
        f0 = self.f0_predictor(mel)[:, :end]  # [1, T]
        cycles = f0[:, :start].double().sum(-1) * hop / SAMPLE_RATE  # fundamental, in cycles
        f0 = f0[:, start:].repeat_interleave(hop, dim=-1)
        source = self.m_source(f0, noise, cycles)
        return self.decode(mel[..., start:end], source)

    def decode(self, mel: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
        """The waveform ``[B, L]`` of mel ``[B, mel_dim, T]`` and its source ``[B, 1, L]``."""
        spec = torch.stft(source[:, 0], N_FFT, HOP, N_FFT, window=self.window, return_complex=True)
        spec = torch.view_as_real(spec)
        spec = torch.cat([spec[..., 0], spec[..., 1]], dim=1)  # [B, N_FFT + 2, frames]
        x = self.conv_pre(mel)
        kernels = len(self.config.resblock_kernels)
        for i, up in enumerate(self.ups):
            x = up(F.leaky_relu(x, 0.1))
            if i == len(self.ups) - 1:
                x = F.pad(x, (1, 0), mode="reflect")
            x = x + self.source_resblocks[i](self.source_downs[i](spec))
            blocks = self.resblocks[i * kernels : (i + 1) * kernels]
            total = blocks[0](x)
            for block in blocks[1:]:
                total += block(x)
            x = total / kernels
        x = self.conv_post(F.leaky_relu(x))
        half = N_FFT // 2 + 1
        magnitude = torch.clip(torch.exp(x[:, :half]), max=1e2)
        phase = torch.sin(x[:, half:])
        spectrum = torch.complex(magnitude * torch.cos(phase), magnitude * torch.sin(phase))
        wav = torch.istft(spectrum, N_FFT, HOP, N_FFT, window=self.window)
        return torch.clamp(wav, -0.99, 0.99)

    @torch.inference_mode()
    def forward(self, mel: torch.Tensor, noise: SourceNoise) -> tuple[torch.Tensor, torch.Tensor]:
        """``mel`` ``[B, mel_dim, T]`` -> ``(waveform [B, 480 T], source [B, 1, 480 T])``
        (upstream ``HiFTGenerator.inference`` without a cached source)."""
        source = self.source(mel, noise)
        return self.decode(mel, source), source


def trim_fade(wav: torch.Tensor) -> torch.Tensor:
    """Upstream ``S3Token2Wav``'s spill-over guard: the first 20 ms silenced and the next 20 ms
    faded in by a raised cosine (``(cos(linspace(pi, 0, n)) + 1) / 2``), on ``[..., L]``."""
    n = SAMPLE_RATE // 50
    fade = torch.zeros(2 * n, dtype=wav.dtype, device=wav.device)
    fade[n:] = (torch.cos(torch.linspace(torch.pi, 0, n, device=wav.device)) + 1) / 2
    out = wav.clone()
    m = min(2 * n, wav.shape[-1])
    out[..., :m] *= fade[:m]
    return out
