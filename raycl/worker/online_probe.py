"""The online probe (``eval.online_probe``): a linear head per attribute trained beside the
method, on the training batches' backbone features, as solo-learn and stable-pretraining report
by default.

Stop-gradient: the features are captured detached, by a forward hook on ``method.backbone``
while the training step's forward runs, so the probe's loss never reaches the encoder. The heads
start at zero (the same on every rank, no broadcast needed), have an optimizer of their own
(AdamW without weight decay: backbone features come at any scale) and their gradients are
averaged over the ranks before each step, as DDP averages the method's: one small all-reduce
per step, entered by every rank. Their state is in each checkpoint, so a resumed trial's heads
go on where they were.

Reported as a family of its own, never mixed with the closed-form probe on frozen features
(solo-learn's online and offline numbers differ by up to 4 points):
``train/online_linear/<attribute>``, the epoch's running accuracy on the augmented views over
every rank, and at each evaluation ``val/online_linear/<attribute>``, the heads applied to the
val embeddings the evaluation computed (``test/`` at a trial's end), each with its ``mean``.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from raycl.config.metric_names import MEAN, ONLINE_LINEAR, TRAIN, metric_name
from raycl.distributed import all_reduce_mean, all_reduce_sum


class OnlineProbe:
    """The heads, their optimizer and the epoch's running counts (see the module docstring).

    Args:
        backbone: the encoder whose outputs the heads read (``method.backbone``).
        labels: attribute -> the training split's labels, one per training row (rows of a
            batch's ``index`` beyond them, pretraining-only images, are not probed).
        num_classes: attribute -> classes.
        lr: the heads' learning rate (``eval.online_probe_lr``).
        device: where the heads and labels live (the session's).
    """

    def __init__(self, backbone: nn.Module, labels: Mapping[str, np.ndarray],
                 num_classes: Mapping[str, int], lr: float, device: torch.device) -> None:
        if not labels:
            raise ValueError("the online probe needs labelled training rows")
        self._labels = {name: torch.as_tensor(np.asarray(values), dtype=torch.long,
                                              device=device) for name, values in labels.items()}
        self._rows = len(next(iter(self._labels.values())))
        self._num_classes = dict(num_classes)
        self._lr, self._device = lr, device
        self.heads: nn.ModuleDict | None = None  # built at the first batch: the feature width
        self.optimizer: torch.optim.Optimizer | None = None
        self._captured: list[Tensor] = []
        self._capturing = False
        self._correct = torch.zeros(len(self._labels), device=device)
        self._seen = torch.zeros((), device=device)
        backbone.register_forward_hook(self._capture)

    def _capture(self, module: nn.Module, inputs: Any, output: Any) -> None:
        if self._capturing and isinstance(output, Tensor) and output.dim() == 2:
            self._captured.append(output.detach())

    @contextmanager
    def capturing(self) -> Iterator[None]:
        """The training forward: what the backbone outputs in it is kept for :meth:`step`."""
        self._capturing = True
        try:
            yield
        finally:
            self._capturing = False

    def _build(self, width: int) -> None:
        self.heads = nn.ModuleDict({name: nn.Linear(width, classes)
                                    for name, classes in self._num_classes.items()
                                    if name in self._labels}).to(self._device)
        for head in self.heads.values():  # zeros: the same heads on every rank
            nn.init.zeros_(head.weight)
            nn.init.zeros_(head.bias)
        self.optimizer = torch.optim.AdamW(self.heads.parameters(), lr=self._lr,
                                           weight_decay=0.0)

    def step(self, index: Tensor) -> None:
        """One optimizer step of the heads on the features the last forward captured: every
        backbone call over the batch's rows (or a multiple: views stacked in order), each view
        labelled by its row. Every rank steps, with gradients averaged over the ranks."""
        captured, self._captured = self._captured, []
        batch = len(index)
        views = [features for features in captured if len(features) % batch == 0]
        if not views:  # a phase that never calls the backbone (every rank alike)
            return
        features = torch.cat(views).float()
        rows = index.to(self._device).repeat(len(features) // batch)
        probed = rows < self._rows
        rows = torch.where(probed, rows, torch.zeros_like(rows))
        if self.heads is None:
            self._build(features.shape[1])
        assert self.heads is not None and self.optimizer is not None
        weight = probed.float() / probed.sum().clamp(min=1)
        loss = features.new_zeros(())
        for position, (name, head) in enumerate(self.heads.items()):
            logits = head(features)
            target = self._labels[name][rows]
            loss = loss + (nn.functional.cross_entropy(logits, target, reduction="none")
                           * weight).sum()
            with torch.no_grad():
                self._correct[position] += ((logits.argmax(1) == target) & probed).sum()
        self._seen += probed.sum()
        self.optimizer.zero_grad(set_to_none=False)
        loss.backward()
        self._average_gradients()
        self.optimizer.step()

    def _average_gradients(self) -> None:
        """The heads' gradients averaged over the ranks, in one all-reduce."""
        assert self.heads is not None
        grads = [parameter.grad for parameter in self.heads.parameters()]
        flat = all_reduce_mean(torch.cat([grad.reshape(-1) for grad in grads]))
        offset = 0
        for grad in grads:
            grad.copy_(flat[offset:offset + grad.numel()].view_as(grad))
            offset += grad.numel()

    def pop_metrics(self) -> dict[str, float]:
        """The epoch's running accuracy per attribute (and their mean) over every rank, and the
        counts reset. A collective: every rank calls it, at the end of every epoch."""
        if self.heads is None:
            return {}
        counts = all_reduce_sum(torch.cat([self._correct, self._seen.reshape(1)]))
        self._correct.zero_()
        self._seen.zero_()
        seen = float(counts[-1])
        if seen == 0:
            return {}
        accuracy = {metric_name(TRAIN, ONLINE_LINEAR, name): float(correct) / seen
                    for name, correct in zip(self.heads, counts[:-1].tolist(), strict=True)}
        accuracy[metric_name(TRAIN, ONLINE_LINEAR, MEAN)] = float(np.mean(list(accuracy.values())))
        return accuracy

    @torch.no_grad()
    def score(self, split: str, features: np.ndarray,
              labels: Mapping[str, np.ndarray]) -> dict[str, float]:
        """``<split>/online_linear/<attribute>`` (and ``mean``): the heads' accuracy on
        ``features`` (rows with a non-finite value left out: a file stream mode could not
        decode). Local: rank 0 calls it with the features it gathered."""
        if self.heads is None or not len(features):
            return {}
        keep = np.isfinite(features).all(axis=1)
        inputs = torch.as_tensor(features[keep], dtype=torch.float32, device=self._device)
        scores = {}
        for name, head in self.heads.items():
            predicted = head(inputs).argmax(1).cpu().numpy()
            scores[metric_name(split, ONLINE_LINEAR, name)] = float(
                np.mean(predicted == np.asarray(labels[name])[keep]))
        scores[metric_name(split, ONLINE_LINEAR, MEAN)] = float(np.mean(list(scores.values())))
        return scores

    def state_dict(self) -> dict[str, Any]:
        """The heads and their optimizer ({} before the first step)."""
        if self.heads is None or self.optimizer is None:
            return {}
        return {"heads": self.heads.state_dict(), "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """What :meth:`state_dict` gave (a checkpoint's, read to the CPU)."""
        if not state:
            return
        first = next(name for name in state["heads"] if name.endswith(".weight"))
        self._build(int(state["heads"][first].shape[1]))
        assert self.heads is not None and self.optimizer is not None
        self.heads.load_state_dict(state["heads"])
        self.optimizer.load_state_dict(state["optimizer"])


__all__ = ["OnlineProbe"]
