"""The tar shard format: writer, reader, index (WebDataset-compatible)."""
