"""The networks of the ResNet example (torchvision's ResNet family, written out: torchvision's
CPU wheel does not import beside this torch build)."""

from models.resnet import MODELS, BasicBlock, Bottleneck, ResNet, get_model

__all__ = ["MODELS", "BasicBlock", "Bottleneck", "ResNet", "get_model"]
