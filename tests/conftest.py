import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
# torch.cuda.is_available() through NVML: it does not initialize CUDA in this process,
# whose forked workers could then not use the GPU
os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")

import torch  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

torch.set_num_threads(1)

# CI: derandomized, bounded. Locally: HYPOTHESIS_PROFILE=thorough for many more examples.
settings.register_profile(
    "ci",
    derandomize=True,
    deadline=None,
    max_examples=40,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "thorough",
    deadline=None,
    max_examples=1000,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
