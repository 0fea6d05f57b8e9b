"""The token shard format, offline tokenizing, the word cache that speeds it."""
