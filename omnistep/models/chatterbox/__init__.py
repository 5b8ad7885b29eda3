"""Chatterbox (ResembleAI/chatterbox, MIT): T3, a Llama AR over 25 Hz speech tokens conditioned
on a speaker embedding, a prompt's speech tokens and an emotion-exaggeration scalar, sampled
with classifier-free guidance (the shared ``PagedARModel`` option). ``loader`` reads the
published folder; ``t3`` is the component; ``perceiver`` its prompt resampler. S3Gen (flow
matching to mel), HiFT and the voice encoder are not built yet (docs/models/chatterbox.md)."""
