"""The training loop and what it needs: schedule, precision, loggers, throughput."""
