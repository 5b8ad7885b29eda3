"""Qwen3-Omni (Qwen/Qwen3-Omni-30B-A3B-*): MoE thinker -> MoE talker with the code predictor ->
causal ConvNet code2wav, on omnistep's layers. ``loader`` reads the published folder (its
``load_code2wav`` builds the shared codec decoder), ``tiny`` writes a seeded random one,
``thinker`` is the text model on the paged-KV AR runner (docs/models/qwen3_omni.md)."""
