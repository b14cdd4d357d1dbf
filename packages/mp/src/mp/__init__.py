"""mp: model parallelism for PyTorch behind the SageMaker model parallelism v1 API (import mp as smp)."""

__version__ = "0.1.0"
