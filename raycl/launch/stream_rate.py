"""Whether stream mode's decoders can keep a GPU fed: a warning before launch, never an error.

A decoding CPU turns about :data:`DECODED_PER_CPU` full-size ImageNet JPEGs a second into
224 px images (Pillow, one core, the JPEG draft shortcut included); a GPU trains a ResNet-50
on some 1 000 to 3 000 of them a second. Below :data:`STREAM_CPUS_PER_GPU` decoding CPUs per
GPU (``data.stream_cpus``, per worker), the decoders, not the GPU, set a stream-mode trial's
pace, and nothing else says so: the GPU only looks idle. Small images (CIFAR-sized folders)
decode several times faster, so this is a warning the user may ignore.
"""

from __future__ import annotations

from raycl.config.schema import CoreConfig

# Images a second that one decoding CPU gives at 224 px from full-size JPEGs (issue 33).
DECODED_PER_CPU = 200
# Decoding CPUs per GPU below which stream mode warns: about 800 images a second per GPU.
STREAM_CPUS_PER_GPU = 4.0


def stream_cpus_warning(config: CoreConfig) -> str | None:
    """The warning where GPU workers stream with fewer than :data:`STREAM_CPUS_PER_GPU` decoding
    CPUs per GPU (``data.stream_cpus``; scaled by ``scaling.gpus_per_worker`` where a worker
    holds part of a GPU), or None. ``config.data.loader`` is the settled one (``auto`` decided);
    ``data.stream_cpus: 0`` reserves nothing (decoders take any free CPU) and is not warned of.
    """
    data, scaling = config.data, config.scaling
    if data.loader != "stream" or not scaling.use_gpu or data.stream_cpus <= 0:
        return None
    wanted = STREAM_CPUS_PER_GPU * scaling.gpus_per_worker
    if data.stream_cpus >= wanted:
        return None
    rate = data.stream_cpus * DECODED_PER_CPU
    return (f"data.stream_cpus: {data.stream_cpus:g} decoding CPU(s) per GPU worker give about "
            f"{rate:,.0f} images/s per worker at 224 px (~{DECODED_PER_CPU} per CPU), far below "
            f"what a GPU trains on; the GPU will wait on its decoders. Reserve at least "
            f"{wanted:g} (data.stream_cpus), or use data.loader: memory where the set fits")


__all__ = ["DECODED_PER_CPU", "STREAM_CPUS_PER_GPU", "stream_cpus_warning"]
