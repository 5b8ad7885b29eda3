"""Chatterbox (ResembleAI/chatterbox, MIT): T3, a Llama AR over 25 Hz speech tokens conditioned
on a speaker embedding, a prompt's speech tokens and an emotion-exaggeration scalar, sampled
with classifier-free guidance (the shared ``PagedARModel`` option); S3Gen's conditional flow
matching to mel; HiFT to 24 kHz audio. ``card`` declares the served model; ``loader`` reads the
published folder; ``frontend`` is the text front end and voice; ``t3`` (with ``perceiver``),
``s3gen`` (with ``s3gen_encoder`` and ``s3gen_estimator``), ``hift`` and ``voice_encoder`` are
the models; ``stages`` wraps S3Gen and HiFT as scheduler components (docs/models/chatterbox.md).
"""
