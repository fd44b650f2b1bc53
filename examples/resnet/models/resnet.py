"""torchvision's ResNet family (He et al., 2016), with torchvision's module and parameter names.

Why written out: torchvision's wheel for this machine is a CUDA build that fails to import beside
the CPU torch, and the example must run anywhere. The names (``conv1``, ``bn1``, ``layer1.0.conv2``,
``fc``, ``downsample.0``/``.1``) are torchvision's, so a ``state_dict`` moves between the two, and
the recompute strategy can name ``layer1`` ... ``layer4`` as its checkpoints.

``small_input=True`` swaps the ImageNet stem (7x7 stride-2 conv + max pool, which would shrink a
32x32 image to 8x8 before the first block) for a 3x3 stride-1 conv and no pool, as CIFAR ResNets
do. The models are TorchScript-scriptable (the served model of ``evaluate.py``).

Example:
    >>> model = get_model("ResNet18", num_classes=10, small_input=True)
    >>> model(torch.zeros(2, 3, 32, 32)).shape
    torch.Size([2, 10])
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

__all__ = ["MODELS", "BasicBlock", "Bottleneck", "ResNet", "get_model",
           "resnet18", "resnet34", "resnet50", "resnet101", "resnet152"]


def conv3x3(in_planes: int, out_planes: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(in_planes, out_planes, kernel_size=3, stride=stride, padding=1, bias=False)


def conv1x1(in_planes: int, out_planes: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(in_planes, out_planes, kernel_size=1, stride=stride, bias=False)


class BasicBlock(nn.Module):
    """Two 3x3 convolutions and the identity (ResNet18/34)."""

    expansion: int = 1

    def __init__(self, inplanes: int, planes: int, stride: int = 1, downsample: nn.Module | None = None) -> None:
        super().__init__()
        self.conv1 = conv3x3(inplanes, planes, stride)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = conv3x3(planes, planes)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = downsample
        self.stride = stride

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        if self.downsample is not None:
            identity = self.downsample(x)
        return self.relu(out + identity)


class Bottleneck(nn.Module):
    """1x1 reduce, 3x3 (carrying the stride, as torchvision's "v1.5"), 1x1 expand (ResNet50+)."""

    expansion: int = 4

    def __init__(self, inplanes: int, planes: int, stride: int = 1, downsample: nn.Module | None = None) -> None:
        super().__init__()
        self.conv1 = conv1x1(inplanes, planes)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = conv3x3(planes, planes, stride)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = conv1x1(planes, planes * self.expansion)
        self.bn3 = nn.BatchNorm2d(planes * self.expansion)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = downsample
        self.stride = stride

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        if self.downsample is not None:
            identity = self.downsample(x)
        return self.relu(out + identity)


class ResNet(nn.Module):
    """torchvision's ``ResNet(block, layers, num_classes, zero_init_residual)`` plus
    ``small_input`` (see the module docstring)."""

    def __init__(self, block: type[BasicBlock] | type[Bottleneck], layers: list[int], num_classes: int = 1000,
                 zero_init_residual: bool = False, small_input: bool = False) -> None:
        super().__init__()
        if isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 1:
            raise ValueError(f"ResNet: num_classes={num_classes!r}; give the number of classes (an int >= 1)")
        self.inplanes = 64
        if small_input:
            self.conv1 = nn.Conv2d(3, 64, kernel_size=3, stride=1, padding=1, bias=False)
        else:
            self.conv1 = nn.Conv2d(3, 64, kernel_size=7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool: nn.Module = nn.Identity() if small_input else nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        self.layer1 = self._make_layer(block, 64, layers[0])
        self.layer2 = self._make_layer(block, 128, layers[1], stride=2)
        self.layer3 = self._make_layer(block, 256, layers[2], stride=2)
        self.layer4 = self._make_layer(block, 512, layers[3], stride=2)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(512 * block.expansion, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.constant_(m.weight, 1)
                nn.init.constant_(m.bias, 0)
        if zero_init_residual:
            for m in self.modules():
                if isinstance(m, Bottleneck):
                    nn.init.constant_(m.bn3.weight, 0)
                elif isinstance(m, BasicBlock):
                    nn.init.constant_(m.bn2.weight, 0)

    def _make_layer(self, block: type[BasicBlock] | type[Bottleneck], planes: int, blocks: int,
                    stride: int = 1) -> nn.Sequential:
        downsample = None
        if stride != 1 or self.inplanes != planes * block.expansion:
            downsample = nn.Sequential(
                conv1x1(self.inplanes, planes * block.expansion, stride),
                nn.BatchNorm2d(planes * block.expansion),
            )
        layers: list[nn.Module] = [block(self.inplanes, planes, stride, downsample)]
        self.inplanes = planes * block.expansion
        layers += [block(self.inplanes, planes) for _ in range(1, blocks)]
        return nn.Sequential(*layers)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """The pooled 512 (or 2048) features before ``fc``."""
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return torch.flatten(self.avgpool(x), 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The last FC layer's output (the logits): what ``evaluate.py`` compares."""
        return self.fc(self.features(x))


def resnet18(**kwargs: object) -> ResNet:
    return ResNet(BasicBlock, [2, 2, 2, 2], **kwargs)  # type: ignore[arg-type]


def resnet34(**kwargs: object) -> ResNet:
    return ResNet(BasicBlock, [3, 4, 6, 3], **kwargs)  # type: ignore[arg-type]


def resnet50(**kwargs: object) -> ResNet:
    return ResNet(Bottleneck, [3, 4, 6, 3], **kwargs)  # type: ignore[arg-type]


def resnet101(**kwargs: object) -> ResNet:
    return ResNet(Bottleneck, [3, 4, 23, 3], **kwargs)  # type: ignore[arg-type]


def resnet152(**kwargs: object) -> ResNet:
    return ResNet(Bottleneck, [3, 8, 36, 3], **kwargs)  # type: ignore[arg-type]


#: ``--model`` names (seed 003's spelling) -> builder
MODELS: dict[str, Callable[..., ResNet]] = {
    "ResNet18": resnet18, "ResNet34": resnet34, "ResNet50": resnet50,
    "ResNet101": resnet101, "ResNet152": resnet152,
}


def get_model(name: str, num_classes: int = 1000, small_input: bool = False) -> ResNet:
    """The network called ``name`` (``ResNet18`` ... ``ResNet152``; torchvision's lower-case
    ``resnet50`` spelling is accepted too)."""
    by_lower = {k.lower(): k for k in MODELS}
    key = by_lower.get(str(name).lower())
    if key is None:
        raise ValueError(f"--model={name!r} is not a known network; choose one of {', '.join(MODELS)}")
    return MODELS[key](num_classes=num_classes, small_input=small_input)
