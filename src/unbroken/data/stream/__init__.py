"""Reading during a job: epoch order, the dataset, the loader and its transport, the remote cache."""
