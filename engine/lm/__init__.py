"""Speech-LM decoding backends (native PyTorch, vLLM) and the RAS sampler."""
