"""The speech LM: its geometry (``lm_config``), the Qwen2 backbone (``qwen2``), the CosyVoice2/3 speech LM
around it (``speech_lm``), the decoding backends (native PyTorch, vLLM) behind one contract (``backend``),
bistream text input and the RAS sampler."""
