"""Model families, checkpoint loading and presets. Models compose kernels; no Triton code here."""
