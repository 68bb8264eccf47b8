"""The text front end: normalisation (``frontend``), sentence splitting (``split``), English number words,
the Qwen tokenizer with the CosyVoice special tokens, text that arrives in pieces (``stream``) and the
worker processes that normalise and tokenise many requests at once (``pool``)."""
