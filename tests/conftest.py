"""Suite-wide settings.

Tiny CPU models are latency-bound: with two intra-op threads on a 2-core machine that also runs simulator
subprocesses, OpenMP threads contend and a 20 ms policy call can take seconds. One thread is both faster and
deterministic here, so the whole suite runs single-threaded in torch.
"""

import torch

torch.set_num_threads(1)
