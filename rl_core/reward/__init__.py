"""Rewards: rule scorers chosen by ``data_source``, user scoring functions, and the reward manager that turns a
batch of responses into token-level scores."""
