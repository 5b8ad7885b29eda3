"""Qwen2.5-Omni token2wav (omnistep/models/qwen2_5_omni/ token2wav.py, dit.py, bigvgan.py):
upstream parity, batching of ODE steps across requests, exact chunked BigVGAN, receptive field,
loading.

Upstream reference: transformers' ``Qwen2_5OmniToken2WavModel`` built from a tiny
``Qwen2_5OmniToken2WavConfig`` (official BigVGAN geometry, narrow channels; a 4-layer DiT with
blocks of 4 frames so block masking, look-ahead and look-back layers all matter), weights drawn
with a realistic scale (stock init gives ~1e-7 waveforms), copied into ours by ``load_token2wav``
from its ``state_dict`` (strict). Upstream draws its initial noise from the global RNG; ours
gets the same tensor, drawn from a generator seeded alike.
"""

from __future__ import annotations

import math

import pytest
import torch
import transformers  # noqa: F401
from transformers.models.qwen2_5_omni.configuration_qwen2_5_omni import (
    Qwen2_5OmniBigVGANConfig,
    Qwen2_5OmniDiTConfig,
    Qwen2_5OmniToken2WavConfig,
)
from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import (
    Qwen2_5OmniToken2WavModel,
)

from omnistep.models.qwen2_5_omni.bigvgan import BigVGAN, BigVGANConfig
from omnistep.models.qwen2_5_omni.dit import ChunkWindow, DiTChunking, DiTConfig
from omnistep.models.qwen2_5_omni.token2wav import (
    Token2Wav,
    Token2WavConfig,
    load_token2wav,
    load_token2wav_part,
)
from omnistep.runners.flow_matching import (
    FrameNoise,
    SolverConfig,
    frame_noise,
    sde_noise,
    sde_terms,
)

MEL_DIM = 10
NUM_EMBEDS = 20  # codec ids 0..20
TINY = {
    "dit_config": {
        "hidden_size": 32,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "head_dim": 8,
        "ff_mult": 2,
        "emb_dim": 16,
        "block_size": 4,
        "look_ahead_layers": [1],
        "look_backward_layers": [0, 2],
        "repeats": 2,
        "num_embeds": NUM_EMBEDS,
        "mel_dim": MEL_DIM,
        "enc_emb_dim": 12,
        "enc_dim": 8,
        "enc_channels": [16, 16, 16, 16, 48],
        "enc_attention_channels": 8,
        "enc_se_channels": 8,
        "max_position_embeddings": 512,
    },
    "bigvgan_config": {"mel_dim": MEL_DIM, "upsample_initial_channel": 64},
}
PARITY_TOL = 1e-4
BATCH_TOL = 1e-5
CHUNK_TOL = 1e-5


