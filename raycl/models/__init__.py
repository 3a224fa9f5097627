"""Backbones and MLP heads."""

from raycl.models.backbones import BACKBONES, STEMS, build_backbone, resolve_stem
from raycl.models.heads import projection_mlp

__all__ = ["BACKBONES", "STEMS", "build_backbone", "projection_mlp", "resolve_stem"]
