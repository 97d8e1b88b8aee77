"""Stage 1: reasoning SFT with quoted evidence (token-weighted loss, LoRA, trainable `<evidence>` rows)."""
