"""The training loop and its phases: `trainer` (the loop), `rollout` (sampling and rewards), `epoch_advantages`,
the updates (`stepwise_update` on trajectory steps, `forward_training` on the forward process), `reference` (KL),
`critic` and `critic_designs`, `models` (building the policy and its optimizer), `sharding` (FSDP2), `batch`,
`diagnostics`. docs/architecture.md draws the map."""
