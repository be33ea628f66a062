"""Training algorithms: each declares how its teacher sees a rollout and which loss it applies."""
