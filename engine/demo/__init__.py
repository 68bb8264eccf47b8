"""demo-tiny: a model directory in the released layout with seeded random weights (``make_model``), built
offline from its yaml templates, a tiny byte-level tokenizer, ONNX stand-ins for the speech tokenizer and
CAM++, and a tiny Whisper. ``--model demo-tiny`` runs the whole stack on a fresh CPU machine; its audio is
noise. The bench uses the same builder at other sizes."""
