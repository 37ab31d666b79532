"""RL on the runtime: algorithms, prompt sources, rewards, the actor and the critic."""

from asyncrl.rl.actor import Actor
from asyncrl.rl.algorithms import gae, grpo_advantages, kl_penalty, ppo_policy_loss, whiten
from asyncrl.rl.config import RLConfig
from asyncrl.rl.critic import Critic
from asyncrl.rl.data import PromptSource
from asyncrl.rl.reward import RewardFn, RewardModel

__all__ = ["Actor", "Critic", "PromptSource", "RLConfig", "RewardFn", "RewardModel", "gae",
           "grpo_advantages", "kl_penalty", "ppo_policy_loss", "whiten"]
