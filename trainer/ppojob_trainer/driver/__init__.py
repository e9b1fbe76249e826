"""The trainer's driver: the process that starts the workers and runs the PPO step.

* :mod:`.topology`: the layout and every mode, resolved once from the config (pure);
* :mod:`.groups`: a role's worker handles, data-parallel leaders and sample ranges;
* :mod:`.cluster`: starting the worker processes (hosts, engines, reward and sandbox workers);
* :mod:`.weights`: the weight sync, one class per way weights reach the engines;
* :mod:`.rollouts`: the generation window (launch ahead, take, dynamic sampling's refill);
* :mod:`.elastic`: elastic engines and the reward workers' pool (drop, top up, admit, replace);
* :mod:`.metrics`: a step's metrics from the workers' reports;
* :mod:`.trainer`: :class:`~.trainer.PPOTrainer`, the step;
* :mod:`.run`: :func:`~.run.train`, the run around the steps (resume, checkpoints, export).

Nothing is imported here, so that :mod:`.topology` stays importable without Ray.
"""
