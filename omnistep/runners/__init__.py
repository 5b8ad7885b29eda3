"""The runner plane: the shared mechanisms a model family configures rather than copies.

- ``paged_ar.PagedARModel``: the one paged-KV autoregressive component (admission, growth,
  preemption, prefix sharing, batched prefill/decode, sampling, weight updates, scoring) that
  ChatTTS's GPT, the Qwen2.5-Omni thinker and talker and the Qwen3-TTS talker configure.
- ``vocoder.ChunkVocoder``: the AUDIO_CHUNK component around any chunked vocoder
  (``decode_chunk(window, left, chunk)``): ChatTTS's Decoder + Vocos, Qwen2.5-Omni's BigVGAN,
  and (with its stream state) Qwen3-TTS's codec decoder.
- ``flow_matching``: the flow-matching ODE / SDE math of a denoise runner (time schedule,
  Kutta's 3/8 RK4 step, classifier-free guidance, Flow-GRPO's SDE step and its log-prob,
  per-frame and per-step noise).
- ``encoder.MediaEncoderRunner``: the ENCODE component over a family's batched media
  encoders (Qwen2.5-Omni's audio tower and vision encoder), outputs kept by content hash.
- ``media_prompt``, ``mrope``, ``media_features``: what the Qwen omni families (Qwen2.5-Omni,
  Qwen3-Omni) share between a chat's media parts and their thinker (media checks, template
  parts, the thinker prompt with its M-RoPE positions, the reference feature extraction).
- ``options.ServingOptions``: the KV/batching fields every family's options share, and the
  one ``KVCacheConfig.from_memory`` call they feed.
- ``card_parts``: what every family's ``build_card`` repeats (the "needs weights" refusal,
  the generic loops' ``LoopSpec`` read from their configs, the component ``voice_enroller``,
  the ``usage`` node counting one slot).

Imports: torch, numpy, ``omnistep.core``, ``omnistep.kv``, ``omnistep.layers``,
``omnistep.loops``, ``omnistep.sampling``; never ``engine``, ``models`` or ``server``.
"""
