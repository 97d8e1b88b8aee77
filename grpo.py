"""Stage 2: GRPO with grounded rewards (rollouts, group filtering and resampling, advantages,
clipped policy loss with KL to the LoRA-disabled reference). Run: torchrun grpo.py config.yaml"""
