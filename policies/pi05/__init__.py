"""PI0.5: config, model, checkpoints, processor, rollout sampling, CUDA-graph scheduler, weight sync, policy."""

from policies.pi05.attention import AttentionConfig
from policies.pi05.batch import RolloutBatch, StoredPrefix
from policies.pi05.checkpoint import CheckpointError, LoadReport
from policies.pi05.config import GemmaConfig, Pi05Config, SiglipConfig
from policies.pi05.evaluate import EvalOutput
from policies.pi05.inputs import ModelInputs
from policies.pi05.model import Pi05Model
from policies.pi05.policy import Pi05Policy, RolloutConfig
from policies.pi05.presets import Preset, get_preset, list_presets
from policies.pi05.processor import Pi05Processor, ProcessorConfig
from policies.pi05.scheduler import CaptureError, GraphKeyError, SchedulerConfig
from policies.pi05.weight_sync import WeightSyncError, WeightUpdateReport

__all__ = [
    "AttentionConfig",
    "CaptureError",
    "CheckpointError",
    "EvalOutput",
    "GemmaConfig",
    "GraphKeyError",
    "LoadReport",
    "ModelInputs",
    "Pi05Config",
    "Pi05Model",
    "Pi05Policy",
    "Pi05Processor",
    "Preset",
    "ProcessorConfig",
    "RolloutBatch",
    "RolloutConfig",
    "SchedulerConfig",
    "SiglipConfig",
    "StoredPrefix",
    "WeightSyncError",
    "WeightUpdateReport",
    "get_preset",
    "list_presets",
]
