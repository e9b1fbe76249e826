"""Ray workers per role (rollout, actor, critic) with backend-agnostic role logic."""
