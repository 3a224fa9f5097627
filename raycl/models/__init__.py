"""Backbones and MLP heads."""

from raycl.models.backbones import BACKBONES, build_backbone
from raycl.models.heads import projection_mlp

__all__ = ["BACKBONES", "build_backbone", "projection_mlp"]
