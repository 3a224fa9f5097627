"""One reader per dataset, each in the format its authors distribute (see
:mod:`raycl.data.registry` for the names)."""
