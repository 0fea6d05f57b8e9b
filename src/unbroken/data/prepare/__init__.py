"""Getting data ready before a job: pack files into shards, stage shards onto local disk."""
