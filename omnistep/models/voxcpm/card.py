"""The ``voxcpm`` card: VoxCPM2 (``openbmb/VoxCPM2``) on a published folder
(``--model voxcpm=DIR``).

Program: ``frontend`` (text ids, voice -> ``VoxCPMPrompt``; ``frontend`` module) -> ``decode``
(``loop.VoxCPMLoop`` on the ``lm`` component, ``ar.VoxCPMAR``: both LMs, the stop decision
and the LocDiT solve of every request's patch in one AR unit; each step streams its patch's
latent frames) -> ``vocode`` (``AudioDecodeLoop`` on the ``vae`` component,
``vocoder.AudioVAEComponent``, stateful: each request's conv tails are kept, a chunk costs its
own frames; first chunk one patch, so audio starts after the first AR step) -> ``usage``.
Output: 48 kHz mono float32 (``audio_vae_config.out_sample_rate``).

Voices: ``default`` and the OpenAI voice names are the zero-shot voice (its timbre follows the
seed); cloned voices (``POST /v1/audio/voices`` or inline ``ref_audio`` + ``ref_text``) carry a
reference clip's latent patches (upstream's reference-only mode; the transcript is not used).
Generation settings (upstream ``generate`` defaults): ``cfg_value`` 2.0, ``inference_timesteps``
10, ``min_len`` 2, ``max_len`` 4096 patches (``VoxCPMOptions``). The stop decision is greedy
(upstream's argmax) unless the request sets ``temperature`` (the stop head's softmax at that
temperature, drawn with the request's seed) or ``flow_noise_level`` > 0 (the LocDiT solve as
an SDE, for RL; the stop is then sampled at temperature 1 unless ``temperature`` says
otherwise: ``ar.stop_temperature``); the other sampling fields do not apply; ``speed`` is
ignored.

This module declares the card only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from omnistep.core import (
    OPENAI_VOICES,
    Capability,
    ComponentSpec,
    KernelNode,
    LoopNode,
    ModelCard,
    Program,
    ProgramContext,
)
from omnistep.layers.device import check_device
from omnistep.loops.ar_decode import ARDecodeConfig
from omnistep.loops.audio_decode import AudioDecodeConfig
from omnistep.models.voxcpm.ar import STOP, VoxCPMAR, stop_sampling, stop_temperature
from omnistep.models.voxcpm.config import VoxCPMConfig
from omnistep.models.voxcpm.frontend import (
    DEFAULT_VOICE,
    VoxCPMEncoder,
    VoxCPMFrontend,
    VoxCPMTextTokenizer,
)
from omnistep.models.voxcpm.loader import load_voxcpm
from omnistep.models.voxcpm.loop import VoxCPMLoop
from omnistep.models.voxcpm.vocoder import AudioVAEComponent
from omnistep.runners.card_parts import (
    ar_decode_loop,
    audio_decode_loop,
    component_enroller,
    require_weights,
)
from omnistep.runners.locate import checkpoint_folder
from omnistep.runners.options import ServingOptions

CARD_ID = "voxcpm2"
LAYOUT = (
    "config.json, the tokenizer files, model.safetensors or pytorch_model.bin, "
    "audiovae.safetensors or audiovae.pth: openbmb/VoxCPM2"
)
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
VAE_FILES = ("audiovae.safetensors", "audiovae.pth")


@dataclass(frozen=True)
class VoxCPMOptions(ServingOptions):
    """Serving options: ``ServingOptions`` (the LMs' KV pool, batching, dtype) and

    Attributes:
        cfg_value: LocDiT classifier-free guidance scale (upstream default 2.0).
        inference_timesteps: Euler steps of each patch's solve (upstream default 10).
        min_len: no stop before step ``min_len + 1`` (upstream default 2).
        max_len: most patches per request (upstream ``generate``'s default 4096; the text's
            own cap ``len(ids) * 6 + 10`` is usually lower).
        first_chunk, chunk, max_chunk: the vocoder's chunk schedule in patches (1 patch =
            4 latent frames = 160 ms at 48 kHz); the first chunk is the first patch, so audio
            starts after one AR step.
    """

    cfg_value: float = 2.0
    inference_timesteps: int = 10
    min_len: int = 2
    max_len: int = 4096
    first_chunk: int = 1
    chunk: int = 1
    max_chunk: int = 4


def _usage(tokenizer: VoxCPMTextTokenizer):
    """The ``usage`` node: input text ids and output patches."""

    def usage(ctx: ProgramContext) -> None:
        ctx.usage["input_tokens"] = len(tokenizer(ctx.request.text))
        ctx.usage["output_tokens"] = len(ctx.slots["stops"])

    return usage


def build_card(
    path: str | None = None, options: VoxCPMOptions | None = None, **overrides: Any
) -> ModelCard:
    """The VoxCPM2 card on a published folder ``path`` (``config.json``, the tokenizer,
    ``model.safetensors`` or ``pytorch_model.bin``, ``audiovae.safetensors`` or
    ``audiovae.pth``).

    Raises:
        InvalidRequestError: no path given.
        ModelFilesError: the folder, ``config.json``, ``tokenizer_config.json`` or both
            weight files of a pair are missing (named).
        VoxCPMConfigError / VoxCPMCheckpointError: a missing or malformed file (named), when
            the card's components load.
    """
    path = require_weights("voxcpm", path, "/path/to/VoxCPM2")
    opts = options or VoxCPMOptions(**overrides)
    root = checkpoint_folder(path, "VoxCPM2", LAYOUT, ("config.json", "tokenizer_config.json"))
    for names in (WEIGHT_FILES, VAE_FILES):  # named now, not when the components load
        checkpoint_folder(root, "VoxCPM2", LAYOUT, one_of=names)
    config = VoxCPMConfig.from_file(root / "config.json")
    from transformers import LlamaTokenizerFast

    tokenizer = VoxCPMTextTokenizer(LlamaTokenizerFast.from_pretrained(str(root)))
    frontend = VoxCPMFrontend(
        tokenizer,
        config.patch_size,
        config.feat_dim,
        opts.cfg_value,
        opts.inference_timesteps,
        opts.max_len,
    )
    sample_rate = int(config.audio_vae["out_sample_rate"])
    patch = config.patch_size
    cache: dict[str, Any] = {}

    def weights(device: str):
        if device not in cache:  # the three components share one load
            cache.clear()
            cache[device] = load_voxcpm(root, device, opts.dtype)
        return cache[device]

    def build_lm(device: str) -> VoxCPMAR:
        check_device(device)
        base, res = config.base_lm(), config.residual_lm()
        # one block holds the rows of both LMs: size the pool by their layers together
        layers = base.num_hidden_layers + res.num_hidden_layers
        kv = opts.kv_config(layers, base.num_key_value_heads, base.head_dim)
        return VoxCPMAR(weights(device).backbone, kv, device, opts.dtype, opts.batch_invariant)

    def build_vae(device: str) -> AudioVAEComponent:
        check_device(device)
        loaded = weights(device)
        return AudioVAEComponent(loaded.vae, opts.batch_invariant, loaded.vae_normed)

    def build_encoder(device: str) -> VoxCPMEncoder:
        check_device(device)
        loaded = weights(device)
        return VoxCPMEncoder(loaded.encoder, patch, loaded.encoder_normed)

    decode = ARDecodeConfig(
        loop_id="decode",
        component="lm",
        prompt_slot="voice",
        make_sampling=lambda req: stop_sampling(opts.min_len, stop_temperature(req.sampling)),
        max_new_tokens=opts.max_len,
        eos_token_ids=(STOP,),
        stream_slot="latents",
        penalty_window=0,
    )
    vocode = AudioDecodeConfig(
        loop_id="vocode",
        component="vae",
        in_slot="latents",
        sample_rate=sample_rate,
        first_chunk=opts.first_chunk * patch,
        chunk=opts.chunk * patch,
        chunk_growth=2.0,
        max_chunk=max(opts.max_chunk, opts.chunk) * patch,
        stream_state=True,
    )
    program = Program(
        inputs=("request",),
        nodes=(
            KernelNode("frontend", frontend, needs=("request",), binds=("voice",)),
            LoopNode("decode", "decode", needs=("voice",), binds="stops", streams=("latents",)),
            LoopNode("vocode", "vocode", needs=("latents",), binds="samples"),
            KernelNode("usage", _usage(tokenizer), needs=("stops", "samples")),
        ),
    )
    return ModelCard(
        card_id=CARD_ID,
        family="voxcpm",
        components=(
            ComponentSpec("lm", build_lm, opts.max_batch_size, "base + residual LM + LocDiT"),
            ComponentSpec("vae", build_vae, opts.max_batch_size, "AudioVAE decoder, 48 kHz"),
            ComponentSpec("encoder", build_encoder, 1, "AudioVAE encoder (cloning clips)"),
        ),
        loops=(
            ar_decode_loop(decode, VoxCPMLoop),
            audio_decode_loop(vocode),
        ),
        program=program,
        capabilities=frozenset({Capability.TEXT_TO_SPEECH, Capability.VOICE_CLONING}),
        sample_rate=sample_rate,
        voices=(DEFAULT_VOICE, *OPENAI_VOICES),
        default_voice=DEFAULT_VOICE,
        voice_validator=frontend.check_voice,
        voice_enroller=component_enroller("encoder"),
        parity=frozenset({"C0", "C1", "C3", "stream", "reference"}),
        description="VoxCPM2: MiniCPM-4 LM + residual LM over continuous AudioVAE latents, "
        "LocDiT flow-matching solve per patch, causal AudioVAE decoder, 48 kHz; zero-shot or "
        "cloned from a reference clip.",
    )
