"""omnidraft's lab: the experiments behind docs/, run as `python -m benchmarks COMMAND`."""
