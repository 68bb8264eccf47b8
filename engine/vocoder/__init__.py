"""The vocoder, 80-bin mel -> 24 kHz waveform: HiFT (``hift``: v2 ``HiFTGenerator``, v3 causal), its config,
layers, F0 predictor and v3's fixed noise, and v3's causal HiFT as replayed CUDA graphs (``graphs``)."""
