"""Flow matching, speech tokens -> 80-bin mel: the token encoder (``encoder``), the conditional flow and its
10-step CFM solver (``cfm``), the two estimators (v3 DiT ``dit``, v2 U-Net ``unet``) with their attention
mask, the reuse of a request's finished frames across streaming calls (``*_cache``) and in the graph solver's
page pools (``*_pages``), the compiled estimator and the solver as replayed CUDA graphs (``graphs``)."""
