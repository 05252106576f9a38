"""Real compute for RL post-training: task and rewards, models, the warm start, the GRPO Trainer.

* :mod:`~aurora.rl.tasks` - reward functions ``(prompt, completion) -> float``, the arithmetic
  task (prompts by integer id from a seed, a fixed held-out set), a GSM8K-style extractor.
* :mod:`~aurora.rl.warmstart` - supervised pre-training to a threshold, cached as the v0
  snapshot in the Checkpoint Store's format.
* :mod:`~aurora.rl.trainer` - GRPO on fp32 master weights; publishes bf16 delta checkpoints.
* :mod:`~aurora.rl.loop` - evaluation and the synchronous Trainer + engine loop.

The engines live in :mod:`aurora.engines`. docs/RL.md has the objective, defaults and API.
"""
