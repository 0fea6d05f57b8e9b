"""Host to device: pinned memory and asynchronous copies ahead of the step."""
