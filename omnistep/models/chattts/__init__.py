"""ChatTTS family: GPT (Llama) multi-codebook decoder, Decoder + Vocos vocoder, official assets."""
