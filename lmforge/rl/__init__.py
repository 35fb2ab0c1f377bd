"""Reinforcement learning from feedback: rollouts through the engine, rewards, advantages, policy losses."""
