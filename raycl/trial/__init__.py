"""A Tune trial: the trainable that runs in a trial process."""
