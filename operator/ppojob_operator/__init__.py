"""ppojob control plane: the kopf operator. Never imports torch, ray or user code."""
