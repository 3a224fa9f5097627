"""The on-disk cache of decoded image sets (:mod:`~raycl.data.cache.store`) and how a node builds
it once (:mod:`~raycl.data.cache.build`)."""
