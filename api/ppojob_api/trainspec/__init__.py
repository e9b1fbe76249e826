"""The parts of the training half of a PPOJob, one section of the spec per module; the
models compose in `ppojob_api.training` (`TrainingHalf`, `TrainerConfig`), which also exports every
public model class."""
