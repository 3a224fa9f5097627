"""The stream path (``data.loader: stream``): image files decoded when a batch needs them, and
samples packed in shards (WebDataset tar, Parquet) read in sequence."""
