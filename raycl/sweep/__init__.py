"""The driver of a sweep: what runs in the `python -m raycl.tune` process."""
