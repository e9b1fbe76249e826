"""The torch backend: Hugging Face ``transformers`` models on CPU or one GPU per worker.

Generation (:mod:`.generation`) is a tight sampling loop over the whole batch with the model's KV
cache (``past_key_values``): one forward over the prompts, then one single-token forward per step
until every row has produced a stop token.

Training (:mod:`.policy`, :mod:`.value`) is data parallel over the role's ``torch.distributed``
group (gloo on CPU, nccl on GPU):
- device: tensors cross the backend seam on the CPU; :func:`.memory.to_device` is the one place a
  micro-batch moves to the worker's device (model inputs go through
  :func:`.trainer_common._device_inputs`);
- precision: float32 master weights and AdamW state; ``model.dtype`` bfloat16 computes under
  ``torch.autocast`` (float16 is rejected by validation: no loss scaling); the frozen reference
  and the generation engines hold their weights in ``model.dtype``;
- memory: forwards without gradient run ``forwardMicroBatchSize`` rows at a time; every
  (micro-)batch is padded to its own longest prompt and response (:func:`.memory.trim_padding`);
  log-probs and entropy come from the hidden states ``LOGITS_CHUNK_TOKENS`` positions at a time
  (:func:`.memory.chunked_logprobs`); ``gradientCheckpointing`` recomputes block activations;
- sharding (:mod:`.sharding`): ``sharding: none`` keeps a replica per worker and averages
  gradients with one flat ``all_reduce``; ``sharding: fsdp`` shards parameters, gradients and
  optimizer state with FSDP2 (``fully_shard``, one unit per transformer block), the reference
  model too (optionally offloaded to CPU memory);
- checkpoints (:mod:`.optimiser`): every worker writes its own shard with
  ``torch.distributed.checkpoint``.

Modules: ``common`` (inputs, log-probs, entropy, learning-rate schedule), ``packing`` (token-budget
micro-batches, packed rows), ``memory`` (device moves, padding, chunked log-probs), ``sharding``
(FSDP2, state dicts), ``optimiser`` (AdamW, accumulation, checkpoints), ``generation``
(:class:`TorchGenerationEngine`), ``trainer_common`` (what both trainers share), ``lora`` (PEFT),
``policy`` (:class:`TorchPolicyTrainer`), ``value`` (:class:`TorchValueTrainer`).
"""
