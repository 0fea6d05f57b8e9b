"""Neutral layer both lifelines use: files, events, run comparison, metrics log, processes."""
