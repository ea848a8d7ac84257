"""Agentic (multi-turn, tool-calling) rollouts: the tools a policy can call (``rl_core.agent.tools``)."""
