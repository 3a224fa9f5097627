"""Loss functions: small, pure, typed. One module per family; import from here.

Conventions shared by every loss here:
- inputs are projections ``(B_local, D)`` of the local batch; the losses normalise or rescale
  them themselves, so callers pass raw projector outputs;
- losses whose docstring says float32 run with autocast off
  (:func:`~raycl.losses.common.full_precision`): fourth powers, square roots of sums of
  squares and 65k-way softmaxes are not half-precision work;
- losses that contrast against the batch gather the global batch *inside* the loss (with
  :func:`raycl.distributed.gather_with_grad`), so callers never have to think about ranks;
- the returned loss is the mean over the **local** anchors. Averaged over ranks it equals the
  global-batch mean, and with DDP's gradient averaging the parameters receive exactly the
  global-batch gradient (see :mod:`raycl.distributed`).
"""

from __future__ import annotations

from raycl.losses.contrastive import info_nce, moco_infonce, nt_xent, same_label_mask
from raycl.losses.non_contrastive import (
    redundancy_reduction_loss,
    simsiam_loss,
    sinusoidal_positional_encoding,
)
from raycl.losses.spectral import (
    check_filter_args,
    high_pass_filter,
    hscl_loss,
    spectral_contrastive_loss,
)

__all__ = [
    "check_filter_args",
    "high_pass_filter",
    "hscl_loss",
    "info_nce",
    "moco_infonce",
    "nt_xent",
    "redundancy_reduction_loss",
    "same_label_mask",
    "simsiam_loss",
    "sinusoidal_positional_encoding",
    "spectral_contrastive_loss",
]
