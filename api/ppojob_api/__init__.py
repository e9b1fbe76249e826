"""The PPOJob API: the bottom layer both halves stand on.

`spec` (the cluster half and status) and `training` (the training half, which is the trainer's own
config, composed of one module per section of the spec in `trainspec`) define the typed models;
`checks` holds the semantic checks, one concern per function; `validation` reads a manifest as the
API server does and judges it once; `overrides`, `yamlio`, `metadata` and `problems` serve them;
`crd` and `reference` generate the CRD and the docs' reference from the models. It imports no
Kubernetes client, kopf, torch, Ray or Hugging Face code (an import-linter contract in
pyproject.toml keeps it so).
"""
