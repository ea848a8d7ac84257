"""Data: verl-format RL datasets, the resumable sampler, the synthetic demo task and the GSM8K preprocessor."""
