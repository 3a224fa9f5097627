"""Linear-probe evaluation of frozen features (one probe per labelled attribute)."""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Literal

import numpy as np
import torch

ArrayLike = np.ndarray | torch.Tensor
# Split name -> (features, labels): every set a fitted probe is scored on.
EvalSets = Mapping[str, tuple[ArrayLike, ArrayLike]]
# Evaluation rows the torch probe standardises and classifies at once.
PREDICT_BLOCK = 65_536


def to_numpy(array: ArrayLike) -> np.ndarray:
    """Return a numpy view/copy of a numpy array or (any-device) torch tensor."""
    if isinstance(array, torch.Tensor):
        return array.detach().cpu().numpy()
    return np.asarray(array)


def check_probe_inputs(
    train_x: ArrayLike, train_y: ArrayLike, test_x: ArrayLike, test_y: ArrayLike
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Validate and convert the inputs shared by every probe.

    Args:
        train_x: (N, D) training features.
        train_y: (N,) integer training labels.
        test_x: (M, D) test features.
        test_y: (M,) integer test labels.

    Returns:
        The four inputs as numpy arrays (features float, labels int64).
    """
    train_x, test_x = to_numpy(train_x), to_numpy(test_x)
    train_y, test_y = to_numpy(train_y), to_numpy(test_y)
    for name, features, labels in (("train", train_x, train_y), ("test", test_x, test_y)):
        if features.ndim != 2:
            raise ValueError(f"{name} features must be 2-D (N, D), got shape {features.shape}")
        if labels.ndim != 1 or labels.shape[0] != features.shape[0]:
            raise ValueError(
                f"{name} labels must be 1-D with {features.shape[0]} entries, "
                f"got shape {labels.shape}"
            )
        if features.shape[0] == 0:
            raise ValueError(f"{name} set is empty")
        if not np.issubdtype(labels.dtype, np.integer):
            raise ValueError(f"{name} labels must be integers, got dtype {labels.dtype}")
        if not np.issubdtype(features.dtype, np.number) or not np.all(np.isfinite(features)):
            raise ValueError(f"{name} features must be finite numbers")
    if train_x.shape[1] != test_x.shape[1]:
        raise ValueError(
            f"train and test feature dims differ: {train_x.shape[1]} vs {test_x.shape[1]}"
        )
    return train_x, train_y.astype(np.int64), test_x, test_y.astype(np.int64)


def _check_eval_sets(
    train_x: ArrayLike, train_y: ArrayLike, eval_sets: EvalSets
) -> tuple[np.ndarray, np.ndarray, dict[str, tuple[np.ndarray, np.ndarray]]]:
    if not eval_sets:
        raise ValueError("no evaluation set to score")
    checked: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    train_np = train_labels = None
    for name, (features, labels) in eval_sets.items():
        train_np, train_labels, features_np, labels_np = check_probe_inputs(
            train_x, train_y, features, labels)
        checked[name] = (features_np, labels_np)
    assert train_np is not None and train_labels is not None
    return train_np, train_labels, checked


def linear_probe_scores(
    train_x: ArrayLike,
    train_y: ArrayLike,
    eval_sets: EvalSets,
    max_iter: int = 200,
    seed: int = 0,
) -> dict[str, float]:
    """Fit one multinomial logistic regression on frozen features; score every evaluation set.

    Features are standardised with statistics fitted on the training set only. Fitting once
    and scoring validation and test with the same probe keeps the two numbers comparable.

    Args:
        train_x: (N, D) training features.
        train_y: (N,) integer labels.
        eval_sets: split name -> ((M, D) features, (M,) integer labels).
        max_iter: lbfgs iteration cap.
        seed: random_state of the classifier.

    Returns:
        Split name -> accuracy in [0, 1].

    Example:
        >>> scores = linear_probe_scores(x_train, y_train, {"val": (x_val, y_val)})
    """
    train_x, train_y, checked = _check_eval_sets(train_x, train_y, eval_sets)
    if max_iter < 1:
        raise ValueError(f"max_iter must be >= 1, got {max_iter}")
    classes = np.unique(train_y)
    if len(classes) == 1:
        # LogisticRegression refuses a single class; the only possible prediction is it.
        return {name: float(np.mean(y == classes[0])) for name, (_, y) in checked.items()}
    # Imported here: scikit-learn takes ~1 s to import, and only the rank that scores probes
    # needs it (every Ray Train worker imports this module).
    from sklearn.exceptions import ConvergenceWarning
    from sklearn.linear_model import LogisticRegression
    from sklearn.preprocessing import StandardScaler

    scaler = StandardScaler().fit(train_x)
    # lbfgs fits the multinomial (softmax) model for multi-class targets.
    classifier = LogisticRegression(solver="lbfgs", max_iter=max_iter, random_state=seed)
    with warnings.catch_warnings():
        # A capped iteration budget is part of the protocol, not an error worth logging.
        warnings.simplefilter("ignore", ConvergenceWarning)
        classifier.fit(scaler.transform(train_x), train_y)
    return {name: float(np.mean(classifier.predict(scaler.transform(x)) == y))
            for name, (x, y) in checked.items()}


def linear_probe_accuracy(
    train_x: ArrayLike,
    train_y: ArrayLike,
    test_x: ArrayLike,
    test_y: ArrayLike,
    max_iter: int = 200,
    seed: int = 0,
) -> float:
    """Top-1 test accuracy of a multinomial logistic regression on frozen features.

    One evaluation set of :func:`linear_probe_scores`.
    """
    return linear_probe_scores(train_x, train_y, {"test": (test_x, test_y)}, max_iter,
                               seed)["test"]


def _resolve_device(features: ArrayLike, device: str | torch.device | None) -> torch.device:
    if device is not None:
        return torch.device(device)
    if isinstance(features, torch.Tensor):
        return features.device
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def torch_linear_probe_scores(
    train_x: ArrayLike,
    train_y: ArrayLike,
    eval_sets: EvalSets,
    epochs: int = 100,
    lr: float = 1e-2,
    weight_decay: float = 0.0,
    batch_size: int = 4096,
    seed: int = 0,
    device: str | torch.device | None = None,
) -> dict[str, float]:
    """Fit one softmax linear head with Adam (for large sets); score every evaluation set.

    Full-batch when the training set fits in one `batch_size`, mini-batch otherwise.
    Features are standardised with training statistics; the head starts at zero (the
    problem is convex, so no random init is needed and the result is deterministic).

    Args:
        train_x: (N, D) training features.
        train_y: (N,) integer labels.
        eval_sets: split name -> ((M, D) features, (M,) integer labels).
        epochs: passes over the training set.
        lr: Adam learning rate.
        weight_decay: Adam L2 penalty.
        batch_size: mini-batch size.
        seed: seeds the mini-batch order.
        device: where to train; default: the device of `train_x` if it is a tensor, else
            CUDA when available.

    Returns:
        Split name -> accuracy in [0, 1].
    """
    if epochs < 1:
        raise ValueError(f"epochs must be >= 1, got {epochs}")
    if lr <= 0:
        raise ValueError(f"lr must be > 0, got {lr}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    target_device = _resolve_device(train_x, device)
    train_np, train_labels, checked = _check_eval_sets(train_x, train_y, eval_sets)
    classes = np.unique(train_labels)
    # Map labels to 0..C-1; evaluation labels unseen in training can never be predicted.
    train_targets = torch.as_tensor(np.searchsorted(classes, train_labels), device=target_device)
    train_feats, mean, std = _standardised(train_np, target_device)
    head = _fit_linear_head(train_feats, train_targets, len(classes), epochs=epochs, lr=lr,
                            weight_decay=weight_decay, batch_size=batch_size, seed=seed)
    scores = {}
    with torch.no_grad():
        for name, (features, labels) in checked.items():
            # Blocks of rows: a large evaluation split is never copied to the device whole.
            predicted = np.concatenate([
                head(torch.as_tensor(features[start:start + PREDICT_BLOCK], dtype=torch.float32,
                                     device=target_device).sub(mean).div_(std))
                .argmax(dim=1).cpu().numpy()
                for start in range(0, len(features), PREDICT_BLOCK)])
            scores[name] = float(np.mean(classes[predicted] == labels))
    return scores


def _standardised(train_np: np.ndarray, device: torch.device
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(features standardised by their own statistics, mean, std)`` on ``device``."""
    train_feats = torch.as_tensor(train_np, dtype=torch.float32, device=device)
    mean = train_feats.mean(dim=0)
    std = train_feats.std(dim=0, unbiased=False).clamp_min(1e-6)
    # as_tensor shares a float32 numpy array's memory on the CPU: that one is standardised into
    # one new array (the caller's features stay as they are); a copy made above in place.
    shared = device.type == "cpu" and train_np.dtype == np.float32
    train_feats = torch.sub(train_feats, mean) if shared else train_feats.sub_(mean)
    return train_feats.div_(std), mean, std


def _fit_linear_head(train_feats: torch.Tensor, train_targets: torch.Tensor, num_classes: int,
                     *, epochs: int, lr: float, weight_decay: float, batch_size: int,
                     seed: int) -> torch.nn.Linear:
    """A softmax linear head fitted with Adam from zero weights, mini-batches in a seeded
    order (one full batch when the set fits in ``batch_size``)."""
    device = train_feats.device
    head = torch.nn.Linear(train_feats.shape[1], num_classes).to(device)
    torch.nn.init.zeros_(head.weight)
    torch.nn.init.zeros_(head.bias)
    optimizer = torch.optim.Adam(head.parameters(), lr=lr, weight_decay=weight_decay)
    generator = torch.Generator().manual_seed(seed)
    num_train = train_feats.shape[0]
    with torch.enable_grad():
        for _ in range(epochs):
            order = torch.randperm(num_train, generator=generator).to(device)
            for start in range(0, num_train, batch_size):
                rows = order[start : start + batch_size]
                logits = head(train_feats[rows])
                loss = torch.nn.functional.cross_entropy(logits, train_targets[rows])
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
    return head


def torch_linear_probe_accuracy(
    train_x: ArrayLike,
    train_y: ArrayLike,
    test_x: ArrayLike,
    test_y: ArrayLike,
    epochs: int = 100,
    lr: float = 1e-2,
    weight_decay: float = 0.0,
    batch_size: int = 4096,
    seed: int = 0,
    device: str | torch.device | None = None,
) -> float:
    """Top-1 test accuracy of the torch linear head: one set of :func:`torch_linear_probe_scores`.
    """
    return torch_linear_probe_scores(train_x, train_y, {"test": (test_x, test_y)}, epochs=epochs,
                                     lr=lr, weight_decay=weight_decay, batch_size=batch_size,
                                     seed=seed, device=device)["test"]


def evaluate_linear_splits(
    train_feats: ArrayLike,
    train_labels: Mapping[str, ArrayLike],
    eval_sets: Mapping[str, tuple[ArrayLike, Mapping[str, ArrayLike]]],
    max_iter: int = 200,
    seed: int = 0,
    backend: Literal["sklearn", "torch"] = "sklearn",
    device: str | torch.device | None = None,
) -> dict[str, dict[str, float]]:
    """Linear-probe accuracy for every labelled attribute, one probe per attribute fit on the
    training features and scored on every evaluation split (validation, test).

    Args:
        train_feats: (N, D) training features.
        train_labels: attribute name -> (N,) integer labels.
        eval_sets: split name -> ((M, D) features, attribute name -> (M,) labels).
        max_iter: lbfgs iterations (sklearn) or epochs (torch).
        seed: probe seed.
        backend: "sklearn" (exact lbfgs, small sets) or "torch" (Adam, large sets / GPU).
        device: torch backend only; see `torch_linear_probe_scores`.

    Returns:
        ``{split: {attribute: accuracy, ..., "mean": mean over attributes}}``.
    """
    if backend not in ("sklearn", "torch"):
        raise ValueError(f"backend must be 'sklearn' or 'torch', got {backend!r}")
    if not eval_sets:
        raise ValueError("no evaluation split to score")
    # Every split must label the same attributes as the training set.
    attributes = check_attributes(train_labels, next(iter(eval_sets.values()))[1])
    for _, labels in eval_sets.values():
        check_attributes(train_labels, labels)
    results: dict[str, dict[str, float]] = {split: {} for split in eval_sets}
    for attribute in attributes:
        sets = {split: (features, labels[attribute])
                for split, (features, labels) in eval_sets.items()}
        if backend == "sklearn":
            scores = linear_probe_scores(train_feats, train_labels[attribute], sets,
                                         max_iter=max_iter, seed=seed)
        else:
            scores = torch_linear_probe_scores(train_feats, train_labels[attribute], sets,
                                               epochs=max_iter, seed=seed, device=device)
        for split, score in scores.items():
            results[split][attribute] = score
    for split_results in results.values():
        split_results["mean"] = float(np.mean([split_results[a] for a in attributes]))
    return results


def evaluate_linear(
    train_feats: ArrayLike,
    train_labels: Mapping[str, ArrayLike],
    test_feats: ArrayLike,
    test_labels: Mapping[str, ArrayLike],
    max_iter: int = 200,
    seed: int = 0,
    backend: Literal["sklearn", "torch"] = "sklearn",
    device: str | torch.device | None = None,
) -> dict[str, float]:
    """Linear-probe accuracy for every labelled attribute on one evaluation split.

    Returns:
        {attribute: accuracy, ..., "mean": mean over attributes}; see
        :func:`evaluate_linear_splits`.
    """
    return evaluate_linear_splits(train_feats, train_labels, {"test": (test_feats, test_labels)},
                                  max_iter=max_iter, seed=seed, backend=backend,
                                  device=device)["test"]


def check_attributes(
    train_labels: Mapping[str, ArrayLike], test_labels: Mapping[str, ArrayLike]
) -> list[str]:
    """Return the attribute names (train order) after checking both dicts agree."""
    attributes = list(train_labels)
    if not attributes:
        raise ValueError("no attributes to evaluate (empty label dict)")
    if set(attributes) != set(test_labels):
        raise ValueError(
            f"train and test attributes differ: {sorted(train_labels)} vs {sorted(test_labels)}"
        )
    if "mean" in attributes:
        raise ValueError("an attribute may not be called 'mean' (reserved for the average)")
    return attributes
