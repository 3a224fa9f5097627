"""The on-disk cache of decoded image sets (:mod:`~raycl.data.cache.store`), how a node builds
it once (:mod:`~raycl.data.cache.build`), and the listing manifest that finds it again without
listing the dataset (:mod:`~raycl.data.cache.manifest`)."""
