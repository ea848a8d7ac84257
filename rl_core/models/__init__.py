"""Models: the loading pipeline (tokenizer -> config -> class -> weights -> LoRA), the critic's value head,
optimizers and LR schedules, log-prob computation, and the tiny demo models built with no download."""
