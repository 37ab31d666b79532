"""RLConfig: the algorithm settings an actor and a critic share (GRPO or PPO)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(kw_only=True)
class RLConfig:
    """GRPO: advantages from each prompt's group of `group_size` samples (contiguous rows),
    KL to the reference as a loss term (`kl_in_reward=False`, the GRPO paper) or in the reward.
    PPO: a critic, GAE(gamma, lam) on per-token rewards (the score on the last response token,
    minus `kl_coef` * KL when `kl_in_reward`), advantages whitened over the batch."""

    algo: str = "grpo"
    group_size: int = 1
    std_normalize: bool = True  # GRPO: divide by the group's std (False: Dr. GRPO)
    clip: float = 0.2
    agg: str = "token-mean"  # or "seq-mean-token-mean"
    kl_coef: float = 0.0
    kl_kind: str = "k3"  # k1, k2, k3 (see kl_penalty)
    kl_in_reward: bool = False
    entropy_coef: float = 0.0
    gamma: float = 1.0
    lam: float = 0.95
    value_clip: float = 0.2  # critic: how far a value may move from the rollout's value
    epochs: int = 1  # passes over each batch
    mini_batches: int = 1  # optimizer steps per pass (the batch in this many near-equal parts)

    def __post_init__(self) -> None:
        if self.algo not in ("grpo", "ppo"):
            raise ValueError(f"RLConfig.algo is 'grpo' or 'ppo', got {self.algo!r}")
        if self.group_size < 1:
            raise ValueError(f"RLConfig.group_size must be >= 1, got {self.group_size}")
        if self.algo == "grpo" and self.group_size < 2:
            raise ValueError("RLConfig: GRPO needs group_size >= 2 samples per prompt (with one, "
                             "every advantage is 0 and nothing is learned)")
        for name in ("epochs", "mini_batches"):
            if getattr(self, name) < 1:
                raise ValueError(f"RLConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.kl_kind not in ("k1", "k2", "k3"):
            raise ValueError(f"RLConfig.kl_kind is 'k1', 'k2' or 'k3', got {self.kl_kind!r}")
        if self.agg not in ("token-mean", "seq-mean-token-mean"):
            raise ValueError(f"RLConfig.agg is 'token-mean' or 'seq-mean-token-mean', got "
                             f"{self.agg!r}")
