"""Remote archive of committed checkpoints (fsspec): upload in the background, download verified."""
