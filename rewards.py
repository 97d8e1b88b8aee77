"""Every reward as a plain function behind one registry: task correctness, IU_G and the CLUE
combined reward, and the Social-R1, EmoLLM and CARE reward families."""
