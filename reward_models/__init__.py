"""Trained reward models, an extension of the core: Social-R1's content RM and the GRPO run that
scores R_content with it, and CARE's rubric generator. Each module imports the core; the core
imports none of them.

    python -m reward_models.content_rm pairs CONFIG [key=value ...]    # rollouts -> pair file
    python -m reward_models.content_rm CONFIG [key=value ...]          # train the content RM
    python -m reward_models.content_rm serve --model RM --port 8000    # serve it as a judge
    torchrun --nproc_per_node=N -m reward_models.social_r1 CONFIG      # Social-R1's GRPO with it
    python -m reward_models.rubric_generator targets|winrate CONFIG    # CARE's rubric generator

content_rm.py: the value-head RM, its Bradley-Terry training, the pair builder, its scorer.
social_r1.py: grpo.py's trainer with a `content_model:` section, R_content from the RM.
reward_models/rubric_generator.py: CARE's rubric targets, preference examples and win rate."""
