"""dspark-hf: DSpark speculative-decoding drafters, native to the HuggingFace stack.

The model itself lives in the remote-code files (`configuration_dspark.py`, `drafting_dspark.py` and the siblings
it imports) copied next to every checkpoint; this package re-exports them and adds the pipeline around them
(data → cache → vocab → train → eval → generate → export).
"""

from .remote_code.configuration_dspark import DSparkConfig
from .remote_code.generation_dspark import DSparkCandidateGenerator
from .remote_code.drafting_dspark import DSparkForDrafting
from .remote_code.modeling_dspark import DSparkContextCache, DSparkDraftOutput, DSparkTrainingOutput
from .presets import PRESETS, preset_config

__version__ = "0.1.0"

__all__ = [
    "PRESETS",
    "DSparkCandidateGenerator",
    "DSparkConfig",
    "DSparkContextCache",
    "DSparkDraftOutput",
    "DSparkForDrafting",
    "DSparkTrainingOutput",
    "preset_config",
]
