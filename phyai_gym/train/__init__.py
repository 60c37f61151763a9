"""Training support the examples share.

The torchrun process group (`distributed`), rollout batches between ranks (`rollout_transport`), PPO math
(`ppo_math`), learning curves (`curves`), checkpoints of a run (`training_state`), demonstrations for SFT
(`demos`), float32 master weights (`master_weights`) and the examples' flags from their config dataclasses
(`dataclass_cli`).

The front door reads one thing from here: a run folder's layout (`training_state`), so that `make_policy(RUN)`
and `phyai-gym eval --checkpoint RUN` load the run's newest checkpoint. `wrappers` and `policies` never import it.
"""
