"""Remote archive of committed checkpoints (the object-store layer): upload in the background, download verified."""
