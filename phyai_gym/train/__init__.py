"""Training support the examples share, kept out of the front door.

The torchrun process group (`distributed`), rollout batches between ranks (`rollout_transport`), PPO math
(`ppo_math`), learning curves (`curves`), checkpoints of a run (`training_state`), demonstrations for SFT
(`demos`) and float32 master weights (`master_weights`).

Nothing in `phyai_gym`'s front door, `wrappers` or `policies` imports this package; the examples and benchmarks do.
"""
