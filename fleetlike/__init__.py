"""fleetlike: collective-training strategies for PyTorch, in the shape of PaddlePaddle Fleet."""

__version__ = "0.1.0"
