"""What ``python -m raycl.tune SEARCH.yaml --dry-run`` prints, and the search-collapse notices.

A dry run shows a newcomer the config the sweep would run: only the method sections its trials
read (the method's own, its base's for MCL and FGVR; ``mcl`` only for MCL), each search domain
on one line (``{choice: [2, 5, 10]}``, no ``null`` fields), and for constrained keys (batch
size, MCL's K and N, the data size) the combinations that can train
(:func:`raycl.launch.feasibility.joint_domain`). :func:`collapse_notices` is the line a real
run prints too: constraints that leave a searched key a single value make the search silently
narrower than the YAML says.
"""

from __future__ import annotations

from typing import Any

import yaml

from raycl.config.schema import CoreConfig
from raycl.config.search_config import method_sections
from raycl.launch.feasibility import (
    JointDomain,
    finite_values,
    joint_domain,
    train_split_size,
)


class _FlowDict(dict):
    """A mapping dumped on one line: a search domain."""


class _Dumper(yaml.SafeDumper):
    """Block style, except :class:`_FlowDict` values (one line each)."""


_Dumper.add_representer(
    _FlowDict, lambda dumper, data: dumper.represent_mapping(
        "tag:yaml.org,2002:map", data.items(), flow_style=True))


def used_sections(config: CoreConfig) -> set[str]:
    """The method sections (and ``mcl``) the sweep's trials read (see
    :meth:`CoreConfig.used_sections`)."""
    return config.used_sections() & {*method_sections(), "mcl"}


def dry_run_dict(config: CoreConfig) -> dict[str, Any]:
    """The resolved config as printed: unused method sections dropped, domains compact."""
    raw = config.to_dict()
    used = used_sections(config)
    for name in (*method_sections(), "mcl"):  # mcl: a core section only MCL reads
        if name not in used:
            raw.pop(name, None)
    space = raw.get("tune", {}).get("search_space", {})
    for key, domain in space.items():
        space[key] = _FlowDict((kind, value) for kind, value in domain.items()
                               if value is not None)
    return raw


def _values(config: CoreConfig, key: str) -> list[Any]:
    """Every value the search offers for a constrained key (those are finite domains)."""
    return finite_values(config.tune.search_space[key]) or []


def _context(config: CoreConfig, joint: JointDomain) -> str:
    """The fixed values the feasible combinations depend on, e.g. ``train.batch_size=32 and
    120 training images``."""
    parts = [f"train.batch_size={config.train.batch_size}"] \
        if "train.batch_size" not in joint.keys else []
    if not {"data.samples_per_combination", "data.num_samples"} & set(joint.keys):
        parts.append(f"{train_split_size(config.data)} training images")
    return " and ".join(parts) or "the rest of the config"


def collapse_notices(config: CoreConfig) -> list[str]:
    """One line per searched key that the feasibility constraints leave a single value."""
    try:
        joint = joint_domain(config)
    except ValueError:
        return []  # no feasible combination: the load-time checks already refused the config
    if joint is None:
        return []
    single: dict[str, Any] = {}
    for index, key in enumerate(joint.keys):
        offered = {combination[index] for combination in joint.combinations}
        if len(offered) == 1 and len(_values(config, key)) > 1:
            single[key] = offered.pop()
    one_stage = config.method == "mcl" and single.get("mcl.stages") == 1
    if one_stage:
        single.pop("mcl.clusters", None)  # with one stage K is never used: said below
    notices = []
    for key, value in single.items():
        why = (f" (one stage: plain {config.mcl.base}, mcl.clusters unused)"
               if one_stage and key == "mcl.stages" else "")
        notices.append(f"{key}: only {value} of {_values(config, key)} is feasible with "
                       f"{_context(config, joint)}; the search does not vary it{why}")
    return notices


def feasible_lines(config: CoreConfig) -> list[str]:
    """The feasible combinations of the constrained searched keys, for the dry run."""
    joint = joint_domain(config)
    if joint is None:
        return []
    total = 1
    for key in joint.keys:
        total *= len(_values(config, key))
    rows = ", ".join("(" + ", ".join(str(value) for value in combination) + ")"
                     for combination in joint.combinations)
    return [f"feasible ({', '.join(joint.keys)}): {len(joint.combinations)} of {total} "
            f"combinations with {_context(config, joint)}:", f"  {rows}"]


def print_dry_run(config: CoreConfig) -> None:
    """Print the resolved config and, for a constrained search, what it can offer."""
    print(yaml.dump(dry_run_dict(config), Dumper=_Dumper, sort_keys=False,
                    allow_unicode=True), end="")
    for line in feasible_lines(config):
        print(f"# {line}")


__all__ = ["collapse_notices", "dry_run_dict", "feasible_lines", "print_dry_run",
           "used_sections"]
