"""``train.optimizer: lars`` fits the method a trial trains: checked before launch.

LARS is for convolutional encoders: All4One §4.1 adapts the learning rate per layer "using LARS
(only for CNNs)" and trains its ViT-Small with AdamW, as solo-learn's recipes do. A method whose
trained towers are transformers (clip: the image tower, and the text tower with
``clip.train_text``; :attr:`Method.convolutional <raycl.methods.base.Method.convolutional>`
False) is refused with one line, for every searched combination too.
"""

from __future__ import annotations

from collections.abc import Iterator

from raycl.config.schema import CoreConfig, Problem
from raycl.config.search_config import searched_note, searched_variants

KEY = "train.optimizer"


def check_optimizer(config: CoreConfig) -> Iterator[Problem]:
    """``train.optimizer: lars`` only for a method whose encoder is convolutional.

    Args:
        config: the validated config (its search space's choices of ``method``, ``mcl.base``
            and ``train.optimizer`` each checked).

    Yields:
        At most one problem, of ``train.optimizer``.
    """
    from raycl.methods import METHODS  # late: keeps `--help` and config errors fast

    for chosen, candidate in searched_variants(config, ("method", "mcl.base", KEY)):
        trained = candidate.mcl.base if candidate.method == "mcl" else candidate.method
        method = METHODS.get(trained)
        if candidate.train.optimizer == "lars" and method is not None \
                and not method.convolutional:
            yield Problem(KEY, f"{searched_note(chosen)}lars is for convolutional encoders "
                               f"(LARS 'only for CNNs', as the papers); {trained} trains "
                               f"transformers: use adamw")
            return


__all__ = ["check_optimizer"]
