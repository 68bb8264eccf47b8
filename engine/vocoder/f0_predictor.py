"""HiFT F0 predictor (v2 ``ConvRNNF0Predictor``, v3 ``CausalConvRNNF0Predictor``).

Both are 5 x (weight-normed Conv1d + ELU) -> Linear(cond, 1) -> |.|: mel [B, 80, T] -> f0 [B, T] in Hz.
The causal one looks 3 frames right in its first conv (k=4) and left only in the others (k=3). Key names match
the released hift.pt: ``f0_predictor.condnet.{0,2,4,6,8}.{bias,parametrizations.weight.original0/1}``,
``f0_predictor.classifier.{weight,bias}``.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.utils.parametrizations import weight_norm

from engine.vocoder.hift_config import F0PredictorConfig
from engine.vocoder.hift_layers import causal_conv, same_conv


class F0Predictor(nn.Module):
    """mel [B, C_in, T] -> f0 [B, T]; causal with ``finalize=False``: [B, T - 3] (last 3 frames = context)."""

    def __init__(self, config: F0PredictorConfig) -> None:
        super().__init__()
        self.config = config
        c, layers = config.cond_channels, []
        for i in range(5):
            cin = config.in_channels if i == 0 else c
            if not config.causal:
                conv = same_conv(cin, c, 3)
            else:
                conv = causal_conv(cin, c, 4, right=True) if i == 0 else causal_conv(cin, c, 3)
            layers += [weight_norm(conv), nn.ELU()]
        self.condnet = nn.Sequential(*layers)
        self.classifier = nn.Linear(c, config.num_class)

    def forward(self, mel: torch.Tensor, finalize: bool = True) -> torch.Tensor:
        if not finalize and not self.config.causal:
            raise ValueError("finalize=False needs the causal (v3) f0 predictor")
        x = self.condnet[0](mel, pad=finalize)
        for layer in list(self.condnet)[1:]:
            x = layer(x)
        return torch.abs(self.classifier(x.transpose(1, 2)).squeeze(-1))
