"""Advantage estimators, policy losses and Group-PPO grouping: pure tensor math."""
