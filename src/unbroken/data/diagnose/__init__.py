"""Which stage makes the GPU wait: the step timer, stage benchmark, bottleneck report, plots, shuffle quality."""