def randomize(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Realistic-scale weights: matrices ~ N(0, 1/fan_in) (BigVGAN resblocks and conv_post x0.5
    so the wave has std ~0.1 and does not clip), codec embeddings ~ N(0, 1), SnakeBeta log-alpha
    and log-beta ~ N(0, 0.3), biases ~ N(0, 0.1); the DiT's output bias near -3 puts the mel
    in the range a log-mel lives in."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("codec_embed.weight"):
                p.copy_(torch.randn(p.shape, generator=g))
            elif p.dim() >= 2:
                fan_in = p.shape[0] * p.shape[2] if ".ups." in name else p[0].numel()
                gain = 0.5 if ("resblocks" in name or "conv_post" in name) else 1.0
                p.copy_(torch.randn(p.shape, generator=g) * gain / math.sqrt(fan_in))
            elif name.endswith((".alpha", ".beta")):
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
            elif name.endswith("proj_out.bias"):
                p.copy_(-3.0 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
    return model


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """The models here are tiny: a second thread only adds spin-waiting on 2 shared cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def models() -> tuple[Qwen2_5OmniToken2WavModel, Token2Wav]:
    upstream = Qwen2_5OmniToken2WavModel(Qwen2_5OmniToken2WavConfig(**TINY)).eval()
    randomize(upstream)
    return upstream, load_token2wav(upstream.state_dict(), TINY)


def request(seed: int, tokens: int, batch: int = 1) -> dict[str, torch.Tensor]:
    """Codes [batch, tokens], speaker cond [batch, 12], reference mel [batch, 30, MEL_DIM]."""
    g = torch.Generator().manual_seed(seed)
    return {
        "codes": torch.randint(0, NUM_EMBEDS + 1, (batch, tokens), generator=g),
        "cond": torch.randn(batch, 12, generator=g),
        "ref_mel": torch.randn(batch, 30, MEL_DIM, generator=g) - 4,
    }


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()


# -------------------------------------------------------------------------------------- configs


def test_config_defaults_are_transformers_defaults() -> None:
    ours = Token2WavConfig.from_dict({"dit_config": {}, "bigvgan_config": {}})
    assert ours == Token2WavConfig()
    dit, big = Qwen2_5OmniDiTConfig(), Qwen2_5OmniBigVGANConfig()
    for f in ("hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim", "block_size"):
        assert getattr(ours.dit, f) == getattr(dit, f), f
    assert ours.dit.look_ahead_layers == tuple(dit.look_ahead_layers)
    assert ours.dit.look_backward_layers == tuple(dit.look_backward_layers)
    assert ours.dit.enc_channels == tuple(dit.enc_channels)
    assert ours.dit.rope_theta == dit.rope_parameters["rope_theta"]
    assert ours.dit.num_embeds == dit.num_embeds and ours.dit.mel_dim == dit.mel_dim
    assert ours.bigvgan.upsample_rates == tuple(big.upsample_rates)
    assert ours.bigvgan.resblock_dilation_sizes == tuple(map(tuple, big.resblock_dilation_sizes))
    assert ours.bigvgan.hop_length == 240  # 24 kHz / 100 mel frames per second


def test_config_accepts_original_key_names_and_whole_config_json() -> None:
    raw = {"token2wav_config": {"dit_config": {"dim": 64, "depth": 3, "heads": 2, "x": 1}}}
    config = Token2WavConfig.from_dict(raw)
    assert (config.dit.hidden_size, config.dit.num_hidden_layers) == (64, 3)
    assert config.dit.num_attention_heads == 2
    with pytest.raises(ValueError, match="upsample_kernel_sizes"):
        BigVGANConfig(upsample_rates=(5,), upsample_kernel_sizes=(10,))
    with pytest.raises(ValueError, match="mel_dim"):
        Token2WavConfig(DiTConfig(mel_dim=80), BigVGANConfig(mel_dim=10))


def test_state_dict_layout_equals_transformers_at_official_size() -> None:
    with torch.device("meta"):
        upstream = Qwen2_5OmniToken2WavModel(Qwen2_5OmniToken2WavConfig())
        ours = Token2Wav(Token2WavConfig())
    theirs = {k: tuple(v.shape) for k, v in upstream.state_dict().items()}
    mine = {k: tuple(v.shape) for k, v in ours.state_dict().items()}
    assert mine == theirs
    assert len(mine) == 808


def test_loader_is_strict(models) -> None:
    upstream, _ = models
    state = dict(upstream.state_dict())
    state.pop("code2wav_dit_model.proj_out.bias")
    with pytest.raises(RuntimeError, match="proj_out.bias"):
        load_token2wav(state, TINY)


# ------------------------------------------------------------------------------ upstream parity


@pytest.mark.parametrize(
    "solver",
    [SolverConfig(), SolverConfig(num_steps=4, guidance_scale=0.0, sway_coefficient=None)],
    ids=["default-cfg-sway", "no-cfg-uniform"],
)
def test_stepwise_ode_then_bigvgan_equals_transformers(models, solver) -> None:
    upstream, ours = models
    req, tokens, seed = request(1, tokens=13), 13, 5
    captured = []  # the mel upstream's forward hands its BigVGAN
    hook = upstream.code2wav_bigvgan_model.register_forward_pre_hook(
        lambda module, args: captured.append(args[0].clone())
    )
    torch.manual_seed(seed)
    with torch.no_grad():
        wave_ref = upstream(
            req["codes"],
            req["cond"],
            req["ref_mel"],
            num_steps=solver.num_steps,
            guidance_scale=solver.guidance_scale,
            sway_coefficient=solver.sway_coefficient,
        )
    hook.remove()
    (mel_ref,) = captured

    dit, vocoder = ours.code2wav_dit_model, ours.code2wav_bigvgan_model
    generator = torch.Generator().manual_seed(seed)  # the same draw as upstream's global RNG
    state = dit.initial_state(**req, generator=generator, solver=solver)
    assert state.num_solver_steps == solver.num_steps - 1
    while not state.done:
        (state,) = dit.ode_step([state])
    mel = dit.finalize(state)
    wave = vocoder(mel)

    assert mel.shape == (1, MEL_DIM, 2 * tokens) == mel_ref.shape
    assert wave.shape == (1, 2 * tokens * 240) and wave_ref.shape == (2 * tokens * 240,)
    assert wave.std().item() > 0.02 and wave.abs().max().item() < 1  # realistic, not clipped
    mel_diff, wave_diff = max_diff(mel, mel_ref), max_diff(wave[0], wave_ref)
    print(f"\n[{solver}] max |mel diff| {mel_diff:.3g}, max |wave diff| {wave_diff:.3g}")
    assert mel_diff <= PARITY_TOL and wave_diff <= PARITY_TOL


def test_batched_state_equals_transformers_batch(models) -> None:
    """One ODEState of B = 2 rows is upstream's batch-2 ``sample`` (shared length)."""
    upstream, ours = models
    req, solver = request(2, tokens=9, batch=2), SolverConfig(num_steps=4)
    torch.manual_seed(11)
    with torch.no_grad():
        mel_ref = upstream.code2wav_dit_model.sample(
            req["cond"], req["ref_mel"], req["codes"], num_steps=4
        )
    generator = torch.Generator().manual_seed(11)
    mel = ours.code2wav_dit_model.sample(**req, generator=generator, solver=solver)
    diff = max_diff(mel, mel_ref)
    print(f"\nB = 2 state vs upstream batch-2 sample: max |mel diff| {diff:.3g}")
    assert diff <= PARITY_TOL


# ------------------------------------------------------------------------- batching ODE steps


def run_alone(dit, state):
    while not state.done:
        (state,) = dit.ode_step([state])
    return dit.finalize(state)


def test_requests_stepped_together_equal_each_alone(models) -> None:
    dit = models[1].code2wav_dit_model
    states = [
        dit.initial_state(**request(seed, tokens=11), generator=torch.Generator().manual_seed(seed))
        for seed in (3, 4)
    ]
    alone = [run_alone(dit, s) for s in states]
    together = states
    while not together[0].done:
        together = dit.ode_step(together)
    diffs = [max_diff(dit.finalize(s), a) for s, a in zip(together, alone, strict=True)]
    identical = all(torch.equal(dit.finalize(s), a) for s, a in zip(together, alone, strict=True))
    print(f"\nsame length, batch of 2: max diff {max(diffs):.3g}, bit-identical {identical}")
    assert max(diffs) <= BATCH_TOL


def test_requests_at_different_steps_and_lengths_batch(models) -> None:
    """B starts alone; C (shorter: zero padding + key mask) joins after B's first step and A
    (B's length) after its third, so rows at different t share every forward; each mel equals
    its solo run."""
    dit = models[1].code2wav_dit_model
    plan = {"a": (5, 11, 3), "b": (6, 11, 0), "c": (7, 7, 1)}  # seed, tokens, join at step
    states = {
        k: dit.initial_state(**request(seed, tokens), generator=torch.Generator().manual_seed(seed))
        for k, (seed, tokens, _) in plan.items()
    }
    alone = {k: run_alone(dit, s) for k, s in states.items()}
    live, done, tick = {}, {}, 0
    while len(done) < len(plan):
        live.update({k: states[k] for k, (_, _, join) in plan.items() if join == tick})
        keys = list(live)
        for k, s in zip(keys, dit.ode_step([live[k] for k in keys]), strict=True):
            live[k] = s
            if s.done:
                done[k] = dit.finalize(live.pop(k))
        tick += 1
    diffs = {k: max_diff(done[k], alone[k]) for k in plan}
    print(f"\nstaggered + padded batch: max diffs {diffs}")
    assert done["c"].shape[-1] == 14 and done["a"].shape[-1] == 22
    assert max(diffs.values()) <= BATCH_TOL


def test_ode_misuse_raises(models) -> None:
    dit = models[1].code2wav_dit_model
    req = request(8, tokens=4)
    with pytest.raises(ValueError, match="noise"):
        dit.initial_state(**req, noise=torch.zeros(1, 4, MEL_DIM))
    with pytest.raises(ValueError, match="codes"):
        dit.initial_state(req["codes"] + NUM_EMBEDS + 1, req["cond"], req["ref_mel"])
    state = dit.initial_state(**req, solver=SolverConfig(num_steps=2))
    with pytest.raises(ValueError, match="finished"):
        dit.finalize(state)
    (state,) = dit.ode_step([state])
    with pytest.raises(ValueError, match="all its solver steps"):
        dit.ode_step([state])


# ------------------------------------------------------------------------------ chunked DiT


def test_frame_noise_is_upstreams_draw_and_position_only() -> None:
    """Frame noise equals ``torch.manual_seed(s); torch.randn([1, F, mel])`` (upstream's draw)
    and row f does not depend on how far or in what pieces it was drawn."""
    torch.manual_seed(11)
    upstream = torch.randn([1, 40, 80])
    assert torch.equal(frame_noise(11, 40, 80), upstream[0])
    pieces = FrameNoise(11, 80)
    assert torch.equal(pieces.rows(8, 16), upstream[0, 8:16])  # draws 0..16 first
    assert torch.equal(pieces.rows(0, 40), upstream[0])
    assert not torch.equal(frame_noise(12, 40, 80), upstream[0])


def test_chunk_schedule() -> None:
    """Windows on the block grid: the chunk plus 2 blocks before and 1 after, cut at the
    utterance's ends; a chunk waits for its window's codes unless the codes are complete."""
    c = DiTChunking(first_chunk_blocks=1, chunk_blocks=2, left_context_blocks=2, lookahead_blocks=1)
    assert c.windows(50, 4) == [
        ChunkWindow(0, 0, 4, 8),
        ChunkWindow(0, 4, 12, 16),
        ChunkWindow(4, 12, 20, 24),
        ChunkWindow(12, 20, 28, 32),
        ChunkWindow(20, 28, 36, 40),
        ChunkWindow(28, 36, 44, 48),
        ChunkWindow(36, 44, 50, 50),
    ]
    assert c.next_window(4, 15, False, 4) is None  # needs frames up to 16
    assert c.next_window(4, 16, False, 4) == ChunkWindow(0, 4, 12, 16)
    assert c.next_window(4, 9, True, 4) == ChunkWindow(0, 4, 9, 9)
    assert c.next_window(9, 9, True, 4) is None
    assert DiTChunking().windows(0, 24) == []
    assert DiTChunking().windows(300, 24)[:2] == [  # None: CHUNK_FRAMES, 6 blocks of 24
        ChunkWindow(0, 0, 144, 168),
        ChunkWindow(96, 144, 288, 300),
    ]
    assert DiTChunking().covering(54, 24) == DiTChunking(3, 6, 2, 1)  # BigVGAN's 20 + 34
    assert DiTChunking().covering(54, 8) == DiTChunking(7, 18, 2, 1)
    assert DiTChunking(first_chunk_blocks=2).covering(54, 8).first_chunk_blocks == 2
    config = DiTConfig.from_dict(TINY["dit_config"])  # look back in 2 layers, ahead in 1
    assert DiTChunking.exact(config) == DiTChunking(3, 3, 72, 36)
    assert DiTChunking.exact(config, SolverConfig(num_steps=3)) == DiTChunking(3, 3, 16, 8)
    for bad in ({"chunk_blocks": 0}, {"left_context_blocks": -1}, {"first_chunk_blocks": 1.5}):
        with pytest.raises(ValueError, match="DiTChunking"):
            DiTChunking(**bad)


@pytest.mark.parametrize("num_steps", [3, 10])
def test_chunked_dit_at_the_exact_setting_equals_whole(models, num_steps) -> None:
    """At ``DiTChunking.exact`` (the ODE's whole receptive field: 4 evaluations per RK4 step,
    2 blocks back and 1 ahead per evaluation) chunked equals the whole decode within 1e-5; a
    smaller context does not (the joins show)."""
    dit = models[1].code2wav_dit_model
    solver = SolverConfig(num_steps=num_steps)
    req = request(21, tokens=90 if num_steps == 3 else 180)
    noise = frame_noise(21, 2 * req["codes"].shape[1], MEL_DIM)[None]
    whole = dit.sample(**req, noise=noise, solver=solver)
    exact = DiTChunking.exact(dit.config, solver)
    assert len(exact.windows(whole.shape[-1], dit.config.block_size)) > 3  # real joins
    chunked = dit.sample_chunked(**req, noise=noise, chunking=exact, solver=solver)
    short = dit.sample_chunked(**req, noise=noise, chunking=DiTChunking(), solver=solver)
    print(
        f"\n{num_steps} points: exact {exact}: max diff {max_diff(chunked, whole):.3g}; "
        f"default: {max_diff(short, whole):.3g}"
    )
    assert chunked.shape == whole.shape and max_diff(chunked, whole) <= CHUNK_TOL
    assert max_diff(short, whole) > CHUNK_TOL


def test_windows_at_different_offsets_batch(models) -> None:
    """Windows of two requests at different places (RoPE from each window's first frame)
    stepped together equal each alone; an offset off the block grid is refused."""
    dit = models[1].code2wav_dit_model
    block = dit.config.block_size
    states = []
    for seed, offset in ((31, 0), (32, 3 * block)):
        req = request(seed, tokens=2 * block)
        noise = frame_noise(seed, 4 * block, MEL_DIM)[None]
        states.append(dit.initial_state(**req, noise=noise, offset=offset))
    alone = [run_alone(dit, s) for s in states]
    together = states
    while not together[0].done:
        together = dit.ode_step(together)
    diffs = [max_diff(dit.finalize(s), a) for s, a in zip(together, alone, strict=True)]
    assert max(diffs) <= BATCH_TOL
    assert max_diff(alone[0], alone[1]) > 0.1
    with pytest.raises(ValueError, match="offset"):
        dit.initial_state(**request(1, tokens=4), offset=block - 2)


# ---------------------------------------------------------------- SDE steps (Flow-GRPO)


def test_noise_level_zero_is_the_ode_path_exactly(models) -> None:
    dit = models[1].code2wav_dit_model
    req = request(41, tokens=12)
    noise = frame_noise(41, 24, MEL_DIM)[None]
    ode = dit.sample(**req, noise=noise)
    assert torch.equal(dit.sample(**req, noise=noise, noise_level=0.0, sde_seed=3), ode)
    sde = dit.sample(**req, noise=noise, noise_level=0.7, sde_seed=3)
    assert max_diff(sde, ode) > 0.1
    assert torch.equal(dit.sample(**req, noise=noise, noise_level=0.7, sde_seed=3), sde)


def test_sde_step_is_flow_grpos_transition(models) -> None:
    """Each SDE step: x_next = mean + std * (the step's noise by position), with mean and std
    as Flow-GRPO's ``sde_step_with_logprob`` computes them in its own time convention
    (t' = 1 - t, v = -u), the Euler move x + h u replaced by the RK4 step; the log-prob is
    the Gaussian density summed over elements."""
    import math as m

    dit = models[1].code2wav_dit_model
    req = request(42, tokens=12)
    a, seed = 0.7, 17
    state = dit.initial_state(**req, noise=frame_noise(42, 24, MEL_DIM)[None], noise_level=a)
    state = replace_state(state, sde_seed=seed)
    times = state.times
    while not state.done:
        k = state.step
        ode = dit.ode_step([replace_state(state, noise_level=0.0)])[0].x  # x + RK4 step
        k1 = velocity(dit, state)
        (nxt,) = dit.ode_step([state])
        rec = nxt.last
        # Flow-GRPO, in its time: sigma = 1 - t, dt = sigma_next - sigma (< 0), sigma_max =
        # its first sigma below 1 (1 - t_1), model_output v = -u.
        sigma, sigma_next = 1 - float(times[k]), 1 - float(times[k + 1])
        sigma_max = 1 - float(times[1])
        dt = sigma_next - sigma
        std_dev_t = m.sqrt(sigma / (1 - (sigma_max if sigma == 1 else sigma))) * a
        v = -k1
        theirs = (
            state.x * (1 + std_dev_t**2 / (2 * sigma) * dt)
            + v * (1 + std_dev_t**2 * (1 - sigma) / (2 * sigma)) * dt
        )
        euler = state.x + (-dt) * k1
        assert rec.std == pytest.approx(std_dev_t * m.sqrt(-dt), rel=1e-6)
        assert max_diff(rec.mean - (ode - euler), theirs) <= 1e-5
        eps = sde_noise(seed, k, 0, 24, dit.config.block_size, MEL_DIM)
        assert max_diff(rec.x_next[0], rec.mean[0] + rec.std * eps) <= 1e-5
        z = (rec.x_next.double() - rec.mean.double()) / rec.std
        manual = -0.5 * (z**2).sum() - z.numel() * (m.log(rec.std) + 0.5 * m.log(2 * m.pi))
        assert float(rec.logprob[0]) == pytest.approx(float(manual), rel=1e-9)
        state = nxt
    assert sde_terms(times, 0, 0.0) == (0.0, 0.0)


def test_step_logprob_recomputes_the_recorded_with_gradients(models) -> None:
    """train = serve: a recorded step's log-prob recomputed with autograd equals the recorded
    one (alone: to the bit; stepped in a batch of two: within 1e-5 relative), and its gradient
    reaches the DiT's weights."""
    dit = models[1].code2wav_dit_model
    reqs = [request(seed, tokens=10) for seed in (43, 44)]
    states = [
        dit.initial_state(**r, noise=frame_noise(s, 20, MEL_DIM)[None], noise_level=0.7, sde_seed=s)
        for r, s in zip(reqs, (43, 44), strict=True)
    ]
    records = [[], []]
    while not states[0].done:
        states = dit.ode_step(states)
        for i, s in enumerate(states):
            records[i].append(s.last)
    worst = 0.0
    for r, recs in zip(reqs, records, strict=True):
        for rec in recs:
            lp = dit.step_logprob(r["codes"], r["cond"], r["ref_mel"], rec, 0.7)
            worst = max(worst, abs(lp.item() - rec.logprob.item()) / abs(rec.logprob.item()))
    print(f"\nSDE step log-probs, batch of 2 vs recomputed: max relative diff {worst:.3g}")
    assert worst <= 1e-5
    alone = dit.initial_state(**reqs[0], noise=frame_noise(43, 20, MEL_DIM)[None], noise_level=0.7)
    (alone,) = dit.ode_step([alone])
    lp = dit.step_logprob(reqs[0]["codes"], reqs[0]["cond"], reqs[0]["ref_mel"], alone.last, 0.7)
    assert float(lp[0]) == float(alone.last.logprob[0])
    params = dict(dit.named_parameters())
    for p in params.values():
        p.grad = None
    lp.sum().backward()
    for name in (
        "proj_out.weight",
        "transformer_blocks.0.attn.to_q.weight",
        "text_embed.codec_embed.weight",
    ):
        assert params[name].grad is not None and params[name].grad.abs().sum() > 0, name
    for p in params.values():
        p.grad = None


def test_sde_noise_is_independent_between_windows(models) -> None:
    """A window's SDE noise depends on the seed, the window and the step: the same window
    draws the same noise, two windows over the same frames draw independent noise (a sample's
    step log-probs then sum to the density of what it sampled), and a chunked SDE decode is
    reproducible."""
    block = models[1].code2wav_dit_model.config.block_size
    same = sde_noise(8, 1, 0, 40, block, MEL_DIM)
    assert same.shape == (40, MEL_DIM) and torch.equal(same, sde_noise(8, 1, 0, 40, block, MEL_DIM))
    other_window = sde_noise(8, 1, block, 40, block, MEL_DIM)  # frames block..40 again
    assert (
        abs(
            float(
                torch.corrcoef(torch.stack([same[block:].flatten(), other_window.flatten()]))[0, 1]
            )
        )
        < 0.1
    )
    assert not torch.equal(sde_noise(8, 2, 0, 8, block, MEL_DIM), same[:8])
    dit = models[1].code2wav_dit_model
    req = request(45, tokens=40)
    noise = frame_noise(45, 80, MEL_DIM)[None]
    chunking = DiTChunking(2, 2, 2, 1)
    run = [
        dit.sample_chunked(**req, noise=noise, chunking=chunking, noise_level=0.5, sde_seed=8)
        for _ in range(2)
    ]
    assert torch.equal(run[0], run[1])
    assert max_diff(run[0], dit.sample_chunked(**req, noise=noise, chunking=chunking)) > 0.1


def replace_state(state, **changes):
    import dataclasses

    return dataclasses.replace(state, **changes)


def velocity(dit, state) -> torch.Tensor:
    """u(t, x) of the state's step start (the guided velocity, RK4's k1)."""
    batch = dit._step_batch([state])
    with torch.inference_mode():
        return dit._velocity(batch, state.times[state.step].expand(1), state.x)


# ------------------------------------------------------------------------------------- BigVGAN


def official_geometry_vocoder(dtype: torch.dtype = torch.float32) -> BigVGAN:
    vocoder = BigVGAN(BigVGANConfig(mel_dim=MEL_DIM, upsample_initial_channel=64))
    return randomize(vocoder, seed=3).to(dtype).eval()


def test_receptive_field_matches_perturbation() -> None:
    """Perturb mel frame m (a forward-mode derivative in float64, before the final clamp, so
    tiny far-away effects are not lost to rounding): the samples that move are exactly those of
    frames m - right .. m + left, for the official upsampler geometry."""
    vocoder = official_geometry_vocoder(torch.float64)
    left, right = vocoder.receptive_field
    assert (left, right) == (34, 34)
    g = torch.Generator().manual_seed(0)
    mel = torch.randn(1, MEL_DIM, 80, generator=g, dtype=torch.float64) - 4
    m = 40
    tangent = torch.zeros_like(mel)
    tangent[:, :, m] = 1.0
    _, moved = torch.func.jvp(vocoder.unclamped, (mel,), (tangent,))  # [1, 1, 80 * 240]
    frames = moved[0, 0].nonzero()[:, 0] // vocoder.hop_length
    assert (frames.min().item(), frames.max().item()) == (m - right, m + left)


def test_chunked_bigvgan_equals_whole() -> None:
    vocoder = official_geometry_vocoder()
    left_ctx, lookahead = vocoder.receptive_field
    g = torch.Generator().manual_seed(1)
    mel = torch.randn(2, MEL_DIM, 95, generator=g) - 4
    whole = vocoder(mel)
    assert whole.shape == (2, 95 * 240) and vocoder.sample_rate == 24000
    bounds = [0, 4, 20, 45, 70, 95]  # a small first chunk (time to first audio), then larger
    pieces = []
    for a, b in zip(bounds[:-1], bounds[1:], strict=True):
        lo, hi = max(a - left_ctx, 0), min(b + lookahead, mel.shape[-1])
        pieces.append(vocoder.decode_chunk(mel[:, :, lo:hi], a - lo, b - a))
    diff = max_diff(torch.cat(pieces, dim=1), whole)
    print(f"\nchunked vs whole BigVGAN: max diff {diff:.3g}")
    assert diff <= CHUNK_TOL
    with pytest.raises(ValueError, match="left"):
        vocoder.decode_chunk(mel, 90, 10)


def test_each_half_loads_alone_and_equals_the_whole(models):
    """``load_token2wav_part`` builds the DiT or BigVGAN from its own tensors only, with the
    same parameters and buffers (RoPE, anti-aliasing filters) as the whole load."""
    _, ours = models
    state = ours.state_dict()
    for part, whole in (("dit", ours.code2wav_dit_model), ("bigvgan", ours.code2wav_bigvgan_model)):
        prefix = f"code2wav_{part}_model."
        own = {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}
        alone = load_token2wav_part(part, own, TINY)
        assert type(alone) is type(whole)
        got = dict(alone.named_buffers()) | dict(alone.named_parameters())
        want = dict(whole.named_buffers()) | dict(whole.named_parameters())
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
        with pytest.raises(RuntimeError):  # strict: the other half's tensors do not fit
            load_token2wav_part(part, state, TINY)
    with pytest.raises(ValueError, match="part must be"):
        load_token2wav_part("vocoder", {}, TINY)


def test_kept_time_conditioning_follows_the_weights(models) -> None:
    """``DiT.time_conditioning`` keeps its per-time values without autograd: they equal the
    values computed with autograd on, rows with different times get their own, and an
    in-place change of a weight they read (an optimizer step) is seen at the next call."""
    dit = load_token2wav(models[0].state_dict(), TINY).code2wav_dit_model  # a copy to change
    t = torch.tensor([0.25, 0.5, 0.25], dtype=dit.dtype)

    def both() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        with torch.inference_mode():
            mods, final = dit.time_conditioning(t)
            kept = [*mods, final]
        with torch.enable_grad():
            mods, final = dit.time_conditioning(t)
            fresh = [m.detach() for m in (*mods, final)]
        return kept, fresh

    kept, fresh = both()
    assert len(kept) == len(dit.transformer_blocks) + 1
    for k, f in zip(kept, fresh, strict=True):
        assert torch.equal(k, f)
        assert torch.equal(k[0], k[2]) and not torch.equal(k[0], k[1])
    with torch.no_grad():
        dit.transformer_blocks[1].attn_norm.linear.weight.mul_(1.5)
        dit.time_embed.time_mlp[0].bias.add_(0.1)
    again, fresh = both()
    for a, k, f in zip(again, kept, fresh, strict=True):
        assert torch.equal(a, f) and not torch.equal(a, k)
