"""S3Gen's token-to-mel flow: speech tokens + a voice prompt -> 80-bin mel at 50 Hz.

CosyVoice 2's causal conditional flow matching as Chatterbox runs it (upstream
``chatterbox/models/s3gen/flow.py: CausalMaskedDiffWithXvec.inference`` and
``flow_matching.py: CausalConditionalCFM``):

1. the voice's prompt tokens and the request's tokens are embedded together (6561 ids, width
   512), encoded and upsampled x2 (``S3GenEncoder``), and projected to 80 channels: ``mu``;
2. the speaker x-vector (192, CAMPPlus) is L2-normalised and projected to 80: ``speaker``;
3. ``cond`` is the prompt's mel over its frames and zeros after;
4. from Gaussian noise ``x`` over all frames (prompt included), ``num_steps`` Euler steps on
   the cosine schedule (``runners.flow_matching``) integrate the estimator's velocity with
   classifier-free guidance ``(1 + r) c - r u``, r = 0.7, the unconditional row having ``mu``,
   ``speaker`` and ``cond`` zeroed;
5. the mel of the request's frames (after the prompt's) is the output.

``S3GenFlow.prepare`` does 1-3 once per request (``S3GenInputs``); ``step`` is one solver step
of a batch of prepared requests (the unit a denoise loop runs); ``generate`` runs them all.

Imports torch, ``omnistep.runners.flow_matching`` and this family's modules.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from omnistep.models.chatterbox.s3gen_encoder import EncoderConfig, S3GenEncoder
from omnistep.models.chatterbox.s3gen_estimator import EstimatorConfig, S3GenEstimator
from omnistep.runners.flow_matching import cosine_time_points, euler_delta, guided_velocity

SPEECH_VOCAB = 6561
"""S3 tokenizer ids (3^8); T3's start/stop-of-speech ids (6561, 6562) are not S3Gen inputs."""
CFG_RATE = 0.7
"""Upstream ``CFM_PARAMS.inference_cfg_rate``."""
NUM_STEPS = 10
"""Upstream ``S3Token2Wav.flow_inference``'s Euler steps (non-meanflow checkpoints)."""


@dataclass(frozen=True)
class FlowConfig:
    """S3Gen flow sizes (published values as defaults)."""

    encoder: EncoderConfig = EncoderConfig()
    estimator: EstimatorConfig = EstimatorConfig()
    vocab_size: int = SPEECH_VOCAB
    speaker_dim: int = 192
    """CAMPPlus x-vector size (``spk_embed_dim``)."""

    @classmethod
    def from_state_dict(cls, state: dict[str, torch.Tensor], prefix: str = "flow.") -> FlowConfig:
        """Sizes read from the tensors under ``prefix``.

        Raises:
            KeyError: a tensor the layout needs is missing (its name).
        """
        return cls(
            encoder=EncoderConfig.from_state_dict(state, prefix + "encoder."),
            estimator=EstimatorConfig.from_state_dict(state, prefix + "decoder.estimator."),
            vocab_size=state[prefix + "input_embedding.weight"].shape[0],
            speaker_dim=state[prefix + "spk_embed_affine_layer.weight"].shape[1],
        )


@dataclass(frozen=True, eq=False)
class S3GenInputs:
    """One request's prepared flow inputs (``S3GenFlow.prepare``); ``T`` counts the prompt's
    frames then the request's.

    Attributes:
        mu: ``[mel_dim, T]`` the encoder's conditioning.
        speaker: ``[mel_dim]`` the projected speaker vector.
        cond: ``[mel_dim, T]`` the prompt mel, zero after its frames.
        prompt_frames: mel frames of the prompt (the output starts after them).
    """

    mu: torch.Tensor
    speaker: torch.Tensor
    cond: torch.Tensor
    prompt_frames: int

    @property
    def num_frames(self) -> int:
        return self.mu.shape[-1]


