"""Workers: plain classes that own models on one device (or one rank of a process group), with methods named
after verl's stages. The Ray layer (infra) places and drives them; tests call them directly."""

from rl_core.workers.actor_rollout_ref import ActorRolloutRefWorker
from rl_core.workers.critic import CriticWorker
from rl_core.workers.reward_model import RewardModelWorker

__all__ = ["ActorRolloutRefWorker", "CriticWorker", "RewardModelWorker"]
