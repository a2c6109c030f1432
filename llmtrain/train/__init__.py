"""The training loop and what it needs: schedule, loggers, throughput."""