class S3GenFlow(nn.Module):
    """The token-to-mel flow model; tensors under ``flow.`` of ``s3gen.safetensors``.

    Args:
        config: sizes (``FlowConfig.from_state_dict``).
    """

    def __init__(self, config: FlowConfig):
        super().__init__()
        self.config = config
        width, mel_dim = config.encoder.width, config.estimator.mel_dim
        self.input_embedding = nn.Embedding(config.vocab_size, width)
        self.spk_embed_affine_layer = nn.Linear(config.speaker_dim, mel_dim)
        self.encoder = S3GenEncoder(config.encoder)
        self.encoder_proj = nn.Linear(width, mel_dim)
        self.decoder = nn.Module()
        self.decoder.estimator = S3GenEstimator(config.estimator)

    @property
    def mel_dim(self) -> int:
        return self.config.estimator.mel_dim

    @torch.inference_mode()
    def prepare(self, *args, **kwargs) -> S3GenInputs:
        """``prepare_inputs`` under ``torch.inference_mode`` (serving)."""
        return self.prepare_inputs(*args, **kwargs)

    def prepare_inputs(
        self,
        tokens: torch.Tensor,
        prompt_tokens: torch.Tensor,
        prompt_mel: torch.Tensor,
        embedding: torch.Tensor,
        frames: int | None = None,
    ) -> S3GenInputs:
        """One request's ``mu``, speaker vector and prompt condition (autograd follows the
        caller's grad mode: a scorer recomputes them with it on).

        ``frames`` None encodes every token and keeps all their rows (upstream
        ``inference(finalize=True)``); an int keeps the prompt's rows and the next ``frames``
        (a streamed chunk that is not the last: the encoder still sees every token, and the
        rows of the look-ahead tokens, whose pre-lookahead conv lacked its right context, are
        cut before the estimator, as upstream's ``finalize=False`` cuts ``pre_lookahead_len *
        token_mel_ratio`` rows; with an odd prompt mel one row fewer is cut, so chunks stay on
        the 2-frames-per-token grid).

        Args:
            tokens: ``[n]`` int64 speech tokens (< 6561).
            prompt_tokens: ``[p]`` int64 the voice's prompt tokens.
            prompt_mel: ``[2p or 2p + 1, mel_dim]`` the voice's prompt mel (24 kHz, 50 Hz frames).
            embedding: ``[speaker_dim]`` the voice's x-vector.

        Raises:
            ValueError: ``frames`` more than the tokens make, a token outside the vocabulary,
                or a prompt mel shorter than
                ``upsample`` x the prompt tokens or longer by ``upsample`` or more. (Upstream's
                ``embed_ref`` trims a clip's tokens to ``mel frames // 2``: an odd-length mel
                keeps one frame more than ``2p``, and the output, which starts after the
                prompt's frames, is one frame shorter, as upstream's.)
        """
        device = self.input_embedding.weight.device
        ids = torch.cat([prompt_tokens.reshape(-1), tokens.reshape(-1)]).to(
            device=device, dtype=torch.long
        )
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.config.vocab_size):
            raise ValueError(
                f"S3Gen takes speech tokens in [0, {self.config.vocab_size}), got {ids.tolist()}"
            )
        ratio, num_prompt = self.config.encoder.upsample, prompt_tokens.numel()
        if not ratio * num_prompt <= prompt_mel.shape[0] < ratio * (num_prompt + 1):
            raise ValueError(
                f"prompt mel has {prompt_mel.shape[0]} frames for {num_prompt} "
                f"prompt tokens (S3Gen needs {ratio} per token, and at most {ratio - 1} more)"
            )
        lengths = torch.tensor([ids.numel()], device=device)
        h = self.encoder(self.input_embedding(ids)[None], lengths)
        mu = self.encoder_proj(h)[0].transpose(0, 1)  # [mel_dim, T]
        if frames is not None:
            keep = prompt_mel.shape[0] + frames
            if not (frames >= 0 and keep <= mu.shape[-1]):
                raise ValueError(
                    f"{frames} frames asked of {mu.shape[-1] - prompt_mel.shape[0]} the tokens make"
                )
            mu = mu[:, :keep]
        speaker = self.spk_embed_affine_layer(F.normalize(embedding.reshape(1, -1).to(mu), dim=1))[
            0
        ]
        cond = torch.zeros_like(mu)
        cond[:, : prompt_mel.shape[0]] = prompt_mel.to(mu).transpose(0, 1)
        return S3GenInputs(mu, speaker, cond, prompt_mel.shape[0])

    def velocity(
        self, inputs: list[S3GenInputs], t: torch.Tensor, x: torch.Tensor, cfg_rate: float
    ) -> torch.Tensor:
        """The guided velocity of requests of equal length at times ``t`` ``[B]``, state ``x``
        ``[B, mel_dim, T]``: the conditional rows and, when ``cfg_rate`` > 0, unconditional
        rows (zero ``mu``, speaker and prompt) in the same estimator call."""
        mu = torch.stack([i.mu for i in inputs])
        speaker = torch.stack([i.speaker for i in inputs])
        cond = torch.stack([i.cond for i in inputs])
        mask = torch.ones_like(x[:, :1])
        estimator = self.decoder.estimator
        if cfg_rate <= 0:
            return estimator(x, mask, mu, t, speaker, cond)
        both = estimator(
            torch.cat([x, x]),
            torch.cat([mask, mask]),
            torch.cat([mu, torch.zeros_like(mu)]),
            torch.cat([t, t]),
            torch.cat([speaker, torch.zeros_like(speaker)]),
            torch.cat([cond, torch.zeros_like(cond)]),
        )
        c, u = both.split(x.shape[0])
        return guided_velocity(c, u, cfg_rate)

    def step(
        self,
        inputs: list[S3GenInputs],
        x: torch.Tensor,
        times: torch.Tensor,
        steps: list[int],
        cfg_rate: float = CFG_RATE,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One Euler step of schedule ``times`` for requests of equal length, row ``i`` taking
        its step ``steps[i]``: ``x`` ``[B, mel_dim, T]`` -> ``(x_next, k1)`` with ``k1`` the
        guided velocity at the step's start. Autograd follows the caller's grad mode."""
        index = torch.tensor(steps, device=times.device)
        t0 = times[index]
        dt = times[index + 1] - t0
        delta, k1 = euler_delta(lambda t, y: self.velocity(inputs, t, y, cfg_rate), t0, dt, x)
        return x + delta, k1

    @torch.inference_mode()
    def generate(
        self,
        inputs: S3GenInputs,
        noise: torch.Tensor,
        num_steps: int = NUM_STEPS,
        cfg_rate: float = CFG_RATE,
    ) -> torch.Tensor:
        """The request's mel ``[mel_dim, frames]`` (prompt frames dropped).

        Args:
            inputs: ``prepare``'s output.
            noise: ``[mel_dim, T]`` the initial state over all frames (upstream draws
                ``torch.randn_like(mu)``).
            num_steps: Euler steps (upstream 10).
            cfg_rate: guidance rate r (upstream 0.7; 0 runs no unconditional row).
        """
        x = noise.to(inputs.mu)[None]
        times = cosine_time_points(num_steps, x.dtype, x.device)
        for step in range(num_steps):
            x, _ = self.step([inputs], x, times, [step], cfg_rate)
        return x[0, :, inputs.prompt_frames :]
