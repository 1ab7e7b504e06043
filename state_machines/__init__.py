"""Hypothesis state machines that drive a real allocator in lockstep with the
ownership model.  Tensors become Python values here, and only here."""

import os
import warnings

# torch_npu installed without Huawei's CANN runtime breaks `import torch` when
# torch autoloads device backends, so the harness turns autoload off before
# torch is first imported and probes torch_npu itself (see devices.py).
os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")
# The CPU build of torch warns at import when NumPy is absent; we never need it.
warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
