"""A ``timm/`` backbone checked before launch, one line per problem.

For every searched combination of the keys that shape it: the name is a timm model (else the
closest names), ``timm.create_model`` accepts ``model.timm_kwargs`` and the data's channels, the
model takes ``data.resolution`` images (a ViT's ``img_size`` and ``patch_size``), LARS is not
asked of a transformer, and ``model.pretrained`` fits it key by key and shape by shape. The
model is built on PyTorch's meta device: no memory, no weights, milliseconds even for a ViT-L.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from raycl.config.schema import CoreConfig, Problem
from raycl.config.search_config import searched_note, searched_variants

# The keys whose values change what the model is or takes.
SHAPING_KEYS: tuple[str, ...] = ("model.backbone", "model.timm_kwargs", "model.pretrained",
                                 "data.dataset", "data.resolution", "train.optimizer")


def _first_line(exc: BaseException) -> str:
    return ((str(exc).strip().splitlines() or [type(exc).__name__])[0])[:200]


def _meta_model(name: str, channels: int, kwargs: dict[str, Any]) -> Any:
    import torch

    from raycl.models.timm_backbones import create

    with torch.device("meta"):
        return create(name, channels, kwargs)


def timm_problems(config: CoreConfig, channels: int) -> Iterator[Problem]:
    """The problems of one (unsearched) config's timm backbone, in the order a user fixes them."""
    import torch

    from raycl.models.timm_backbones import is_transformer, unknown_name_problem

    model_config = config.model
    name, kwargs = model_config.backbone, dict(model_config.timm_kwargs)
    unknown = unknown_name_problem(name)
    if unknown:
        yield Problem("model.backbone", unknown)
        return
    try:
        model = _meta_model(name, channels, kwargs)
    except Exception as exc:  # timm's own message: an unknown kwarg, a value it refuses
        yield Problem("model.timm_kwargs", f"timm.create_model({name[5:]!r}, in_chans="
                                           f"{channels}, **{kwargs}) fails: {_first_line(exc)}")
        return
    size = config.data.resolution
    try:
        with torch.no_grad():
            model.eval()(torch.zeros(2, channels, size, size, device="meta"))
    except Exception as exc:
        yield Problem("data.resolution", f"{name} with model.timm_kwargs {kwargs} cannot take "
                                         f"{size} px images ({_first_line(exc)}); a ViT needs "
                                         f"img_size: {size} and a patch_size dividing it")
    if config.train.optimizer == "lars" and is_transformer(model):
        yield Problem("train.optimizer", f"lars is for convolutional encoders (LARS 'only for "
                                         f"CNNs', as the papers); {name} is a transformer: use "
                                         f"adamw")
    if model_config.pretrained is not None:
        problem = _pretrained_problem(model_config.pretrained, name, channels, kwargs)
        if problem:
            yield Problem("model.pretrained", problem)


def _pretrained_problem(path: str, name: str, channels: int, kwargs: dict[str, Any]) -> str | None:
    """Why the timm backbone could not start from ``path`` (None: it can)."""
    from raycl.models.timm_backbones import create, read_timm_state, timm_state_problem

    model = create(name, channels, kwargs)  # real tensors: the filter resamples against them
    try:
        state = read_timm_state(path, model)
    except (FileNotFoundError, ValueError) as exc:
        return str(exc)
    except Exception as exc:  # the model's checkpoint filter refused the file
        return f"{path} does not fit {name}: {_first_line(exc)}"
    return timm_state_problem(state, model, str(path), name)


def check_timm(config: CoreConfig) -> Iterator[Problem]:
    """Every searched combination's ``timm/`` backbone (see the module docstring); the first
    problem of each key once."""
    from raycl.data import CHANNELS
    from raycl.models.timm_backbones import is_timm

    seen: set[str] = set()
    for chosen, candidate in searched_variants(config, SHAPING_KEYS):
        if candidate.method == "clip" or not is_timm(candidate.model.backbone):
            continue  # clip trains open_clip's towers, not model.backbone
        channels = CHANNELS[candidate.data.dataset]
        for problem in timm_problems(candidate, channels):
            if problem.key not in seen:
                seen.add(problem.key)
                yield Problem(problem.key, f"{searched_note(chosen)}{problem.why}")


__all__ = ["SHAPING_KEYS", "check_timm", "timm_problems"]
