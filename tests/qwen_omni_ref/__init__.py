"""Test-only helpers for Qwen2.5-Omni reference parity (transformers ``qwen2_5_omni``).

* :mod:`omnistep.models.qwen2_5_omni.tiny` writes a checkpoint folder in the official Hugging Face
  layout of ``Qwen/Qwen2.5-Omni-7B`` (config, sharded safetensors + index, ``spk_dict.pt``,
  tokenizer files with a chat template), tiny, with seeded random weights of real scale.
* :mod:`tests.qwen_omni_ref.reference` runs transformers' ``Qwen2_5OmniForConditionalGeneration``
  on such a folder and returns tensors to compare against; its docstring lists the pipeline
  facts (prompt format, thinker -> talker hand-off, DiT ODE, BigVGAN).

Nothing here imports torch or transformers at package import time.
"""
