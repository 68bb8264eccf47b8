"""Neural modules of the CosyVoice family; constructor defaults equal the released configs."""
