"""CosyStream inference engine: released CosyVoice2 / Fun-CosyVoice3 checkpoints, streamed.

Nothing heavy is imported here; import submodules explicitly (``engine.serving.engine.TTSEngine``).
"""
