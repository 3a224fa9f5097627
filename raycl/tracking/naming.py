"""What a trial's child run is called in MLflow: ``t03 K=5 N=2 τ=0.31``.

The trial's number as Ray gives it (:func:`trial_index`), then each searched key's symbol and
its value, short (:func:`format_value`). Needs nothing from MLflow.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from raycl.config.search_config import key_symbol
from raycl.config.sweep import Domain

if TYPE_CHECKING:
    from ray.tune.experiment import Trial

# MLflow stores a run name in 250 characters.
_MAX_RUN_NAME_LENGTH = 250


def trial_index(trial: Trial) -> int | None:
    """The trial's number in its sweep, as Ray gives it, None when it cannot be read.

    Ray's searcher-driven trials (``SearchGenerator``: raycl's Optuna searchers) get a random
    8-hex id and the experiment tag ``<n>_<values>`` with n = 1, 2, ...; grid/variant trials
    (``BasicVariantGenerator``: the seed repeats of an empty search space) get the id
    ``<5 hex>_<n:05d>`` with n = 0, 1, ... and the same n in their experiment tag. The number is
    the one in the trial's directory name (``run_trial_<id>_<n>_...``).
    """
    match = re.match(r"(\d+)(?:_|$)", str(getattr(trial, "experiment_tag", "") or ""))
    if match is None:
        match = re.search(r"_(\d{5})$", str(trial.trial_id))
    return int(match.group(1)) if match else None


def format_value(value: Any, continuous: bool = False) -> str:
    """A searched value, short: a float drawn from a continuous domain to 2 significant digits
    (0.31, 3e-04: whichever of the plain and the exponent form is shorter), one chosen from a
    list as written (0.1, 0.125); integers plain; anything else as its text."""
    if isinstance(value, bool) or not isinstance(value, float):
        return str(value)
    if not math.isfinite(value) or value == 0.0:
        return f"{value:g}"
    if not continuous:
        return f"{value:g}"
    rounded = float(f"{value:.2g}")
    mantissa, exponent = f"{rounded:.1e}".split("e")
    scientific = f"{mantissa.rstrip('0').rstrip('.')}e{exponent}"
    plain = f"{rounded:.{max(0, 1 - math.floor(math.log10(abs(rounded))))}f}"
    if "." in plain:
        plain = plain.rstrip("0").rstrip(".")
    return scientific if len(scientific) < len(plain) else plain


def trial_run_name(
    index: int | None, values: Mapping[str, Any], space: Mapping[str, Domain]
) -> str:
    """``t03 K=5 N=2 τ=0.31``: the trial's number, then each searched key's symbol and value.

    Keys come in the search space's order, then any other key of the trial's config (``seed``
    for the repeats of an empty space). A symbol is the key's declared one
    (:func:`raycl.config.key_symbol`); two keys with the same symbol (``mocov2.temperature`` and
    ``fgvr.temperature``, both τ) are told apart by their section (``mocov2.τ``). Cut at
    MLflow's 250 characters on a whole ``symbol=value``, with "…".
    """
    keys = [key for key in space if key in values]
    keys += [key for key in values if key not in keys]
    symbols = {key: key_symbol(key) for key in keys}
    repeated = {symbol for symbol in symbols.values()
                if list(symbols.values()).count(symbol) > 1}
    parts = [f"t{index:02d}" if index is not None else "t?"]
    for key in keys:
        symbol = symbols[key]
        if symbol in repeated and "." in key:
            symbol = f"{key.split('.', 1)[0]}.{symbol}"
        domain = space.get(key)
        continuous = domain is not None and domain.kind in ("uniform", "loguniform")
        parts.append(f"{symbol}={format_value(values[key], continuous)}")
    name = parts[0]
    for part in parts[1:]:
        if len(name) + 1 + len(part) > _MAX_RUN_NAME_LENGTH - 2:
            return f"{name} …"
        name = f"{name} {part}"
    return name
