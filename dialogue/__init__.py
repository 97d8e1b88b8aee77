"""Dialogue RL, an extension of the core: EmoLLM's and CARE's stage II (GRPO on role-played
dialogues against a simulated user) and their evaluations. Each module imports the core; the core
imports none of them.

    torchrun --nproc_per_node=N -m dialogue.rl CONFIG [key=value ...]    # training (rl.py)
    python -m dialogue.evaluation CONFIG [key=value ...]                 # EmoLLM F, CARE metrics
    python -m dialogue.eqbench3 CONFIG [key=value ...]                   # the benchmark table,
                                                                           EQBench3's rows judged

play.py: scenario seeds, the role-play, the dialogue judges asked, the dialogue sampler.
rl.py: grpo.py's trainer with a `dialogue:` section and that sampler.
evaluation.py: EmoLLM's Appendix F metrics and CARE's rubric score over played dialogues.
eqbench3.py: EQ-Bench 3's scripted role-plays scored by a rubric judge (a row of the benchmark
table, evaluate.py's)."""
